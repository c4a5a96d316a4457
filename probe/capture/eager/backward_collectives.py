"""Run a backward pass with the API mode on the mode stack, so that the collectives its hooks
launch are recorded: FSDP2's reduce-scatter of the gradients and the all-gather that
re-unshards a parameter for backward (``reshard_after_forward=True``), a user's gradient
hook that calls ``dist.all_reduce``.

Why this is needed: ``loss.backward()`` and ``torch.autograd.backward`` ask the
TorchFunctionMode first, and torch takes the mode off its stack while the mode handles the
call. The whole backward runs inside that call, and the autograd engine runs every node,
hook and callback under the thread-local state it captured when the pass started: a stack
without the mode. Calling the same function again with the mode pushed back would only ask
the mode again. So the mode does what ``torch.autograd.backward`` does after its own
``__torch_function__`` check: it builds the gradient tuple with torch's helpers and starts
the engine, with itself pushed back on the stack for the engine to capture.

Only collectives are recorded in backward (the mode passes every other call straight
through while ``in_backward`` is set): a checkpointed block's recomputation, FSDP2's own
copies and a user's hook code keep their meaning of today. Numerics do not change: the
engine runs the same graph with the same gradients; only the mode stack differs.

Used only where recording can find something (a process group is initialised) and where
torch's engine entry is there; any other case, or an argument shape this does not know
(``GradientEdge``, ``grad_variables``, functorch transforms, another mode or a tensor
subclass that overrides ``__torch_function__``), runs the call as torch would without probe:
its backward collectives are then not recorded.
"""

from __future__ import annotations

import sys

import torch
import torch.autograd as autograd
from torch.overrides import TorchFunctionMode, has_torch_function

from probe import compat
from probe.capture.eager.defaults import bind_call

Tensor = torch.Tensor
#: the calls that start a backward pass through __torch_function__
ENTRIES = frozenset({Tensor.backward, autograd.backward})
_engine_run_backward = compat.engine_run_backward
_make_grads = compat.make_grads
_to_tuple = compat.tensor_or_tensors_to_tuple
_functorch_active = compat.functorch_transforms_active


def available() -> bool:
    """True where this torch has the engine entry and helpers the re-entry needs."""
    return None not in (_engine_run_backward, _make_grads, _to_tuple)


def wanted() -> bool:
    """Backward can hold a collective: torch.distributed has a process group."""
    distributed = torch.distributed
    return available() and distributed.is_available() and distributed.is_initialized()


def run_backward(mode: TorchFunctionMode, func, args, kwargs):
    """Run ``Tensor.backward`` / ``torch.autograd.backward`` with `mode` on the stack while
    the engine runs; `mode.in_backward` is true meanwhile."""
    plan = _engine_arguments(func, args, kwargs)
    if plan is None:
        return func(*args, **kwargs)
    tensors, grads, retain_graph, create_graph, inputs = plan
    was_inside = mode.in_backward
    mode.in_backward = True
    # TorchFunctionMode's own enter/exit: a subclass's __exit__ may end more than the mode
    TorchFunctionMode.__enter__(mode)
    try:
        _engine_run_backward(tensors, grads, retain_graph, create_graph, inputs,
                             allow_unreachable=True, accumulate_grad=True)
    finally:
        TorchFunctionMode.__exit__(mode, None, None, None)
        mode.in_backward = was_inside
    return None


def _engine_arguments(func, args, kwargs):
    """(tensors, grads, retain_graph, create_graph, inputs) as torch.autograd.backward
    hands them to the engine; None for anything it does not handle as torch does."""
    bound = bind_call(func, args, kwargs)
    if bound is None:
        return None  # torch raises its own error for the call
    arguments = bound.arguments
    if func is Tensor.backward:
        tensors, grads = arguments["self"], arguments.get("gradient")
    else:
        if arguments.get("grad_variables") is not None:
            return None
        tensors, grads = arguments["tensors"], arguments.get("grad_tensors")
    inputs = arguments.get("inputs")
    if _functorch_active():
        return None
    # a generator would be used up before a fall-back; a dict's values are its inputs
    if not isinstance(tensors, (Tensor, list, tuple)):
        return None
    if inputs is not None and not isinstance(inputs, (Tensor, list, tuple)):
        return None
    tensors = (tensors,) if isinstance(tensors, Tensor) else tuple(tensors)
    if inputs is not None:
        inputs = (inputs,) if isinstance(inputs, Tensor) else tuple(inputs)
        if not inputs:
            return None  # torch's error: "inputs argument to backward() cannot be empty."
    else:
        inputs = ()
    if not all(isinstance(item, Tensor) for item in tensors + inputs):
        return None  # GradientEdge
    # the mode is off the stack here: what remains is another mode or a subclass override
    if has_torch_function(tensors + inputs):
        return None
    grads = _make_grads(tensors, _to_tuple(grads, len(tensors)), is_grads_batched=False)
    create_graph = bool(arguments.get("create_graph", False))
    retain_graph = arguments.get("retain_graph")
    if retain_graph is None:
        retain_graph = create_graph
    return tensors, grads, retain_graph, create_graph, inputs


#: how far up from a collective the FSDP2 parameter group that called it can be
_OWNER_DEPTH = 12


def owner_path(mode) -> str:
    """The module path a collective in backward is recorded under: the first module of the
    FSDP2 parameter group whose backward hook runs it (its reduce-scatter, its re-gather
    for backward), found among the callers; "" (the root) for any other collective, such
    as one a user's gradient hook runs."""
    frame = sys._getframe(2)
    for _ in range(_OWNER_DEPTH):
        if frame is None:
            break
        if "self" in frame.f_code.co_varnames[:1]:
            owner = frame.f_locals.get("self")
            if type(owner).__name__ == "FSDPParamGroup":
                modules = getattr(owner, "modules", None) or (getattr(owner, "module", None),)
                return mode.module_path(modules[0])
        frame = frame.f_back
    return ""
