"""Align stage, optimizer part: foreach elements paired with the other run's per-tensor calls.

When one run has foreach calls left without a partner and the other run has per-tensor
calls left without one (same phase, same module), the elements of each block (normalize.py)
are laid out parameter by parameter, the order the per-tensor loop runs in, and aligned
with the other run's calls on (op without its foreach/in-place spelling, shape), as align.py
aligns any stream. A scalar argument spelled positionally on one side and by keyword on the
other (``_foreach_addcdiv_(..., scalars)`` against ``addcdiv_(..., value=)``) pairs by
position among the unpaired plain values. A fused kernel's element pairs with the last call
of the other run's per-parameter chain.
"""

from __future__ import annotations

import difflib
import math
from collections import defaultdict

from probe.comparison.ops import is_fused, op_name
from probe.comparison.records import (
    Call, CallPair, Records,
    FOREACH, FUSED, parameter_blocks, parameter_major,
)


def _token(call: Call, records: Records) -> tuple:
    cols = records.columns
    row = call.slots.get("input.0", call.slots.get("output.0"))
    shape = cols["shape"][row] if row is not None else ""
    return op_name(call.name[1]), shape


def pair_foreach(pairs: list[CallPair], records_a: Records, records_b: Records) -> list[CallPair]:
    """Pair the foreach calls left without partner in one run with the per-tensor calls left
    without partner in the other (see the module docstring); every other pair is kept."""
    lonely_a = [p.a for p in pairs if p.b is None]
    lonely_b = [p.b for p in pairs if p.a is None]
    if not lonely_a or not lonely_b:
        return pairs
    fused = {id(c) for c in lonely_a + lonely_b if c.element >= 0}
    if not fused:
        return pairs
    new_pairs: list[CallPair] = []
    replaced: set = set()
    groups_a = _by_stream(lonely_a)
    groups_b = _by_stream(lonely_b)
    for stream in groups_a.keys() & groups_b.keys():
        calls_a, calls_b = groups_a[stream], groups_b[stream]
        foreach_a = [c for c in calls_a if id(c) in fused]
        foreach_b = [c for c in calls_b if id(c) in fused]
        if foreach_a and foreach_b:
            # both runs split their foreach calls; pair those left over only where the other
            # run has no foreach element left in this stream
            continue
        if foreach_a and not foreach_b:
            made = _pair_side(foreach_a, calls_b, records_a, records_b, a_is_foreach=True)
        elif foreach_b and not foreach_a:
            made = _pair_side(foreach_b, calls_a, records_b, records_a, a_is_foreach=False)
        else:
            continue
        if made is None:
            continue
        split, per_tensor, stream_pairs = made
        replaced |= split | per_tensor
        new_pairs += stream_pairs
    if not new_pairs:
        return pairs
    kept = [p for p in pairs if id(p.a if p.a is not None else p.b) not in replaced]
    return kept + new_pairs


def _by_stream(calls: list[Call]) -> dict:
    streams: dict = defaultdict(list)
    for call in calls:
        streams[(call.phase, call.name[0])].append(call)
    return streams


