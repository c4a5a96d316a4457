"""Compare the records of one step file of A with one of B.

records -> calls -> aligned call pairs -> per record pair: metrics (tensors streamed one
pair at a time, each distinct pair measured once) -> judgement -> origin per call.
Tensor data is fetched through callables so the engine never holds a whole dump.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from probe.comparison.defaults import pair_defaults
from probe.comparison.drift import carries_the_same
from probe.comparison.kernels import explain_different_kernels
from probe.comparison import result as R
from probe.comparison import elementwise, optimizer, verdict
from probe.comparison.align import CallPair, align_calls
from probe.comparison.mapping import NameMapping
from probe.comparison.metrics import Metrics, limit_masked, statistics_metrics, tensor_metrics, value_metrics
from probe.comparison.prefetch import Prefetcher
from probe.comparison.records import Call, Records, build_calls, is_param_slot
from probe.comparison.sketch import refine as refine_with_sketch
from probe.comparison.stale import StaleRecords
from probe.comparison.tolerances import Tolerances, tolerance_dtype


def lower_precision(first: str | None, second: str) -> str:
    """The less precise of two tolerance dtypes ("exact" never lowers a float)."""
    if first is None or first == "exact":
        return second
    if second == "exact":
        return first
    return tolerance_dtype(first, second)

Fetch = Callable[[int], np.ndarray]
_STAT_COLUMNS = ("min", "max", "mean", "norm", "nan_count", "inf_count", "numel", "checksum", "dtype")


@dataclass
class StepOutcome:
    step: int
    rank: int
    rows: list[R.RecordRow]
    summaries: list[R.OpSummary]
    evidence: set = field(default_factory=set)
    tensor_bytes: int = 0
    #: (device in A, device in B) -> records of paired tensors that live on different devices
    devices: dict = field(default_factory=dict)
    #: content_key -> key of A's records whose difference was accepted (R.EXPLAINED outputs):
    #: the next step reads them again (a parameter the optimizer updated) and accepts them too
    explained: dict = field(default_factory=dict)

    @property
    def diverged(self) -> bool:
        return any(row.status == R.DIVERGED for row in self.rows)

    def counts(self) -> dict:
        return count_rows(self.rows)


def count_rows(rows) -> dict:
    """matched: paired records; diverged: those beyond tolerance; changed: those within
    tolerance whose checksums differ (size unknown); only_a/only_b: without partner."""
    counts = {"matched": 0, "only_a": 0, "only_b": 0, "diverged": 0, "changed": 0, "explained": 0}
    for row in rows:
        if row.status in R.PAIRED:
            counts["matched"] += 1
            if row.status != R.MATCH:
                counts[row.status] += 1
        else:
            counts[row.status] += 1
    return counts


def content_key(cols: dict, row: int) -> int | None:
    """A tensor's values, comparable across step files: its checksum when recorded, else its
    statistics (None when neither is known)."""
    head = (cols["dtype"][row], cols["shape"][row], cols["numel"][row])
    if cols["checksum"][row]:
        return hash(head + (cols["checksum"][row],))
    numbers = tuple(cols[name][row] for name in ("min", "max", "mean", "norm"))
    if all(math.isnan(value) for value in numbers):
        return None
    # NaN hashes by identity: spell it out so equal statistics give equal keys
    numbers = tuple("nan" if math.isnan(value) else value for value in numbers)
    return hash(head + numbers + (cols["nan_count"][row], cols["inf_count"][row]))


def content_keys(records: Records) -> set:
    """content_key of every tensor record of a step file (what the next step may carry over)."""
    cols = records.columns
    keys = {content_key(cols, row) for row in range(len(records)) if cols["dtype"][row] != ""}
    keys.discard(None)
    return keys


class _Provenance:
    """Where an input tensor of run A came from: produced by an earlier record of the step, a
    parameter, state carried over from the previous step file, made after the backward began
    by something unrecorded, or none of these (external)."""

    def __init__(self, records: Records, calls: list[Call], previous: set | None = None):
        cols = records.columns
        self._cols = cols
        self._prints: dict[int, list] = {}
        self.produced: dict = {}  # fingerprint -> (order, row) of its earliest output record
        self.params: dict = {}  # fingerprint -> row of a param.* record holding that tensor
        self.previous = previous or set()  # content keys of the previous step file's records
        seqs = cols["seq"]
        backward = [seq for seq, phase in zip(seqs, cols["phase"]) if phase == "backward"]
        # what enters a step from outside (data, weights, buffers) is read by the forward;
        # a tensor no record made that first shows up once the backward has begun was made
        # by something unrecorded from the step's own values (autograd's .grad accumulation)
        self.backward_from = min(backward) if backward else math.inf
        self._call_of: dict[int, int] = {}
        for number, call in enumerate(calls):
            for slot, row in call.slots.items():
                self._call_of[row] = number
                if cols["dtype"][row] == "":
                    continue
                prints = self.fingerprints(row)
                if is_param_slot(slot):
                    for mark in prints:
                        self.params.setdefault(mark, row)
                elif cols["io"][row] == "out":
                    made = ((int(seqs[row]), row), row)
                    for mark in prints:
                        known = self.produced.get(mark)
                        if known is None or made[0] < known[0]:
                            self.produced[mark] = made

    def fingerprints(self, row: int) -> list:
        """The tensor's identity: its tensor_id when stored, else its checksum and statistics."""
        found = self._prints.get(row)
        if found is not None:
            return found
        cols = self._cols
        if cols["tensor_id"][row] >= 0:
            marks = [("id", cols["tensor_id"][row])]
        elif all(math.isnan(cols[name][row]) for name in ("min", "max", "mean", "norm")):
            marks = []
        else:
            marks = [("stats", tuple(repr(cols[name][row]) for name in _STAT_COLUMNS) + (cols["shape"][row],))]
        self._prints[row] = marks
        return marks

    def _late_producer_ok(self, row: int, producer: int) -> bool:
        """A gradient flowing into a module (grad_output) is recorded by its module hook before
        the downstream module's hook records the grad_input that is the same tensor: the
        producer of a backward grad_output may come later in seq (never from its own call)."""
        cols = self._cols
        return (
            cols["phase"][row] == "backward"
            and cols["slot"][row].startswith("grad_output")
            and self._call_of.get(producer) != self._call_of.get(row)
        )

    def kind(self, row: int, order: tuple) -> tuple[str, int | None]:
        """(kind, row): ("produced", producing row) | ("param" | "param_update", param record) |
        ("carried" | "unrecorded" | "external", None).

        "carried": no record of this step made it, but the previous step file holds the same
        values (optimizer state, a parameter updated in place, a buffer): its error, if any,
        was made in an earlier step. "unrecorded": no record made it and it first shows up
        after the backward began (a parameter gradient accumulated by autograd, optimizer
        state): made from the step's own values by something not recorded. "external": read
        before the backward and made by no record (data, buffers, weights of an api-level
        dump): what enters the step from outside."""
        prints = self.fingerprints(row)
        for mark in prints:
            made = self.produced.get(mark)
            if made is None:
                continue
            if made[0] < order:
                return "produced", made[1]
            if self._late_producer_ok(row, made[1]):
                return "produced", made[1]
        param = next((self.params[mark] for mark in prints if mark in self.params), None)
        if param is not None:
            # read once the backward began: the optimizer updating it; its difference, if
            # any, entered the step where the forward read it
            return ("param_update" if order[0] > self.backward_from else "param"), param
        forward = self._cols["phase"][row] == "forward"
        if forward and self.previous and content_key(self._cols, row) in self.previous:
            return "carried", None
        if order[0] > self.backward_from:
            return "unrecorded", None
        return "external", None


