"""Pair the calls of run A with the calls of run B.

Keys alone are not enough: they are stable outside a changed module, but inside it one
extra call shifts the index of every later call of the same op. So calls are aligned by
execution order, per phase (forward, backward) and per module path (after the mapping
file's renames; a call can only pair with a call of the same module), in three passes:

1. Sequence pass. Each call of a module becomes a token (op, tensor shapes). Common
   leading and trailing runs pair directly; the middle is aligned with
   difflib.SequenceMatcher (no autojunk), so extra calls in one run (autocast's casts, a
   debug print's copy, an op that a fused kernel replaces) fall out as unmatched while
   everything around them still pairs. Aligning module by module keeps each sequence
   short, so even casts sprinkled through a whole model align in linear-ish time.
2. Name pass. Inside each region SequenceMatcher marks as replaced, calls are aligned again
   on the op alone: same op, same place, different shapes -> paired, reported as a shape
   change, provided their tensor inputs have the same shapes or their arguments are the same
   (both different: two different calls, left unpaired).
3. Key pass. Calls still unmatched pair by key (module, op, index) only when that
   (module, op, phase) stream is identical in both runs (same number of calls, same shapes
   in the same order); this recovers calls whose order differs (e.g. backward hooks firing
   in another order) without ever pairing shifted indexes.

Whatever is left has no partner: only_a / only_b, never "pass".
"""

from __future__ import annotations

import difflib
from collections import defaultdict

from probe.comparison.records import Call, CallPair
from probe.dump import schema

#: how a pair was made: see the module docstring
SEQUENCE, NAME, KEY = "sequence", "name", "key"


def align_calls(calls_a: list[Call], calls_b: list[Call]) -> list[CallPair]:
    """All calls of both runs, paired where possible, in A's execution order."""
    phases = [phase for phase in schema.PHASES]
    phases += sorted({c.phase for c in calls_a + calls_b} - set(phases))
    result: list[CallPair] = []
    forward: dict = {}  # (module, op, index) of A's forward call -> its partner's in B
    for phase in phases:
        seq_a = [c for c in calls_a if c.phase == phase]
        seq_b = [c for c in calls_b if c.phase == phase]
        if seq_a or seq_b:
            pairs = _order(_align_phase(seq_a, seq_b, forward if phase != "forward" else None), seq_b)
            if phase == "forward":
                forward = {_identity(p.a): _identity(p.b) for p in pairs if p.a is not None and p.b is not None}
            result.extend(pairs)
    result.sort(key=lambda pair: pair.order)
    return result


def _token(call: Call) -> tuple:
    if call.kind == "module":
        # a module is identified by what it is given: its outputs may legitimately differ in
        # form (attention weights from eager attention, None from sdpa)
        return (call.name[1], _inputs(call))
    return (call.name[1], call.shapes)


def _identity(call: Call) -> tuple:
    return call.name, call.index, call.element


def _align_phase(calls_a: list[Call], calls_b: list[Call], forward: dict | None = None) -> list[CallPair]:
    streams_a: dict[str, list[Call]] = defaultdict(list)
    streams_b: dict[str, list[Call]] = defaultdict(list)
    for call in calls_a:
        streams_a[call.name[0]].append(call)
    for call in calls_b:
        streams_b[call.name[0]].append(call)
    pairs: list[CallPair] = []
    for module in list(streams_a) + [m for m in streams_b if m not in streams_a]:
        pairs += _align_module(streams_a.get(module, []), streams_b.get(module, []), forward)
    return _pair_by_key(pairs, calls_a, calls_b)


def _align_module(calls_a: list[Call], calls_b: list[Call], forward: dict | None = None) -> list[CallPair]:
    tokens_a = [_token(c) for c in calls_a]
    tokens_b = [_token(c) for c in calls_b]
    n_a, n_b = len(tokens_a), len(tokens_b)
    head = 0
    while head < n_a and head < n_b and tokens_a[head] == tokens_b[head]:
        head += 1
    tail = 0
    while tail < n_a - head and tail < n_b - head and tokens_a[n_a - 1 - tail] == tokens_b[n_b - 1 - tail]:
        tail += 1
    pairs = [CallPair(calls_a[i], calls_b[i], SEQUENCE) for i in range(head)]
    middle_a, middle_b = calls_a[head : n_a - tail], calls_b[head : n_b - tail]
    pairs += _match(middle_a, middle_b, tokens_a[head : n_a - tail], tokens_b[head : n_b - tail], SEQUENCE, forward)
    pairs += [CallPair(calls_a[n_a - tail + i], calls_b[n_b - tail + i], SEQUENCE) for i in range(tail)]
    return pairs


