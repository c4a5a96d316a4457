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
from probe.comparison.assemble import (
    DRIFTED, JUDGED, SETTLED, ChangeFold, FileFacts, KeptFile, Tally, finish, is_change, may_keep, unpaired_fails,
)
from probe.comparison.foreach_pairing import pair_foreach
from probe.comparison.judge import judge
from probe.comparison.measure import measure, shared_autocast
from probe.comparison.records import NameMapping, load_mapping, mapping_from_dict
from probe.comparison.ops import MOVE_OPS
from probe.comparison.result import INTRODUCED, MAX_DIVERGENT, add_summary
from probe.comparison.rounding import measured_envelopes
from probe.comparison.story import (
    apply_drift, differs_at_rounding, drift_facts, entering_cause, entering_reason, first_divergence, likely_cause,
    restated, settled_copies, shard_entries, story_rows, update_sizes, within_envelopes, DATA_PARTED,
)
from probe.comparison.structs import UNINITIALIZED_NOTE, Carry, StepInput, StepOutcome
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


def summarize_unit(outcomes, positions, infos, strict: bool, previous: dict, budget: int | None = None,
                   head: dict | None = None, plan_notes=(), cutoff: tuple | None = None) -> Partial:
    """The Partial of one unit: its outcomes (one per pair of step files, a sharded step's
    ranks together), their positions in the compare and steps_info entries. previous: rank ->
    update_sizes of the rank's previous compared step file (drift), updated here for the next
    unit of the rank; head: what the compare's first pair says of the runs (its notes, the
    settings they differ in, devices, whether they record one model); plan_notes: the sharded
    plan's notes; cutoff: Partial.cutoff of the compare so far, when known (rows past it are not
    kept). The rows are left as judged (shard_entries aside): the unit keeps copies for the
    figures drift would change."""
    partial = Partial(budget=budget, head=head, plan_notes=list(plan_notes), cutoff=cutoff)
    partial.entered = {step: entry for step, entry in shard_entries(outcomes).items()}
    for outcome, position, info in zip(outcomes, positions, infos):
        _summarize_pair(partial, outcome, position, dict(info), strict, previous)
    return partial


def _summarize_pair(partial: Partial, outcome, position: int, info: dict, strict: bool, previous: dict) -> None:
    rows = outcome.rows
    info["counts"] = counts = outcome.counts()
    diverged = [row for row in rows if row.status == R.DIVERGED]
    settled = settled_copies(diverged)  # as drift within rounding would restate them
    introduced, carried = drift_facts(rows, sizes := previous.get(outcome.rank))
    previous[outcome.rank] = update_sizes(rows, sizes)
    parted = DATA_PARTED in previous[outcome.rank]  # what follows from parted data has no envelope
    entering = next((row for row in rows if entering_reason(row) is not None), None)
    lonely = [row for row in rows if row.status in (R.ONLY_A, R.ONLY_B)]
    facts = FileFacts(
        position=position, info=info, diverged=len(diverged), differs=(differs := differs_at_rounding(rows)),
        differs_settled=differs or differs_at_rounding(settled),
        introduced=introduced, carried=carried, within=not diverged or within_envelopes(diverged) or (parted and carried),
        fails=unpaired_fails(counts, strict), story=story_rows(rows) if diverged else None,
        entering=entering, lonely=min(lonely, key=lambda row: row.order) if lonely else None,
        devices=dict(outcome.devices), precision=outcome.precision,
    )
    partial.files[position] = facts
    partial.evidence |= set(outcome.evidence)
    noted = [row.notes for row in rows if row.notes]
    for name, note in (("placement", R.PLACEMENT_NOTE), ("unwritten", UNINITIALIZED_NOTE)):
        partial.figures[name] += sum(1 for notes in noted if any(text.startswith(note) for text in notes))
    partial.figures["moves"] += len({row.key for row in lonely if row.op in MOVE_OPS and row.io == "out"})
    for row in R.sharded_only_rows(rows):  # their call-0 partners are among the paired rows
        if row.slot.startswith("param_grad."):
            partial.figures["reduced_a" if row.status == R.ONLY_A else "reduced_b"] += 1
    for row in rows:
        if row.kind == "module":
            partial.module_rows = True
        if row.kind == "api" and row.phase == "backward" and row.status in R.PAIRED:
            call = (row.module, row.op, row.index)
            partial.has_out[call] = partial.has_out.get(call, False) or row.io == "out"
    for number, row in enumerate(rows):
        if is_change(row):
            partial.changes.add(row, (info["step"], info["rank"], row.order, position, number), position)
    partial.divergent = sorted(partial.divergent + [((position, number), row) for number, row in enumerate(rows)
                                                     if row.status == R.DIVERGED])[:MAX_DIVERGENT]
    fold_outcome(partial, outcome, position, zip(diverged, settled), entering)
    if may_keep(partial.cutoff, KeptFile.key_of(position, bool(diverged))):  # made only where keep() would keep it
        partial.keep(KeptFile.of(position, bool(diverged), outcome))
    partial.prune()


