"""Result stage: every step file pair's outcome put together into one CompareResult (data only).

A compare is a map over units (a pair of step files; a sharded step's pairs, every rank of
its group) into small mergeable summaries, reduced into one result (docs/architecture.md,
"Comparing step files in parallel"):

* ``summarize_unit``: one unit's outcomes -> a ``Partial`` (summary.py): the rules that need
  only the unit run on its rows (a shard that differs on entry on one rank; each pair's
  story candidates, drift facts and where a low-precision error may have entered), and the
  rows are reduced to what the report needs: counts, the op summaries folded into top-op
  groups, changed parameters, the first divergent rows, the notes' figures. A unit whose
  rows the report keeps (``Partial.budget``) hands them on whole.
* ``Partial.merge``: in any order, any grouping; the result does not depend on it.
* ``finish``: the rules over every step file (story.py: the first divergence and likely
  cause, drift, drift within rounding, where a low-precision error entered) decide from the
  facts, and the summaries of the outcome they chose are taken: a unit folds its figures as
  judged, as drift would restate them and as drift within rounding would explain them
  (``JUDGED``, ``DRIFTED``, ``SETTLED``), so that no row needs to be kept for the rules.

Rounding only
-------------

Is the whole gap between the runs what rounding alone makes?

Every output the judge gave a rounding envelope (rounding.py) says how its measured
difference compares with what rounding alone can make it differ by (``gap``: seen over
expected). A compare that passes while the runs differ at all differs by rounding only, and
its headline says so with the largest gap; the outputs judged rounding or uncertain are
counted, and each uncertain one is named in a note with the config line that decides it.
Torch-free.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from probe.comparison import result as R
from probe.comparison.envelope import EnvelopeFold
from probe.comparison.ops import MOVE_OPS
from probe.comparison.metrics import Best
from probe.comparison.result import PrecisionTally, RecordRow, StepOutcome, merge_groups, rank_groups
from probe.comparison.sketch import sketch_note
from probe.comparison.story import (
    apply_drift, drifted, drifting_ranks, entering_cause, find_drift, settle_row, settled_note, settles, story,
)
from probe.comparison.structs import sci

_EVIDENCE_ORDER = ("statistics", "checksum", "tensor")  # weakest first


def unpaired_fails(counts: dict, strict: bool) -> bool:
    """Unmatched records fail a step with --strict, or when nothing at all could be paired
    (an empty or unrelated dump must never pass)."""
    unmatched = counts["only_a"] + counts["only_b"]
    # nothing paired is never a pass: two empty dumps (a scope typo) compared nothing at all
    return counts["matched"] == 0 or (bool(unmatched) and strict)


def step_verdict(counts: dict, strict: bool) -> str:
    return "diverged" if counts["diverged"] or unpaired_fails(counts, strict) else "pass"


# ---------------------------------------------------------------------------- the mergeable summary

#: how a rule over every step file may leave the rows (assemble.finish): as the judge left
#: them, restated by drift (no op introduced an error), or explained by drift within rounding
JUDGED, DRIFTED, SETTLED = "judged", "drifted", "settled"
#: the uncertain outputs a note names
NAMED = 3


@dataclass
class Tally:
    """What one way of leaving the rows (JUDGED, DRIFTED, SETTLED) makes of them: the top-op
    groups, the explained outputs and the rounding envelopes."""

    groups: dict = field(default_factory=dict)  # add_summary's {group key: OpGroup}
    explained: int = 0
    worst_explained: Best = field(default_factory=Best)
    envelope: EnvelopeFold = field(default_factory=EnvelopeFold)

    def add_row(self, row: RecordRow, ordinal: tuple) -> None:
        if row.status == R.EXPLAINED and row.io == "out":
            self.explained += 1
            self.worst_explained.offer(row.metrics.rel_l2 if row.metrics else 0.0, ordinal, row)
        self.envelope.add(row, ordinal)

    def merge(self, other: "Tally") -> None:
        merge_groups(self.groups, other.groups)
        self.explained += other.explained
        self.worst_explained.merge(other.worst_explained)
        self.envelope.merge(other.envelope)


# ---------------------------------------------------------------------------- one unit


@dataclass(slots=True)
class FileFacts:
    """What the rules over every step file need of one compared pair of step files. One is held
    per step file until the report is made: slots, not a dict (4.1 to 3.3 KB each)."""

    position: int  # its place in the compare's pairs, (step, rank) order
    info: dict  # its steps_info entry: step, rank, step_b, rank_b, file_a, file_b, verdict, counts
    diverged: int = 0  # its divergent records
    differs: bool = False  # story.differs_at_rounding, as judged and once drift within rounding settled
    differs_settled: bool = False
    introduced: bool = False  # story.drift_facts
    carried: bool = False
    within: bool = True  # every divergent record within its envelope (story.within_envelopes)
    fails: bool = False  # its records without partner fail it
    story: list | None = None  # the rows story() reads (None: pruned, or none diverged)
    entering: RecordRow | None = None  # the first row where a low-precision error may have entered
    lonely: RecordRow | None = None  # its first record without partner
    devices: dict = field(default_factory=dict)  # StepOutcome.devices
    precision: PrecisionTally | None = None  # StepOutcome.precision


@dataclass
class KeptFile:
    """A pair of step files whose rows the report keeps: its rows and calls (row numbers)."""

    key: tuple  # (passed, position): the pairs that diverged are kept first
    rows: list
    calls: list  # [(row numbers of the call, row numbers of its forward)]

    @classmethod
    def of(cls, position: int, diverged: bool, outcome: StepOutcome) -> "KeptFile":
        number = {id(row): index for index, row in enumerate(outcome.rows)}
        calls = [([number[id(r)] for r in rows], [number[id(r)] for r in forward]) for rows, forward in outcome.calls]
        return cls(cls.key_of(position, diverged), outcome.rows, calls)

    @staticmethod
    def key_of(position: int, diverged: bool) -> tuple:
        return not diverged, position


def may_keep(cutoff: tuple | None, key: tuple) -> bool:
    """Whether the rows of a pair with this KeptFile key may still be kept, the smallest key a
    compare left out being cutoff (None: none yet): nothing after it is."""
    return cutoff is None or key <= cutoff


# ---------------------------------------------------------------------------- changes


@dataclass
class Change:
    """One changed parameter or argument, over every step file where it differs."""

    kind: str  # PARAM | ARGUMENT
    key: str
    module: str
    op: str
    index: int
    phase: str
    slot: str
    source: str
    reason: str  # why its worst occurrence diverged
    value_a: str | None = None  # arguments: the values
    value_b: str | None = None
    rel_l2: float | None = None  # parameters: the worst rel L2
    score: float | None = None
    worst: tuple[int, int] = (0, 0)  # (step, rank) of the worst occurrence
    where: list[tuple[int, int]] = field(default_factory=list)
    size_unknown: bool = False  # parameters: the checksum differs while the statistics agree

    def to_dict(self) -> dict:
        return R.json_safe({
            "kind": self.kind, "key": self.key, "module": self.module, "op": self.op, "index": self.index,
            "phase": self.phase, "slot": self.slot, "source": self.source, "reason": self.reason,
            "value_a": self.value_a, "value_b": self.value_b, "rel_l2": self.rel_l2, "score": self.score,
            "worst": {"step": self.worst[0], "rank": self.worst[1]}, "occurrences": len(self.where),
            "where": R.where_dicts(self.where), "where_text": R.where_text(self.where),
            "size_unknown": self.size_unknown,
        })


def is_change(row: RecordRow) -> bool:
    """A changed argument, or a parameter by its own record (an API input holding the same
    weight would repeat it)."""
    if row.status != R.DIVERGED:
        return False
    return row.divergence == R.ARGUMENT or (row.divergence == R.PARAM and row.slot.startswith("param."))


def group_changes(rows) -> list[Change]:
    """Changed parameters and arguments, each once, in order of first occurrence."""
    fold = ChangeFold()
    places: dict = {}  # (step, rank) -> its number, in the order met
    for number, row in enumerate(rows):
        if is_change(row):
            fold.add(row, (row.step, row.rank, row.order, number), places.setdefault((row.step, row.rank), len(places)))
    return fold.changes(list(places))


def _worse_key(row) -> tuple:
    """Which occurrence of a change is worse: a sized difference beats one of unknown size (its
    rel L2 is only a lower bound), then the larger rel L2 (NaN the smallest)."""
    rel = row.metrics.rel_l2
    return (not row.size_unknown, -math.inf if math.isnan(rel) else rel)


@dataclass
class ChangeFold:
    """group_changes, folded step file by step file: {group: [first (ordinal, row), Best of the
    later occurrences by _worse, bitset of places]}."""

    groups: dict = field(default_factory=dict)

    def add(self, row, ordinal: tuple, place: int) -> None:
        m = row.metrics
        if row.divergence == R.ARGUMENT:
            group = (row.divergence, row.key, m.value_a if m else None, m.value_b if m else None)
        else:
            group = (row.divergence, row.key)
        entry = self.groups.setdefault(group, [None, Best(), 0])
        if entry[0] is None or ordinal < entry[0][0]:
            entry[0] = (ordinal, row)
        if m is not None:
            entry[1].offer(_worse_key(row), ordinal, row)
        entry[2] |= 1 << place

    def merge(self, other: "ChangeFold") -> None:
        for group, (first, best, bits) in other.groups.items():
            entry = self.groups.setdefault(group, [None, Best(), 0])
            if entry[0] is None or first[0] < entry[0][0]:
                entry[0] = first
            entry[1].merge(best)
            entry[2] |= bits

    def changes(self, pairs) -> list[Change]:
        """Each group's Change, in order of first occurrence; pairs: place -> (step, rank)."""
        found = []
        for (_, first), best, bits in sorted(self.groups.values(), key=lambda entry: entry[0][0]):
            m = first.metrics
            worst = first
            rel_l2 = m.rel_l2 if m and m.evidence != "value" else None
            # the first occurrence sets the worst; a later one replaces it where _worse_key is larger
            if rel_l2 is not None and best.item is not None and _worse_key(best.item) > _worse_key(first):
                worst = best.item
                rel_l2 = worst.metrics.rel_l2
            found.append(Change(
                kind=first.divergence, key=first.key, module=first.module, op=first.op, index=first.index,
                phase=first.phase, slot=first.slot, source=first.source, reason="; ".join(worst.reasons),
                value_a=m.value_a if m else None, value_b=m.value_b if m else None, rel_l2=rel_l2,
                score=worst.score, worst=(worst.step, worst.rank), where=R.where_pairs(bits, pairs),
                size_unknown=worst.size_unknown,
            ))
        return found