def compare_step(
    records_a: Records,
    records_b: Records,
    fetch_a: Fetch | None,
    fetch_b: Fetch | None,
    tolerances: Tolerances,
    mapping: NameMapping | None = None,
    step: int = 0,
    rank: int = 0,
    progress: Callable[[int, int, int], None] | None = None,
    previous: set | None = None,
    previous_explained: dict | None = None,
    autocast: tuple | None = None,
) -> StepOutcome:
    """Align, measure and judge one pair of step files.

    progress(done_calls, total_calls, tensor_bytes_read) is called after each call pair.
    previous: content_keys() of A's previous step file of the same rank, so that state
    carried over from it (optimizer state, parameters) is told from new external inputs.
    previous_explained: StepOutcome.explained of that step file: a record holding the same
    values as an accepted difference there (a parameter AdamW updated from rounding noise)
    carries that accepted difference.
    autocast: (A's first seq under autocast, its dtype) when both runs computed under autocast in
    that dtype (precision.shared_autocast): every record from there on, the backward included,
    carries that dtype's rounding and is judged at its tolerance at least.
    """
    rename = mapping.rename if mapping else None
    # a foreach call is one call per tensor (the i-th parameter's), on both sides
    calls_a = optimizer.split_foreach(build_calls(records_a, rename), records_a)
    calls_b = optimizer.split_foreach(build_calls(records_b, rename), records_b)
    # optimizer records named by the parameter they update (fused kernels pair by that name)
    optimizer.name_targets(calls_a, records_a)
    optimizer.name_targets(calls_b, records_b)
    pairs = optimizer.pair_foreach(align_calls(calls_a, calls_b), records_a, records_b)
    pairs.sort(key=lambda pair: pair.order)
    provenance = _Provenance(records_a, calls_a, previous)
    measure = _Measurer(records_a, records_b, fetch_a, fetch_b, tolerances)
    seqs = records_a.columns["seq"]

    per_pair = [_pair_rows(pair, records_a, records_b, step, rank) for pair in pairs]
    # Measure in A's execution order (a module's output after the API calls inside it), so
    # that precision floors are known before the records that inherit them.
    paired = [
        (row, row_a, row_b, number)
        for number, call_rows in enumerate(per_pair)
        for row, row_a, row_b in call_rows
        if row_a is not None and row_b is not None
    ]
    paired.sort(key=lambda item: item[0].order)
    judged: dict[int, R.RecordRow] = {}  # A's row -> its RecordRow (producers' status)
    effective: dict[int, str] = {}  # A's row -> the tolerance dtype it was judged with
    origins: dict[int, tuple] = {}  # A's input row -> (kind, producing row)
    measure.start_prefetch(paired)
    stale = StaleRecords(records_a.columns, records_b.columns)
    firsts = {number: next(((ra, rb) for r, ra, rb in call_rows if r.slot == "input.0"), (None, None))
              for number, call_rows in enumerate(per_pair)}
    try:
        def after_judge(row, ra, rb, number):
            stale.check(row, (ra, rb), firsts[number], number)
            earlier = previous_explained.get(content_key(records_a.columns, ra)) if previous_explained else None
            if earlier is not None and not carries_the_same(row, earlier):
                # A's values are what was accepted last step, B's moved since: a change (a weight
                # edited between steps), not the accepted difference carried over
                earlier = None
            elif earlier is not None:
                earlier = earlier[0]
            if earlier is not None and row.status == R.DIVERGED and verdict.is_accepted_carry(row):
                verdict.explain(row, f"carries the accepted difference of {earlier} from the previous step")
            elif earlier is not None and row.status in R.WITHIN:
                row.accepted = True
            elif previous_explained and row.status == R.DIVERGED and verdict.is_accepted_carry(row):
                grad = previous_explained.get(("param", _param_name(records_a.columns, row, ra, origins)))
                if grad is not None:
                    verdict.explain(row, f"an optimizer step that is not recorded (level \"module\") updated this "
                                         f"parameter from a gradient whose difference was accepted ({grad}); Adam-type "
                                         "optimizers turn a rounding-noise gradient into an lr-sized update")

        _judge_in_order(paired, measure, provenance, seqs, judged, effective, origins, progress, step, after_judge,
                        autocast)
        stale.resolve(lambda number: [row for row, ra, rb in per_pair[number]
                                      if row.io == "out" and ra is not None and rb is not None
                                      and row.metrics is not None and row.metrics.evidence != "value"])
    finally:
        measure.close()

    rows: list[R.RecordRow] = []
    summaries: list[R.OpSummary] = []
    forwards = _forward_rows(pairs, per_pair)
    # every record of A, paired or not: an input made by a call only A has names that call
    rows_of_a = {row_a: row for call_rows in per_pair for row, row_a, _ in call_rows if row_a is not None}
    # calls in the order their outputs were made: what made a call's inputs is judged before it,
    # and a module call after the api calls inside it (verdict.explain_module_by_its_calls)
    for pair, call_rows in sorted(zip(pairs, per_pair), key=lambda item: max(row.order for row, _, _ in item[1])):
        if pair.a is not None and pair.b is not None:
            lookup = {id(row): row_a for row, row_a, _ in call_rows}

            def input_kind(row, _lookup=lookup):
                kind, producer = origins.get(_lookup[id(row)], ("external", None))
                return kind, (judged.get(producer) or rows_of_a.get(producer)) if producer is not None else None

            forward = forwards.get(_call_key(call_rows), ()) if pair.phase == "backward" else ()
            verdict.judge_call([row for row, _, _ in call_rows], input_kind, forward)
            explain_different_kernels([row for row, _, _ in call_rows])
            verdict.explain_module_by_its_calls([row for row, _, _ in call_rows], rows)
            _check_amplified(call_rows, measure)
            summary = verdict.summarize_call([row for row, _, _ in call_rows], forward)
            if summary is not None:
                summaries.append(summary)
        rows.extend(row for row, _, _ in call_rows)
    if progress is not None and not paired:
        progress(1, 1, measure.bytes_read)
    rows.sort(key=lambda row: row.order)
    explained: dict = {}
    diverged_params = {_param_name(records_a.columns, row, None, {}) for row in rows
                       if row.slot.startswith("param.") and row.status == R.DIVERGED}
    updated = {row.target for row in rows if row.target}  # parameters a recorded optimizer call updates
    for row, row_a, _ in (item for call_rows in per_pair for item in call_rows):
        if row.io == "out" and row_a is not None and verdict.accepted_difference(row):
            key = content_key(records_a.columns, row_a)
            if key is not None:
                explained[key] = (row.key, row.metrics.rel_l2 if row.metrics is not None else None)
            if row.slot.startswith("param_grad."):
                name = f"{row.module}.{row.slot[len('param_grad.'):]}" if row.module else row.slot[len("param_grad."):]
                if name not in diverged_params and name not in updated:
                    # the next step's parameter was updated from it by an optimizer probe did not
                    # record (a recorded update is judged itself, and its result carried by value)
                    explained[("param", name)] = f"{row.key}, rel L2 {verdict.sci(row.metrics.rel_l2)}"
    moved: dict = {}
    dev_a, dev_b = records_a.columns["device"], records_b.columns["device"]
    for _, row_a, row_b, _ in paired:
        if dev_a[row_a] and dev_b[row_b] and dev_a[row_a] != dev_b[row_b]:
            moved[(dev_a[row_a], dev_b[row_b])] = moved.get((dev_a[row_a], dev_b[row_b]), 0) + 1
    return StepOutcome(step, rank, rows, summaries, measure.evidence, measure.bytes_read,
                       devices=moved, explained=explained)