def _match(calls_a, calls_b, tokens_a, tokens_b, how, forward=None) -> list[CallPair]:
    if not calls_a or not calls_b:
        return [CallPair(c, None) for c in calls_a] + [CallPair(None, c) for c in calls_b]
    matcher = difflib.SequenceMatcher(None, tokens_a, tokens_b, autojunk=False)
    pairs: list[CallPair] = []
    for tag, a0, a1, b0, b1 in matcher.get_opcodes():
        if tag == "equal":
            for k in range(a1 - a0):
                a, b = calls_a[a0 + k], calls_b[b0 + k]
                if how == NAME and not _related(a, b, forward):
                    pairs += [CallPair(a, None), CallPair(None, b)]
                else:
                    pairs.append(CallPair(a, b, how))
        elif tag == "replace" and how == SEQUENCE:
            sub_a, sub_b = calls_a[a0:a1], calls_b[b0:b1]
            pairs += _match(sub_a, sub_b, [c.name[1] for c in sub_a], [c.name[1] for c in sub_b], NAME, forward)
        else:
            pairs += [CallPair(c, None) for c in calls_a[a0:a1]]
            pairs += [CallPair(None, c) for c in calls_b[b0:b1]]
    return pairs


def _inputs(call: Call) -> tuple:
    return tuple(item for item in call.shapes if not item[0].startswith("output"))


def _related(a: Call, b: Call, forward: dict | None = None) -> bool:
    """Two calls of one op in the same place are the same call with a change when the tensor
    inputs both sides have agree in shape (a slot on one side only aside) or their arguments are the same; when both differ they are
    different calls (eager attention's repeat_kv reshape against sdpa's output reshape). A
    backward call is its forward call's: it pairs where the forward calls paired."""
    inputs_a, inputs_b = dict(_inputs(a)), dict(_inputs(b))
    common = inputs_a.keys() & inputs_b.keys()
    same_inputs = all(inputs_a[slot] == inputs_b[slot] for slot in common) and (bool(common) or not inputs_a)
    if forward is not None:
        partner = forward.get(_identity(a))
        return partner == _identity(b) if partner is not None else same_inputs
    return same_inputs or a.values == b.values


def _pair_by_key(pairs: list[CallPair], calls_a: list[Call], calls_b: list[Call]) -> list[CallPair]:
    lonely_a = [p.a for p in pairs if p.b is None]
    lonely_b = [p.b for p in pairs if p.a is None]
    if not lonely_a or not lonely_b:
        return pairs
    streams_a, streams_b = _streams(calls_a), _streams(calls_b)
    wanted = {(c.name, c.index): c for c in lonely_b}
    partner: dict[int, Call] = {}
    for call in lonely_a:
        other = wanted.get((call.name, call.index))
        if other is not None and other.shapes == call.shapes and streams_a[call.name] == streams_b[call.name]:
            partner[id(call)] = other
    if not partner:
        return pairs
    taken = {id(c) for c in partner.values()}
    result = []
    for pair in pairs:
        if pair.b is None and id(pair.a) in partner:
            result.append(CallPair(pair.a, partner[id(pair.a)], KEY))
        elif pair.a is None and id(pair.b) in taken:
            continue
        else:
            result.append(pair)
    return result


def _streams(calls: list[Call]) -> dict:
    """(module, op) -> the shapes of its calls in index order."""
    streams: dict = defaultdict(list)
    for call in sorted(calls, key=lambda c: c.index):
        streams[call.name].append(call.shapes)
    return streams


def _order(pairs: list[CallPair], calls_b: list[Call]) -> list[CallPair]:
    """Sort keys: A's (seq, row); a B-only call sorts right after the A partner of the
    paired call that precedes it in B's execution order."""
    for pair in pairs:
        if pair.a is not None:
            pair.order = (*pair.a.order(), 0, 0)
    lonely = {id(pair.b): pair for pair in pairs if pair.a is None}
    partner = {id(pair.b): pair.a for pair in pairs if pair.a is not None and pair.b is not None}
    anchor: tuple = (-1, -1)
    following = 0
    for call in calls_b:
        if id(call) in partner:
            anchor = partner[id(call)].order()
            following = 0
        elif id(call) in lonely:
            following += 1
            lonely[id(call)].order = (*anchor, 1, following)
    return pairs
