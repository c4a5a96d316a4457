"""Align stage: call pairs of the two runs, and one RecordRow per record pair.

align.align_calls pairs the calls of one phase and module; then each refiner in
engine.ALIGN_REFINERS may pair what it left alone (foreach_pairing.pair_foreach: foreach
elements against per-tensor calls). The pairs are put in A's execution order, and each
becomes its rows: one RecordRow per slot (paired, or on one side only).
"""

from __future__ import annotations

from dataclasses import dataclass

from probe.comparison.defaults import pair_defaults
from probe.comparison import result as R
from probe.comparison.align import align_calls
from probe.comparison.normalize import NormalizedStep
from probe.comparison.records import Call, CallPair, Records

#: (RecordRow, A's row or None, B's row or None) of one slot of a call pair
SlotRow = tuple


@dataclass
class AlignedStep:
    """The aligned calls of one pair of step files and their record rows."""

    step: int
    rank: int
    records_a: Records
    records_b: Records
    calls_a: list[Call]
    pairs: list[CallPair]  # in A's execution order
    per_pair: list[list[SlotRow]]  # the rows of each pair, slots in record order
    #: (RecordRow, A's row, B's row, pair number) of every record paired on both sides, in A's
    #: execution order (a module's output after the API calls inside it)
    paired: list[tuple]


def align(normalized: NormalizedStep, refiners, step: int = 0, rank: int = 0) -> AlignedStep:
    records_a, records_b = normalized.a.records, normalized.b.records
    pairs = align_calls(normalized.a.calls, normalized.b.calls)
    for refine in refiners:
        pairs = refine(pairs, records_a, records_b)
    pairs.sort(key=lambda pair: pair.order)
    per_pair = [_pair_rows(pair, records_a, records_b, step, rank) for pair in pairs]
    paired = [
        (row, row_a, row_b, number)
        for number, call_rows in enumerate(per_pair)
        for row, row_a, row_b in call_rows
        if row_a is not None and row_b is not None
    ]
    paired.sort(key=lambda item: item[0].order)
    return AlignedStep(step, rank, records_a, records_b, normalized.a.calls, pairs, per_pair, paired)


def _pair_rows(pair: CallPair, records_a: Records, records_b: Records, step: int, rank: int):
    """RecordRows of one call pair, slots in A's record order then B's extra slots."""
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
    for position, slot in enumerate(ordered):
        row_a, row_b = slots_a.get(slot), slots_b.get(slot)
        out.append((_new_row(pair, slot, row_a, row_b, records_a, records_b, step, rank, position), row_a, row_b))
    for call, records, status in ((a, records_a, R.ONLY_A), (b, records_b, R.ONLY_B)):
        for extra in call.extras if call else ():
            row_a = extra if status == R.ONLY_A else None
            row_b = extra if status == R.ONLY_B else None
            slot = records.get("slot", extra)
            out.append((_new_row(pair, slot, row_a, row_b, records_a, records_b, step, rank, len(out)), row_a, row_b))
    return out


def _own_slot(call, slot: str) -> bool:
    return call.element <= 0 or slot not in call.shared


def _new_row(pair, slot, row_a, row_b, records_a, records_b, step, rank, position) -> R.RecordRow:
    main, main_row = (records_a, row_a) if row_a is not None else (records_b, row_b)
    get = main.columns
    if row_a is not None and row_b is not None:
        status = R.MATCH
    else:
        status = R.ONLY_A if row_a is not None else R.ONLY_B
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
        target=(pair.a.target if pair.a is not None and pair.a.target else (pair.b.target if pair.b else "")),
        # a record's own seq: a module's output comes after the API calls inside it
        order=(int(records_a.columns["seq"][row_a]), row_a, 0, 0) if row_a is not None else (*pair.order, position),
    )
    if row_a is not None:
        cols = records_a.columns
        row.key_a, row.seq_a = cols["key"][row_a], int(cols["seq"][row_a])
        row.dtype_a, row.shape_a = cols["dtype"][row_a], cols["shape"][row_a]
    if row_b is not None:
        cols = records_b.columns
        row.key_b, row.seq_b = cols["key"][row_b], int(cols["seq"][row_b])
        row.dtype_b, row.shape_b = cols["dtype"][row_b], cols["shape"][row_b]
    if status == R.ONLY_A:
        row.reasons.append("no partner in B")
    elif status == R.ONLY_B:
        row.reasons.append("no partner in A")
    return row
