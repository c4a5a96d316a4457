"""Attribute stage: what each call adds, and what one step file hands to the next.

From the judged rows of one step file pair: the summary of each call pair (summarize_call:
the error it adds, in tolerance units, which ranks the top ops), made after every verdict
of the judge stage, so a summary says what its rows say. The first divergence and likely
cause of a whole compare are told from every step's outcome by assemble.py (story).
"""

from __future__ import annotations

import math

from probe.comparison import result as R
from probe.comparison.structs import JudgedStep, StepOutcome, forward_carriers, is_carrier, rel_error


def attribute(judged: JudgedStep) -> StepOutcome:
    measured = judged.measured
    aligned = measured.aligned
    summaries = [summary for summary in (summarize_call(rows, forward) for rows, forward in judged.calls)
                 if summary is not None]
    return StepOutcome(aligned.step, aligned.rank, judged.rows, summaries, measured.evidence, measured.bytes_read,
                       devices=measured.devices, explained=judged.explained, precision=judged.precision,
                       content_keys=measured.content_keys)


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
