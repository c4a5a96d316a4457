"""Measure stage: provenance, tolerance and metrics of every paired record.

Records are measured in A's execution order, so that the precision a value was computed
from is known before the records that inherit it (a float32 tensor made from bfloat16
values gets bfloat16's tolerance). Tensor data is fetched through callables, read ahead by
a prefetcher where reading costs (a pair a fetch maps from its files is read when measured),
and each distinct tensor pair is read once: the stage never holds a whole dump. What a
measurement says (within tolerance or not) is the judge stage's.

Provenance
----------

Measure stage, provenance: where each input tensor of run A came from.

An input is *produced* by an earlier record of the step, a *param* (or a *param_update* once
the backward began), *carried* over from the previous step file, *unrecorded* (made after
the backward began by something not recorded) or *external* (data, buffers, constants).
The judge stage (call_rules.py) adds *changed*, *unpaired* and *forward* from the judged rows.

Autocast runs
-------------

Whether both runs computed under autocast, read from their step files' root attribute
``autocast`` (probe/capture/eager/autocast.py): then every record from the first autocast call on
carries that dtype's rounding (measure.py judges it at that dtype's tolerance at least).
Torch-free.
"""

from __future__ import annotations

import json
import math
from typing import Callable

import numpy as np

from probe.comparison.envelope import Operand
from probe.comparison.metrics import (
    Metrics, Prefetcher, limit_masked, parse_value, statistics_metrics, tensor_metrics, value_metrics,
)
from probe.comparison.records import (
    Call, Records, is_param_slot, number_keys, param_name, parse_shape, row_facts, unknown_statistics,
)
from probe.comparison.sketch import raw_errors, refine as refine_with_sketch, refine_many, statistics_columns
from probe.comparison.structs import (
    ABSENT, MIXED, PRODUCED, SCALAR, SHAPE, TENSOR, VALUE, AlignedStep, MeasuredStep, Measurement, RecordRow,
)
from probe.comparison.tolerances import Tolerances, tolerance_dtype
from probe.dump import schema

Fetch = Callable[[int], np.ndarray]


def lower_precision(first: str | None, second: str) -> str:
    """The less precise of two tolerance dtypes ("exact" never lowers a float)."""
    if first is None or first == "exact":
        return second
    if second == "exact":
        return first
    return tolerance_dtype(first, second)


def shared_autocast(runs_a, runs_b) -> tuple | None:
    """(A's first seq under autocast, dtype) when both runs computed under autocast in the same
    dtype; None otherwise (or when a dump does not record it)."""
    if not runs_a or not runs_b:
        return None
    dtypes_a = {dtype for _, _, dtype in runs_a}
    dtypes_b = {dtype for _, _, dtype in runs_b}
    if len(dtypes_a) != 1 or dtypes_a != dtypes_b:
        return None
    return (min(first for first, _, _ in runs_a), next(iter(dtypes_a)))


