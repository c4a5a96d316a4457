"""A unit's outcomes reduced to what the report needs (``summarize_unit``), and that summary
merged with others' (``Partial``), in any order and grouping with the same result.

api.py compares a unit's step files; this module keeps of them the counts, the op summaries
folded into top-op groups, the first divergent rows, the story candidates and the rows the
report keeps (assemble.py's docstring lists it all); assemble.finish runs the rules over every
step file on the merged Partial. Merging stays as cheap at the thousandth unit as at the first:
``Partial.prune`` visits only the step files that still hold rows (``Partial.live``), and the
earliest divergent step and failing pair are kept as running minima.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from probe.comparison import result as R
from probe.comparison.assemble import (
    DRIFTED, JUDGED, SETTLED, ChangeFold, FileFacts, KeptFile, Tally, is_change, may_keep, unpaired_fails,
)
from probe.comparison.ops import MOVE_OPS
from probe.comparison.result import INTRODUCED, MAX_DIVERGENT, add_summary
from probe.comparison.story import (
    apply_drift, differs_at_rounding, drift_facts, entering_cause, entering_reason, first_divergence, likely_cause,
    restated, settled_copies, shard_entries, story_rows, update_sizes, within_envelopes, DATA_PARTED,
)
from probe.comparison.structs import UNINITIALIZED_NOTE


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
    partial.add_file(facts)
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
    #: the positions whose facts may still hold story, entering or lonely rows or a pending row:
    #: the files prune() visits (the others were pruned to their counts and flags)
    live: set = field(default_factory=set)
    first_step: int | None = None  # the earliest step of a pair with divergent records
    first_failing: int | None = None  # the earliest pair its records without partner fail

    def add_file(self, facts: FileFacts) -> None:
        self.files[facts.position] = facts
        self.live.add(facts.position)
        if facts.diverged:
            self.first_step = _least(self.first_step, facts.info["step"])
        if facts.fails:
            self.first_failing = _least(self.first_failing, facts.position)

    def keep(self, kept: KeptFile) -> None:
        """Keep a pair's rows while the rows kept stay within the budget, the pairs that
        diverged first, then by position; the first pair is always kept."""
        if not may_keep(self.cutoff, kept.key):
            return
        self.kept, self.cutoff = within_budget(self.kept + [kept], self.budget, self.cutoff)

    def kept_sizes(self) -> list:
        """(key, rows) of each pair whose rows this summary keeps: all another process needs to
        tell which of them the merged summary will keep (kept_cutoff)."""
        return [(kept.key, len(kept.rows)) for kept in self.kept]

    def leave_out_from(self, cutoff: tuple | None) -> None:
        """Drop the kept pairs from key cutoff on (kept_cutoff: the merged summary would drop
        them), so that a process hands over only rows the report can keep."""
        if cutoff is not None:
            self.kept = [kept for kept in self.kept if kept.key < cutoff]
            self.cutoff = _least(self.cutoff, cutoff)

    def merge(self, other: "Partial") -> "Partial":
        self.budget = other.budget if self.budget is None else self.budget
        self.files.update(other.files)
        self.live |= other.live
        self.first_step = _least(self.first_step, other.first_step)
        self.first_failing = _least(self.first_failing, other.first_failing)
        self.common.merge(other.common)
        for mode, tally in other.modes.items():
            self.modes[mode].merge(tally)
        self.pending.update(other.pending)
        self.entered.update(other.entered)
        self.changes.merge(other.changes)
        self.divergent = sorted(self.divergent + other.divergent, key=lambda item: item[0])[:MAX_DIVERGENT]
        self.leave_out_from(_least(self.cutoff, other.cutoff))
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
        partner). What is kept does not grow with the ranks, and neither does the work: only
        the live files are visited; the others hold nothing a later merge could choose."""
        step, failing = self.first_step, self.first_failing
        live = [(position, self.files[position]) for position in sorted(self.live)]
        later = min((p for p, facts in live if facts.story and any(row.origin == INTRODUCED for row in facts.story)),
                    default=None)
        fault = min((p for p, facts in live if facts.story and not facts.carried), default=None)
        chosen = self._story_files(step, live) | {later, fault}
        for position, facts in live:
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
            if facts.story is None and facts.entering is None and facts.lonely is None and position not in self.pending:
                self.live.discard(position)
        self.entered = {key: entry for key, entry in self.entered.items() if key == step}

    def _story_files(self, step, live) -> set:
        """The pairs of `step` whose story rows story() can choose: the one whose introduced
        cause comes first and the one whose first divergence comes first (by order, then rank),
        or every pair of the step where a shard differed on entry (story.shard_entries)."""
        here = {p: facts for p, facts in live if facts.story and facts.info["step"] == step}
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


class _Sized:
    """A kept pair as kept_sizes() tells it: its key and how many rows it holds."""

    def __init__(self, key: tuple, rows: int):
        self.key, self.rows = key, range(rows)


def within_budget(kept: list, budget: int | None, cutoff: tuple | None) -> tuple[list, tuple | None]:
    """Partial.keep's rule over kept pairs (anything with a key and rows): by key, the last
    dropped while more than one is left and their rows exceed budget; (those kept, the smallest
    key left out)."""
    kept = sorted(kept, key=lambda item: item.key)
    while budget is not None and len(kept) > 1 and sum(len(k.rows) for k in kept) > budget:
        cutoff = _least(cutoff, kept.pop().key)
    return kept, cutoff


def kept_cutoff(sizes: list, budget: int | None, *cutoffs) -> tuple | None:
    """The smallest key the merge of summaries leaves out, from their kept_sizes() (all of them
    together) and the keys they left out (Partial.cutoff: each a key or None)."""
    cutoff = min((found for found in cutoffs if found is not None), default=None)
    _, cutoff = within_budget([_Sized(key, rows) for key, rows in sizes if may_keep(cutoff, key)], budget, cutoff)
    return cutoff


def _least(known, other):
    """The smaller of two running minima, either None (nothing seen yet)."""
    return other if known is None else known if other is None else min(known, other)