def fold_outcome(partial, outcome, position: int, diverged, entering) -> None:
    """The outcome's rows and call summaries into the tallies: what no rule over every step
    file can change into ``common``; the divergent rows (diverged: each with its settled copy), the
    row where a low-precision error may have entered and their calls as each mode leaves them."""
    variants, touched = {JUDGED: {}, DRIFTED: {}, SETTLED: {}}, set()
    for row, settled in diverged:
        touched.add(id(row))
        variants[SETTLED][id(row)] = settled
        if row.origin == R.INTRODUCED:
            variants[DRIFTED][id(row)] = twin = restated(row)
            apply_drift(None, [twin])
    pending = entering is not None and entering.status != R.DIVERGED
    if pending:
        touched.add(id(entering))
    for number, row in enumerate(outcome.rows):
        ordinal = (position, number)
        if id(row) not in touched:
            partial.common.add_row(row, ordinal)
            continue
        for mode, tally in partial.modes.items():
            if not (mode == JUDGED and pending and row is entering):
                tally.add_row(variants[mode].get(id(row), row), ordinal)
    entering_at = (position, next((n for n, row in enumerate(outcome.rows) if row is entering), -1))
    for number, (rows, forward) in enumerate(outcome.calls):
        ordinal, judged = (position, number), R.summarize_call(rows, forward)
        if touched.isdisjoint(map(id, rows)) and touched.isdisjoint(map(id, forward)):
            if judged is not None:
                add_summary(partial.common.groups, judged, ordinal, position)
            continue
        for mode, tally in partial.modes.items():
            swap = variants[mode]
            summary = judged if swap.keys().isdisjoint(map(id, [*rows, *forward])) else R.summarize_call(
                [swap.get(id(r), r) for r in rows], [swap.get(id(r), r) for r in forward])
            if summary is None:
                continue
            if mode == JUDGED and pending and any(r is entering for r in rows):
                partial.pending[position] = (entering, entering_at, ordinal, summary,
                                             _entered_summary(entering, rows, forward))
            else:
                add_summary(tally.groups, summary, ordinal, position)
    if pending and position not in partial.pending:
        partial.pending[position] = (entering, entering_at, (position, -1), None, None)


def _entered_summary(row, rows, forward):
    """The summary of row's call had the story named it where a low-precision error entered."""
    twin = restated(row)
    entering_cause(twin, None, [twin])  # names it: origin introduced, the reason its cause
    return R.summarize_call([twin if r is row else r for r in rows], forward)