def measure(aligned: AlignedStep, fetch_a: Fetch | None, fetch_b: Fetch | None, tolerances: Tolerances,
            previous: set | None = None, progress=None, autocast: tuple | None = None) -> MeasuredStep:
    """Measure every paired record of one step file pair, carrying the precision floors.

    previous: content keys of A's previous step file of the same rank (provenance "carried").
    progress(done, total, tensor_bytes_read) is called every 64 records and at the end.
    autocast: (A's first seq under autocast, its dtype) when both runs computed under autocast in
    that dtype (shared_autocast): every record from there on, the backward included,
    carries that dtype's rounding and is judged at its tolerance at least."""
    records_a = aligned.records_a
    cols_a, cols_b = records_a.columns, aligned.records_b.columns
    (stats_a, keys_a), (stats_b, _) = row_facts(records_a), row_facts(aligned.records_b)
    provenance = Provenance(records_a, aligned.calls_a, previous, keys_a)
    measurer = Measurer(records_a, aligned.records_b, fetch_a, fetch_b, tolerances)
    seqs = cols_a["seq"]
    paired = aligned.paired
    firsts = [next(((slot.a, slot.b) for slot in slots if slot.row.slot == "input.0"), (None, None))
              for slots in aligned.per_pair]
    inputs: dict[int, tuple | None] = {}  # pair -> the statistics of its input.0, read once
    effective: dict[int, str] = {}  # A's row -> the tolerance dtype it was judged with
    call_floor: dict[int, str] = {}  # pair -> lowest precision among its inputs
    forward_floor: dict[tuple, str] = {}  # (module, op, index) -> lowest precision of its forward's records
    mixed = None  # lowest precision where the runs' dtypes differ, once seen
    measurements = []
    measurer.start_prefetch(paired)
    measurer.measure_statistics(paired)
    try:
        for done, slot in enumerate(paired, 1):
            row, row_a, row_b, number = slot.row, slot.a, slot.b, slot.number
            order = (int(seqs[row_a]), row_a)
            kind, producer = provenance.kind(row_a, order)
            upstream = mixed
            if autocast is not None and order[0] >= autocast[0]:
                upstream = lower_precision(upstream, autocast[1])
            if kind == PRODUCED and producer in effective:
                upstream = lower_precision(upstream, effective[producer])
            if row.io == "out" and number in call_floor:
                upstream = lower_precision(upstream, call_floor[number])
            call_key = (row.module, row.op, row.index)
            if row.phase == "backward" and call_key in forward_floor:
                # a backward computes from the values its forward saw: a float32 gradient in a
                # bfloat16 model's float32 island carries bfloat16 rounding, as its forward did
                upstream = lower_precision(upstream, forward_floor[call_key])
            what, metrics, tol = measurer.measure(row, row_a, row_b, upstream)
            row.stale = _unwritten_in(cols_a, row_a, cols_b, row_b)
            if number not in inputs:
                first = firsts[number]
                inputs[number] = None if None in first else (stats_a[first[0]], stats_b[first[1]])
            measurements.append(_measurement(slot, kind, producer, order, what, metrics, tol, cols_a, cols_b,
                                             inputs[number], (stats_a[row_a], stats_b[row_b]), keys_a[row_a]))
            if row.tol_dtype and row.tol_dtype != "exact":
                effective[row_a] = row.tol_dtype
                if row.phase == "forward":
                    forward_floor[call_key] = lower_precision(forward_floor.get(call_key), row.tol_dtype)
                if row.io == "in":
                    call_floor[number] = lower_precision(call_floor.get(number), row.tol_dtype)
                if row.dtype_a != row.dtype_b:
                    # B computed in another precision from here on: every later value carries it
                    mixed = lower_precision(mixed, tolerance_dtype(row.dtype_a, row.dtype_b))
            if progress is not None and (done % 64 == 0 or done == len(paired)):
                progress(done, len(paired), measurer.bytes_read)
    finally:
        measurer.close()
    if progress is not None and not paired:
        progress(1, 1, measurer.bytes_read)
    return MeasuredStep(aligned, measurements, provenance.backward_from, measurer.evidence, measurer.bytes_read,
                        devices=_moved(paired, cols_a, cols_b), content_keys=content_keys(records_a, keys_a),
                        fetch_a=fetch_a, fetch_b=fetch_b)


def _measurement(slot, kind, producer, order, what, metrics, tol, cols_a, cols_b, inputs, stats,
                 key) -> Measurement:
    """A measured slot with what the later stages need of its records, read here once (stats:
    A's and B's row_facts statistics; key: A's content key)."""
    row, row_a, row_b = slot.row, slot.a, slot.b
    if row.io != "in":
        producer = None  # where an output's tensor came from says nothing about the call
    values = (None, None)
    if metrics is not None and metrics.evidence == "value":
        values = (parse_value(metrics.value_a or ""), parse_value(metrics.value_b or ""))
    return Measurement(slot, kind, producer, order, what, metrics, tol, values=values,
                       texts=(cols_a["value"][row_a], cols_b["value"][row_b]),
                       content_key=key, param=_held_param(cols_a, row, kind, producer),
                       stats=stats, input_stats=inputs, operand=_operand(cols_a, row_a) if stats[0] else None)


def _held_param(cols: dict, row: RecordRow, kind: str, producer: int | None) -> str | None:
    """fc1.weight for a param.* record, or for an input holding that parameter's tensor."""
    if row.slot.startswith("param."):
        return param_name(row.module, row.slot)
    if kind == "param" and producer is not None:
        return param_name(cols["module"][producer], cols["slot"][producer])
    return None


def content_keys(records: Records, keys: list) -> set:
    """The content keys (row_facts) of every tensor record of a step file: what the next step
    file may carry over."""
    found = {key for key, dtype in zip(keys, records.columns["dtype"]) if dtype != ""}
    found.discard(None)
    return found


