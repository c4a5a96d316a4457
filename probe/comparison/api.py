"""Compare dump A (the reference) with dump B: the stages, step file pair by step file pair.

    load (load.py) -> for each pair of step files: compare_step -> assemble (assemble.py)
        -> CompareResult

and for one pair of step files (compare_step):

    StepInput --normalize--> calls --align--> call pairs and their Slots
        --measure--> Measurements --judge--> StepOutcome (statuses, origins)

Each stage is a module with one job; it takes the previous stage's struct (structs.py) and
returns its own, and no stage calls back into an earlier one. After measure no stage reads
a record column: what the judge needs of the records is in each Measurement (the float64
recheck, rounding.py, is the one exception: it replays an op from the dumped tensors). A
normalize step (a function NormalizedStep -> NormalizedStep) or an align refiner (a function
(pairs, records_a, records_b) -> pairs) is added by listing it below. docs/architecture.md
draws the stages.

The result is data. ``probe.compare`` (probe/compare_and_replay.py) adds the replay and the
renderers (to_text, to_json, write_csv, write_html). A is the reference (relative errors).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from typing import Callable, Iterable

from probe.comparison import KEEP_ROWS
from probe.comparison import load as L
from probe.comparison import normalize
from probe.comparison import result as R
from probe.comparison.align import align
from probe.comparison.assemble import finish
from probe.comparison.foreach_pairing import pair_foreach
from probe.comparison.judge import judge
from probe.comparison.measure import measure, shared_autocast
from probe.comparison.records import NameMapping, load_mapping, mapping_from_dict
from probe.comparison.rounding import measured_envelopes
from probe.comparison.structs import Carry, StepInput, StepOutcome
from probe.comparison.summary import Partial, summarize_unit
from probe.comparison.tolerances import Tolerances
from probe.errors import CompareError

DEFAULT_TOP = 10
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
                 carry: Carry | None = None) -> StepOutcome:
    """Normalize, align, measure and judge one pair of step files.

    tolerances: the table in force, and whether it decides alone (Tolerances.strict: rounding
    envelopes are information only); mapping: the renames of a mapping file; carry: what A's
    previous step file of the same rank handed on (its content keys and its accepted
    differences, StepOutcome.explained), None for the first one."""
    carry = carry or Carry()
    normalized = normalize.normalize(step_input.records_a, step_input.records_b, mapping, NORMALIZE)
    aligned = align(normalized, ALIGN_REFINERS, step_input.step, step_input.rank)
    measured = measure(aligned, step_input.fetch_a, step_input.fetch_b, tolerances, carry.content_keys,
                       step_input.progress, shared_autocast(step_input.autocast_a, step_input.autocast_b))
    return judge(measured, carry.explained, (step_input.autocast_a, step_input.autocast_b), tolerances.strict,
                 step_input.baseline)


def compare(
    a,
    b,
    *,
    rtol: float | None = None,
    atol: float | None = None,
    tol: Iterable[str] = (),
    tol_file: str | None = None,
    tolerances: dict | None = None,
    mapping=None,
    allow_missing: bool = False,
    steps: Iterable[int] | None = None,
    ranks: Iterable[int] | None = None,
    top: int = DEFAULT_TOP,
    strict: bool = False,
    progress: Callable[[float, int], None] | None = None,
    baseline=None,
    keep_rows: int | None = KEEP_ROWS,
    runner: Callable | None = None,
) -> R.CompareResult | None:
    """Compare dump A (the reference) with dump B (probe.compare documents the options).

    baseline: dump C, a second trusted run of A's kind (another thread count, another GPU of
    the same type, ``probe run --perturb``): each output's envelope is then measured, what
    C differs from A by there (rounding.measured_envelopes), and B - A is judged against it.
    keep_rows: how many records the result keeps rows of (None: all). runner(job, context,
    progress) -> Partial runs the units (default: run_units here, one after the other;
    probe/parallel spreads them over processes and machines); a runner whose ``finishes`` is
    False hands its Partial to another process and returns None, and so does compare."""
    if isinstance(top, bool) or not isinstance(top, int) or top < 0:
        raise CompareError(f"top must be an integer >= 0, found {top!r}")
    if keep_rows is not None and (isinstance(keep_rows, bool) or not isinstance(keep_rows, int) or keep_rows < 0):
        raise CompareError(f"keep_rows must be an integer >= 0 or None (every row), found {keep_rows!r}")
    measured = None
    if baseline is not None:
        trusted = compare(a, baseline, rtol=rtol, atol=atol, tol=tol, tol_file=tol_file, tolerances=tolerances,
                          mapping=mapping, allow_missing=allow_missing, steps=steps, ranks=ranks, top=top,
                          keep_rows=None)
        measured = measured_envelopes(trusted.rows)
    job = CompareJob(os.fspath(a), os.fspath(b), dict(rtol=rtol, atol=atol, per_dtype=tuple(tol), tol_file=tol_file,
                                                      overrides=tolerances, strict=strict),
                     mapping, allow_missing, None if steps is None else list(steps),
                     None if ranks is None else list(ranks), keep_rows, measured)
    context = Context.of(job)
    runner = runner or run_units
    finishes = getattr(runner, "finishes", True)  # False: another process finishes the compare (torchrun)
    notes = L.dump_notes(context.dump_a, context.dump_b) if finishes else []
    with L.few_full_collections():
        partial = runner(job, context, progress)
    if partial is None:
        return None
    return finish(partial, context.table, job.path_a, job.path_b, context.plan.missing, notes, top, strict,
                  os.fspath(baseline) if baseline is not None else None)


@dataclass
class CompareJob:
    """A compare as plain data: what every process of a compare builds its Context from."""

    path_a: str
    path_b: str
    tolerances: dict  # Tolerances.build's arguments
    mapping: object = None  # a YAML path, a dict or a NameMapping
    allow_missing: bool = False
    steps: list | None = None
    ranks: list | None = None
    keep_rows: int | None = KEEP_ROWS
    measured: dict | None = None  # (step, rank) -> the baseline's envelopes (--baseline)


@dataclass
class Context:
    """What a process needs to compare the units of a job: the dumps, the plan of units, the
    tolerance table and the name mapping."""

    job: CompareJob
    dump_a: object
    dump_b: object
    plan: L.UnitPlan
    table: Tolerances
    names: NameMapping | None

    @classmethod
    def of(cls, job: CompareJob) -> "Context":
        table = Tolerances.build(**job.tolerances)
        names = _mapping(job.mapping)
        dump_a, dump_b = L.load_dumps(job.path_a, job.path_b)
        plan = L.plan_units(dump_a, dump_b, job.path_a, job.path_b, job.allow_missing, job.steps, job.ranks)
        return cls(job, dump_a, dump_b, plan, table, names)


@dataclass
class Chain:
    """What a unit hands to the next unit of its chain (UnitPlan.chains), per rank of A:
    what A's step file carries (structs.Carry) and the sizes of its optimizer's updates (drift)."""

    carried: dict = field(default_factory=dict)
    updates: dict = field(default_factory=dict)


def run_units(job: CompareJob, context: Context, progress=None, numbers=None) -> Partial:
    """The units (their numbers, each chain's in order; default every one, chain by chain) one
    after the other in this process, merged. progress(fraction of the units done, tensor bytes
    read). What a chain hands on is dropped at its end, so it is held for one chain at a time."""
    chains = context.plan.chains()
    numbers = [number for found in chains for number in found] if numbers is None else list(numbers)
    ends = {found[-1] for found in chains}
    partial, chain, read = None, Chain(), [0]
    for done, number in enumerate(numbers):
        def report(records, count, unit_read, _done=done):
            if progress is not None:
                progress((_done + records / max(count, 1)) / len(numbers), read[0] + unit_read)

        # no Partial is made before the first unit's: the stages run in pipeline order
        unit_partial, unit_read = compare_unit(context, context.plan.units[number], chain, report,
                                               partial.cutoff if partial is not None else None)
        read[0] += unit_read
        partial = unit_partial if partial is None else partial.merge(unit_partial)
        if number in ends:
            chain = Chain()
    return partial if partial is not None else Partial(budget=job.keep_rows)


def compare_unit(context: Context, unit: list, chain: Chain, progress=None, cutoff=None) -> tuple[Partial, int]:
    """Compare one unit's pairs of step files and reduce them to a Partial; (it, the tensor
    bytes read). chain: what the previous unit of its chain handed on (updated here); cutoff:
    the smallest key of a pair whose rows the compare already left out (Partial.keep)."""
    job, plan = context.job, context.plan
    outcomes, infos, head, read = [], [], None, 0
    with contextlib.closing(plan.open(context.dump_a, context.dump_b, unit)) as step_files:
        for position, files in zip(unit, step_files):
            key_a, key_b = files.key_a, files.key_b
            if position == 0:
                head = L.run_head(files, context.names is not None)
            step_input = StepInput(files.records_a, files.records_b, files.fetch_a, files.fetch_b, key_a[0], key_a[1],
                                   files.attrs_a.get("autocast"), files.attrs_b.get("autocast"), progress,
                                   (job.measured or {}).get((key_a[0], key_a[1]), {}) if job.measured is not None
                                   else None)
            outcome = compare_step(step_input, context.table, context.names, chain.carried.get(key_a[1]))
            chain.carried[key_a[1]] = Carry(outcome.content_keys, outcome.explained)
            read += outcome.tensor_bytes
            outcomes.append(outcome)
            infos.append({"step": key_a[0], "rank": key_a[1], "step_b": key_b[0], "rank_b": key_b[1],
                          "file_a": context.dump_a.files[key_a], "file_b": context.dump_b.files[key_b],
                          "verdict": None, "counts": None})  # assemble.py decides, with strict
    plan_notes = plan.sharded.notes if plan.sharded is not None and unit[0] == 0 else ()
    partial = summarize_unit(outcomes, unit, infos, context.table.strict, chain.updates, job.keep_rows, head,
                             plan_notes, cutoff)
    return partial, read


def assemble(outcomes, steps_info, table, path_a, path_b, missing, notes, top, strict,
             devices_ab=("", ""), run_differences=(), same_model=None, baseline=None) -> R.CompareResult:
    """The CompareResult of every step file pair's outcome, in one process: each outcome its
    own unit (summarize_unit), merged and finished. run_differences: the recorded settings the
    runs differ in; same_model: the note that the dumps record different models, or None;
    baseline: the trusted third dump that measured the envelopes (--baseline), or None."""
    head = {"devices": devices_ab, "differences": list(run_differences), "same_model": same_model}
    partial = Partial()
    previous: dict = {}
    for position, (outcome, info) in enumerate(zip(outcomes, steps_info)):
        partial.merge(summarize_unit([outcome], [position], [info], strict, previous,
                                     head=head if position == 0 else None))
    return finish(partial, table, path_a, path_b, missing, notes, top, strict, baseline)


def _mapping(mapping) -> NameMapping | None:
    if mapping is None or isinstance(mapping, NameMapping):
        return mapping
    if isinstance(mapping, dict):
        return mapping_from_dict(mapping)
    return load_mapping(os.fspath(mapping))
