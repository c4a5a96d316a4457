"""Normalize stage: every optimizer call named by the parameter it updates.

An optimizer call (run after the backward began, outside any module) is named by the
parameter it updates: a tensor it reads or writes is that parameter's ``param.*`` or
``param_grad.*`` record, or was made by an optimizer call already named; the elements of
one foreach block share their position's name; a call linked to nothing takes the name of
the next named call (a loop body starts with its step counter). Fused kernels pair by
that name (foreach_pairing.py).
"""

from __future__ import annotations

from collections import defaultdict

from probe.comparison.optimizer_calls import base_op, tensor_print
from probe.comparison.records import Call, Records, is_param_slot


def name_targets(calls: list[Call], records: Records) -> None:
    """Set Call.target on the optimizer calls of one run (module docstring: name_targets)."""
    cols = records.columns
    backward = [int(s) for s, phase in zip(cols["seq"], cols["phase"]) if phase == "backward"]
    if not backward:
        return
    start = min(backward)
    names = _parameter_prints(records)
    made: dict = defaultdict(set)  # fingerprint -> names of the optimizer calls that wrote it
    region = [c for c in calls if c.phase == "forward" and c.seq > start and c.kind == "api" and c.module == ""]
    decisive: dict[int, str] = {}  # id(call) -> name, for calls a parameter's value or gradient names
    for call in region:
        found, direct = _linked(call, records, names, made)
        if len(found) == 1:
            call.target = next(iter(found))
            if direct:
                decisive[id(call)] = call.target
            for slot, row in call.slots.items():
                if cols["io"][row] == "out" or slot == "input.0":
                    mark = tensor_print(cols, row)
                    if mark is not None:
                        made[mark].add(call.target)
    _vote_in_bodies([c for c in region if c.element < 0], records, decisive)
    _share_in_blocks(region)
    following = ""
    for call in reversed(region):
        if call.target:
            following = call.target
        elif following:
            call.target = following


def _linked(call: Call, records: Records, names: dict, made: dict) -> set:
    """The parameters a call's tensors tie it to: a tensor that is one parameter's value or
    gradient decides; else one written by an optimizer call named before; else what every
    linked tensor agrees on (all-zero state of equal shape matches many parameters)."""
    cols = records.columns
    direct, produced = [], []
    for row in call.slots.values():
        mark = tensor_print(cols, row)
        if mark is None:
            continue
        if names.get(mark):
            direct.append(names[mark])
        if cols["io"][row] == "in" and made.get(mark):
            produced.append(made[mark])
    for found, decides in ((direct, True), (produced, False)):
        unique = set().union(*(names_ for names_ in found if len(names_) == 1))
        if len(unique) == 1:
            return unique, decides
    linked = direct + produced
    common = set.intersection(*linked) if linked else set()
    return (common if len(common) == 1 else set()), False


def _vote_in_bodies(calls: list[Call], records: Records, decisive: dict) -> None:
    """A per-parameter loop runs the same ops for every parameter: split its calls (creation
    ops aside) into equal bodies and name each body by the parameter most of its decisively
    linked calls name (all-zero or all-one tensors of equal shape link to many parameters,
    and a wrong guess must not spread)."""
    cols = records.columns
    loop = [c for c in calls if any(s.startswith("input.") and cols["dtype"][r] != "" for s, r in c.slots.items())]
    while len(loop) >= 4:
        bodies = _trailing_bodies(loop)
        if not bodies:
            return
        _vote(bodies, decisive)
        loop = loop[:len(loop) - sum(len(body) for body in bodies)]


def _trailing_bodies(loop: list[Call]) -> list[list[Call]]:
    """The longest run of equal bodies (same ops in the same order) that ends the loop."""
    ops = [base_op(c.op) for c in loop]
    best: list = []
    for size in range(1, min(len(loop) // 2, 64) + 1):
        pattern = ops[len(ops) - size:]
        count = 0
        while (count + 1) * size <= len(ops) and ops[len(ops) - (count + 1) * size:len(ops) - count * size] == pattern:
            count += 1
        if count >= 2 and count * size > sum(len(b) for b in best):
            best = [loop[len(loop) - (k + 1) * size:len(loop) - k * size] for k in reversed(range(count))]
    return best


def _vote(bodies, decisive: dict) -> None:
    for body in bodies:
        votes: dict[str, int] = defaultdict(int)
        for call in body:
            if id(call) in decisive:
                votes[decisive[id(call)]] += 1
        if votes:
            best = max(votes.values())
            winners = [name for name, count in votes.items() if count == best]
            if len(winners) == 1:
                for call in body:
                    call.target = winners[0]


def _share_in_blocks(region: list[Call]) -> None:
    """The elements at one position of a foreach block (a parameter group) are one parameter's:
    a position named by any of its elements names them all."""
    by_position: dict = defaultdict(list)
    for call in region:
        if call.element >= 0:
            by_position[(call.block, call.element)].append(call)
    for elements in by_position.values():
        named = {c.target for c in elements if c.target}
        if len(named) == 1:
            for call in elements:
                call.target = call.target or next(iter(named))


def _parameter_prints(records: Records) -> dict:
    """fingerprint -> names of the parameters whose value or gradient it is."""
    cols = records.columns
    names: dict = defaultdict(set)
    for row, slot in enumerate(cols["slot"]):
        if not (is_param_slot(slot) or slot.startswith("param_grad.")):
            continue
        mark = tensor_print(cols, row)
        if mark is None:
            continue
        name = slot.split(".", 1)[1]
        module = cols["module"][row]
        names[mark].add(f"{module}.{name}" if module else name)
    return names