def _pair_side(foreach, others, records_f, records_o, a_is_foreach):
    """Elements of the foreach side's calls against the other side's per-tensor calls."""
    blocks = parameter_blocks(foreach, records_f)
    elements = [element for block in blocks for element in parameter_major(block)]
    if not elements:
        return None
    per_tensor = [c for c in others if c.element < 0]
    tokens_f = [_token(c, records_f) for c in elements]
    tokens_o = [_token(c, records_o) for c in per_tensor]
    matcher = difflib.SequenceMatcher(None, tokens_f, tokens_o, autojunk=False)
    partner: dict[int, Call] = {}
    for tag, f0, f1, o0, o1 in matcher.get_opcodes():
        if tag == "equal":
            for k in range(f1 - f0):
                partner[id(elements[f0 + k])] = per_tensor[o0 + k]
    fused_pairs = _pair_fused(elements, per_tensor, partner, records_o)
    if not partner and not fused_pairs:
        return None
    result: list[CallPair] = []
    for element in elements:
        other = partner.get(id(element))
        if id(element) in fused_pairs:
            result += _fused_pair(element, fused_pairs[id(element)], records_f, records_o, a_is_foreach)
            continue
        if other is not None:
            _name_leftover_values(element, other, records_f, records_o)
            pair = CallPair(element, other, FOREACH) if a_is_foreach else CallPair(other, element, FOREACH)
        else:
            if element.element > 0:
                # a lonely element keeps its own tensors; the call's shared arguments stay with element 0
                element.slots = {s: r for s, r in element.slots.items() if s not in element.shared}
            pair = CallPair(element, None) if a_is_foreach else CallPair(None, element)
        result.append(pair)
    paired_others = {id(c) for c in partner.values()} | {id(c) for body in fused_pairs.values() for c in body}
    for call in per_tensor:
        if id(call) not in paired_others:
            result.append(CallPair(None, call) if a_is_foreach else CallPair(call, None))
    _order_pairs(result)
    return {id(e) for e in elements}, {id(c) for c in per_tensor}, result


def _pair_fused(elements, per_tensor, partner, records_o: Records) -> dict:
    """A fused kernel's element (torch._fused_adamw_'s i-th parameter) against the unfused
    run's loop body for the i-th parameter: the records allow comparing the updated
    parameter, the output of the body's last call. The loop runs the same ops for every
    parameter, so its calls (creation ops such as the step counter's torch.tensor aside) fall
    into equal bodies, one per element, in the fused list's order."""
    fused = [e for e in elements if is_fused(e.op) and id(e) not in partner and "output.0" in e.slots]
    if not fused:
        return {}
    taken = {id(c) for c in partner.values()}
    cols = records_o.columns
    loop = [c for c in per_tensor if id(c) not in taken and any(
        slot.startswith("input.") and cols["dtype"][row] != "" for slot, row in c.slots.items())]
    if not loop or len(loop) % len(fused):
        return {}
    size = len(loop) // len(fused)
    bodies = [loop[i * size:(i + 1) * size] for i in range(len(fused))]
    pattern = [op_name(c.op) for c in bodies[0]]
    if any([op_name(c.op) for c in body] != pattern for body in bodies) or "output.0" not in bodies[0][-1].slots:
        return {}
    found = {}
    for element, body in zip(fused, bodies):
        last = body[-1]
        if cols["shape"][last.slots["output.0"]] == cols["shape"][last.slots.get("input.0", last.slots["output.0"])]:
            found[id(element)] = body
    return found


