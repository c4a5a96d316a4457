"""Gradients from inside a compiled graph: zero inputs whose gradient is the one wanted.

The backward of a compiled graph runs as one compiled function: no hook can see the gradient
of a node inside it. But the gradient of a graph *input* comes out of that function, and a
zero added to a value changes nothing in the forward while its gradient is exactly the
gradient of that value. So, for a graph that will be trained:

* after each recorded call ``y = f(...)``, every later use of ``y`` reads ``y + z_y``: the
  gradient of ``z_y`` is the gradient of ``y`` over all its uses, the eager ``grad_output.0``;
* each use of a value ``x`` by a call ``C`` reads ``x + z_(C,x)`` instead: the gradient of
  ``z_(C,x)`` is what flowed into ``x`` through ``C`` only, the eager per-call ``grad_input``
  (and the sum over a submodule call's uses of its input is the module's ``grad_input.0``).

Where one call alone reads ``y``, ``z_(C,y)`` would get the same gradient as ``z_y``: that use
takes ``z_y``'s gradient instead of a zero of its own (each zero costs the compiled backward
one more activation-sized gradient to hand out).

The ``z`` are new graph inputs, zeros made for every run of the graph (requires_grad); a hook
on each records its gradient in the backward. Adding an exact zero changes no value (a -0.0
becomes +0.0); the extra adds and the gradients handed out of the backward may change how a
compiler fuses the graph (docs/howto.md).
"""

from __future__ import annotations

import functools
import warnings

import torch

from probe import compat
from probe.capture.compiled import graph_names

_DisableTorchFunction = compat.DisableTorchFunction


#: calls that return their input itself when there is nothing to convert: the api level
#: records no backward for them then (api_mode._returns_an_input)
_MAYBE_SAME = frozenset({"to", "float", "double", "half", "bfloat16", "contiguous", "type",
                         "type_as", "cpu", "cuda"})


def returns_its_input(node) -> bool:
    """The call hands back its first argument unchanged (``x.float()`` of a float32 x)."""
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
    if name not in _MAYBE_SAME or not node.args or not hasattr(node.args[0], "op"):
        return False
    before, after = graph_names.example(node.args[0]), graph_names.example(node)
    if not isinstance(before, torch.Tensor) or not isinstance(after, torch.Tensor):
        return False
    return (before.dtype, before.shape, before.stride(), before.device) == \
        (after.dtype, after.shape, after.stride(), after.device)


def _trained(node) -> bool:
    value = graph_names.example(node)
    return isinstance(value, torch.Tensor) and value.requires_grad and value.is_floating_point() \
        and all(isinstance(size, int) for size in value.shape)


class Zeros:
    """The zero inputs a graph run needs: (shape, dtype, device) of each, in order."""

    def __init__(self) -> None:
        self.specs: list = []

    def make(self) -> list:
        return [torch.zeros(shape, dtype=dtype, device=device, requires_grad=True)
                for shape, dtype, device in self.specs]