def _param_name(cols: dict, row: R.RecordRow, row_a: int | None, origins: dict) -> str | None:
    """fc1.weight for a param.* record, or for an input holding that parameter's tensor."""
    if row.slot.startswith("param."):
        name = row.slot[len("param."):]
        return f"{row.module}.{name}" if row.module else name
    kind, producer = origins.get(row_a, (None, None)) if row_a is not None else (None, None)
    if kind == "param" and producer is not None:
        name = cols["slot"][producer][len("param."):]
        module = cols["module"][producer]
        return f"{module}.{name}" if module else name
    return None


def _check_amplified(call_rows, measure: "_Measurer") -> None:
    """Where the tensors were dumped, an output accepted as amplified by an elementwise op is
    checked by replaying the op in float64 on each run's own inputs (elementwise.py): an
    output its own inputs do not give was computed differently there (introduced)."""
    outputs = [(row, ra, rb) for row, ra, rb in call_rows if row.io == "out" and row.status == R.EXPLAINED
               and row.origin == R.AMPLIFIED and row.metrics is not None and row.metrics.evidence == "tensor"]
    if not outputs or measure.fetch_a is None or measure.fetch_b is None:
        return
    op = optimizer.base_op(call_rows[0][0].op)
    sides = []
    for side, cols, fetch in ((1, measure.a, measure.fetch_a), (2, measure.b, measure.fetch_b)):
        tensors, values = {}, {}
        for row, *rows in call_rows:
            index = rows[side - 1]
            if row.io != "in" or index is None:
                continue
            if cols["dtype"][index] == "":
                values[row.slot] = cols["value"][index]
            elif cols["tensor_id"][index] >= 0:
                tensors[row.slot] = fetch(cols["tensor_id"][index]).astype(np.float64)
        sides.append({"tensors": tensors, "values": values})
    for row, ra, rb in outputs:
        errors = []
        for side, cols, fetch, index in ((sides[0], measure.a, measure.fetch_a, ra), (sides[1], measure.b, measure.fetch_b, rb)):
            if cols["tensor_id"][index] < 0:
                return
            errors.append(elementwise.own_error(op, side, fetch(cols["tensor_id"][index])))
        if None in errors:
            continue
        limit = row.rtol or 0.0
        if max(errors) > limit:
            verdict.unexplain(row, f"replayed in float64 from each run's own inputs, {row.op} gives A's output within "
                                   f"rel L2 {verdict.sci(errors[0])} and B's within {verdict.sci(errors[1])} "
                                   f"(tolerance {limit:g}): the op itself computed differently, not its conditioning")
        else:
            row.cause += (f"; checked elementwise: replayed in float64 from each run's own inputs it gives both "
                          f"outputs (rel L2 {verdict.sci(errors[0])} and {verdict.sci(errors[1])})")


