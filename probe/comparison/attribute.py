"""Attribute stage: what each call adds, and what one step file hands to the next.

From the judged rows of one step file pair: the summary of each call pair (story.py: the
error it adds, in tolerance units, which ranks the top ops), the accepted differences the
next step file of the rank may read again, and the records whose tensors sit on different
devices in the two runs. The first divergence and likely cause of a whole compare are
told from every step's outcome by assemble.py (story.story).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from probe.comparison import result as R
from probe.comparison.explain import accepted_difference
from probe.comparison.judge import JudgedStep, param_name
from probe.comparison.provenance import content_key
from probe.comparison.story import summarize_call
from probe.comparison.verdict import sci


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