# ---------------------------------------------------------------------------- every unit


@dataclass
class _View:
    """What story() reads of one pair of step files."""

    step: int
    rank: int
    rows: list
    diverged: bool = True


def finish(partial, table, path_a, path_b, missing, notes, top, strict, baseline=None) -> R.CompareResult:
    """The CompareResult of every unit's Partial merged: the rules over every step file run
    here, on the facts the units kept, before the summaries are taken."""
    files = [partial.files[position] for position in sorted(partial.files)]
    steps_info = [facts.info for facts in files]
    where = {(facts.info["step"], facts.info["rank"]): facts for facts in files}
    head = partial.head or {}
    notes = list(notes) + list(head.get("notes", ())) + list(partial.plan_notes)
    drift_files = [{"step": f.info["step"], "rank": f.info["rank"], "differs": f.differs,
                    "introduced": f.introduced, "carried": f.carried} for f in files]
    drift_ranks = drifting_ranks(drift_files)  # what drift explains there is not the story
    first, cause = story([_View(f.info["step"], f.info["rank"], drifted(f.story) if f.info["rank"] in drift_ranks
                                else f.story) for f in files if f.story],
                         {step: entry for step, entry in partial.entered.items()})
    told_first = first
    drifting = find_drift(first, "diverged", drift_files)
    # drift that stays within every op's rounding envelope is rounding: settled before any
    # verdict is counted; then nothing diverges, and there is no story
    diverged_rows = sum(f.diverged for f in files)
    mode = JUDGED
    if settles(drifting, bool(diverged_rows) and all(f.within for f in files), strict):
        mode, first, cause = SETTLED, None, None
        for facts in files:
            facts.info["counts"] = _settled_counts(facts.info["counts"])
        for row in partial.rows():
            if row.status == R.DIVERGED:
                settle_row(row)
        for facts in drift_files:
            facts["differs"] = where[(facts["step"], facts["rank"])].differs_settled
    for info in steps_info:
        info["verdict"] = step_verdict(info["counts"], strict)
    counts = _total_counts([info["counts"] for info in steps_info])
    devices_ab = head.get("devices", ("", ""))
    placed: dict = {}  # (device in A, device in B) -> paired tensor records, per record
    for facts in files:
        for pair, count in facts.devices.items():
            placed[pair] = placed.get(pair, 0) + count
    if devices_ab[0] == devices_ab[1] and placed:
        devices_ab = max(placed, key=placed.get)  # the root attributes agree; the records do not
    placement, moves = partial.figures["placement"], partial.figures["moves"]
    if devices_ab[0] != devices_ab[1] or placement or moves or placed:
        notes.append(device_note(*devices_ab, placement, moves))
    failing = next((f for f in files if f.fails), None)
    if first is None and failing is not None:
        first = failing.lonely
        failed = failing.info["counts"]
        if failed["matched"] == 0 and first is None:
            notes.append(
                f"step {failing.info['step']} rank {failing.info['rank']}: nothing was compared, both step files "
                "hold no records (did scope or list select nothing?); that is not a pass"
            )
        elif failed["matched"] == 0:
            notes.append(
                f"step {failing.info['step']} rank {failing.info['rank']}: no record could be paired "
                f"({failed['only_a']} in A, {failed['only_b']} in B): the dumps do not describe the same run"
            )
    used = partial.evidence
    # the weakest evidence any pair used; "none" when no tensor pair was measured at all
    evidence = next((name for name in _EVIDENCE_ORDER if name in used), "none" if not used - {"value"} else "statistics")
    if "sketch" in used:
        notes.append(sketch_note("tensor" in used))
    elif evidence == "statistics":
        notes.append("statistics only: errors are lower bounds from min/max/mean/norm; dump with task 'tensor' for full evidence")
    elif evidence == "checksum":
        notes.append("checksums tell bit-equal or not; magnitudes are lower bounds from the statistics")
    unmatched = counts["only_a"] + counts["only_b"]
    if unmatched and not strict:
        sharded = (f"; {counts['sharded_only']} of them only a sharded run makes (collectives, reduced "
                   "gradient shards)") if counts["sharded_only"] else ""
        notes.append(f"{unmatched} records have no partner (only_a {counts['only_a']}, only_b {counts['only_b']})"
                     f"{sharded}; they are not compared")
    if partial.figures["unwritten"]:
        notes.append(f"{partial.figures['unwritten']} records hold memory nothing had written yet (an empty-family "
                     "allocation, or a view of one, read before its first write); they are not compared")
    reduced = reduced_gradients_note(partial.figures["reduced_a"], partial.figures["reduced_b"])
    if reduced:
        notes.append(reduced)
    verdict = "diverged" if counts["diverged"] > 0 or failing is not None else "pass"
    # the story's first divergence is a divergent row, so the verdict was "diverged" above too
    drift = drifting if first is told_first else find_drift(first, verdict, drift_files)
    if drift is not None:  # no op introduced an error: the runs part through accumulated rounding
        apply_drift(drift, partial.rows())
        cause = None
        mode = DRIFTED if mode == JUDGED else mode
    else:
        entering = where[(first.step, first.rank)].entering if first is not None else None
        cause = entering_cause(first, cause, [entering] if entering is not None else [])
    tally = partial.tally(mode, cause)
    explained = tally.worst_explained.item
    if explained is not None:
        notes.append(
            f"{tally.explained} outputs are beyond their own dtype's tolerance but explained by accepted differences "
            f"of their inputs (amplified rounding; not divergences); the largest: {explained.key} at step "
            f"{explained.step} rank {explained.rank}, rel L2 {sci(explained.metrics.rel_l2)}: {explained.cause}")
    unranked_at = len(notes)  # the note on backward calls no record measures goes here
    tolerances = {"reference": "a", "rule": "||a-b|| <= rtol*||a|| + atol*sqrt(n)", "by_dtype": table.to_dict()}
    changes = [] if mode == SETTLED else partial.changes.changes(_pairs(files))
    precision = PrecisionTally.total(facts.precision for facts in files)
    notes.extend(precision.notes())
    # the last rule has run: the summaries say what the rows say
    top_ops = rank_groups(tally.groups, _pairs(files), top)
    unranked = _unranked_backward(partial.has_out, partial.module_rows, tally.groups)
    if unranked:
        notes.insert(unranked_at, unranked)
    if drift is not None:
        notes.insert(0, drift["text"])
    if mode == SETTLED:
        notes.insert(0, settled_note(drifting, diverged_rows))
    if head.get("same_model") is not None:
        notes.insert(0, head["same_model"])
    envelope = tally.envelope.summary(notes, strict, baseline)
    kept = partial.kept_rows()
    if partial.budget != 0 and len(kept[0]) < counts["matched"] + unmatched:  # 0: no table asked for rows
        notes.append(_kept_note(partial, len(files), counts["matched"] + unmatched))
    divergent = [] if mode == SETTLED else [row for _, row in partial.divergent]
    return R.CompareResult(
        verdict=verdict,
        first_divergence=first,
        likely_cause=cause,
        counts=counts,
        rows=kept[0],
        top_ops=top_ops,
        tolerances=tolerances,
        evidence=evidence,
        steps=steps_info,
        path_a=path_a,
        path_b=path_b,
        missing=missing,
        notes=notes,
        changes=changes,
        op_summaries=[summary for rows, forward in kept[1] if (summary := R.summarize_call(rows, forward)) is not None],
        run_differences=list(head.get("differences", ())) + precision.differences(),
        drift=drift,
        envelope=envelope,
        divergent=divergent,
        divergences_total=0 if mode == SETTLED else diverged_rows,
    )


