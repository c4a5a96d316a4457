"""Result stage: the first divergence and the likely cause, one story for every report.

* The first divergence is the earliest divergent output record in A's execution order
  (seq; forward and backward as they ran). Records that exist on one side only are never
  a pass and never a divergence: they are counted as only_a / only_b.
* The likely cause is the first divergent output that introduced its error (story()).
"""

from __future__ import annotations

from probe.comparison import result as R


def first_divergence(rows: list[R.RecordRow]) -> R.RecordRow | None:
    """Earliest divergent output in execution order (inputs only if no output diverged)."""
    diverged = [row for row in rows if row.status == R.DIVERGED]
    outputs = [row for row in diverged if row.divergence in (R.OUTPUT, R.PRECISION)]
    candidates = outputs or [row for row in diverged if row.divergence in (R.PARAM, R.ARGUMENT, R.INPUT)] or diverged
    return min(candidates, key=lambda row: row.order, default=None)


def likely_cause(rows: list[R.RecordRow], first: R.RecordRow | None) -> R.RecordRow | None:
    """The first divergent output that introduced its error; failing that, the first record
    where error entered (a changed parameter or argument, a divergent external input); else
    the first divergence."""
    ordered = sorted((row for row in rows if row.status == R.DIVERGED), key=lambda row: row.order)
    for row in ordered:
        if row.divergence in (R.OUTPUT, R.PRECISION) and row.origin == R.INTRODUCED:
            return row
    for row in ordered:
        if row.divergence in (R.PARAM, R.ARGUMENT, R.INPUT) and row.origin == R.INTRODUCED:
            return row
    return first


def story(outcomes) -> tuple[R.RecordRow | None, R.RecordRow | None]:
    """(first divergence, likely cause) of a whole compare: one story for every report.

    The earliest step file pair with a divergence decides the step. Among its ranks, a rank
    where an op introduced its error tells the story (on the other ranks the error arrives
    through a collective, DDP's gradient all-reduce, and is only inherited): a rank-1-only
    fault is named on rank 1. When no op of that step introduced its error, the likely cause
    is the first introduced one of a later step file, if any."""
    diverged = [o for o in outcomes if o.diverged]
    if not diverged:
        return None, None
    step = min(o.step for o in diverged)
    told = []
    for outcome in (o for o in diverged if o.step == step):
        first = first_divergence(outcome.rows)
        told.append((outcome.rank, first, likely_cause(outcome.rows, first)))
    introducing = [t for t in told if t[2] is not None and t[2].origin == R.INTRODUCED]
    if introducing:
        rank, first, cause = min(introducing, key=lambda t: (t[2].order, t[0]))
        return first, cause
    rank, first, cause = min(told, key=lambda t: (t[1].order, t[0]))
    for outcome in sorted(diverged, key=lambda o: (o.step, o.rank)):
        later = likely_cause(outcome.rows, None)
        if later is not None and later.origin == R.INTRODUCED:
            return first, later
    return first, cause