def _unwritten_in(cols_a: dict, row_a: int, cols_b: dict, row_b: int) -> str:
    """"A", "B", "AB" or "": the runs whose record holds memory nothing had written yet (the
    reader's column uninitialized; judged by record_rules.judge_uninitialized)."""
    name = schema.UNINITIALIZED
    return ("A" if name in cols_a and cols_a[name][row_a] else "") + \
        ("B" if name in cols_b and cols_b[name][row_b] else "")


def _operand(cols: dict, row: int) -> Operand:
    """A's recorded tensor as the rounding envelopes read it: its statistics, parsed once."""
    norm = float(cols["norm"][row])
    return Operand(numel=int(cols["numel"][row]), norm=norm if math.isfinite(norm) else math.inf,
                   min=float(cols["min"][row]), max=float(cols["max"][row]), mean=float(cols["mean"][row]),
                   shape=parse_shape(cols["shape"][row]), dtype=cols["dtype"][row])


def _moved(paired, cols_a: dict, cols_b: dict) -> dict:
    """(device in A, device in B) -> paired tensor records that live on different devices."""
    moved: dict = {}
    dev_a, dev_b = cols_a["device"], cols_b["device"]
    for slot in paired:
        pair = (dev_a[slot.a], dev_b[slot.b])
        if pair[0] and pair[1] and pair[0] != pair[1]:
            moved[pair] = moved.get(pair, 0) + 1
    return moved


#: a pair of fewer elements on both sides is read when it is measured, not ahead by a thread: the
#: hand-over and the thread's share of the GIL cost more than the overlap saves. Two bfloat16
#: dumps on two cores (medians of 5, docs/performance.md): 1,024 elements a tensor, 0.70 CPU s
#: with the thread against 0.52 without; 262,144 the same wall time; 2^20 9% less wall time
#: with the thread for 2% more CPU time
READ_AHEAD_MIN_ELEMENTS = 1 << 20


def _never(dtype_name: str) -> bool:
    return False


def read_ahead_keys(a: dict, b: dict, paired, maps_a=_never, maps_b=_never) -> list:
    """The (tensor id A, tensor id B) pairs worth reading ahead, in the order measure() asks
    for them: stored on both sides, of one shape, large, and not mapped on both sides. a, b: the
    record columns; maps_a/maps_b: whether a large tensor of a dtype comes mapped."""
    keys, seen = [], set()
    for slot in paired:
        row_a, row_b = slot.a, slot.b
        if a["dtype"][row_a] == "" or b["dtype"][row_b] == "" or not _same_shape(a["shape"][row_a], b["shape"][row_b]):
            continue
        if maps_a(a["dtype"][row_a]) and maps_b(b["dtype"][row_b]):
            continue  # both come mapped (dump/mapped.py): a thread reading them ahead costs more than it saves
        if max(a["numel"][row_a], b["numel"][row_b]) < READ_AHEAD_MIN_ELEMENTS:
            continue  # read here: handing a small pair to the thread costs more than reading it
        key = (a["tensor_id"][row_a], b["tensor_id"][row_b])
        if key[0] >= 0 and key[1] >= 0 and key not in seen:
            seen.add(key)
            keys.append(key)
    return keys


