"""How big a record's difference is, and how a report writes it."""

from __future__ import annotations

import math

from probe.comparison import result as R


def sci(value: float) -> str:
    """An error in scientific notation, as every report writes them: 1.15e-04 (0 stays 0)."""
    return "0" if value == 0 else f"{value:.2e}"


def rel_error(row: R.RecordRow) -> float:
    """The rel L2 error of a row; inf when it diverged without one (NaN/Inf on one side,
    shapes differ, a tensor against a plain value, changed bytes of unknown size)."""
    m = row.metrics
    if row.stale:
        return 0.0  # not compared: its record holds values from before an in-place write (stale.py)
    if m is None or m.nan_mismatch or m.inf_mismatch or (row.status == R.DIVERGED and row.size_unknown):
        return math.inf if row.status == R.DIVERGED else 0.0
    return m.rel_l2