@dataclass
class Partial:
    """The summary of any number of units, merged in any order and grouping with the same
    result (assemble.finish): every figure is a count, a set, or the earliest or largest item
    by its place in the compare (an ordinal: position, then row or call number)."""

    budget: int | None = None  # records the report keeps rows of (None: every one)
    files: dict = field(default_factory=dict)  # position -> FileFacts
    common: Tally = field(default_factory=Tally)  # rows and calls no rule over every step file changes
    modes: dict = field(default_factory=lambda: {JUDGED: Tally(), DRIFTED: Tally(), SETTLED: Tally()})
    #: position -> (row, its ordinal, its call's ordinal, the call's summary as judged, as the entering
    #: rule names it):
    #: a row where a low-precision error may have entered, held out of modes[JUDGED]
    pending: dict = field(default_factory=dict)
    entered: dict = field(default_factory=dict)  # story.shard_entries of the units
    changes: ChangeFold = field(default_factory=ChangeFold)
    divergent: list = field(default_factory=list)  # [(ordinal, row)], the first MAX_DIVERGENT
    kept: list = field(default_factory=list)  # KeptFile, by key
    cutoff: tuple | None = None  # the smallest key left out: nothing after it is kept
    head: dict | None = None  # the first pair's notes, run differences, devices, same model
    plan_notes: list = field(default_factory=list)
    evidence: set = field(default_factory=set)
    figures: dict = field(default_factory=lambda: dict.fromkeys(("placement", "moves", "reduced_a", "reduced_b",
                                                                  "unwritten"), 0))
    has_out: dict = field(default_factory=dict)  # backward API call -> an output of it recorded
    module_rows: bool = False

    def keep(self, kept: KeptFile) -> None:
        """Keep a pair's rows while the rows kept stay within the budget, the pairs that
        diverged first, then by position; the first pair is always kept."""
        if not may_keep(self.cutoff, kept.key):
            return
        self.kept = sorted(self.kept + [kept], key=lambda item: item.key)
        while self.budget is not None and len(self.kept) > 1 and sum(len(k.rows) for k in self.kept) > self.budget:
            dropped = self.kept.pop()
            self.cutoff = dropped.key if self.cutoff is None else min(self.cutoff, dropped.key)

    def merge(self, other: "Partial") -> "Partial":
        self.budget = other.budget if self.budget is None else self.budget
        self.files.update(other.files)
        self.common.merge(other.common)
        for mode, tally in other.modes.items():
            self.modes[mode].merge(tally)
        self.pending.update(other.pending)
        self.entered.update(other.entered)
        self.changes.merge(other.changes)
        self.divergent = sorted(self.divergent + other.divergent, key=lambda item: item[0])[:MAX_DIVERGENT]
        if other.cutoff is not None:
            self.cutoff = other.cutoff if self.cutoff is None else min(self.cutoff, other.cutoff)
        self.kept = [kept for kept in self.kept if self.cutoff is None or kept.key < self.cutoff]
        for kept in other.kept:
            self.keep(kept)
        self.head = self.head if self.head is not None else other.head
        self.plan_notes = self.plan_notes or other.plan_notes
        self.evidence |= other.evidence
        for name, value in other.figures.items():
            self.figures[name] += value
        for call, out in other.has_out.items():
            self.has_out[call] = self.has_out.get(call, False) or out
        self.module_rows = self.module_rows or other.module_rows
        self.prune()
        return self

    def prune(self) -> None:
        """Drop what no story can read: the story rows of every pair but those story() can
        choose in the earliest step with a divergence (_story_files), the earliest pair with an
        introduced error and the earliest whose error drift does not explain (a later step's
        likely cause); the entering rows and pending summaries of pairs that cannot hold the
        first divergence (all but those chosen and the first failing for records without
        partner). What is kept does not grow with the ranks."""
        steps = [facts.info["step"] for facts in self.files.values() if facts.diverged]
        step = min(steps, default=None)
        failing = min((p for p, facts in self.files.items() if facts.fails), default=None)
        later = min((p for p, facts in self.files.items()
                     if facts.story and any(row.origin == INTRODUCED for row in facts.story)), default=None)
        fault = min((p for p, facts in self.files.items() if facts.story and not facts.carried), default=None)
        chosen = self._story_files(step) | {later, fault}
        for position, facts in self.files.items():
            first_here = position in chosen or position == failing
            if facts.story is not None and position not in chosen:
                facts.story = None
            if not first_here:
                facts.entering = None
                if position in self.pending:
                    row, ordinal, call, judged, _ = self.pending.pop(position)
                    self.modes[JUDGED].add_row(row, ordinal)
                    if judged is not None:
                        add_summary(self.modes[JUDGED].groups, judged, call, position)
            if position != failing:
                facts.lonely = None
        self.entered = {key: entry for key, entry in self.entered.items() if key == step}

    def _story_files(self, step) -> set:
        """The pairs of `step` whose story rows story() can choose: the one whose introduced
        cause comes first and the one whose first divergence comes first (by order, then rank),
        or every pair of the step where a shard differed on entry (story.shard_entries)."""
        here = {p: facts for p, facts in self.files.items() if facts.story and facts.info["step"] == step}
        if step in self.entered:
            return set(here)
        told = [(position, facts.info["rank"], first_divergence(facts.story)) for position, facts in here.items()]
        told = [(position, rank, first, likely_cause(self.files[position].story, first))
                for position, rank, first in told]
        chosen = {min(told, key=lambda t: (t[2].order, t[1]))[0]} if told else set()
        introducing = [t for t in told if t[3] is not None and t[3].origin == INTRODUCED]
        if introducing:
            chosen.add(min(introducing, key=lambda t: (t[3].order, t[1]))[0])
        return chosen

    def tally(self, mode: str, cause) -> Tally:
        """The figures of every pair as ``mode`` leaves the rows; cause: the likely cause, a
        pending row where the entering rule named it."""
        tally = Tally()
        tally.merge(self.common)
        tally.merge(self.modes[mode])
        if mode == JUDGED:
            for position, (row, ordinal, call, judged, entered) in self.pending.items():
                tally.add_row(row, ordinal)
                summary = entered if row is cause else judged
                if summary is not None:
                    add_summary(tally.groups, summary, call, position)
        return tally

    def rows(self) -> list:
        """Every row the summary holds (kept, divergent, story, entering, changes ...), once each."""
        found: dict = {}
        for kept in self.kept:
            for row in kept.rows:
                found[id(row)] = row
        for _, row in self.divergent:
            found[id(row)] = row
        for facts in self.files.values():
            for row in (facts.story or []) + [facts.entering, facts.lonely]:
                if row is not None:
                    found[id(row)] = row
        for row, _ in self.entered.values():
            found[id(row)] = row
        for row, *_ in self.pending.values():
            found[id(row)] = row
        for (_, first), best, _ in self.changes.groups.values():
            for entry in (first, best.first and best.first[2], best.best and best.best[2]):
                if entry is not None:
                    found[id(entry)] = entry
        return list(found.values())

    def kept_rows(self) -> tuple[list, list]:
        """(the kept rows in position order, their calls as (rows, forward) lists)."""
        rows, calls = [], []
        for kept in sorted(self.kept, key=lambda item: item.key[1]):
            rows += kept.rows
            calls += [([kept.rows[n] for n in numbers], [kept.rows[n] for n in forward]) for numbers, forward in kept.calls]
        return rows, calls


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
