"""API level: one TorchFunctionMode that records every torch call made while it is active.

A TorchFunctionMode sees torch.*, torch.nn.functional.*, Tensor methods and operators, and
``from torch import relu`` references alike, because torch routes them all through
``__torch_function__``; no torch attribute is replaced. In torch >= 2.1 the collectives of
torch.distributed (all_reduce, broadcast, all_gather, all_gather_into_tensor,
reduce_scatter_tensor, all_to_all_single, send/recv, ...) also check for a mode and arrive
here as ``distributed.<name>`` (all_gather_into_tensor as ``distributed.all_gather_single``,
reduce_scatter_tensor as ``distributed.reduce_scatter_single``, on every torch version) --
from torch 2.12 on; older versions pass only some or none (probe.compat.uncaptured_collectives,
warned about at start()).

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
log_softmax + nll_loss) get grad_input too while COMPOSITE_GRAD_INPUT is on (the default): the
call's own autograd nodes are walked from its outputs to the edges into its inputs and
those nodes are hooked (see _composite_edges; an input reaching several of them gets the
sum, recorded as its own backward event when the last edge ran). Node hooks do not change
numerics, and they stay with the node that produced the value, so a later in-place op on
the output does not move them.
"""

from __future__ import annotations

import functools
import inspect

import torch
from torch.overrides import TorchFunctionMode

from probe import compat
from probe.capture import naming
from probe.capture.recorder import Recorder

Tensor = torch.Tensor
_DisableTorchFunction = compat.DisableTorchFunction
_is_grad_enabled = torch.is_grad_enabled
_graph_task_id = compat.graph_task_id
_sequence_nr = compat.sequence_nr
_names = naming._cache
_MISSING = naming._MISSING
_op_name = naming.op_name
_PLAIN = (int, float, bool, str, type(None))
_INPUT_SLOTS = tuple(f"input.{i}" for i in range(64))

#: record grad_input.N of composite calls (several autograd nodes) too. On: compare judges
#: a backward call against its grad_output and the records of the same call's forward, so a
#: loss whose grad_output agrees (1.0) but whose grad_input differs because its logits did
#: inherits that error. An escape hatch: set it False before start() to hook only the node
#: that made the outputs (fewer hooks; composite calls then record grad_output only).
COMPOSITE_GRAD_INPUT = True

#: ops that return None but write into their first argument, which is then their output
#: (besides every in-place "..._" op that returns None, such as torch._foreach_add_)
_WRITES_ARG = frozenset({"Tensor.__setitem__"})
#: torch.distributed ops (names after compat.COLLECTIVE_ALIASES): the parameter holding what
#: the collective produced, spelled the same by every version's signature
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
    before = _grad_edges(args, kwargs) if track else None
    edges = before if filt.backward_out else None
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
    if track and not _returns_an_input(produced, before):
        _hook_backward(rec, call, produced, edges)
    return out


def _returns_an_input(produced, edges) -> bool:
    """The call computed nothing: it returned one of its inputs as it was (``x.to(x.dtype)``,
    ``x.contiguous()`` on a contiguous x). Its output's autograd node is the input's producer,
    so a hook there would record the gradient summed over every use of that tensor, not
    this call's: such a call records no backward (an in-place op returns its input too, but
    with a new node, and keeps its backward)."""
    if not edges or not isinstance(produced, Tensor):
        return False
    return any(tensor is produced and grad_fn is produced.grad_fn for _, grad_fn, _, tensor in edges)


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
    mappings = [_match_inputs(node, edges) for node, _ in nodes] if edges else None
    composite = COMPOSITE_GRAD_INPUT and mappings is not None and None in mappings
    generation = rec.generation
    for position, (node, outs) in enumerate(nodes):
        mapping = None if composite or not mappings else mappings[position]
        node.register_hook(functools.partial(_on_backward, rec, generation, call, tuple(outs),
                                             mapping))
    if composite:
        # the call ran as several autograd nodes: find its own edges into its inputs
        # (registered after the grad_output hooks, which fire first on a shared node)
        found = _composite_edges([node for node, _ in nodes], edges)
        if found:
            counts = _edge_counts(found)
            shared = None
            if any(count > 1 for count in counts.values()):
                shared = _CallBackward()
                shared.edges = {slot: count for slot, count in counts.items() if count > 1}
            for node, positions in found:
                node.register_hook(functools.partial(_on_input_grads, rec, generation, call,
                                                     shared, positions))


