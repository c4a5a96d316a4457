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
   (both different: two different calls, left unpaired). API calls whose arguments differ
   in kind (a tensor in one, a plain value in the other) and whose outputs differ in shape
   are different calls, never paired. Module calls still alone there whose classes differ
   pair when given the same inputs (class pass: another activation module at the same
   path).
3. Key pass. Calls still unmatched pair by key (module, op, index) only when that
   (module, op, phase) stream is identical in both runs (same number of calls, same shapes
   in the same order); this recovers calls whose order differs (e.g. backward hooks firing
   in another order) without ever pairing shifted indexes.

Whatever is left has no partner: only_a / only_b, never "pass".

Pairing
-------

Align stage: call pairs of the two runs, and one RecordRow per record pair.

align.align_calls pairs the calls of one phase and module; then each refiner in
api.ALIGN_REFINERS may pair what it left alone (foreach_pairing.pair_foreach: foreach
elements against per-tensor calls). The pairs are put in A's execution order, and each
becomes its rows: one RecordRow per slot (paired, or on one side only).

Defaults
--------

Pair an argument one run left at its default with the same argument the other run spelled out.

Capture records a call's defaults that choose the function at ``default.<name>``
(probe/capture/eager/defaults.py), what the call passed at ``kwarg.<name>``. ``F.gelu(x)`` in A and
``F.gelu(x, approximate="tanh")`` in B then compare as ``kwarg.approximate``: "none" in A,
"tanh" in B, a changed argument. A default whose name the other run did not pass by keyword
is not compared (both runs recorded it alike, or the other passed it by position), so dumps
of older versions, which record no defaults, compare as before.
"""

from __future__ import annotations

import difflib
from collections import defaultdict
from operator import methodcaller

from probe.comparison import result as R
from probe.comparison.records import Call, CallPair, Records
from probe.comparison.structs import AlignedStep, NormalizedStep, Slot
from probe.dump import schema

#: how a pair was made: see the module docstring
SEQUENCE, NAME, KEY, CLASS = "sequence", "name", "key", "class"


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
            pairs += _pair_classes(
                _match(sub_a, sub_b, [c.name[1] for c in sub_a], [c.name[1] for c in sub_b], NAME, forward), forward)
        else:
            pairs += [CallPair(c, None) for c in calls_a[a0:a1]]
            pairs += [CallPair(None, c) for c in calls_b[b0:b1]]
    return pairs


def _pair_classes(pairs: list[CallPair], forward: dict | None) -> list[CallPair]:
    """Module calls left alone in one replaced region, at the same path, whose classes differ
    (GELUActivation in A, NewGELUActivation in B) pair when they are given the same inputs
    (a backward one: where its forward paired): the change is named at that module, not at
    the next op that reads what its unpaired inner calls made."""
    lonely_b = [p.b for p in pairs if p.a is None and p.b.kind == "module"]
    partner: dict[int, Call] = {}  # id of A's call -> B's
    taken: set = set()
    for pair in pairs:
        a = pair.a
        if pair.b is not None or a.kind != "module":
            continue
        for b in lonely_b:
            if id(b) in taken or a.name[1] == b.name[1]:
                continue
            wanted = forward.get(_identity(a)) if forward is not None else None
            if (wanted == _identity(b)) if wanted is not None else _inputs(a) == _inputs(b):
                partner[id(a)] = b
                taken.add(id(b))
                break
    return _repaired(pairs, partner, CLASS)


def _repaired(pairs: list[CallPair], partner: dict, how: str) -> list[CallPair]:
    """pairs with each lonely call of A whose id is in partner paired with its partner (made
    ``how``), and those partners' lonely entries dropped."""
    if not partner:
        return pairs
    taken = {id(c) for c in partner.values()}
    result = []
    for pair in pairs:
        if pair.b is None and id(pair.a) in partner:
            result.append(CallPair(pair.a, partner[id(pair.a)], how))
        elif pair.a is None and id(pair.b) in taken:
            continue
        else:
            result.append(pair)
    return result


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
    if a.kind != "module" and _other_kinds(a, b) and _outputs(a) != _outputs(b):
        return False
    return same_inputs or a.values == b.values


def _outputs(call: Call) -> tuple:
    return tuple(item for item in call.shapes if item[0].startswith("output"))


def _other_kinds(a: Call, b: Call) -> bool:
    """An argument is a tensor in one call and a plain value in the other (``mask[:, -1]``
    against indexing with two index tensors): of an API call, not the same call. (A module is
    identified by what it is given; its arguments may change form: a mask or None.)"""
    tensors_a, tensors_b = {slot for slot, _ in _inputs(a)}, {slot for slot, _ in _inputs(b)}
    values_a, values_b = {slot for slot, _ in a.values}, {slot for slot, _ in b.values}
    return bool(tensors_a & values_b or tensors_b & values_a)


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
    return _repaired(pairs, partner, KEY)


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


