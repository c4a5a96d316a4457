"""Records of an in-place write that hold the values from before the write.

An in-place op (``exp_avg.lerp_(grad, 0.1)``, ``torch._foreach_lerp_``) writes into its first
argument, and its output record is that tensor after the call. A capture that takes the
output's statistics from its per-tensor cache (keyed by the tensor's version counter) or
measures it before the write has landed (asynchronous device statistics) records the
*pre-call* values instead: the output record equals the op's own input record, bit for bit.
Seen in real H100 dumps (``_foreach_lerp_`` outputs and the ``_foreach_addcdiv_`` input that
reads the same tensor), while the parameter the step then wrote agreed with the CPU run.

Such a record says nothing about the values, so it is not compared: when one run's output of
an in-place call is identical to that run's input.0 of the same call while the other run's
output differs from its input.0, the pair is "stale" on that side; a later divergent record
of that run holding the very same statistics (the same stale tensor read again) is stale too.
The ops that consume the tensor are still compared, so a write that really did not happen
shows up there (the updated parameter differs).
"""

from __future__ import annotations

import math

from probe.comparison import result as R

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
    """Tell the paired records of one step pair whose value on one side is stale."""

    def __init__(self, cols_a: dict, cols_b: dict):
        self.cols = (cols_a, cols_b)
        self.seen: tuple[set, set] = (set(), set())  # stale statistics per side

    def check(self, row: R.RecordRow, rows: tuple, inputs: tuple) -> None:
        """row was just judged; rows = (row_a, row_b); inputs = the call's input.0 (row_a, row_b)."""
        if row.status != R.DIVERGED or row.metrics is None or row.metrics.evidence == "value":
            return
        stats = [_stats(self.cols[side], rows[side]) for side in (0, 1)]
        side = self._stale_side(row, stats, inputs)
        if side is None:
            return
        self.seen[side].add(stats[side])
        name = "AB"[side]
        row.status = R.MATCH
        row.reasons.clear()
        row.stale = name
        row.notes.append(
            f"not compared: {name}'s record holds the values from before the in-place write (identical to the "
            f"call's input.0, while the other run's changed): the capture measured it too early; the ops "
            f"reading the tensor are compared")

    def _stale_side(self, row, stats, inputs) -> int | None:
        for side in (0, 1):
            if stats[side] is not None and stats[side] in self.seen[side]:
                return side
        if row.io != "out" or not is_in_place(row.op) or None in inputs:
            return None
        before = [_stats(self.cols[side], inputs[side]) for side in (0, 1)]
        unchanged = [stats[side] is not None and stats[side] == before[side] for side in (0, 1)]
        if unchanged[0] != unchanged[1]:
            return 0 if unchanged[0] else 1
        return None
