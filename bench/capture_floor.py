"""The floor of an API-level capture written in Python: what any such capture pays per record
before it does anything of its own.

``FloorCapture`` is the least a capture at level api must do to give records that can be paired
with another run's: a ``TorchFunctionMode`` names each torch call (op name, the module it runs
in, its index there), keeps the identity and layout of each tensor the call takes (positional
or keyword) and returns (address, version, dtype, shape: enough to compute its numbers later,
once per distinct tensor), and hooks the autograd node of each output for the gradients
(grad_output, and grad_input where the node's inputs are the call's). It records nothing
else: no source line, no statistics, no step file, no filter, no guard against in-place
writes, no keyword defaults or other non-tensor values, no autocast, collectives or sharded
tensors. ``bench/record_cost.py --floor`` times it beside probe's "records" path (the same
step, numbers taken as known): probe's per-record host time over this floor is what probe's
own features cost.
"""

from __future__ import annotations

import functools

import torch
from torch.nn.modules import module as module_hooks
from torch.overrides import TorchFunctionMode

from probe.capture.eager.naming import op_name

Tensor = torch.Tensor


class FloorCapture(TorchFunctionMode):
    """``with FloorCapture() as floor:`` around a training step; ``floor.records`` after it."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list = []
        self._layouts: dict = {}  # (address, version, dtype, shape) -> (dtype, shape)
        self._counts: dict = {}  # (module, op) -> calls so far
        self._stack: list = []
        self._paths: dict = {}
        self._handles: list = []

    def watch(self, model: torch.nn.Module) -> "FloorCapture":
        """Name calls by the module of ``model`` they run in (global module hooks, as probe's)."""
        self._paths = {id(module): path for path, module in model.named_modules()}
        stack, paths = self._stack, self._paths

        def enter(module, args):
            stack.append(paths.get(id(module), ""))

        def leave(module, args, output):
            if stack:
                stack.pop()

        self._handles = [module_hooks.register_module_forward_pre_hook(enter),
                         module_hooks.register_module_forward_hook(leave, always_call=True)]
        return self

    def __exit__(self, *exc):
        for handle in self._handles:
            handle.remove()
        self._handles = []
        return super().__exit__(*exc)

    def _keep(self, call, slot, tensor) -> None:
        key = (tensor.data_ptr(), tensor._version, tensor.dtype, tensor.shape)
        layout = self._layouts.get(key)
        if layout is None:
            layout = self._layouts[key] = (tensor.dtype, tuple(tensor.shape))
        self.records.append((call, slot, layout))

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
