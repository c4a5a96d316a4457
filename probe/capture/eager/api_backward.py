"""API level, backward: the hooks on the autograd nodes of a captured call.

For outputs that require grad, one hook is registered on the autograd node that produced
them (``grad_fn.register_hook``). When it fires it records the gradient flowing into each
output (``grad_output.N``) and, when the call is exactly that one node (each of the node's
inputs is one of the call's tensor inputs; checked at forward time), the gradient the node
sends to each input (``grad_input.N``). Composite calls get grad_input too while
api_mode.COMPOSITE_GRAD_INPUT is on: the call's own autograd nodes are walked from its
outputs to the edges into its inputs and those nodes are hooked (_composite_edges).
api_mode.py records the forward and calls hook_nodes / hook_backward.

Module level gets a module call's grad_input the same way (hook_input_edges): the walk goes
back from the module's outputs through every node made during the call. No node is added
between a tensor and its readers, so autograd sums a tensor's gradients from its readers in
the order it would without capture.
"""

from __future__ import annotations

import functools

import torch

from probe import compat
from probe.capture.recorder import charged

Tensor = torch.Tensor
_DisableTorchFunction = compat.DisableTorchFunction
_graph_task_id = compat.graph_task_id
_sequence_nr = compat.sequence_nr
_partial = functools.partial


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


def hook_backward(rec, call, produced, edges, composite: bool):
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
        hook_nodes(rec, call, [(node, tuple(outs)) for node, outs in nodes], edges, composite)


def hook_nodes(rec, call, nodes, edges, composite: bool):
    """Register the hooks of one call: nodes are (node, ((output_nr, grad slot), ...)) of the
    nodes that made its outputs; edges (api_mode._grad_edges) None when grad_input is not
    wanted; composite: api_mode.COMPOSITE_GRAD_INPUT."""
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
        if mapping is not None or not composite:
            node.register_hook(_partial(_on_backward, rec, generation, call, outs, mapping))
            return
        next_functions = (first,)
    else:
        next_functions = [node.next_functions for node, _ in nodes]
        mappings = [_match_inputs(found, edges) for found in next_functions]
        if not (composite and None in mappings):
            for (node, outs), mapping in zip(nodes, mappings):
                node.register_hook(_partial(_on_backward, rec, generation, call, outs,
                                            mapping))
            return
    # the call ran as several autograd nodes: find its own edges into its inputs
    found = _composite_edges([node for node, _ in nodes], next_functions, edges)
    shared = _shared_sums(found) if found else None
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
    index = _edge_index(edges)
    _, _, input_nodes, oldest = index
    for node in out_nodes:
        # an output that is an input (x.contiguous() of a contiguous x) made no node here
        if id(node) in input_nodes or _sequence_nr(node) <= oldest:
            return None
    # the same tensor passed in two slots (x * x) is one autograd edge: which slot the
    # gradient belongs to is not defined, so such slots get no grad_input
    return _walk(out_nodes, out_next_functions, index, oldest + 1, _WALK_LIMIT, False)


def _edge_index(edges):
    """({(id(input grad_fn), output_nr): [grad slot]}, {id(leaf input): [grad slot]}, ids of
    the inputs' nodes, the largest sequence number among them or -1)."""
    by_edge: dict = {}
    by_leaf: dict = {}
    input_nodes = set()  # input nodes stay alive while a walk runs: edges holds them
    oldest = -1
    for slot, grad_fn, output_nr, tensor in edges:
        if grad_fn is None:
            by_leaf.setdefault(id(tensor), []).append(slot)
        else:
            by_edge.setdefault((id(grad_fn), output_nr), []).append(slot)
            input_nodes.add(id(grad_fn))
            number = _sequence_nr(grad_fn)
            if number > oldest:
                oldest = number
    return by_edge, by_leaf, input_nodes, oldest


