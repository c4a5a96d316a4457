"""Precision is a finding: an op one run computes in a lower dtype than the other.

A lower dtype on one side is judged at that dtype's tolerance, so its rounding alone never
fails a compare; without this module such an op passed in silence. The rules, per paired
API forward call whose floating output has a coarser dtype on one side (``X``):

* the call ran under autocast on X (root attribute ``autocast``, probe/capture/eager/autocast.py):
  expected, autocast chose that precision. Counted in a note, not a divergence.
* the runs compute in different dtypes throughout (their most common output dtypes differ:
  a float32 run against a ``model.double()`` one): a choice of the whole run, listed under
  "the runs differ in", not a divergence.
* otherwise the model's own casts chose it: a divergence of kind ``precision`` at that op,
  introduced there: "B computes fc1 functional.linear in bfloat16 where A uses float32".
  Dumps that do not record autocast (older versions) cannot tell, and keep the note only.

Either way the dtypes each run computed in are listed under "the runs differ in" when they
differ. Torch-free.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from probe.comparison import result as R

#: machine epsilon by dtype name: which of two dtypes is coarser
_EPS = {"float64": 2.0 ** -52, "float32": 2.0 ** -23, "float16": 2.0 ** -10, "bfloat16": 2.0 ** -7,
        "float8_e4m3fn": 2.0 ** -3, "float8_e4m3fnuz": 2.0 ** -3, "float8_e5m2": 2.0 ** -2,
        "float8_e5m2fnuz": 2.0 ** -2}


@dataclass
class PrecisionTally:
    """What the precision rule found over every step file of a compare."""

    autocast: Counter = field(default_factory=Counter)  # ("A"/"B", dtype) -> ops under autocast
    unknown: Counter = field(default_factory=Counter)  # ("A"/"B", dtype) -> ops, autocast not recorded
    dtypes_a: Counter = field(default_factory=Counter)  # dtype -> api forward outputs of A
    dtypes_b: Counter = field(default_factory=Counter)
    findings: int = 0

    def notes(self) -> list[str]:
        out = []
        for (side, dtype), count in sorted(self.autocast.items()):
            other = "B" if side == "A" else "A"
            out.append(f"{side} ran {count} op{'s' if count != 1 else ''} in {dtype} under autocast where {other} "
                       "computes in a finer dtype: expected (autocast chose that precision), not a divergence")
        for (side, dtype), count in sorted(self.unknown.items()):
            out.append(f"{side} ran {count} op{'s' if count != 1 else ''} in {dtype} where the other run computes in a "
                       "finer dtype; this dump does not record whether autocast was on, so it is judged at "
                       f"{dtype}'s tolerance and not reported as a precision divergence")
        return out

    def differences(self) -> list[dict]:
        """The "the runs differ in" entry for the dtypes each run computed in."""
        if set(self.dtypes_a) == set(self.dtypes_b) and not self.findings and not self.autocast:
            return []
        return [{"setting": "compute dtypes", "a": _describe(self.dtypes_a), "b": _describe(self.dtypes_b)}]


def _describe(dtypes: Counter) -> str:
    if not dtypes:
        return "not recorded"
    return ", ".join(f"{dtype} ({count} op{'s' if count != 1 else ''})" for dtype, count in dtypes.most_common())


def _in_runs(seq, runs) -> str:
    if seq is None or not runs:
        return ""
    for first, last, dtype in runs:
        if first <= seq <= last:
            return dtype
    return ""


def judge_precision(rows: list, autocast_a, autocast_b, tally: PrecisionTally) -> None:
    """Mark the precision divergences of one step file pair and count the rest in tally.

    autocast_a/_b: the step files' root attribute ``autocast`` (None where not recorded)."""
    calls: dict = {}
    for row in rows:
        if (row.kind == "api" and row.phase == "forward" and row.io == "out" and row.status in R.PAIRED
                and row.dtype_a in _EPS and row.dtype_b in _EPS):
            calls.setdefault((row.module, row.op, row.index), row)  # the call's first output
    main_a = Counter(row.dtype_a for row in calls.values())
    main_b = Counter(row.dtype_b for row in calls.values())
    tally.dtypes_a.update(main_a)
    tally.dtypes_b.update(main_b)
    whole_run = bool(main_a) and main_a.most_common(1)[0][0] != main_b.most_common(1)[0][0]
    for row in calls.values():
        if _EPS[row.dtype_a] == _EPS[row.dtype_b]:
            continue
        side, low, high = ("B", row.dtype_b, row.dtype_a) if _EPS[row.dtype_b] > _EPS[row.dtype_a] \
            else ("A", row.dtype_a, row.dtype_b)
        runs, seq = (autocast_b, row.seq_b) if side == "B" else (autocast_a, row.seq_a)
        if _in_runs(seq, runs):
            tally.autocast[(side, low)] += 1
        elif whole_run:
            continue
        elif runs is None:
            tally.unknown[(side, low)] += 1
        else:
            _mark(row, side, low, high)
            tally.findings += 1


def _mark(row, side: str, low: str, high: str) -> None:
    other = "A" if side == "B" else "B"
    text = f"{side} computes {row.module or '<root>'} {row.op} in {low} where {other} uses {high}"
    earlier = row.cause if row.status == R.DIVERGED and row.cause else ""
    row.status = R.DIVERGED
    row.divergence = R.PRECISION
    row.origin = R.INTRODUCED
    row.cause = text + (f"; {earlier}" if earlier else "")
    row.reasons.append(f"precision: {text} (the model's own cast, not autocast)")