def _call_key(call_rows) -> tuple | None:
    """(module, op, index) of a call pair: what ties a backward call to its forward."""
    if not call_rows:
        return None
    head = call_rows[0][0]
    return head.module, head.op, head.index


def _forward_rows(pairs, per_pair) -> dict:
    """(module, op, index) -> RecordRows of that paired forward call: the values the call's
    backward computes from (verdict.judge_call counts them as carriers)."""
    found: dict = {}
    for pair, call_rows in zip(pairs, per_pair):
        if pair.a is not None and pair.b is not None and pair.phase == "forward":
            found.setdefault(_call_key(call_rows), [row for row, _, _ in call_rows])
    return found


def _judge_in_order(paired, measure, provenance, seqs, judged, effective, origins, progress, step=0,
                    check_stale=None, autocast=None) -> None:
    """Judge every paired record in A's execution order, carrying the precision floors."""
    call_floor: dict[int, str] = {}  # pair -> lowest precision among its inputs
    mixed = None  # lowest precision where the runs' dtypes differ, once seen
    differed = False  # an earlier record of this step file already differs between the runs
    for done, (row, row_a, row_b, number) in enumerate(paired, 1):
        order = (int(seqs[row_a]), row_a)
        kind, producer = provenance.kind(row_a, order)
        if row.io == "in":
            origins[row_a] = (kind, producer)
        upstream = mixed
        if autocast is not None and order[0] >= autocast[0]:
            upstream = lower_precision(upstream, autocast[1])
        if kind == "produced" and producer in effective:
            upstream = lower_precision(upstream, effective[producer])
        if row.io == "out" and number in call_floor:
            upstream = lower_precision(upstream, call_floor[number])
        measure.judge(row, row_a, row_b, upstream)
        if check_stale is not None:
            check_stale(row, row_a, row_b, number)
        verdict.judge_checksum_change(row, _untouched(row, kind, order, step, provenance, differed))
        differed = differed or _differs(row)
        judged[row_a] = row
        if row.tol_dtype and row.tol_dtype != "exact":
            effective[row_a] = row.tol_dtype
            if row.io == "in":
                call_floor[number] = lower_precision(call_floor.get(number), row.tol_dtype)
            if row.dtype_a != row.dtype_b:
                # B computed in another precision from here on: every later value carries it
                mixed = lower_precision(mixed, tolerance_dtype(row.dtype_a, row.dtype_b))
        if progress is not None and (done % 64 == 0 or done == len(paired)):
            progress(done, len(paired), measure.bytes_read)