def _walk(out_nodes, out_next_functions, index, floor: int, limit, every_slot: bool):
    """The nodes made since sequence number floor, reached from out_nodes, that have an edge
    into an input: [(node, ((position, grad slot), ...))], or None (none found, or more than
    limit nodes walked). index: _edge_index of the inputs. every_slot: an edge into a tensor
    passed in several slots counts for each of them (else for none)."""
    by_edge, by_leaf, input_nodes, _ = index
    result = []
    if out_next_functions is None:
        out_next_functions = [None] * len(out_nodes)
    stack = list(zip(out_nodes, out_next_functions))
    # id -> node: holding the nodes keeps their ids unique while the walk runs. Up to torch
    # 2.12 a C++ node does not keep its Python wrapper alive: once the walk dropped a wrapper,
    # the next one made could get its id, and a set of ids "remembered" a node it never saw
    # (on 2.11 F.normalize's LinalgVectorNormBackward0 got a freed ExpandBackward0's id, was
    # skipped, and its grad_input recorded wrong). Holding the wrapper makes torch hand back
    # that same wrapper for that node (2.13+ always does).
    seen = {id(node): node for node in out_nodes}
    if limit is None:
        limit = -1
    while stack:
        node, next_functions = stack.pop()
        if next_functions is None:
            next_functions = node.next_functions
        kept = None
        for position, (fn, output_nr) in enumerate(next_functions):
            if fn is None:
                continue
            key = id(fn)
            slots = by_edge.get((key, output_nr)) if key in input_nodes else None
            if slots is None:
                if key in seen:
                    continue
                variable = getattr(fn, "variable", None)  # only AccumulateGrad has one
                if variable is not None:
                    slots = by_leaf.get(id(variable))
                    if slots is None:
                        continue
                elif _sequence_nr(fn) < floor:
                    continue
                else:
                    seen[key] = fn
                    if len(seen) > limit >= 0:
                        return None
                    stack.append((fn, None))
                    continue
            if len(slots) == 1 or every_slot:
                if kept is None:
                    kept = []
                for slot in slots:
                    kept.append((position, slot))
        if kept is not None:
            result.append((node, tuple(kept)))
    return result or None


def hook_input_edges(rec, call, out_nodes, edges, floor: int) -> None:
    """Module level: grad_input.N of one module call, from hooks on the autograd nodes the
    call made that read its inputs (edges: (grad slot, grad_fn, output_nr, tensor) of each
    input, taken before the call; floor: compat.next_sequence_nr() then, -1 when unknown).

    Each such node sends its share of an input's gradient along its edge; a hook on the node
    (which changes nothing autograd computes) reads it, and an input several of them read gets
    the sum of their shares: the gradient that flowed through this call only. The walk goes
    from the outputs' nodes back through the nodes made during the call, however many."""
    index = _edge_index(edges)
    _, _, input_nodes, oldest = index
    if floor < 0:
        floor = oldest + 1
    # an output that is an input itself made no node in this call
    starts = [node for node in out_nodes
              if id(node) not in input_nodes and _sequence_nr(node) >= floor]
    if not starts:
        return
    found = _walk(starts, None, index, floor, None, True)
    if not found:
        return
    generation = rec.generation
    shared = _shared_sums(found)
    for node, positions in found:
        node.register_hook(_partial(_on_input_grads, rec, generation, call, shared, positions))


def _shared_sums(found):
    """A _CallBackward for the inputs several found edges lead to; None when there is none."""
    if len(found) == 1 and len(found[0][1]) == 1:  # one node reads one input (most calls)
        return None
    counts = _edge_counts(found)
    if not any(count > 1 for count in counts.values()):
        return None
    shared = _CallBackward()
    shared.edges = {slot: count for slot, count in counts.items() if count > 1}
    return shared


def _edge_counts(found) -> dict:
    counts: dict = {}
    for _, positions in found:
        for _, slot in positions:
            counts[slot] = counts.get(slot, 0) + 1
    return counts


@charged
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
    from probe.capture.eager.values import flatten

    return [(slot, leaf) for slot, leaf in flatten(produced, "output", [])
            if isinstance(leaf, Tensor)]


@charged
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