class Measurer:
    """Metrics of record pairs, reading each distinct tensor pair once."""

    def __init__(self, records_a, records_b, fetch_a, fetch_b, tolerances: Tolerances):
        self.a, self.b = records_a.columns, records_b.columns
        self.fetch_a, self.fetch_b = fetch_a, fetch_b
        self.tolerances = tolerances
        self.memo: dict[tuple[int, int], Metrics] = {}
        self.evidence: set = set()
        self.bytes_read = 0
        self.prefetcher: Prefetcher | None = None
        self.measured: dict = {}  # (row_a, row_b) -> Metrics of a statistics pair (measure_statistics)

    def start_prefetch(self, paired) -> None:
        """Read ahead the tensor pairs measure() will ask for in this order."""
        if self.fetch_a is None or self.fetch_b is None:
            return
        maps_a, maps_b = (getattr(fetch, "maps", _never) for fetch in (self.fetch_a, self.fetch_b))
        keys = read_ahead_keys(self.a, self.b, paired, maps_a, maps_b)
        if len(keys) > 1:
            self.prefetcher = Prefetcher(keys, self.fetch_a, self.fetch_b)

    def measure_statistics(self, paired) -> None:
        """The statistics and sketch metrics of every tensor pair with no stored tensors, column
        by column (sketch.statistics_columns, raw_errors); metrics() hands each out once."""
        a, b = self.a, self.b
        stored = self.fetch_a is not None and self.fetch_b is not None
        rows = [(slot.a, slot.b) for slot in paired if a["dtype"][slot.a] != "" and b["dtype"][slot.b] != ""
                and not (stored and a["tensor_id"][slot.a] >= 0 and b["tensor_id"][slot.b] >= 0)]
        rows_a, rows_b = [row for row, _ in rows], [row for _, row in rows]
        found = statistics_columns(a, rows_a, b, rows_b)
        sketched = [number for number, metrics in enumerate(found) if metrics is not None
                    and not metrics.bit_equal] if "sketch" in a and "sketch" in b else []
        raws = raw_errors([a["sketch"][rows_a[i]] for i in sketched], [b["sketch"][rows_b[i]] for i in sketched])
        refine_many([found[i] for i in sketched], [a["dtype"][rows_a[i]] for i in sketched],
                    [b["dtype"][rows_b[i]] for i in sketched], raws)
        self.measured = {pair: metrics for pair, metrics in zip(rows, found) if metrics is not None}

    def close(self) -> None:
        if self.prefetcher is not None:
            self.prefetcher.close()
            self.prefetcher = None

    def measure(self, row: RecordRow, row_a: int, row_b: int, upstream: str | None = None):
        """(what, metrics, tolerance) of one paired record. upstream: the lowest-precision
        dtype its value was computed from (a float32 tensor made from bfloat16 values is
        judged as bfloat16)."""
        a, b = self.a, self.b
        if a["dtype"][row_a] == "" or b["dtype"][row_b] == "":
            if a["dtype"][row_a] != b["dtype"][row_b]:
                number_a, number_b = _scalar_text(a, row_a), _scalar_text(b, row_b)
                if number_a is not None and number_b is not None:
                    # torch.tensor(1.0) on one side, the number 1 on the other (foreach vs per-tensor)
                    return SCALAR, value_metrics(number_a, number_b), None
                if a["value"][row_a] == "null" or b["value"][row_b] == "null":
                    return ABSENT, None, None
                return MIXED, None, None
            return VALUE, value_metrics(a["value"][row_a], b["value"][row_b]), None
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
            return SHAPE, None, tol
        if "bool" in (row.dtype_a, row.dtype_b) and row.dtype_a != row.dtype_b:
            same = self.same_mask(row_a, row_b)
            if same is not None:
                return _mask_pair(row, same)
        metrics = self.metrics(row_a, row_b, tol)
        self.evidence.add(metrics.evidence)
        return TENSOR, metrics, tol

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
        found = self.measured.pop((row_a, row_b), None)
        if found is not None:
            if found.sketch is not None:
                self.evidence.add("sketch")
            return found
        stats_a = {name: a[name][row_a] for name in STAT_COLUMNS}
        stats_b = {name: b[name][row_b] for name in STAT_COLUMNS}
        evidence = "checksum" if stats_a["checksum"] and stats_b["checksum"] else "statistics"
        found = statistics_metrics(stats_a, stats_b, evidence)
        # sketches measure what statistics only bound; not a tensor whose extremes are
        # its dtype's limit on both sides (a mask filled with finfo.min in a float32 and a float64
        # run): the mask values alone would make the sketches differ by ~1e308
        if "sketch" in a and "sketch" in b and not limit_masked(stats_a, stats_b):
            refine_with_sketch(found, a["sketch"][row_a], b["sketch"][row_b], stats_a["dtype"], stats_b["dtype"])
            if found.sketch is not None:
                self.evidence.add("sketch")
        return found


    def same_mask(self, row_a: int, row_b: int) -> tuple | None:
        """A bool mask (True: attend, as sdpa reads it) in one run and an additive float mask
        (0: attend, a large negative number or -inf: masked, as eager attention adds it) in the
        other: (whether they mask the same positions, the float side's masking value, the masked
        counts of A and B); None when the pair is not two such masks."""
        a, b = self.a, self.b
        flip = a["dtype"][row_a] != "bool"
        (bools, rb), (floats, rf) = ((b, row_b), (a, row_a)) if flip else ((a, row_a), (b, row_b))
        low, high = floats["min"][rf], floats["max"][rf]
        if high not in (0.0, low) or not low <= _MASKED or floats["nan_count"][rf]:
            return None
        numel = int(bools["numel"][rb])
        masked_bool = numel - round(float(bools["mean"][rb]) * numel)
        ids = (a["tensor_id"][row_a], b["tensor_id"][row_b])
        if min(ids) >= 0 and self.fetch_a is not None and self.fetch_b is not None:
            arrays = (self.fetch_a(ids[0]), self.fetch_b(ids[1]))
            mask, added = (arrays[1], arrays[0]) if flip else arrays
            same = bool(np.array_equal(mask.astype(bool), added == 0) and np.all(added[~mask.astype(bool)] <= _MASKED))
            masked_float = int(np.count_nonzero(added != 0))
        elif math.isinf(low):
            masked_float = int(floats["inf_count"][rf])
            same = masked_float == masked_bool
        else:
            # every masked value is ``low`` and the rest 0: ||f||^2 = count * low^2
            estimate = (float(floats["norm"][rf]) / abs(low)) ** 2
            masked_float = round(estimate)
            same = abs(estimate - masked_float) < 1e-3 * max(numel, 1) and masked_float == masked_bool
        counts = (masked_float, masked_bool) if flip else (masked_bool, masked_float)
        return same, low, counts


