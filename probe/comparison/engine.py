"""Compare the records of one step file of A with one of B: the compare pipeline.

    records A, B --normalize--> calls --align--> call pairs and record rows
        --measure--> metrics --judge--> statuses, origins --attribute--> StepOutcome

Each stage is a module with one job; it takes the previous stage's output and returns its
own, and no stage calls back into an earlier one. A normalize step (a function
NormalizedStep -> NormalizedStep) or an align refiner (a function (pairs, records_a,
records_b) -> pairs) is added by listing it below. docs/architecture.md draws the stages.
"""

from __future__ import annotations

from typing import Callable

from probe.comparison import normalize
from probe.comparison.attribute import attribute
from probe.comparison.foreach_pairing import pair_foreach
from probe.comparison.judge import judge
from probe.comparison.mapping import NameMapping
from probe.comparison.measure import Fetch, measure
from probe.comparison.pairing import align
from probe.comparison.records import Records
from probe.comparison.reduced_grads import link_reduced_gradients
from probe.comparison.result import StepOutcome
from probe.comparison.tolerances import Tolerances

#: the normalize steps, in the order they run on both sides' records and calls
NORMALIZE = (
    link_reduced_gradients,
    normalize.build_call_lists,
    normalize.split_foreach_calls,
    normalize.name_optimizer_targets,
)
#: what pairs the calls align.align_calls left alone, in order
ALIGN_REFINERS = (
    pair_foreach,
)


def compare_step(
    records_a: Records,
    records_b: Records,
    fetch_a: Fetch | None,
    fetch_b: Fetch | None,
    tolerances: Tolerances,
    mapping: NameMapping | None = None,
    step: int = 0,
    rank: int = 0,
    progress: Callable[[int, int, int], None] | None = None,
    previous: set | None = None,
    previous_explained: dict | None = None,
    autocast: tuple | None = None,
    strict: bool = False,
    baseline: dict | None = None,
) -> StepOutcome:
    """Normalize, align, measure, judge and attribute one pair of step files.

    progress(done_records, total_records, tensor_bytes_read) is called as records are measured.
    previous: content_keys() of A's previous step file of the same rank, so that state
    carried over from it (optimizer state, parameters) is told from new external inputs.
    previous_explained: StepOutcome.explained of that step file: a record holding the same
    values as an accepted difference there (a parameter AdamW updated from rounding noise)
    carries that accepted difference.
    autocast: (A's first seq under autocast, its dtype) when both runs ran under autocast in it.
    strict: the fixed tolerance decides alone (rounding envelopes are information only).
    baseline: A's output key -> what a trusted second run differs from A by there (--baseline).
    """
    normalized = normalize.normalize(records_a, records_b, mapping, NORMALIZE)
    aligned = align(normalized, ALIGN_REFINERS, step, rank)
    measured = measure(aligned, fetch_a, fetch_b, tolerances, previous, progress, autocast)
    judged = judge(measured, previous_explained, strict, baseline)
    return attribute(judged)