def align(normalized: NormalizedStep, refiners, step: int = 0, rank: int = 0) -> AlignedStep:
    records_a, records_b = normalized.a.records, normalized.b.records
    pairs = align_calls(normalized.a.calls, normalized.b.calls)
    for refine in refiners:
        pairs = refine(pairs, records_a, records_b)
    pairs.sort(key=lambda pair: pair.order)
    per_pair = [_pair_rows(pair, number, records_a, records_b, step, rank) for number, pair in enumerate(pairs)]
    paired = [slot for slots in per_pair for slot in slots if slot.paired]
    paired.sort(key=lambda slot: slot.row.order)
    return AlignedStep(step, rank, records_a, records_b, normalized.a.calls, pairs, per_pair, paired)


def _pair_rows(pair: CallPair, number: int, records_a: Records, records_b: Records, step: int, rank: int) -> list[Slot]:
    """The Slots of one call pair, in A's record order then B's extra slots."""
    a, b = pair.a, pair.b
    slots_a = a.slots if a else {}
    slots_b = b.slots if b else {}
    slots_a, slots_b = pair_defaults(slots_a, slots_b)
    ordered = sorted(slots_a, key=slots_a.get) + sorted((s for s in slots_b if s not in slots_a), key=slots_b.get)
    if a is not None and b is not None:
        # a foreach call's argument shared by all its elements, without a partner: once, with element 0
        ordered = [slot for slot in ordered if slot in slots_a and slot in slots_b
                   or _own_slot(a, slot) and _own_slot(b, slot)]
    out = []
    target = a.target if a is not None and a.target else (b.target if b else "")
    for position, slot in enumerate(ordered):
        row_a, row_b = slots_a.get(slot), slots_b.get(slot)
        out.append(Slot(_new_row(pair, slot, row_a, row_b, records_a, records_b, step, rank, position, target), row_a,
                        row_b, number))
    for call, records, status in ((a, records_a, R.ONLY_A), (b, records_b, R.ONLY_B)):
        for extra in call.extras if call else ():
            row_a = extra if status == R.ONLY_A else None
            row_b = extra if status == R.ONLY_B else None
            slot = records.get("slot", extra)
            out.append(Slot(_new_row(pair, slot, row_a, row_b, records_a, records_b, step, rank, len(out), target),
                            row_a, row_b, number))
    return out


def _buffer(records, row) -> str:
    """The model buffer a record holds, where its file names it (root attribute buffers)."""
    if row is None:
        return ""
    names = records.columns.get(schema.BUFFER)
    return names[row] if names is not None and row < len(names) else ""


def _own_slot(call, slot: str) -> bool:
    return call.element <= 0 or slot not in call.shared


def _new_row(pair, slot, row_a, row_b, records_a, records_b, step, rank, position, target) -> R.RecordRow:
    main, main_row = (records_a, row_a) if row_a is not None else (records_b, row_b)
    get = main.columns
    if row_a is not None and row_b is not None:
        status = R.MATCH
    else:
        status = R.ONLY_A if row_a is not None else R.ONLY_B
    seq_a = int(records_a.columns["seq"][row_a]) if row_a is not None else None
    row = R.RecordRow(
        step=step,
        rank=rank,
        status=status,
        module=get["module"][main_row],
        op=get["op"][main_row],
        index=int(get["index"][main_row]),
        phase=get["phase"][main_row],
        slot=slot,
        io=get["io"][main_row],
        kind=get["kind"][main_row],
        source=get["source"][main_row],
        paired_by=pair.how,
        target=target,
        # a record's own seq: a module's output comes after the API calls inside it
        order=(seq_a, row_a, 0, 0) if row_a is not None else (*pair.order, position),
    )
    if row_a is not None:
        cols = records_a.columns
        row.key_a, row.seq_a = cols["key"][row_a], seq_a
        row.dtype_a, row.shape_a = cols["dtype"][row_a], cols["shape"][row_a]
    if row_b is not None:
        cols = records_b.columns
        row.key_b, row.seq_b = cols["key"][row_b], int(cols["seq"][row_b])
        row.dtype_b, row.shape_b = cols["dtype"][row_b], cols["shape"][row_b]
    row.buffer = _buffer(records_a, row_a) or _buffer(records_b, row_b)
    if status == R.ONLY_A:
        row.reasons.append("no partner in B")
    elif status == R.ONLY_B:
        row.reasons.append("no partner in A")
    return row


DEFAULT, KEYWORD = "default.", "kwarg."
_is_default = methodcaller("startswith", DEFAULT)


def pair_defaults(slots_a: dict, slots_b: dict) -> tuple[dict, dict]:
    """(slots_a, slots_b) with each default renamed to the keyword slot the other side has,
    or dropped when unpaired; the inputs are not modified."""
    if not any(map(_is_default, slots_a)) and not any(map(_is_default, slots_b)):
        return slots_a, slots_b
    return _renamed(slots_a, slots_b), _renamed(slots_b, slots_a)


def _renamed(own: dict, other: dict) -> dict:
    out = {}
    for slot, row in own.items():
        if slot.startswith(DEFAULT):
            name = slot[len(DEFAULT):]
            keyword = KEYWORD + name
            if keyword in other and keyword not in own:
                out[keyword] = row  # the other run passed it: compare it with this default
            elif slot in other:
                out[slot] = row  # both left it at the default: the same, recorded alike
            continue
        out[slot] = row
    return out