#: an additive mask's masking value is at most float16's lowest
_MASKED = -65504.0


def _mask_pair(row: RecordRow, found: tuple):
    """The measurement of a bool mask against an additive float mask (Measurer.same_mask)."""
    same, low, counts = found
    forms = {"bool": "bool (True: attend)"}
    form_a = forms.get(row.dtype_a, f"additive {row.dtype_a} (0: attend, {low:g}: masked)")
    form_b = forms.get(row.dtype_b, f"additive {row.dtype_b} (0: attend, {low:g}: masked)")
    row.notes = [note for note in row.notes if not note.startswith("dtype ")]
    text = f"mask given as {form_a} in A, {form_b} in B"
    if same:
        row.notes.append(f"{MASK_NOTE}: {text}")
        return VALUE, Metrics(evidence="value", numel=1, bit_equal=True, value_a=form_a, value_b=form_b), None
    row.cause = f"{text}, and they mask other positions ({counts[0]} masked in A, {counts[1]} in B)"
    row.notes.append(f"mask representation changed: {text}")
    return VALUE, Metrics(evidence="value", numel=1, err_l2=math.inf, rel_l2=math.inf, max_abs=math.inf,
                          bit_equal=False, value_a=form_a, value_b=form_b), None


#: the note of a mask pair of two representations that mask the same positions
MASK_NOTE = "the same mask in another form"


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
    return text_a == text_b or parse_shape(text_a) == parse_shape(text_b)


STAT_COLUMNS = ("min", "max", "mean", "norm", "nan_count", "inf_count", "numel", "checksum", "dtype")
_FLOATS = frozenset(STAT_COLUMNS[:4])


class Provenance:
    """Where an input tensor of run A came from: produced by an earlier record of the step, a
    parameter, state carried over from the previous step file, made after the backward began
    by something unrecorded, or none of these (external)."""

    def __init__(self, records: Records, calls: list[Call], previous: set | None, keys: list):
        cols = records.columns
        self._cols = cols
        self._keys = keys  # row_facts' content keys
        # every record's identity: its tensor_id when stored, else its checksum and statistics
        statistics = zip(*(number_keys(cols[name]) if name in _FLOATS else cols[name] for name in STAT_COLUMNS),
                         cols["shape"])
        self._prints = [[("id", tensor_id)] if tensor_id >= 0 else [] if empty else [("stats", values)]
                        for tensor_id, empty, values in zip(cols["tensor_id"], unknown_statistics(records), statistics)]
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
        return self._prints[row]

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
        param = None
        for mark in prints:
            if mark in self.params:
                param = self.params[mark]
                break
        if param is not None:
            # read once the backward began: the optimizer updating it; its difference, if
            # any, entered the step where the forward read it
            return ("param_update" if order[0] > self.backward_from else "param"), param
        forward = self._cols["phase"][row] == "forward"
        if forward and self.previous and self._keys[row] in self.previous:
            return "carried", None
        if order[0] > self.backward_from:
            return "unrecorded", None
        return "external", None