def add(graph, events, where, op_kind, open_kind, taps) -> tuple[Zeros, list]:
    """Add the zero inputs to ``graph`` and to each event the gradients it records:
    OP events get ``[(slot, zero index, io)]``, OPEN events ``[(slot, [zero indices], io)]``.
    Returns (Zeros, the placeholder nodes added)."""
    zeros = Zeros()
    added = []
    last = [node for node in graph.nodes if node.op == "placeholder"][-1]

    def zero_like(node):
        nonlocal last
        value = graph_names.example(node)
        with graph.inserting_after(last):
            placeholder = graph.placeholder(f"probe_zero_{len(zeros.specs)}")
        placeholder.meta["example_value"] = value
        # made here, not read from the user's frame
        compat.set_input_source(placeholder, compat.added_input_source(placeholder.name))
        last = placeholder
        zeros.specs.append((tuple(value.shape), value.dtype, value.device))
        added.append(placeholder)
        return placeholder, len(zeros.specs) - 1

    node_at = {index: node for node, index in where.items()}
    # 1. the gradient of every recorded call's output
    output_zero: dict = {}
    origin: dict = {}  # y + z -> y
    for event in events:
        if event[0] != op_kind:
            continue
        node = event[6]
        if not _trained(node) or node in output_zero or returns_its_input(node):
            continue
        placeholder, index = zero_like(node)
        users = [user for user in node.users if user not in taps]
        with graph.inserting_after(node):
            shifted = graph.call_function(torch.add, (node, placeholder))
        shifted.meta["example_value"] = graph_names.example(node)
        for user in users:
            user.replace_input_with(node, shifted)
        output_zero[node] = index
        origin[shifted] = node
    # 2. the gradient through each use of a value by a call
    use_zero: dict = {}  # (call node, value node) -> zero index
    passes: dict = {}  # a call that returns its input unchanged -> that input's value node
    twice: set = set()  # (call node, value node) of a call reading the value more than once
    for event in events:
        if event[0] != open_kind and event[0] != op_kind:
            continue
        members = [event[6]] if event[0] == op_kind else event[5]
        for call in members:
            if returns_its_input(call):
                # eager autograd makes no node for it: a zero would add one; its readers'
                # zeros are the uses of its input (a submodule's grad_input below)
                passes[call] = origin.get(call.args[0], call.args[0])
                continue
            for used in list(call.all_input_nodes):
                source = origin.get(used, used)
                if (call, source) in use_zero or used in taps or not _trained(source):
                    continue
                if _reads(call, used) > 1:
                    # x * x: through a zero of its own, the call's two gradients would be
                    # summed before the other uses' (autograd adds each to x's in turn)
                    twice.add((call, source))
                    continue
                if source in output_zero and _only_user(used, call, taps):
                    # all of the value's gradient flows through this call: the gradient of
                    # its output zero is this use's too, and the backward hands out one less
                    use_zero[(call, source)] = output_zero[source]
                    continue
                placeholder, index = zero_like(source)
                with graph.inserting_before(call):
                    shifted = graph.call_function(torch.add, (used, placeholder))
                shifted.meta["example_value"] = graph_names.example(source)
                call.replace_input_with(used, shifted)
                use_zero[(call, source)] = index
    # 3. what each event records
    for event in events:
        if event[0] == op_kind:
            node, grads = event[6], event[7]
            if returns_its_input(node):
                continue
            if node in output_zero:
                grads.append(("grad_output.0", output_zero[node], "in"))
            slots_of: dict = {}
            for slot, ref in _argument_slots(event[4]):
                slots_of.setdefault(node_at.get(ref[1]), []).append(slot)
            for source, slots in slots_of.items():
                index = use_zero.get((node, source))
                if index is not None and len(slots) == 1:
                    grads.append((_grad_slot(slots[0]), index, "out"))
        elif event[0] == open_kind:
            # a submodule call: the gradient through its uses of each input it names, and
            # the gradient of each output it names (capture/compiled/graph_marks.py)
            members, grads = event[5], event[6]
            for slot, ref in event[3]:
                if ref[0] != "env":
                    continue
                # the input and what returned it unchanged (x.to(torch.float32) of a float32 x)
                same = {node_at.get(ref[1])}
                for call in members:
                    if passes.get(call) in same:
                        same.add(call)
                found = [use_zero[(call, source)] for call in members for source in same
                         if (call, source) in use_zero]
                if found and not any((call, source) in twice for call in members for source in same):
                    grads.append((_grad_slot(slot), found, "out"))  # (a read twice: left out)
            passed = {ref[1] for _, ref in event[3] if ref[0] == "env"}
            for slot, ref in event[4]:
                if ref[0] != "env" or ref[1] in passed:
                    continue  # an input returned as it was (nn.Identity): nothing made here
                made = node_at.get(ref[1])
                if made in output_zero:
                    grads.append(("grad_" + slot, [output_zero[made]], "in"))
    return zeros, added


