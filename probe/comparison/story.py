"""Attribute stage: the first divergence, the likely cause, and what each call adds.

* The first divergence is the earliest divergent output record in A's execution order
  (seq; forward and backward as they ran). Records that exist on one side only are never
  a pass and never a divergence: they are counted as only_a / only_b.
* The likely cause is the first divergent output that introduced its error (story()).
* Each call pair's summary (summarize_call) sizes the error it adds, in tolerance units:
  the top ops of a report are ranked by it (groups.py).
"""

from __future__ import annotations

import math

from probe.comparison import result as R
from probe.comparison.explain import forward_carriers, is_carrier
from probe.comparison.verdict import rel_error


def first_divergence(rows: list[R.RecordRow]) -> R.RecordRow | None:
    """Earliest divergent output in execution order (inputs only if no output diverged)."""
    diverged = [row for row in rows if row.status == R.DIVERGED]
    outputs = [row for row in diverged if row.divergence == R.OUTPUT]
    candidates = outputs or [row for row in diverged if row.divergence in (R.PARAM, R.ARGUMENT, R.INPUT)] or diverged
    return min(candidates, key=lambda row: row.order, default=None)


def likely_cause(rows: list[R.RecordRow], first: R.RecordRow | None) -> R.RecordRow | None:
    """The first divergent output that introduced its error; failing that, the first record
    where error entered (a changed parameter or argument, a divergent external input); else
    the first divergence."""
    ordered = sorted((row for row in rows if row.status == R.DIVERGED), key=lambda row: row.order)
    for row in ordered:
        if row.divergence == R.OUTPUT and row.origin == R.INTRODUCED:
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


def added_score(score: float, out_rel: float, carried_rel: float) -> float:
    """The part of an output's score its inputs do not explain, in tolerance units: the
    share ``1 - carried/out`` of its relative error that is new here. Scale-free: an op that
    only scales what it was given (x / 0.03) adds nothing, even when the scaled output no
    longer fits under the absolute floor ``atol`` and its score crosses 1."""
    if not score or not out_rel:
        return 0.0
    if math.isinf(carried_rel):
        return 0.0
    if carried_rel <= 0:
        return score
    if math.isinf(out_rel):
        return score
    return score * max(0.0, 1.0 - carried_rel / out_rel)


def summarize_call(rows: list[R.RecordRow], forward: list[R.RecordRow] = ()) -> R.OpSummary | None:
    """Error this call pair introduces, in tolerance units: the largest added_score of its
    outputs against the largest rel L2 error of its carried inputs (produced ones, state
    carried over, and for a backward call the tensor records of its forward); parameters,
    changed arguments and external inputs are error entering here, so they count as nothing
    carried."""
    outputs = [r for r in rows if r.io == "out" and r.metrics is not None and r.metrics.evidence != "value"
               and not r.stale]
    if not outputs:
        return None
    carried = {e["slot"] for e in outputs[0].input_errors if is_carrier(e["source"], e["status"])}
    input_rel = max((rel_error(r) for r in rows if r.io == "in" and r.slot in carried), default=0.0)
    input_rel = max([input_rel] + [rel_error(r) for r in forward_carriers(forward)])
    # an explained output adds nothing: its inputs' accepted differences account for it
    added = [(0.0 if r.status == R.EXPLAINED else added_score(_score(r), rel_error(r), input_rel), _score(r), r)
             for r in outputs]
    introduced, _, worst = max(added, key=lambda item: (item[0], item[1]))
    out_rel = rel_error(worst)
    head = rows[0]
    return R.OpSummary(
        step=head.step,
        rank=head.rank,
        module=head.module,
        op=head.op,
        index=head.index,
        phase=head.phase,
        key=worst.key.rsplit("/", 1)[0],
        kind=head.kind,
        introduced=introduced,
        output_rel_l2=out_rel,
        input_rel_l2=input_rel,
        ratio=(out_rel / input_rel) if input_rel > 0 else None,
        diverged=any(r.status == R.DIVERGED for r in outputs),
        origin=worst.origin,
        source=worst.source,
        target=head.target,
    )


def _score(row: R.RecordRow) -> float:
    if row.score is None:
        return math.inf if row.status == R.DIVERGED else 0.0
    return row.score
