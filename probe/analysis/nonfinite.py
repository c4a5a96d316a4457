"""The first NaN/Inf of one run, from its dump alone: no reference run, no torch.

    finding = probe.first_nonfinite("dump/")    # None when every record is finite
    print(finding.describe())

Every tensor record carries ``nan_count`` and ``inf_count``. The first record, in execution
order across steps (step, then ``seq`` within a step file), whose counts are not zero is the
first place a NaN/Inf was seen. Its call (every record with the same module, op, index and
phase: inputs, parameters, outputs) decides the origin:

* **introduced**: the call's inputs were all finite and an output is not; this op made it.
* **inherited**: a NaN/Inf was already in the call's inputs (its data, a parameter, an
  incoming gradient): it was made before the capture began or by code probe did not record.

An introduced NaN/Inf gets its cause (probe/analysis/nonfinite_cause.py): an overflow (a result beyond
the dtype's largest value), a division by zero (a denominator that held 0, often one that
underflowed in half precision) or an invalid operation (sqrt or log of a negative value, 0/0).
A half-precision record whose finite values sit at its dtype's largest magnitude is reported as
saturated.

Ranks are independent runs of the same step: ``find_nonfinite`` returns the first finding of
each rank, ``first_nonfinite`` the first of all (lowest step, then lowest rank).
"""

from __future__ import annotations

import math
import os

import numpy as np
from dataclasses import asdict, dataclass, field

from probe.analysis import nonfinite_cause
from probe.errors import DumpFormatError, NonfiniteError, NothingRecordedError

INTRODUCED, INHERITED = "introduced", "inherited"

#: largest finite magnitude of the half-precision dtypes (torch.finfo(dtype).max): values there
#: are saturated
DTYPE_MAX = {name: nonfinite_cause.DTYPE_MAX[name] for name in nonfinite_cause.HALF_DTYPES}
#: the columns that name one call (its records may have several seq: a module's inputs are
#: recorded when it starts, its outputs when it returns)
CALL_COLUMNS = ("module", "op", "index", "phase")
_ROW_COLUMNS = ("key", "seq", "kind", "module", "op", "index", "phase", "slot", "io", "dtype",
                "shape", "value", "min", "max", "nan_count", "inf_count", "numel", "source")


@dataclass(frozen=True)
class Slot:
    """One tensor of the first non-finite call: where it sits and what it holds."""

    slot: str
    io: str
    dtype: str
    shape: str
    nan_count: int
    inf_count: int
    numel: int

    @property
    def finite(self) -> bool:
        return self.nan_count <= 0 and self.inf_count <= 0


@dataclass(frozen=True)
class NonfiniteFinding:
    """The first record holding NaN/Inf, and what the rest of its call held."""

    step: int
    rank: int
    seq: int
    key: str
    kind: str
    module: str
    op: str
    index: int
    phase: str
    slot: str
    dtype: str
    shape: str
    nan_count: int
    inf_count: int
    numel: int
    source: str
    origin: str  # INTRODUCED or INHERITED
    overflow: bool
    file: str
    inputs: tuple[Slot, ...] = ()
    outputs: tuple[Slot, ...] = ()
    notes: tuple[str, ...] = field(default=())
    #: why an introduced NaN/Inf appeared: "overflow", "division by zero", "invalid operation",
    #: or "" (inherited, or the records do not say)
    cause: str = ""

    def to_dict(self) -> dict:
        data = asdict(self)
        for name in ("inputs", "outputs"):
            data[name] = [dict(asdict(slot), finite=slot.finite) for slot in getattr(self, name)]
        data["notes"] = list(self.notes)
        return data

    def describe(self) -> str:
        """Several lines for a terminal."""
        where = f"{self.module or '<root>'} {self.op}#{self.index} ({self.phase}, {self.kind})"
        counts = f"{self.nan_count} NaN, {self.inf_count} Inf of {self.numel} elements"
        if self.origin == INTRODUCED:
            finite = ", ".join(s.slot for s in self.inputs) or "none recorded"
            origin = f"introduced here: its inputs were finite ({finite})"
            if self.cause:
                origin += f"; cause: {self.cause}"
        else:
            bad = ", ".join(f"{s.slot} ({s.nan_count} NaN, {s.inf_count} Inf)"
                            for s in self.inputs if not s.finite)
            origin = (f"inherited: NaN/Inf was already in its inputs: {bad}; it was made before "
                      "the capture began or by code probe did not record")
        lines = [
            f"first NaN/Inf: step {self.step} rank {self.rank}: {where}",
            f"  record: {self.key}  {self.dtype} {self.shape}",
            f"  counts: {counts}",
            f"  origin: {origin}",
            f"  source: {self.source or 'unknown'}",
        ]
        lines += [f"  note: {note}" for note in self.notes]
        lines.append(f"  file: {self.file}")
        return "\n".join(lines)


def _int(value) -> int:
    return int(value)


def _slot(row: dict) -> Slot:
    return Slot(row["slot"], row["io"], row["dtype"], row["shape"], _int(row["nan_count"]),
                _int(row["inf_count"]), _int(row["numel"]))