def _pairs(files) -> list:
    """place (a pair's position) -> (step, rank), for the ``where`` of top ops and changes."""
    pairs = [None] * (max((f.position for f in files), default=-1) + 1)
    for facts in files:
        pairs[facts.position] = (facts.info["step"], facts.info["rank"])
    return pairs


def _settled_counts(counts: dict) -> dict:
    """A pair's counts once drift within rounding explained its divergent records."""
    settled = dict(counts)
    settled["explained"] += settled["diverged"]
    settled["diverged"] = 0
    return settled


def _total_counts(per_file: list) -> dict:
    total = {"matched": 0, "only_a": 0, "only_b": 0, "diverged": 0, "changed": 0, "explained": 0, "sharded_only": 0}
    for counts in per_file:
        for name in total:
            total[name] += counts[name]
    return total


def _kept_note(partial, files: int, records: int) -> str:
    kept = len(partial.kept)
    return (f"the report's rows (--csv, --html, --json --rows) hold the records of {kept} of the {files} compared "
            f"pairs of step files (those that diverged first, then in step and rank order, up to "
            f"{partial.budget} records; {records} in all): every count, verdict, top op and the story cover them "
            "all; --keep-rows all keeps every record")


def reduced_gradients_note(lonely_a: int, lonely_b: int) -> str:
    """Like with like: FSDP2 records each gradient twice (param_grad call 1: this rank's, before
    the reduce-scatter; call 1: the reduced shard); DDP and one device record call 0 alone.
    The reduced ones then have no partner, and the note says which quantity was compared.
    lonely_a, lonely_b: the reduced gradients of A and B without partner."""
    lonely = {"A": lonely_a, "B": lonely_b}
    side = next((name for name, count in lonely.items() if count), None)
    if side is None:
        return ""
    other = "B" if side == "A" else "A"
    return (f"{lonely[side]} reduced gradients of {side} (param_grad call 1: FSDP2's reduce-scatter shards) have no "
            f"partner: {other} recorded each gradient once, before any reduction, and that pairs with {side}'s call 0 "
            "(each rank's own gradient); the reduced ones are not compared with it")


