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
from probe.capture.autocast import autocast_dtype as _autocast_dtype, note_call as _note_autocast
from probe.capture.defaults import defaulted as _defaulted
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
_partial = functools.partial
_INPUT_SLOTS = tuple(f"input.{i}" for i in range(64))
_GRAD_SLOTS = tuple("grad_" + slot for slot in _INPUT_SLOTS)

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

    def __exit__(self, exc_type, exc_value, traceback):
        self.recorder.locate.forget()  # the source walk may hold a frame of the user's code
        return super().__exit__(exc_type, exc_value, traceback)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        try:
            name = _names.get(func, _MISSING)
        except TypeError:
            name = _op_name(func)
        if name is _MISSING:
            name = _op_name(func)
        if name is None:  # attribute reads and metadata: most calls the mode sees
            return func(*args, **kwargs) if kwargs else func(*args)
        if kwargs is None:
            kwargs = {}
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
    # frames 1 and 2 are this function and __torch_function__: start at the caller of torch
    call = ("api", module, name, index, "forward", seq, rec.locate(3), decision,
            f"{module}/{name}#{index}/forward/")
    rec.calls += 1
    add = rec.add
    autocast = _autocast_dtype()
    if autocast:  # a lower precision autocast chose is expected, one the model chose is not
        _note_autocast(rec.autocast_runs, seq, autocast, rec.autocast_last)
    rec.autocast_last[0] = seq
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
        # the defaults that choose the function: F.gelu(x) against F.gelu(x, approximate="tanh")
        for key, arg in _defaulted(func, args, kwargs):
            add(call, "default." + key, "in", arg)
    track = filt.backward and _is_grad_enabled()
    edges = _grad_edges(args, kwargs) if track else None
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
        if isinstance(produced, Tensor):
            # one tensor out (most calls): the common case without the structure walk
            if produced.requires_grad:
                node = produced.grad_fn
                if node is not None and not (edges and _returns_an_input(produced, node, edges)):
                    _hook_nodes(rec, call, ((node, ((produced.output_nr, "grad_output.0"),)),),
                                edges if filt.backward_out else None)
        elif isinstance(produced, (tuple, list)):
            _hook_backward(rec, call, produced, edges if filt.backward_out else None)
    return out


def _returns_an_input(produced, node, edges) -> bool:
    """The call computed nothing: it returned one of its inputs as it was (``x.to(x.dtype)``,
    ``x.contiguous()`` on a contiguous x). Its output's autograd node is the input's producer,
    so a hook there would record the gradient summed over every use of that tensor, not
    this call's: such a call records no backward (an in-place op returns its input too, but
    with a new node, and keeps its backward)."""
    for _, grad_fn, _, tensor in edges:
        if tensor is produced and grad_fn is node:
            return True
    return False


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
    """(grad slot, grad_fn, output_nr, tensor) of each input requiring grad, taken before the
    call; None when there is none. The grad slot is "grad_input.N" ("grad_input.N.M" inside a
    list, "grad_input.<name>" for a keyword)."""
    edges = None
    position = 0
    for arg in args:
        if isinstance(arg, Tensor):
            if arg.requires_grad:
                if edges is None:
                    edges = []
                edges.append((_GRAD_SLOTS[position] if position < 64
                              else f"grad_input.{position}", arg.grad_fn, arg.output_nr, arg))
        elif isinstance(arg, (list, tuple)):
            inner = 0
            for item in arg:
                if isinstance(item, Tensor) and item.requires_grad:
                    if edges is None:
                        edges = []
                    edges.append((f"grad_input.{position}.{inner}", item.grad_fn,
                                  item.output_nr, item))
                inner += 1
        position += 1
    if kwargs:
        for key, arg in kwargs.items():
            if isinstance(arg, Tensor) and arg.requires_grad:
                if edges is None:
                    edges = []
                edges.append(("grad_input." + key, arg.grad_fn, arg.output_nr, arg))
    return edges


def _match_inputs(next_functions, edges) -> tuple | None:
    """((position in node inputs, grad slot), ...) when a node's inputs (its next_functions)
    are exactly the call's, else None."""
    mapping = []
    used = set()  # grad slots (unique per call)
    for position, (fn, output_nr) in enumerate(next_functions):
        if fn is None:
            continue
        for slot, grad_fn, edge_nr, tensor in edges:
            if slot in used:
                continue
            if grad_fn is not None:
                if fn is not grad_fn or output_nr != edge_nr:
                    continue
            elif getattr(fn, "variable", None) is not tensor:
                continue
            used.add(slot)
            mapping.append((position, slot))
            break
        else:
            return None  # an input of the node was made inside the call: composite op
    if len(used) != len(edges):
        return None
    return tuple(mapping)


def _hook_backward(rec, call, produced, edges):
    """Backward hooks of a call that returned a tuple or list of tensors."""
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
    if nodes:
        _hook_nodes(rec, call, [(node, tuple(outs)) for node, outs in nodes], edges)