def _fused_pair(element: Call, body: list[Call], records_f: Records, records_o: Records,
                a_is_foreach: bool) -> list[CallPair]:
    """One pair: the updated parameter (the element's output.0, the body's last output.0) and
    each tensor the fused kernel reads (parameter, gradient, optimizer state) against the
    body's first read of the most similar tensor of that shape (the loop reads each before
    writing it). What is left of both sides has no counterpart."""
    cols_f, cols_o = records_f.columns, records_o.columns
    last = body[-1]
    mine = {"output.0": element.slots["output.0"]}
    theirs = {"output.0": last.slots["output.0"]}
    used = {last.slots["output.0"]}
    # what the body reads from outside itself (the parameter, its gradient, the optimizer
    # state), each tensor at its first read; reads of what the body itself wrote are not
    written, reads, prints = set(), [], records_o.prints()
    for call in body:
        for slot, row in sorted(call.slots.items(), key=lambda item: item[1]):
            mark = prints[row]
            if cols_o["io"][row] == "in" and cols_o["dtype"][row] != "" and mark not in written:
                reads.append(row)
                written.add(mark)  # a later read of the same tensor is not a new one
        written |= {prints[row] for row in call.slots.values() if cols_o["io"][row] == "out"}
    wanted = [(slot, row) for slot, row in element.slots.items()
              if cols_f["io"][row] == "in" and cols_f["dtype"][row] != "" and slot not in element.shared]
    # one read per input, the closest by statistics first (a parameter, its gradient and the
    # two moments differ in scale and sign far more than two runs do)
    options = sorted((_distance(cols_f, row, cols_o, other), slot, row, other)
                     for slot, row in wanted for other in reads if cols_o["shape"][other] == cols_f["shape"][row])
    for _, slot, row, other in options:
        if slot in mine or other in used:
            continue
        mine[slot], theirs[slot] = row, other
        used.add(other)
    pieces_f = [(_piece(element, mine), _piece(element, {s: r for s, r in element.slots.items()
                                                          if s not in mine and (element.element <= 0 or s not in element.shared)}))]
    pair_f, rest_f = pieces_f[0]
    pair_o = _piece(last, theirs)
    pairs = [CallPair(pair_f, pair_o, FUSED) if a_is_foreach else CallPair(pair_o, pair_f, FUSED)]
    leftovers = [rest_f] if rest_f is not None else []
    for call in body:
        rest = _piece(call, {s: r for s, r in call.slots.items() if r not in used})
        if rest is not None:
            pairs.append(CallPair(None, rest) if a_is_foreach else CallPair(rest, None))
    for rest in leftovers:
        pairs.append(CallPair(rest, None) if a_is_foreach else CallPair(None, rest))
    return pairs


def _distance(cols_f, row_f, cols_o, row_o) -> float:
    """How far apart two runs' records of one tensor are, by their statistics."""
    total = 0.0
    for name in ("norm", "mean", "max", "min"):
        x, y = cols_f[name][row_f], cols_o[name][row_o]
        if math.isnan(x) or math.isnan(y):
            continue
        total += abs(x - y) / max(abs(x), abs(y), 1e-30)
    return total


def _piece(call: Call, slots: dict) -> Call | None:
    """The call restricted to some of its slots (rows of other calls allowed: a virtual call)."""
    if not slots:
        return None
    piece = Call(module=call.module, op=call.op, index=call.index, phase=call.phase, kind=call.kind,
                 seq=call.seq, first_row=min(slots.values()), slots=slots, name=call.name,
                 element=call.element, target=call.target)
    piece.shapes = call.shapes
    return piece


def _name_leftover_values(element: Call, other: Call, records_f: Records, records_o: Records) -> None:
    """A scalar given positionally on one side and by keyword on the other: pair the unpaired
    plain values of the two calls by position (the element's slot takes the other's name)."""
    values_f = [s for s, r in element.slots.items() if records_f.columns["dtype"][r] == "" and s not in other.slots]
    values_o = [s for s, r in other.slots.items() if records_o.columns["dtype"][r] == "" and s not in element.slots]
    if not values_f or len(values_f) != len(values_o):
        return
    ordered_f = sorted(values_f, key=element.slots.get)
    ordered_o = sorted(values_o, key=other.slots.get)
    slots = dict(element.slots)
    for mine, theirs in zip(ordered_f, ordered_o):
        slots[theirs] = slots.pop(mine)
        if mine in element.shared:
            element.shared = (element.shared - {mine}) | {theirs}
    element.slots = slots


def _order_pairs(pairs: list[CallPair]) -> None:
    """Execution-order keys: A's own; a B-only call right after the pair before it."""
    known = [pair.a.order() for pair in pairs if pair.a is not None]
    anchor: tuple = min(known) if known else (-1, -1)
    following = 0
    for pair in pairs:
        if pair.a is not None:
            anchor = pair.a.order()
            following = 0
            pair.order = (*anchor, 0, pair.a.element + 1)
        else:
            following += 1
            pair.order = (*anchor, 1, following)
