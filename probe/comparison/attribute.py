"""Attribute stage: what each call adds, and what one step file hands to the next.

From the judged rows of one step file pair: the summary of each call pair (summarize_call:
the error it adds, in tolerance units, which ranks the top ops), the accepted differences the
next step file of the rank may read again, and the records whose tensors sit on different
devices in the two runs. The first divergence and likely cause of a whole compare are
told from every step's outcome by assemble.py (story.story).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from probe.comparison import result as R
from probe.comparison.explain import accepted_difference, forward_carriers, is_carrier
from probe.comparison.judge import JudgedStep, param_name
from probe.comparison.provenance import content_key
from probe.comparison.sizes import rel_error, sci


@dataclass
class StepOutcome:
    step: int
    rank: int
    rows: list[R.RecordRow]
    summaries: list[R.OpSummary]
    evidence: set = field(default_factory=set)
    tensor_bytes: int = 0
    #: (device in A, device in B) -> records of paired tensors that live on different devices
    devices: dict = field(default_factory=dict)
    #: content_key -> key of A's records whose difference was accepted (R.EXPLAINED outputs):
    #: the next step reads them again (a parameter the optimizer updated) and accepts them too
    explained: dict = field(default_factory=dict)

    @property
    def diverged(self) -> bool:
        return any(row.status == R.DIVERGED for row in self.rows)

    def counts(self) -> dict:
        return count_rows(self.rows)


def count_rows(rows) -> dict:
    """matched: paired records; diverged: those beyond tolerance; changed: those within
    tolerance whose checksums differ (size unknown); only_a/only_b: without partner."""
    counts = {"matched": 0, "only_a": 0, "only_b": 0, "diverged": 0, "changed": 0, "explained": 0}
    for row in rows:
        if row.status in R.PAIRED:
            counts["matched"] += 1
            if row.status != R.MATCH:
                counts[row.status] += 1
        else:
            counts[row.status] += 1
    return counts


def attribute(judged: JudgedStep) -> StepOutcome:
    measured = judged.measured
    aligned = measured.aligned
    summaries = [summary for summary in (summarize_call(rows, forward) for rows, forward in judged.calls)
                 if summary is not None]
    return StepOutcome(aligned.step, aligned.rank, judged.rows, summaries, measured.evidence, measured.bytes_read,
                       devices=_moved(aligned), explained=_explained(judged))


def _explained(judged: JudgedStep) -> dict:
    """content_key -> key of A's records whose difference was accepted, and ("param", name)
    -> the accepted gradient the optimizer updated that parameter from."""
    aligned = judged.measured.aligned
    cols_a = aligned.records_a.columns
    explained: dict = {}
    diverged_params = {param_name(cols_a, row, None, {}) for row in judged.rows
                       if row.slot.startswith("param.") and row.status == R.DIVERGED}
    for row, row_a, _ in (item for call_rows in aligned.per_pair for item in call_rows):
        if row.io == "out" and row_a is not None and accepted_difference(row):
            key = content_key(cols_a, row_a)
            if key is not None:
                explained[key] = row.key
            if row.slot.startswith("param_grad."):
                name = f"{row.module}.{row.slot[len('param_grad.'):]}" if row.module else row.slot[len("param_grad."):]
                if name not in diverged_params:
                    # the next step's parameter was updated from it by the optimizer
                    explained[("param", name)] = f"{row.key}, rel L2 {sci(row.metrics.rel_l2)}"
    return explained


def _moved(aligned) -> dict:
    """(device in A, device in B) -> paired tensor records that live on different devices."""
    moved: dict = {}
    dev_a, dev_b = aligned.records_a.columns["device"], aligned.records_b.columns["device"]
    for _, row_a, row_b, _ in aligned.paired:
        if dev_a[row_a] and dev_b[row_b] and dev_a[row_a] != dev_b[row_b]:
            moved[(dev_a[row_a], dev_b[row_b])] = moved.get((dev_a[row_a], dev_b[row_b]), 0) + 1
    return moved


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
