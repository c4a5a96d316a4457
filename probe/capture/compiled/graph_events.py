"""The plan of a compiled graph: which calls of the graph to record, in graph order.

An event is a list whose first item is its kind: an API call (``OP``), or the start
(``OPEN``) and end (``CLOSE``) of a submodule call the graph spans, with the values that
name its inputs and outputs. capture/compiled/graph_taps.py builds the plan with ``events`` and
records it while the compiled graph runs.
"""

from __future__ import annotations

import operator

import torch

from probe.capture.compiled import graph_names

Tensor = torch.Tensor

# event kinds of a plan
OP, OPEN, CLOSE = 0, 1, 2


def events(ordered, marks, where, params, taps) -> list:
    """The plan's events in graph order. A submodule call opens where the graph enters it and
    closes where it leaves; where probe.compile marked the calls (capture/compiled/graph_marks.py), a
    mark opens and closes the call, and names its inputs and outputs."""
    events = []
    opened: list = []  # (module chain entry, event index) of the calls currently open
    runs: dict = {}  # open event index -> set of nodes
    named: dict = {}  # open event index -> [inputs, outputs] named by marks

    def close_to(depth):
        while len(opened) > depth:
            _, start = opened.pop()
            events[start].append(len(events))
            events.append([CLOSE, start])

    def enter(chain, node):
        keep = 0
        while keep < min(len(opened), len(chain)) and opened[keep][0] == chain[keep]:
            keep += 1
        close_to(keep)
        for entry in chain[keep:]:
            start = len(events)
            events.append([OPEN, entry, graph_names.source(node, 1), [], [], set(), []])
            runs[start] = set()
            opened.append((entry, start))

    for node in ordered:
        chain = graph_names.module_chain(node)
        mark = marks.get(node)
        if mark is not None:
            io, slots = mark
            if not chain:
                continue
            if io == "in":
                # a new call of the marked module begins, even right after one that ended
                enter(chain[:-1], node)
                enter(chain, _first_call_after(ordered, node, marks) or node)
                named[opened[-1][1]] = [_refs(slots, where), None]
            else:
                enter(chain, node)
                start = opened[-1][1]
                if start in named:
                    named[start][1] = _refs(slots, where)
                close_to(len(chain) - 1)
            continue
        enter(chain, node)
        for _, start in opened:
            runs[start].add(node)
        op, args = graph_names.as_eager_sees_it(node, where)
        if op is not None:
            outs = _outputs(node, where)
            if outs:
                events.append([OP, op, chain, graph_names.source(node), args, outs, node, []])
    close_to(0)
    for start, members in runs.items():
        inputs, outputs = named.get(start, (None, None))
        events[start][3] = _run_inputs(members, where, params) if inputs is None else inputs
        events[start][4] = _run_outputs(members, where, taps) if outputs is None else outputs
        events[start][5] = members
    return events


def _first_call_after(ordered, mark, marks):
    """The first node after ``mark`` that is not a mark (the source line of the call)."""
    for node in ordered[ordered.index(mark) + 1:]:
        if node not in marks:
            return node
    return None


def _refs(slots, where) -> list:
    """[(slot, ref)] of a mark's plain values and of the tensors the plan can read at run
    time."""
    refs = []
    for slot, found in slots:
        if isinstance(found, tuple):
            refs.append((slot, found))
        elif found in where:
            refs.append((slot, ("env", where[found])))
    return refs


def _outputs(node, where) -> list:
    if node in where:
        return [("output.0", ("env", where[node]))]
    if isinstance(graph_names.example(node), (tuple, list)):
        found = []
        for user in node.users:
            if user.target is operator.getitem and user in where:
                found.append((f"output.{user.args[1]}", ("env", where[user])))
        return sorted(found)
    return []


def _run_inputs(members, where, params) -> list:
    seen = []
    for node in members:
        for arg in node.all_input_nodes:
            if arg in members or arg in params or arg in seen or arg not in where:
                continue
            if not isinstance(graph_names.example(arg), Tensor) and arg.op == "placeholder":
                continue
            seen.append(arg)
    # which argument each tensor was (input.N, a keyword) is not in the graph: only a call
    # with one tensor input is named (input.0)
    return [("input.0", ("env", where[seen[0]]))] if len(seen) == 1 else []


def _run_outputs(members, where, taps) -> list:
    """Values made inside a module call and used after it: what the call returned."""
    made = []
    for node in members:
        if node not in where:
            continue
        if any(user not in members and user not in taps for user in node.users):
            made.append(node)
    # several values leave the call: which one is output.N is not in the graph; a guess could
    # pair two different tensors, so none is recorded
    return [("output.0", ("env", where[made[0]]))] if len(made) == 1 else []