def _untouched(row: R.RecordRow, kind: str, order: tuple, step: int, provenance: _Provenance,
               differed: bool) -> bool:
    """Nothing in either run has computed this tensor yet, so rounding cannot have changed it:
    read by the forward of step 0 (no optimizer update yet), and a parameter, or an input
    no recorded op made (data, a weight of an api-level dump) read before any record of the
    step file differed (an unrecorded op could have carried a rounding difference into it)."""
    if step != 0 or row.io != "in" or order[0] >= provenance.backward_from:
        return False
    if is_param_slot(row.slot) or kind == "param":
        return True
    return kind == "external" and not differed


def _differs(row: R.RecordRow) -> bool:
    """The record shows any difference between the runs (beyond tolerance or not)."""
    if row.status not in R.PAIRED:
        return False
    m = row.metrics
    if row.status != R.MATCH or m is None:
        return True
    return m.bit_equal is False or (m.bit_equal is None and m.err_l2 > 0)


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


class _Measurer:
    """Metrics of record pairs, reading each distinct tensor pair once."""

    def __init__(self, records_a, records_b, fetch_a, fetch_b, tolerances: Tolerances):
        self.a, self.b = records_a.columns, records_b.columns
        self.fetch_a, self.fetch_b = fetch_a, fetch_b
        self.tolerances = tolerances
        self.memo: dict[tuple[int, int], Metrics] = {}
        self.evidence: set = set()
        self.bytes_read = 0
        self.prefetcher: Prefetcher | None = None

    def start_prefetch(self, paired) -> None:
        """Read ahead the tensor pairs the judge() calls in this order will ask for."""
        if self.fetch_a is None or self.fetch_b is None:
            return
        a, b = self.a, self.b
        keys, seen = [], set()
        for _, row_a, row_b, _ in paired:
            if a["dtype"][row_a] == "" or b["dtype"][row_b] == "" or not _same_shape(a["shape"][row_a], b["shape"][row_b]):
                continue
            key = (a["tensor_id"][row_a], b["tensor_id"][row_b])
            if key[0] >= 0 and key[1] >= 0 and key not in seen:
                seen.add(key)
                keys.append(key)
        if len(keys) > 1:
            self.prefetcher = Prefetcher(keys, self.fetch_a, self.fetch_b)

    def close(self) -> None:
        if self.prefetcher is not None:
            self.prefetcher.close()
            self.prefetcher = None

    def judge(self, row: R.RecordRow, row_a: int, row_b: int, upstream: str | None = None) -> None:
        """Judge one paired record. upstream: the lowest-precision dtype its value was computed
        from (a float32 tensor made from bfloat16 values is judged as bfloat16)."""
        a, b = self.a, self.b
        if a["dtype"][row_a] == "" or b["dtype"][row_b] == "":
            if a["dtype"][row_a] != b["dtype"][row_b]:
                number_a, number_b = _scalar_text(a, row_a), _scalar_text(b, row_b)
                if number_a is not None and number_b is not None:
                    # torch.tensor(1.0) on one side, the number 1 on the other (foreach vs per-tensor)
                    verdict.judge_value(row, value_metrics(number_a, number_b))
                    row.notes.append("a one-element tensor on one side, a plain number on the other")
                    return
                if a["value"][row_a] == "null" or b["value"][row_b] == "null":
                    # attention weights from eager attention, None from sdpa: absent, not different
                    row.status = R.ONLY_A if b["value"][row_b] == "null" else R.ONLY_B
                    row.reasons.append(f"absent on one side: None in {'B' if row.status == R.ONLY_A else 'A'}, "
                                       "a tensor in the other")
                    return
                row.status = R.DIVERGED
                row.reasons.append("a tensor on one side, a plain value on the other")
                return
            verdict.judge_value(row, value_metrics(a["value"][row_a], b["value"][row_b]))
            return
        own = tolerance_dtype(row.dtype_a, row.dtype_b)
        row.tol_dtype = own
        if upstream is not None and own != "exact":
            row.tol_dtype = lower_precision(own, upstream)
        tol = self.tolerances.table[row.tol_dtype]
        if row.dtype_a != row.dtype_b:
            row.notes.append(f"dtype {row.dtype_a} in A, {row.dtype_b} in B (judged as {row.tol_dtype})")
        elif row.tol_dtype != own:
            row.notes.append(f"computed from {row.tol_dtype} values upstream (judged as {row.tol_dtype})")
        if not _same_shape(row.shape_a, row.shape_b):
            verdict.judge_shape(row)
            return
        verdict.judge_tensor(row, self.metrics(row_a, row_b, tol), tol)
        self.evidence.add(row.metrics.evidence)

    def metrics(self, row_a: int, row_b: int, tol) -> Metrics:
        a, b = self.a, self.b
        id_a, id_b = a["tensor_id"][row_a], b["tensor_id"][row_b]
        if id_a >= 0 and id_b >= 0 and self.fetch_a is not None and self.fetch_b is not None:
            memo_key = (id_a, id_b, tol)
            found = self.memo.get(memo_key)
            if found is not None:
                return found
            pair = self.prefetcher.take((id_a, id_b)) if self.prefetcher is not None else None
            array_a, array_b = pair if pair is not None else (self.fetch_a(id_a), self.fetch_b(id_b))
            del pair
            self.bytes_read += array_a.nbytes + array_b.nbytes
            found = tensor_metrics(array_a, array_b, tol, a["dtype"][row_a], b["dtype"][row_b])
            del array_a, array_b
            self.memo[memo_key] = found
            return found
        stats_a = {name: a[name][row_a] for name in _STAT_COLUMNS}
        stats_b = {name: b[name][row_b] for name in _STAT_COLUMNS}
        evidence = "checksum" if stats_a["checksum"] and stats_b["checksum"] else "statistics"
        found = statistics_metrics(stats_a, stats_b, evidence)
        # issue 10: sketches measure what statistics only bound; not a tensor whose extremes are
        # its dtype's limit on both sides (a mask filled with finfo.min in a float32 and a float64
        # run): the mask values alone would make the sketches differ by ~1e308
        if "sketch" in a and "sketch" in b and not limit_masked(stats_a, stats_b):
            refine_with_sketch(found, a["sketch"][row_a], b["sketch"][row_b], stats_a["dtype"], stats_b["dtype"])
            if found.sketch is not None:
                self.evidence.add("sketch")
        return found


def _scalar_text(cols: dict, row: int) -> str | None:
    """A plain number's text, or a one-element tensor's value as text (its min == max)."""
    if cols["dtype"][row] == "":
        value = cols["value"][row]
        try:
            number = json.loads(value)
        except ValueError:
            return None
        return value if isinstance(number, (int, float)) and not isinstance(number, bool) else None
    if cols["numel"][row] == 1 and cols["min"][row] == cols["max"][row] and math.isfinite(cols["min"][row]):
        return json.dumps(cols["min"][row])
    return None


def _same_shape(text_a: str, text_b: str) -> bool:
    return text_a == text_b or _shape(text_a) == _shape(text_b)


def _shape(text: str):
    try:
        return tuple(json.loads(text)) if text else ()
    except (ValueError, TypeError):
        return text
