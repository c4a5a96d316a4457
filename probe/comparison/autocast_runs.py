"""Whether both runs computed under autocast, read from their step files' root attribute
``autocast`` (probe/capture/eager/autocast.py): then every record from the first autocast call on
carries that dtype's rounding (measure.py judges it at that dtype's tolerance at least).
Torch-free.
"""

from __future__ import annotations


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
