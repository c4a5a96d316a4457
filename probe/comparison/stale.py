"""Records of an in-place write that hold the values from before the write.

An in-place op (``exp_avg.lerp_(grad, 0.1)``, ``torch._foreach_lerp_``) writes into its first
argument, and its output record is that tensor after the call. A capture that takes the
output's statistics from its per-tensor cache (keyed by the tensor's version counter) or
measures it before the write has landed (asynchronous device statistics) records the
*pre-call* values instead: the output record equals the op's own input record, bit for bit.
Seen in real H100 dumps (``_foreach_lerp_`` outputs and the ``_foreach_addcdiv_`` input that
reads the same tensor), while the parameter the step then wrote agreed with the CPU run.

A write that really did not happen looks the same in its own record, so the records decide:
a divergent in-place output that equals its own input.0 in one run while the other run's
changed is a *candidate*; later divergent input records of that run holding the very same
statistics are its *readers*. The candidate and its readers are stale (not compared, a note)
only when some reader's call wrote its own outputs (they are no candidates themselves) and
they agree within tolerance, or the reader is an op that amplifies (Adam's update of a
parameter whose gradient is noise may differ, but it did happen). Otherwise they stay
divergences, and the write that did not happen is where the error entered.
"""

from __future__ import annotations

import math

from probe.comparison import result as R
from probe.comparison.explain import amplifies

_STATS = ("min", "max", "mean", "norm", "nan_count", "inf_count", "numel", "checksum", "shape", "dtype")


def _stats(cols: dict, row: int | None):
    if row is None or cols["dtype"][row] == "":
        return None
    values = tuple(cols[name][row] for name in _STATS)
    if all(isinstance(v, float) and math.isnan(v) for v in values[:4]):
        return None
    return tuple("nan" if isinstance(v, float) and math.isnan(v) else v for v in values)


def is_in_place(op: str) -> bool:
    name = op.rsplit(".", 1)[-1]
    return name.endswith("_") and not name.startswith("__") and not op.startswith("distributed.")


class StaleRecords:
    """Collect candidates while the records are measured (check), decide after (resolve)."""

    def __init__(self, cols_a: dict, cols_b: dict):
        self.cols = (cols_a, cols_b)
        self.candidates: list[tuple[R.RecordRow, int, tuple]] = []  # (row, side, stats)
        self.readers: list[tuple[R.RecordRow, int, tuple, int]] = []  # (row, side, stats, call number)

    def check(self, row: R.RecordRow, rows: tuple, inputs: tuple, number: int) -> None:
        """row was just measured; rows = (row_a, row_b); inputs = its call's input.0 rows."""
        if row.status != R.DIVERGED or row.metrics is None or row.metrics.evidence == "value":
            return
        stats = [_stats(self.cols[side], rows[side]) for side in (0, 1)]
        if row.io == "in":
            for _, side, seen in self.candidates:
                if stats[side] is not None and stats[side] == seen:
                    self.readers.append((row, side, seen, number))
                    return
            return
        if not is_in_place(row.op) or None in inputs:
            return
        before = [_stats(self.cols[side], inputs[side]) for side in (0, 1)]
        unchanged = [stats[side] is not None and stats[side] == before[side] for side in (0, 1)]
        if unchanged[0] != unchanged[1]:
            side = 0 if unchanged[0] else 1
            self.candidates.append((row, side, stats[side]))

    def resolve(self, outputs_of) -> None:
        """outputs_of(call number) -> the RecordRows of that call's outputs."""
        candidate_rows = {id(row) for row, _, _ in self.candidates}
        for row, side, seen in self.candidates:
            readers = [(reader, number) for reader, s, stats, number in self.readers if s == side and stats == seen]
            confirmed = any(
                outputs and all((out.status in R.WITHIN or amplifies(out.op)) and id(out) not in candidate_rows
                                for out in outputs)
                for outputs in (outputs_of(number) for _, number in readers))
            if confirmed:
                for stale_row in [row] + [reader for reader, _ in readers]:
                    _mark(stale_row, "AB"[side])


def _mark(row: R.RecordRow, name: str) -> None:
    row.status = R.MATCH
    row.reasons.clear()
    row.stale = name
    row.notes.append(
        f"not compared: {name}'s record holds the values from before the in-place write (identical to the "
        f"call's input.0, while the other run's changed), and the op that read it computed what the other run "
        f"did: the capture measured it too early")
