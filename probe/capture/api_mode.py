"""API level: one TorchFunctionMode that records every torch call made while it is active.

A TorchFunctionMode sees torch.*, torch.nn.functional.*, Tensor methods and operators, and
``from torch import relu`` references alike, because torch routes them all through
``__torch_function__``; no torch attribute is replaced. In torch >= 2.1 the collectives of
torch.distributed (all_reduce, broadcast, all_gather, all_gather_into_tensor,
reduce_scatter_tensor, all_to_all_single, send/recv, ...) also check for a mode and arrive
here as ``distributed.<name>`` (all_gather_into_tensor as ``distributed.all_gather_single``,
reduce_scatter_tensor as ``distributed.reduce_scatter_single``).

A collective writes into its tensor arguments without bumping their autograd version, so
its output (``output.0`` = the buffer it wrote, e.g. all_reduce's ``tensor``) is always
recomputed, never taken from the statistics cache. DDP's gradient all-reduce runs inside
its C++ reducer and is not an API call: parameter gradients recorded at module level are
the local gradients, before averaging.

Per call: inputs are recorded before the call (so an in-place op's input is seen before it
is overwritten), outputs after it. Only the outermost torch call is recorded: torch disables
the mode while ``__torch_function__`` runs, so F.layer_norm's internal torch.layer_norm is
not a second record.

Backward: for outputs that require grad, one hook is registered on the autograd node that
produced them (``grad_fn.register_hook``). When it fires it records the gradient flowing
into each output (``grad_output.N``) and, when the call is exactly that one node (each of
the node's inputs is one of the call's tensor inputs; checked at forward time), the
gradient the node sends to each input (``grad_input.N``): the per-call contribution, not
the gradient accumulated over every use of the input. Composite calls (F.cross_entropy is
log_softmax + nll_loss) get grad_output only. Node hooks do not change numerics, and they
stay with the node that produced the value, so a later in-place op on the output does not
move them.
"""

from __future__ import annotations

import functools
import inspect

import torch
from torch.overrides import TorchFunctionMode

from probe.capture import naming
from probe.capture.recorder import Recorder

Tensor = torch.Tensor
_DisableTorchFunction = torch._C.DisableTorchFunction
_is_grad_enabled = torch.is_grad_enabled
_names = naming._cache
_MISSING = naming._MISSING
_op_name = naming.op_name
_PLAIN = (int, float, bool, str, type(None))
_INPUT_SLOTS = tuple(f"input.{i}" for i in range(64))

#: ops that return None but write into their first argument, which is then their output
#: (besides every in-place "..._" op that returns None, such as torch._foreach_add_)
_WRITES_ARG = frozenset({"Tensor.__setitem__"})
#: torch.distributed ops: the parameter holding what the collective produced
_DIST_OUTPUT = {
    "all_reduce": "tensor", "broadcast": "tensor", "reduce": "tensor", "recv": "tensor",
    "scatter": "tensor", "all_gather": "tensor_list", "all_gather_single": "output_tensor",
    "all_gather_coalesced": "output_tensor_lists", "all_reduce_coalesced": "tensors",
    "reduce_scatter": "output", "reduce_scatter_single": "output", "all_to_all_single": "output",
    "all_to_all": "output_tensor_list", "gather": "gather_list",
}


class ApiCaptureMode(TorchFunctionMode):
    """Entered by PrecisionDebugger.start(), exited by stop(); records through a Recorder."""

    def __init__(self, recorder: Recorder) -> None:
        super().__init__()
        self.recorder = recorder

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if kwargs is None:
            kwargs = {}
        try:
            name = _names.get(func, _MISSING)
        except TypeError:
            name = _op_name(func)
        if name is _MISSING:
            name = _op_name(func)
        if name is None:
            return func(*args, **kwargs)
        rec = self.recorder
        stack = rec.module_stack
        module = stack[-1] if stack else ""
        counter = (module, name)
        decision = rec.decisions.get(counter)
        if decision is None:
            decision = rec.filter.call(module, name)
        if not decision:
            return func(*args, **kwargs)
        return _capture(rec, func, name, module, counter, decision, args, kwargs)


def _capture(rec: Recorder, func, name, module, counter, decision, args, kwargs):
    filt = rec.filter
    namer = rec.namer
    counts = namer.counts
    index = counts.get(counter, 0)
    counts[counter] = index + 1
    seq = namer.seq
    namer.seq = seq + 1
    call = ("api", module, name, index, "forward", seq, rec.locate(1), decision,
            f"{module}/{name}#{index}/forward/")
    rec.calls += 1
    add = rec.add
    if filt.forward_in:
        position = 0
        for arg in args:
            slot = _INPUT_SLOTS[position] if position < 64 else f"input.{position}"
            position += 1
            if isinstance(arg, Tensor) or type(arg) in _PLAIN:
                add(call, slot, "in", arg)
            else:
                rec.add_tree(call, slot, "in", arg)
        if kwargs:
            for key, arg in kwargs.items():
                if isinstance(arg, Tensor) or type(arg) in _PLAIN:
                    add(call, "kwarg." + key, "in", arg)
                else:
                    rec.add_tree(call, "kwarg." + key, "in", arg)
    track = filt.backward and _is_grad_enabled()
    edges = _grad_edges(args, kwargs) if track and filt.backward_out else None
    out = func(*args, **kwargs)
    produced = out
    written = out is None or name.startswith("distributed.")
    if written:
        produced = _written_argument(func, name, args, kwargs, out)
    if filt.forward_out and produced is not None:
        if isinstance(produced, Tensor) and not written:
            add(call, "output.0", "out", produced)
        else:
            # collectives write their buffers without a version bump: never trust the cache
            rec.add_output(call, "out", produced, fresh=written)
    if track:
        _hook_backward(rec, call, produced, edges)
    return out