class _CallBackward:
    """Partial sums, during one backward pass, of the inputs of one composite call that
    reach several of its autograd nodes."""

    __slots__ = ("task", "edges", "seen", "sums")

    def __init__(self) -> None:
        self.task = None  # graph task id of the pass the partial sums belong to
        self.edges: dict = {}  # grad slot -> number of edges into that input inside the call
        self.seen: dict = {}  # grad slot -> edges fired in this pass
        self.sums: dict = {}  # grad slot -> gradient summed so far in this pass

    def begin(self) -> None:
        """Forget the partial sums of an earlier pass (one that skipped some edges)."""
        task = _graph_task_id()
        if task != self.task:
            self.task = task
            self.seen = {}
            self.sums = {}


#: most autograd nodes one composite call may span before its grad_input is given up
_WALK_LIMIT = 64


def _composite_edges(out_nodes, edges):
    """[(node, ((position, grad slot), ...))] for the edges inside the call's own autograd
    nodes that lead to one of its inputs; None when there are none or the walk is too big.

    The walk starts at the output nodes and stops at the inputs' nodes (a non-leaf input's
    grad_fn, a leaf's AccumulateGrad), at nodes older than every input's node (they belong to
    earlier calls: autograd numbers nodes in creation order) and after _WALK_LIMIT nodes.
    """
    by_node: dict = {}  # id(input grad_fn) -> [(output_nr, slot)]
    by_leaf: dict = {}  # id(leaf tensor) -> [slot]
    oldest = -1
    for slot, grad_fn, output_nr, tensor in edges:
        if grad_fn is None:
            by_leaf.setdefault(id(tensor), []).append(slot)
        else:
            by_node.setdefault(id(grad_fn), []).append((output_nr, slot))
            number = _sequence_nr(grad_fn)
            if number > oldest:
                oldest = number
    for node in out_nodes:
        # an output that is an input (x.contiguous() of a contiguous x) made no node here
        if id(node) in by_node or _sequence_nr(node) <= oldest:
            return None
    found = []
    stack = list(out_nodes)
    seen = compat.NodeSet(out_nodes)  # the nodes, not their ids: ids are reused up to 2.12
    while stack:
        node = stack.pop()
        positions = []
        for position, (fn, output_nr) in enumerate(node.next_functions):
            if fn is None:
                continue
            hits = by_node.get(id(fn))  # input nodes stay alive: edges holds them
            if hits is not None:
                slots = [slot for number, slot in hits if number == output_nr]
                if slots:
                    positions.append((position, slots))
                    continue
            variable = getattr(fn, "variable", None)  # only AccumulateGrad has one
            if variable is not None:
                slots = by_leaf.get(id(variable))
                if slots:
                    positions.append((position, slots))
                continue
            if fn in seen or _sequence_nr(fn) <= oldest:
                continue
            seen.add(fn)
            if len(seen) > _WALK_LIMIT:
                return None
            stack.append(fn)
        if positions:
            found.append((node, positions))
    if not found:
        return None
    # the same tensor passed in two slots (x * x) is one autograd edge: which slot the
    # gradient belongs to is not defined, so such slots get no grad_input
    result = []
    for node, positions in found:
        kept = tuple((position, "grad_" + slots[0]) for position, slots in positions
                     if len(slots) == 1)
        if kept:
            result.append((node, kept))
    return result or None


def _edge_counts(found) -> dict:
    counts: dict = {}
    for _, positions in found:
        for _, slot in positions:
            counts[slot] = counts.get(slot, 0) + 1
    return counts


def _on_input_grads(rec, generation, forward_call, shared, positions, grad_inputs,
                    grad_outputs):
    """A node inside a composite call ran: the gradients it sent to the call's inputs.

    Each firing is its own backward event (its own seq), so records stay in execution order.
    """
    if not rec.active or rec.generation != generation or not rec.filter.backward_out:
        return
    with _DisableTorchFunction():
        ready = []
        if shared is not None:
            shared.begin()
        for position, slot in positions:
            grad = grad_inputs[position] if position < len(grad_inputs) else None
            if shared is None or slot not in shared.edges:
                if grad is not None:
                    ready.append((slot, grad))
                continue
            # the input reaches several nodes of the call: its per-call gradient is the sum
            sums, seen = shared.sums, shared.seen
            if grad is not None:
                partial = sums.get(slot)
                sums[slot] = grad if partial is None else partial + grad
            count = seen.get(slot, 0) + 1
            seen[slot] = count
            if count == shared.edges[slot]:
                del seen[slot]
                summed = sums.pop(slot, None)
                if summed is not None:
                    ready.append((slot, summed))
        if ready:
            kind, module, op, index, _, _, source, decision, _ = forward_call
            call = rec.call(kind, module, op, index, "backward", source, decision)
            for slot, grad in ready:
                rec.add(call, slot, "out", grad)


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
