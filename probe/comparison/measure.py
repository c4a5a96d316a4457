"""Measure stage: provenance, tolerance and metrics of every paired record.

Records are measured in A's execution order, so that the precision a value was computed
from is known before the records that inherit it (a float32 tensor made from bfloat16
values gets bfloat16's tolerance). Tensor data is fetched through callables, read ahead by
a prefetcher, and each distinct tensor pair is read once: the stage never holds a whole
dump. What a measurement says (within tolerance or not) is the judge stage's.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Callable

import numpy as np

from probe.comparison import result as R
from probe.comparison.metrics import Metrics, limit_masked, statistics_metrics, tensor_metrics, value_metrics
from probe.comparison.pairing import AlignedStep
from probe.comparison.prefetch import Prefetcher
from probe.comparison.kinds import PRODUCED
from probe.comparison.provenance import STAT_COLUMNS, Provenance
from probe.comparison.sketch import refine as refine_with_sketch
from probe.comparison.tolerances import Tolerance, Tolerances, tolerance_dtype

Fetch = Callable[[int], np.ndarray]

#: what a paired record was measured as, and so which record rule judges it
TENSOR, VALUE, SCALAR, ABSENT, MIXED, SHAPE = "tensor", "value", "scalar", "absent", "mixed", "shape"


def lower_precision(first: str | None, second: str) -> str:
    """The less precise of two tolerance dtypes ("exact" never lowers a float)."""
    if first is None or first == "exact":
        return second
    if second == "exact":
        return first
    return tolerance_dtype(first, second)


@dataclass
class Measurement:
    """One paired record, measured: its input kind and how it compares."""

    row: R.RecordRow
    row_a: int
    row_b: int
    number: int  # its call pair
    kind: str  # provenance kind of A's tensor
    order: tuple
    what: str  # TENSOR | VALUE | SCALAR | ABSENT | MIXED | SHAPE
    metrics: Metrics | None = None
    tol: Tolerance | None = None


@dataclass
class MeasuredStep:
    aligned: AlignedStep
    measurements: list[Measurement]  # in A's execution order
    provenance: Provenance
    origins: dict  # A's input row -> (kind, producing row)
    evidence: set
    bytes_read: int
    fetch_a: Fetch | None
    fetch_b: Fetch | None


def measure(aligned: AlignedStep, fetch_a: Fetch | None, fetch_b: Fetch | None, tolerances: Tolerances,
            previous: set | None = None, progress=None, autocast: tuple | None = None) -> MeasuredStep:
    """Measure every paired record of one step file pair, carrying the precision floors.

    previous: content keys of A's previous step file of the same rank (provenance "carried").
    progress(done, total, tensor_bytes_read) is called every 64 records and at the end.
    autocast: (A's first seq under autocast, its dtype) when both runs computed under autocast in
    that dtype (autocast_runs.shared_autocast): every record from there on, the backward included,
    carries that dtype's rounding and is judged at its tolerance at least."""
    records_a = aligned.records_a
    provenance = Provenance(records_a, aligned.calls_a, previous)
    measurer = Measurer(records_a, aligned.records_b, fetch_a, fetch_b, tolerances)
    seqs = records_a.columns["seq"]
    paired = aligned.paired
    origins: dict[int, tuple] = {}
    effective: dict[int, str] = {}  # A's row -> the tolerance dtype it was judged with
    call_floor: dict[int, str] = {}  # pair -> lowest precision among its inputs
    mixed = None  # lowest precision where the runs' dtypes differ, once seen
    measurements = []
    measurer.start_prefetch(paired)
    try:
        for done, (row, row_a, row_b, number) in enumerate(paired, 1):
            order = (int(seqs[row_a]), row_a)
            kind, producer = provenance.kind(row_a, order)
            if row.io == "in":
                origins[row_a] = (kind, producer)
            upstream = mixed
            if autocast is not None and order[0] >= autocast[0]:
                upstream = lower_precision(upstream, autocast[1])
            if kind == PRODUCED and producer in effective:
                upstream = lower_precision(upstream, effective[producer])
            if row.io == "out" and number in call_floor:
                upstream = lower_precision(upstream, call_floor[number])
            what, metrics, tol = measurer.measure(row, row_a, row_b, upstream)
            measurements.append(Measurement(row, row_a, row_b, number, kind, order, what, metrics, tol))
            if row.tol_dtype and row.tol_dtype != "exact":
                effective[row_a] = row.tol_dtype
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
    return MeasuredStep(aligned, measurements, provenance, origins, measurer.evidence, measurer.bytes_read,
                        fetch_a, fetch_b)


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

    def start_prefetch(self, paired) -> None:
        """Read ahead the tensor pairs measure() will ask for in this order."""
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

    def measure(self, row: R.RecordRow, row_a: int, row_b: int, upstream: str | None = None):
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