def _written_argument(func, name, args, kwargs, out):
    if name in _WRITES_ARG or (name.endswith("_") and out is None):
        # Tensor.__setitem__, torch._foreach_add_ and friends return None: their first
        # argument, after the call, is what they produced
        return args[0] if args else None
    if not name.startswith("distributed."):
        return out
    parameter = _DIST_OUTPUT.get(name[len("distributed."):])
    if parameter is None or kwargs.get("async_op"):
        return None  # send/isend produce nothing; an async op's buffer is not ready yet
    try:
        bound = _signature(func).bind(*args, **kwargs)
    except (TypeError, ValueError):
        return None
    return bound.arguments.get(parameter)


@functools.lru_cache(maxsize=None)
def _signature(func):
    return inspect.signature(func)


def _grad_edges(args, kwargs):
    """(slot, grad_fn, output_nr, tensor) of each input requiring grad, taken before the call."""
    edges = None
    for position, arg in enumerate(args):
        if isinstance(arg, Tensor):
            if arg.requires_grad:
                if edges is None:
                    edges = []
                edges.append((_INPUT_SLOTS[position] if position < 64 else f"input.{position}",
                              arg.grad_fn, arg.output_nr, arg))
        elif isinstance(arg, (list, tuple)):
            for inner, item in enumerate(arg):
                if isinstance(item, Tensor) and item.requires_grad:
                    if edges is None:
                        edges = []
                    edges.append((f"input.{position}.{inner}", item.grad_fn, item.output_nr, item))
    for key, arg in kwargs.items():
        if isinstance(arg, Tensor) and arg.requires_grad:
            if edges is None:
                edges = []
            edges.append(("input." + key, arg.grad_fn, arg.output_nr, arg))
    return edges


def _match_inputs(node, edges) -> tuple | None:
    """[(position in node inputs, grad slot)] when node's inputs are exactly the call's."""
    if not edges:
        return None
    mapping = []
    used = set()
    for position, (fn, output_nr) in enumerate(node.next_functions):
        if fn is None:
            continue
        for slot, grad_fn, edge_nr, tensor in edges:
            if slot in used:
                continue
            if grad_fn is not None:
                hit = fn is grad_fn and output_nr == edge_nr
            else:
                hit = getattr(fn, "variable", None) is tensor
            if hit:
                used.add(slot)
                mapping.append((position, "grad_" + slot))
                break
        else:
            return None  # an input of the node was made inside the call: composite op
    if len(used) != len(edges):
        return None
    return tuple(mapping)


def _hook_backward(rec, call, produced, edges):
    if isinstance(produced, Tensor):
        if not produced.requires_grad:
            return
        node = produced.grad_fn
        if node is None:
            return
        nodes = [(node, [(produced.output_nr, "grad_output.0")])]
    elif isinstance(produced, (tuple, list)):
        nodes = []
        for slot, tensor in _output_tensors(produced):
            if not tensor.requires_grad:
                continue
            node = tensor.grad_fn
            if node is None:
                continue
            for entry in nodes:
                if entry[0] is node:
                    entry[1].append((tensor.output_nr, "grad_" + slot))
                    break
            else:
                nodes.append((node, [(tensor.output_nr, "grad_" + slot)]))
    else:
        return
    for node, outs in nodes:
        mapping = _match_inputs(node, edges) if edges else None
        node.register_hook(functools.partial(_on_backward, rec, rec.generation, call, tuple(outs),
                                             mapping))


def _output_tensors(produced):
    from probe.capture.values import flatten

    return [(slot, leaf) for slot, leaf in flatten(produced, "output", [])
            if isinstance(leaf, Tensor)]


def _on_backward(rec, generation, forward_call, outs, mapping, grad_inputs, grad_outputs):
    if not rec.active or rec.generation != generation:
        return
    filt = rec.filter
    kind, module, op, index, _, _, source, decision, _ = forward_call
    with _DisableTorchFunction():
        call = rec.call(kind, module, op, index, "backward", source, decision)
        if filt.backward_in:
            for output_nr, slot in outs:
                grad = grad_outputs[output_nr] if output_nr < len(grad_outputs) else None
                if grad is not None:
                    rec.add(call, slot, "in", grad)
        if mapping and filt.backward_out:
            for position, slot in mapping:
                grad = grad_inputs[position] if position < len(grad_inputs) else None
                if grad is not None:
                    rec.add(call, slot, "out", grad)