def _unranked_backward(has_out: dict, module_rows: bool, groups: dict) -> str:
    """A note naming the backward API calls whose error no record measures: with capture's
    COMPOSITE_GRAD_INPUT off (or where it records nothing: a tensor in two slots of one
    call), an op autograd runs as several nodes (F.linear: a transpose and a matmul) records the gradient flowing
    into its output but not what it sends back, so the error its backward adds shows up in
    the next recorded gradient, carried and unranked. Their leaf module (level "mix") measures
    it; the note names the ones no module covers. has_out: (module, op, index) of each paired
    backward API call -> whether an output of it was recorded."""
    rule = R.PoolRule((group.kind, group.module, group.phase) for group in groups.values())
    covered = {group.module for group in groups.values()
               if group.kind != "api" and group.phase == "backward" and rule.admits(group)}
    missing = sorted({op for (module, op, _), out in has_out.items() if not out and module not in covered})
    if not missing:
        return ""
    advice = "" if module_rows else "; level \"mix\" measures them through their modules (Linear)"
    shown = ", ".join(missing[:4]) + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
    return (f"no record measures the backward of {shown}: autograd runs each as several nodes, so only the "
            f"gradient into its outputs is recorded, and the error its backward adds is carried, unranked, into "
            f"the next recorded gradient{advice}")


def device_note(device_a: str, device_b: str, arguments: int, moves: int = 0) -> str:
    """The one report note for runs on different devices."""
    where = f"the runs ran on different devices ({device_a or '?'} in A, {device_b or '?'} in B)"
    if arguments:
        where += (f"; {arguments} placement argument{'s' if arguments != 1 else ''} (device=, .to(device), "
                  "non_blocking, pin_memory) differ and are not compared: where a tensor lives is not a "
                  "numerical difference")
    if moves:
        where += (f"; {moves} device move{'s' if moves != 1 else ''} ({', '.join(MOVE_OPS[:3])}, ...) in one run "
                  "only (without partner, not a divergence)")
    return where