def _reads(call, value) -> int:
    """How many of the call's arguments are ``value``."""
    count = 0

    def visit(node):
        nonlocal count
        count += node is value
        return node

    torch.fx.node.map_arg((call.args, call.kwargs), visit)
    return count


def _only_user(value, call, taps) -> bool:
    """Whether ``call`` is the only node that reads ``value`` (probe's taps aside): no other
    call, and no graph output through which a gradient could come from outside."""
    return all(user is call or user in taps for user in value.users)


def _argument_slots(slots):
    """(slot, ("env", i)) of every graph value among a call's arguments, a list's items as
    ``input.N.M`` (as values.flatten names them)."""
    for slot, ref in slots:
        if ref is None:
            continue
        if ref[0] == "env":
            yield slot, ref
        elif ref[0] == "list":
            for position, item in enumerate(ref[1]):
                if item is not None and item[0] == "env":
                    yield f"{slot}.{position}", item


def _grad_slot(slot: str) -> str:
    """The api level's name for the gradient of an argument: input.N -> grad_input.N, a
    keyword argument -> grad_input.<name>."""
    return "grad_input." + slot[len("kwarg."):] if slot.startswith("kwarg.") else "grad_" + slot


def hook(run: "RunGrads", call, grads, zeros, order: tuple) -> None:
    """Register the hooks that record a call's gradients (grads from add()) on this graph
    run's zero inputs. order: (position of the call's grad_input, of its grad_output) in
    the plan, so that run can record them in the eager backward's order."""
    for slot, index, io in grads:
        position = order[1] if io == "in" else order[0]
        item = (position, call, slot, io)
        if isinstance(index, list) and len(index) > 1:
            total = _Sum(len(index))
            for one in index:
                zeros[one].register_hook(functools.partial(_on_part, run, item, total))
        else:
            one = index[0] if isinstance(index, list) else index
            zeros[one].register_hook(functools.partial(_on_grad, run, item))
        run.expected += 1


class RunGrads:
    """The gradients of one run of a graph. The compiled backward hands out all of them at
    once, in no useful order; they are recorded when the last one arrives (or at stop()),
    as the eager backward would: later calls first, a call's grad_output before its
    grad_input, one backward event per call."""

    def __init__(self, rec) -> None:
        self.rec = rec
        self.generation = rec.generation
        self.expected = 0
        self.items: list = []
        _pending.append(self)

    def arrived(self, item, grad) -> None:
        self.items.append((item, grad))
        if len(self.items) == self.expected:
            self.flush()

    def flush(self) -> None:
        items, self.items = self.items, []
        if self in _pending:
            _pending.remove(self)
        rec = self.rec
        if not items or not rec.active or rec.generation != self.generation:
            return
        items.sort(key=lambda entry: (-entry[0][0], entry[0][3] != "in", entry[0][2]))
        try:
            with _DisableTorchFunction():
                event = last = None
                for (position, call, slot, io), grad in items:
                    if (position, id(call)) != last:
                        last = (position, id(call))
                        kind, module, op, index, _, _, source, decision, _ = call
                        event = rec.call(kind, module, op, index, "backward", source, decision)
                    rec.add(event, slot, io, grad)
        except Exception as error:  # capture never raises into the user's backward
            warnings.warn(f"probe: recording the gradients of a compiled graph failed "
                          f"({error!r}); they are missing from this step", RuntimeWarning,
                          stacklevel=2)


#: graph runs whose gradients are not all in: recorded at stop() (flush_all)
_pending: list = []


def flush_all() -> None:
    for run in list(_pending):
        run.flush()
    _pending.clear()


class _Sum:
    __slots__ = ("left", "total")

    def __init__(self, parts: int) -> None:
        self.left = parts
        self.total = None


def _on_part(run, item, total, grad):
    total.total = grad if total.total is None else total.total + grad
    total.left -= 1
    if total.left == 0:
        run.arrived(item, total.total)


def _on_grad(run, item, grad):
    run.arrived(item, grad)
