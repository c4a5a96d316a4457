"""The floor of a capture written in Python: what any capture pays per record before it does
anything of its own.

``floor_capture(model, level)`` is the least a capture must do at each level to give records
that can be paired with another run's, keeping each tensor by address, version, dtype and shape
(enough to compute its numbers later, once per distinct tensor):

* api (``ApiFloor``): a ``TorchFunctionMode`` names each torch call (op name, the module it runs
  in, its index there; the module from global module hooks, as probe's), keeps each tensor the
  call takes (positional or keyword) and returns, and hooks the autograd node of each output for
  the gradients (grad_output, and grad_input where the node's inputs are the call's);
* module (``ModuleFloor``): forward hooks on every module of the model keep its inputs, its own
  parameters and its outputs, a hook on each output tensor its grad_output, and a hook on each
  parameter its gradient (probe's module level also gives each call's grad_input: the floor
  leaves that out);
* mix: both.

Nothing else: no source line, no statistics, no step file, no filter, no guard against in-place
writes, no keyword defaults or other non-tensor values, no autocast, collectives or sharded
tensors. ``bench/record_cost.py --floor`` times it beside probe's "records" path (the same
step, numbers taken as known): probe's per-record host time over this floor is what probe's
own features cost.
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch.nn.modules import module as module_hooks
from torch.overrides import TorchFunctionMode

from probe.capture.eager.naming import op_name

Tensor = torch.Tensor


class _Kept:
    """The records of one captured step, and each distinct tensor's layout once."""

    def __init__(self) -> None:
        self.records: list = []
        self._layouts: dict = {}  # (address, version, dtype, shape) -> (dtype, shape)

    def keep(self, call, slot, tensor) -> None:
        key = (tensor.data_ptr(), tensor._version, tensor.dtype, tensor.shape)
        layout = self._layouts.get(key)
        if layout is None:
            layout = self._layouts[key] = (tensor.dtype, tuple(tensor.shape))
        self.records.append((call, slot, layout))


class ApiFloor(TorchFunctionMode):
    """Level api: each torch call's tensors and its autograd node's gradients."""

    def __init__(self, kept: _Kept, model: torch.nn.Module) -> None:
        super().__init__()
        self._keep = kept.keep
        self._counts: dict = {}  # (module, op) -> calls so far
        self._stack: list = []
        paths = {id(module): path for path, module in model.named_modules()}
        stack = self._stack

        def enter(module, args):
            stack.append(paths.get(id(module), ""))

        def leave(module, args, output):
            if stack:
                stack.pop()

        self._handles = [module_hooks.register_module_forward_pre_hook(enter),
                         module_hooks.register_module_forward_hook(leave, always_call=True)]

    def __exit__(self, *exc):
        for handle in self._handles:
            handle.remove()
        return super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = op_name(func)
        if kwargs is None:
            kwargs = {}
        if name is None:  # attribute reads and profiler markers
            return func(*args, **kwargs)
        module = self._stack[-1] if self._stack else ""
        index = self._counts.get((module, name), 0)
        self._counts[module, name] = index + 1
        call = (module, name, index)
        edges = []
        for slot, arg in (*enumerate(args), *kwargs.items()):
            if isinstance(arg, Tensor):
                self._keep(call, slot, arg)
                if arg.requires_grad:
                    edges.append((arg.grad_fn, arg.output_nr, arg))
        out = func(*args, **kwargs)
        if isinstance(out, Tensor):
            self._keep(call, "output.0", out)
            node = out.grad_fn
            if out.requires_grad and node is not None:
                node.register_hook(functools.partial(self._on_grads, call, _single_node(node, edges)))
        return out

    def _on_grads(self, call, reads_inputs, grad_inputs, grad_outputs) -> None:
        with torch._C.DisableTorchFunction():
            for position, grad in enumerate(grad_outputs):
                if grad is not None:
                    self._keep(call, f"grad_output.{position}", grad)
            if reads_inputs:
                for position, grad in enumerate(grad_inputs):
                    if grad is not None:
                        self._keep(call, f"grad_input.{position}", grad)


def _single_node(node, edges) -> bool:
    """The call is this one autograd node: each of its inputs is one of the call's tensors."""
    for fn, output_nr in node.next_functions:
        if fn is None:
            continue
        if not any((grad_fn is fn and nr == output_nr) or getattr(fn, "variable", None) is tensor
                   for grad_fn, nr, tensor in edges):
            return False
    return True


class ModuleFloor:
    """Level module: each module call's inputs, own parameters and outputs, the outputs'
    gradients, and each parameter's gradient."""

    def __init__(self, kept: _Kept, model: torch.nn.Module) -> None:
        self._keep = kept.keep
        self._counts: dict = {}  # module path -> calls so far
        self._open: list = []  # the calls entered and not yet left
        self._handles: list = []
        for path, module in model.named_modules():
            self._handles.append(module.register_forward_pre_hook(
                functools.partial(self._enter, path), with_kwargs=True))
            self._handles.append(module.register_forward_hook(
                functools.partial(self._leave, path), always_call=True))
            for name, param in module.named_parameters(recurse=False):
                if param.requires_grad:
                    self._handles.append(param.register_post_accumulate_grad_hook(
                        functools.partial(self._param_grad, (path, "param", 0), "param." + name)))

    def __enter__(self) -> "ModuleFloor":
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()

    def _enter(self, path, module, args, kwargs):
        with torch._C.DisableTorchFunction():  # at mix, the API floor must not see the hook's reads
            self._enter_call(path, module, args, kwargs)

    def _enter_call(self, path, module, args, kwargs):
        index = self._counts.get(path, 0)
        self._counts[path] = index + 1
        call = (path, type(module).__name__, index)
        self._open.append(call)
        for slot, arg in (*enumerate(args), *kwargs.items()):
            if isinstance(arg, Tensor):
                self._keep(call, slot, arg)
        for name, param in module.named_parameters(recurse=False):
            self._keep(call, "param." + name, param)

    def _leave(self, path, module, args, output):
        with torch._C.DisableTorchFunction():
            self._leave_call(path, module, output)

    def _leave_call(self, path, module, output):
        call = self._open.pop() if self._open else (path, type(module).__name__, -1)
        outputs = (output,) if isinstance(output, Tensor) else output if isinstance(output, (tuple, list)) else ()
        for position, tensor in enumerate(outputs):
            if isinstance(tensor, Tensor):
                self._keep(call, f"output.{position}", tensor)
                if tensor.requires_grad:
                    tensor.register_hook(functools.partial(self._grad, call, f"grad_output.{position}"))

    def _grad(self, call, slot, grad):
        self._keep(call, slot, grad)

    def _param_grad(self, call, slot, param):
        if param.grad is not None:
            self._keep(call, slot, param.grad)


@contextlib.contextmanager
def floor_capture(model: torch.nn.Module, level: str):
    """``with floor_capture(model, "api") as records:`` around a step; the records after it."""
    kept = _Kept()
    with contextlib.ExitStack() as stack:
        if level in ("module", "mix"):
            stack.enter_context(ModuleFloor(kept, model))
        if level in ("api", "mix"):
            stack.enter_context(ApiFloor(kept, model))
        yield kept.records