def _hook_nodes(rec, call, nodes, edges):
    """Register the hooks of one call: nodes are (node, ((output_nr, grad slot), ...)) of the
    nodes that made its outputs; edges (_grad_edges) None when grad_input is not wanted."""
    generation = rec.generation
    if not edges:
        for node, outs in nodes:
            node.register_hook(_partial(_on_backward, rec, generation, call, outs, None))
        return
    # next_functions builds a new tuple of wrappers on every read: read each node's once
    if len(nodes) == 1:  # most calls: one node made every output
        node, outs = nodes[0]
        first = node.next_functions
        mapping = _match_inputs(first, edges)
        if mapping is not None or not COMPOSITE_GRAD_INPUT:
            node.register_hook(_partial(_on_backward, rec, generation, call, outs, mapping))
            return
        next_functions = (first,)
    else:
        next_functions = [node.next_functions for node, _ in nodes]
        mappings = [_match_inputs(found, edges) for found in next_functions]
        if not (COMPOSITE_GRAD_INPUT and None in mappings):
            for (node, outs), mapping in zip(nodes, mappings):
                node.register_hook(_partial(_on_backward, rec, generation, call, outs,
                                            mapping))
            return
    # the call ran as several autograd nodes: find its own edges into its inputs
    found = _composite_edges([node for node, _ in nodes], next_functions, edges)
    shared = None
    if found:
        counts = _edge_counts(found)
        if any(count > 1 for count in counts.values()):
            shared = _CallBackward()
            shared.edges = {slot: count for slot, count in counts.items() if count > 1}
    # an output node that is also one of those nodes gets one hook doing both, grad_output
    # first (as two hooks registered in that order would)
    inputs_of = {id(node): positions for node, positions in found} if found else {}
    for node, outs in nodes:
        positions = inputs_of.pop(id(node), None)
        if positions is None:
            node.register_hook(_partial(_on_backward, rec, generation, call, outs, None))
        else:
            node.register_hook(_partial(_on_output_and_input_grads, rec, generation, call,
                                        outs, shared, positions))
    if inputs_of:
        for node, positions in found:
            if id(node) in inputs_of:
                node.register_hook(_partial(_on_input_grads, rec, generation, call, shared,
                                            positions))


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


def _composite_edges(out_nodes, out_next_functions, edges):
    """[(node, ((position, grad slot), ...))] for the edges inside the call's own autograd
    nodes that lead to one of its inputs; None when there are none or the walk is too big.
    out_next_functions: each output node's next_functions, already read.

    The walk starts at the output nodes and stops at the inputs' nodes (a non-leaf input's
    grad_fn, a leaf's AccumulateGrad), at nodes older than every input's node (they belong to
    earlier calls: autograd numbers nodes in creation order) and after _WALK_LIMIT nodes.
    """
    by_edge: dict = {}  # (id(input grad_fn), output_nr) -> [grad slot]
    by_leaf: dict = {}  # id(leaf tensor) -> [grad slot]
    input_nodes = set()  # input nodes stay alive while this runs: edges holds them
    oldest = -1
    for slot, grad_fn, output_nr, tensor in edges:
        if grad_fn is None:
            key = id(tensor)
            slots = by_leaf.get(key)
            if slots is None:
                by_leaf[key] = [slot]
            else:
                slots.append(slot)
        else:
            key = (id(grad_fn), output_nr)
            slots = by_edge.get(key)
            if slots is None:
                by_edge[key] = [slot]
            else:
                slots.append(slot)
            input_nodes.add(id(grad_fn))
            number = _sequence_nr(grad_fn)
            if number > oldest:
                oldest = number
    for node in out_nodes:
        # an output that is an input (x.contiguous() of a contiguous x) made no node here
        if id(node) in input_nodes or _sequence_nr(node) <= oldest:
            return None
    result = []
    stack = list(zip(out_nodes, out_next_functions))
    seen = compat.NodeSet(out_nodes)  # the nodes, not their ids: ids are reused up to 2.12
    while stack:
        node, next_functions = stack.pop()
        if next_functions is None:
            next_functions = node.next_functions
        # the same tensor passed in two slots (x * x) is one autograd edge: which slot the
        # gradient belongs to is not defined, so such slots get no grad_input
        kept = None
        for position, (fn, output_nr) in enumerate(next_functions):
            if fn is None:
                continue
            slots = by_edge.get((id(fn), output_nr))
            if slots is None:
                variable = getattr(fn, "variable", None)  # only AccumulateGrad has one
                if variable is not None:
                    slots = by_leaf.get(id(variable))
                    if slots is None:
                        continue
                elif fn in seen or _sequence_nr(fn) <= oldest:
                    continue
                else:
                    seen.add(fn)
                    if len(seen) > _WALK_LIMIT:
                        return None
                    stack.append((fn, None))
                    continue
            if len(slots) == 1:
                if kept is None:
                    kept = [(position, slots[0])]
                else:
                    kept.append((position, slots[0]))
        if kept is not None:
            result.append((node, tuple(kept)))
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


def _on_output_and_input_grads(rec, generation, forward_call, outs, shared, positions,
                               grad_inputs, grad_outputs):
    """An output node that is also one of a composite call's nodes with edges into its
    inputs: the grad_output event, then the grad_input event, as two hooks would."""
    _on_backward(rec, generation, forward_call, outs, None, grad_inputs, grad_outputs)
    _on_input_grads(rec, generation, forward_call, shared, positions, grad_inputs,
                    grad_outputs)


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