def _first_in_file(step_file) -> NonfiniteFinding | None:
    """The first non-finite record of one step file (lowest seq), or None."""
    records = step_file.records
    if not len(records):
        return None
    nan = records.column("nan_count")
    inf = records.column("inf_count")
    bad = (nan > 0) | (inf > 0)  # -1 = unknown (meta tensors): not evidence of anything
    if "uninitialized" in records.columns:  # leftover bytes nothing had written: no value of the run
        bad &= ~records.column("uninitialized")
    if not bad.any():
        return None
    seq = records.column("seq")
    first_seq = int(seq[bad].min())
    at = int(((seq == first_seq) & bad).nonzero()[0][0])
    # the whole call: a module's inputs are recorded when it starts, its outputs when it ends
    same_call = np.ones(len(records), dtype=bool)
    for name in CALL_COLUMNS:
        same_call &= records.column(name) == records.column(name)[at]
    present = [name for name in _ROW_COLUMNS if name in records.columns]
    call_rows = [{name: _plain(records.column(name)[i]) for name in present}
                 for i in same_call.nonzero()[0]]
    rows = [row for row in call_rows if row["dtype"]]  # tensors only: plain values hold no NaN count
    first = next(row for row in rows if row["nan_count"] > 0 or row["inf_count"] > 0)
    inputs = tuple(_slot(row) for row in rows if row["io"] == "in")
    outputs = tuple(_slot(row) for row in rows if row["io"] == "out")
    inherited = any(not slot.finite for slot in inputs)
    if inherited:  # name the input that carried it, not an output it spread to
        first = next(row for row in rows if row["io"] == "in"
                     and (row["nan_count"] > 0 or row["inf_count"] > 0))
    origin = INHERITED if inherited else INTRODUCED
    cause, notes = nonfinite_cause.classify(first, call_rows) if origin == INTRODUCED else ("", [])
    saturated = _saturated(first, rows)
    overflow = cause == nonfinite_cause.OVERFLOW or bool(saturated)
    return NonfiniteFinding(
        step=int(step_file.step), rank=int(step_file.rank), seq=first_seq, key=first["key"],
        kind=first["kind"], module=first["module"], op=first["op"], index=_int(first["index"]),
        phase=first["phase"], slot=first["slot"], dtype=first["dtype"], shape=first["shape"],
        nan_count=_int(first["nan_count"]), inf_count=_int(first["inf_count"]),
        numel=_int(first["numel"]), source=first["source"], origin=origin, overflow=overflow,
        file=step_file.path, inputs=inputs, outputs=outputs, notes=tuple(notes + saturated),
        cause=cause,
    )


def _saturated(first: dict, rows: list[dict]) -> list[str]:
    """The sentence naming the half-precision slots whose values sit at the dtype's largest
    value (the true values were larger), or none."""
    limit = DTYPE_MAX.get(first["dtype"])
    if limit is None:
        return []
    saturated = [row["slot"] for row in rows if row["dtype"] == first["dtype"]
                 and any(math.isfinite(v) and abs(v) >= limit for v in (row["min"], row["max"]))]
    if not saturated:
        return []
    return [f"{', '.join(saturated)} reach {limit:g}, the largest {first['dtype']} value "
            "(saturated: the true values were larger)"]


def _plain(value):
    if hasattr(value, "item"):
        return value.item()
    return value


def find_nonfinite(dump, *, rank: int | None = None) -> dict[int, NonfiniteFinding]:
    """rank -> the first non-finite record of that rank (ranks with none are left out).

    ``dump``: a dump root, step folder or step file (path), or a loaded probe.load() Dump.
    """
    from probe.dump.reader import Dump, load

    loaded = dump if isinstance(dump, Dump) else load(os.fspath(dump))
    if rank is not None and rank not in loaded.ranks:
        raise DumpFormatError(f"{loaded.path} has no rank {rank} (ranks: {loaded.ranks})")
    found: dict[int, NonfiniteFinding] = {}
    examined = 0
    for step, file_rank in sorted(loaded.files):
        if file_rank in found or (rank is not None and file_rank != rank):
            continue
        with loaded.open(step, file_rank) as step_file:
            examined += len(step_file.records)
            finding = _first_in_file(step_file)
        if finding is not None:
            found[file_rank] = finding
    if not examined:
        # "every record is finite" would be true of nothing: a check that saw nothing fails
        raise NothingRecordedError(
            f"nothing was recorded: the step files of {loaded.path} hold 0 records "
            f"({len(loaded.files)} file(s)); its config's scope or list selects no call, or "
            "start() was not called around the steps")
    return dict(sorted(found.items()))


def first_nonfinite(dump, *, rank: int | None = None) -> NonfiniteFinding | None:
    """The first record holding NaN/Inf in execution order across steps, or None.

    Across ranks: the lowest step, then the lowest rank (``seq`` is per rank and does not
    order ranks against each other).
    """
    findings = find_nonfinite(dump, rank=rank)
    if not findings:
        return None
    return min(findings.values(), key=lambda f: (f.step, f.rank, f.seq))


def stop_error(rows, column_names, step: int, rank: int, path: str | None):
    """stop_on_nonfinite: a NonfiniteError when any of a finished step's rows (tuples in
    column_names order) holds NaN/Inf, else None. The debugger raises it at step()."""
    nan_at, inf_at = column_names.index("nan_count"), column_names.index("inf_count")
    bad = sum(1 for row in rows if row[nan_at] > 0 or row[inf_at] > 0)
    if not bad:
        return None
    dump = os.path.dirname(os.path.dirname(path)) if path else "the dump"
    return NonfiniteError(
        f"stop_on_nonfinite: step {step} rank {rank} holds NaN/Inf in {bad} record(s); "
        f"its file is written ({path}); run `probe nonfinite {dump}` to see where it began"
    )


__all__ = ["first_nonfinite", "find_nonfinite", "NonfiniteFinding", "Slot", "DTYPE_MAX",
           "INTRODUCED", "INHERITED"]
