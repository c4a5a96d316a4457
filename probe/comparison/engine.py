"""Compare the records of one step file of A with one of B: the compare pipeline.

    StepInput --normalize--> calls --align--> call pairs and their Slots
        --measure--> Measurements --judge--> StepOutcome (statuses, origins)

Each stage is a module with one job; it takes the previous stage's struct (structs.py) and
returns its own, and no stage calls back into an earlier one. After measure no stage reads
a record column: what the judge needs of the records is in each Measurement (the
amplification recheck, recheck.py, is the one exception: it replays an op from the dumped
tensors). A normalize step (a function NormalizedStep -> NormalizedStep) or an align refiner
(a function (pairs, records_a, records_b) -> pairs) is added by listing it below.
docs/architecture.md draws the stages.
"""

from __future__ import annotations

from probe.comparison import normalize
from probe.comparison.align import align
from probe.comparison.foreach_pairing import pair_foreach
from probe.comparison.judge import judge
from probe.comparison.records import NameMapping
from probe.comparison.measure import measure, shared_autocast
from probe.comparison.structs import Carry, StepInput, StepOutcome
from probe.comparison.tolerances import Tolerances

#: the normalize steps, in the order they run on both sides' records and calls
NORMALIZE = (
    normalize.link_reduced_gradients,
    normalize.build_call_lists,
    normalize.split_foreach_calls,
    normalize.name_optimizer_targets,
)
#: what pairs the calls align.align_calls left alone, in order
ALIGN_REFINERS = (
    pair_foreach,
)


def compare_step(step_input: StepInput, tolerances: Tolerances, mapping: NameMapping | None = None,
                 carry: Carry | None = None, strict: bool = False, baseline: dict | None = None) -> StepOutcome:
    """Normalize, align, measure and judge one pair of step files.

    carry: what A's previous step file of the same rank handed on (its content keys and its
    accepted differences, StepOutcome.explained), None for the first one. strict: the fixed
    tolerance decides alone (rounding envelopes are information only). baseline: A's output
    key -> what a trusted second run differs from A by there (--baseline)."""
    carry = carry or Carry()
    normalized = normalize.normalize(step_input.records_a, step_input.records_b, mapping, NORMALIZE)
    aligned = align(normalized, ALIGN_REFINERS, step_input.step, step_input.rank)
    measured = measure(aligned, step_input.fetch_a, step_input.fetch_b, tolerances, carry.content_keys,
                       step_input.progress, shared_autocast(step_input.autocast_a, step_input.autocast_b))
    return judge(measured, carry.explained, (step_input.autocast_a, step_input.autocast_b), strict, baseline)
