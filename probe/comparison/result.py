"""What a compare returns: one row per aligned record, the verdict, and the summaries.

Data only: the renderers (probe/report/) import this module, never the reverse.
``probe.compare`` returns it with its renderers attached (report/rendered.py:
``to_text``, ``to_json`` as ``probe compare --json`` prints it, ``write_html/write_csv/
write_json``). ``to_dict()`` is the JSON without the headline and the divergences list;
non-finite floats become the strings "inf", "-inf" and "nan" so the output stays strict JSON.

The op summaries (summarize_call): what each call pair adds, in tolerance units, made from its
final rows once every rule has run (assemble.py calls it after the last one), so a summary
says what its rows say; nothing writes one after.

The summaries folded over step files (assemble.py calls them): what repeats over step files
is folded into one entry with the steps and ranks where it occurs.

A changed argument (GELU's ``approximate``) or parameter differs in every step of a run,
and the op that adds the most error usually does so in every step: listing them once per
step file buries the answer. ``group_changes`` and ``rank_top_ops`` report each once, with
its worst occurrence and ``where`` (every (step, rank) it occurs in); ``where_text`` says
that compactly ("steps 0-4, rank 0").

``PrecisionTally`` counts what the precision rule (judge.py) found but did not call a
divergence; assemble adds up every step file pair's tally into the notes and the run
differences.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field, replace

from probe.comparison.metrics import Best
from probe.comparison.structs import (  # noqa: F401  the names every report reads from here
    AMPLIFIED, ARGUMENT, CHANGED, DIVERGED, EXPLAINED, FACTOR, INHERITED, INPUT, INTRODUCED, MATCH, ONLY_A,
    ONLY_B, OUTPUT, PAIRED, PARAM, PLACEMENT_NOTE, PRECISION, SIZE_UNKNOWN, WITHIN, RecordRow,
    StepOutcome, count_rows, forward_carriers, is_carrier, json_safe, rel_error, sharded_only_rows,
)


@dataclass(frozen=True, init=False)
class OpSummary:
    """One call pair ranked by the error it introduces (top_ops): made from the final rows of
    the call, once every rule has run (result.summarize_call), and never written after."""

    step: int
    rank: int
    module: str
    op: str
    index: int
    phase: str
    key: str
    kind: str
    introduced: float  # output score minus the largest score of its produced inputs (tolerance units)
    output_rel_l2: float
    input_rel_l2: float
    ratio: float | None  # output rel L2 / input rel L2 (None when the inputs agree exactly)
    diverged: bool
    origin: str
    source: str = ""
    where: list = field(default_factory=list)  # every (step, rank) where this op adds error
    target: str = ""  # the parameter an optimizer call updates, "" elsewhere
    diverged_in: int = 0  # in how many of those its output is beyond tolerance

    def __init__(self, step: int, rank: int, module: str, op: str, index: int, phase: str, key: str, kind: str,
                 introduced: float, output_rel_l2: float, input_rel_l2: float, ratio: float | None, diverged: bool,
                 origin: str, source: str = "", where: list | None = None, target: str = "", diverged_in: int = 0):
        # one dict update, in the fields' order: a frozen dataclass's own __init__ sets each field
        # through object.__setattr__, 2.3 us a summary, and a compare makes one per call
        self.__dict__.update(step=step, rank=rank, module=module, op=op, index=index, phase=phase, key=key, kind=kind,
                             introduced=introduced, output_rel_l2=output_rel_l2, input_rel_l2=input_rel_l2,
                             ratio=ratio, diverged=diverged, origin=origin, source=source,
                             where=[] if where is None else where, target=target, diverged_in=diverged_in)

    def to_dict(self) -> dict:
        data = dict(self.__dict__)
        where = data.pop("where") or [(self.step, self.rank)]
        data["occurrences"] = len(where)
        data["where"] = [{"step": step, "rank": rank} for step, rank in where]
        data["where_text"] = where_text(where)
        return json_safe(data)


def _ranges(numbers: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2, 5"."""
    parts, start, previous = [], None, None
    for number in sorted(set(numbers)):
        if start is None:
            start = previous = number
        elif number == previous + 1:
            previous = number
        else:
            parts.append(f"{start}-{previous}" if previous != start else f"{start}")
            start = previous = number
    if start is not None:
        parts.append(f"{start}-{previous}" if previous != start else f"{start}")
    return ", ".join(parts)


def _counted(word: str, numbers: list[int]) -> str:
    return f"{word}{'s' if len(set(numbers)) > 1 else ''} {_ranges(numbers)}"


def where_text(pairs) -> str:
    """(step, rank) pairs -> "steps 0-4, rank 0"; "steps 0-1, ranks 0-1; step 3, rank 0"."""
    by_step: dict[int, list[int]] = {}
    for step, rank in pairs:
        by_step.setdefault(step, []).append(rank)
    by_ranks: dict[tuple, list[int]] = {}
    for step in sorted(by_step):
        by_ranks.setdefault(tuple(sorted(set(by_step[step]))), []).append(step)
    segments = sorted(by_ranks.items(), key=lambda item: item[1][0])
    return "; ".join(f"{_counted('step', steps)}, {_counted('rank', list(ranks))}" for ranks, steps in segments)


@dataclass
class CompareResult:
    verdict: str  # "pass" | "diverged"
    first_divergence: RecordRow | None
    likely_cause: RecordRow | None
    counts: dict
    rows: list[RecordRow]
    top_ops: list[OpSummary]
    tolerances: dict
    evidence: str  # "tensor" | "checksum" | "statistics" (the weakest used)
    steps: list[dict]  # [{"step", "rank", "verdict", "counts"}] per compared file pair
    path_a: str = ""
    path_b: str = ""
    missing: list[str] = field(default_factory=list)  # steps/ranks on one side only
    notes: list[str] = field(default_factory=list)
    changes: list = field(default_factory=list)  # groups.Change: changed params/arguments, each once
    op_summaries: list[OpSummary] = field(default_factory=list)  # every call pair, before grouping
    # probe.replay.ReplayReport when compare ran with replay=N (float64 replay verdicts per
    # call; report/json_report.py, csv_report.py, html_report.py show them)
    replay: object = None
    #: settings the two runs recorded differently: [{"setting", "a", "b"}] (comparison/load.py)
    run_differences: list[dict] = field(default_factory=list)
    #: {step, rank, text} when the runs part through accumulated rounding (comparison/assemble.py)
    drift: dict | None = None
    #: the rounding envelopes over every output: {largest_gap, at, step, rank, differ, outputs,
    #: rounding, uncertain, beyond, strict, rounding_only, baseline} (assemble.summarize); None
    #: when none was judged
    envelope: dict | None = None
    #: the first MAX_DIVERGENT divergent records over every step file, in execution order, and
    #: how many there are (None: counted from rows, which then hold every record)
    divergent: list | None = None
    divergences_total: int | None = None

    @property
    def diverged(self) -> bool:
        return self.verdict == "diverged"

    @property
    def divergences(self) -> list[RecordRow]:
        return [row for row in self.rows if row.status == DIVERGED]

    def first_divergences(self, count: int = 0) -> tuple[list[RecordRow], int]:
        """(the first count divergent records, or all kept when count is 0; how many there are
        over every step file, kept in rows or not)."""
        found = self.divergent if self.divergent is not None else self.divergences
        total = self.divergences_total if self.divergences_total is not None else len(found)
        return (found[:count] if count else list(found)), total

    def to_dict(self, rows: bool = False) -> dict:
        """The result's own fields (to_json() adds headline and divergences)."""
        data = {
            "verdict": self.verdict,
            "a": self.path_a,
            "b": self.path_b,
            "reference": "a",
            "first_divergence": divergence_dict(self.first_divergence),
            "likely_cause": divergence_dict(self.likely_cause),
            "counts": dict(self.counts),
            "evidence": self.evidence,
            "tolerances": self.tolerances,
            "top_ops": [op.to_dict() for op in self.top_ops],
            "changes": [change.to_dict() for change in self.changes],
            "steps": list(self.steps),
            "missing": list(self.missing),
            "notes": list(self.notes),
            "run_differences": list(self.run_differences),
            "drift": self.drift,
            "envelope": self.envelope,
        }
        if rows:
            data["rows"] = [row.to_dict() for row in self.rows]
        return json_safe(data)


def divergence_dict(row: RecordRow | None) -> dict | None:
    """The contract form of a divergence: where, what, and every metric at the top level."""
    if row is None:
        return None
    data = {
        "step": row.step,
        "rank": row.rank,
        "key": row.key,
        "module": row.module,
        "op": row.op,
        "index": row.index,
        "phase": row.phase,
        "slot": row.slot,
        "io": row.io,
        "kind": row.divergence,
        "origin": row.origin or None,
        "cause": row.cause or None,
        "source": row.source,
        "target": row.target or None,
        "dtype_a": row.dtype_a,
        "dtype_b": row.dtype_b,
        "shape": row.shape_a or row.shape_b,
        "score": row.score,
        "size_unknown": row.size_unknown,
        "reasons": list(row.reasons),
        "input_errors": list(row.input_errors),
        "envelope": dict(row.envelope) if row.envelope is not None else None,
    }
    if row.metrics is not None:
        data["evidence"] = row.metrics.evidence
        metrics = row.metrics.to_dict()
        metrics.pop("evidence", None)
        metrics.pop("notes", None)
        data.update(metrics)
    return json_safe(data)


def where_dicts(pairs) -> list[dict]:
    return [{"step": step, "rank": rank} for step, rank in pairs]


def where_pairs(bits: int, pairs) -> list:
    """The (step, rank) pairs a bitset of places (numbers in pairs) holds, sorted."""
    return sorted(pairs[number] for number in range(bits.bit_length()) if bits >> number & 1)


#: an op adding less than this share of the tolerance adds nothing worth listing (rounding
#: of the ratio of two nearly equal errors leaves ~1e-5)
NEGLIGIBLE = 1e-3


def op_summaries(outcomes) -> list[OpSummary]:
    """The summary of every paired call of every step file pair, from the rows as they stand."""
    return [summary for outcome in outcomes for rows, forward in outcome.calls
            if (summary := summarize_call(rows, forward)) is not None]


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


def summarize_call(rows: list[RecordRow], forward: list[RecordRow] = ()) -> OpSummary | None:
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
    added = [(0.0 if r.status == EXPLAINED else added_score(_score(r), rel_error(r), input_rel), _score(r), r)
             for r in outputs]
    introduced, _, worst = max(added, key=lambda item: (item[0], item[1]))
    out_rel = rel_error(worst)
    head = rows[0]
    return OpSummary(
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
        diverged=any(r.status == DIVERGED for r in outputs),
        origin=worst.origin,
        source=worst.source,
        target=head.target,
    )


def _score(row: RecordRow) -> float:
    if row.score is None:
        return math.inf if row.status == DIVERGED else 0.0
    return row.score


def ranked_pool(summaries: list[OpSummary]) -> list[OpSummary]:
    """The calls top ops rank, each computation once: API calls when any were captured, plus
    the calls of leaf modules (no recorded module below them) in a phase where no API call of
    that module measured an output. With capture's COMPOSITE_GRAD_INPUT off, a linear's
    backward at API level records only the gradient flowing into its output (autograd runs
    it as several nodes), so at level "mix" its module (Linear) is what measures the
    gradient it sends back; a container module (Sequential, a block) only repeats what its
    children measured."""
    rule = PoolRule({(s.kind, s.module, s.phase) for s in summaries})
    return [s for s in summaries if s.kind == "api"] + [s for s in summaries if s.kind != "api" and rule.admits(s)]


class PoolRule:
    """ranked_pool's rule, from the (kind, module, phase) of every summary."""

    def __init__(self, calls):
        calls = set(calls)
        self.api = any(kind == "api" for kind, _, _ in calls)
        self.measured = {(module, phase) for kind, module, phase in calls if kind == "api"}
        paths = {module for _, module, _ in calls}
        self.parents = {path.rsplit(".", 1)[0] if "." in path else "" for path in paths if path}

    def admits(self, call) -> bool:
        if not self.api or call.kind == "api":
            return True
        return (call.module, call.phase) not in self.measured and call.module not in self.parents


@dataclass
class OpGroup:
    """The calls of one op (module, op, index, phase, target) of one kind over every step
    file, folded: what rank_top_ops shows of them."""

    kind: str
    module: str
    phase: str
    worst: Best = field(default_factory=Best)  # among the calls adding more than NEGLIGIBLE
    first: tuple | None = None  # the earliest such call's ordinal
    diverged_in: int = 0
    where: int = 0  # bitsets of the places where such a call adds error / diverges
    where_diverged: int = 0

    def add(self, summary: OpSummary, ordinal: tuple, place: int) -> None:
        if not summary.introduced > NEGLIGIBLE:
            return
        self.worst.offer((not _only_inherited(summary), summary.introduced, -summary.step, -summary.rank),
                         ordinal, summary)
        self.first = ordinal if self.first is None else min(self.first, ordinal)
        self.where |= 1 << place
        if summary.diverged:
            self.diverged_in += 1
            self.where_diverged |= 1 << place

    def merge(self, other: "OpGroup") -> None:
        self.worst.merge(other.worst)
        if other.first is not None:
            self.first = other.first if self.first is None else min(self.first, other.first)
        self.diverged_in += other.diverged_in
        self.where |= other.where
        self.where_diverged |= other.where_diverged


def add_summary(groups: dict, summary: OpSummary, ordinal: tuple, place: int) -> None:
    """Fold one call's summary into {group key: OpGroup}."""
    key = (summary.kind, summary.module, summary.op, summary.index, summary.phase, summary.target)
    group = groups.get(key)
    if group is None:
        group = groups[key] = OpGroup(summary.kind, summary.module, summary.phase)
    # ranked_pool lists API calls first: an API call is met before any module's
    group.add(summary, (summary.kind != "api",) + ordinal, place)


def merge_groups(groups: dict, other: dict) -> None:
    for key, group in other.items():
        mine = groups.get(key)
        if mine is None:  # not setdefault: that would make a group for every key, held or not
            mine = groups[key] = OpGroup(group.kind, group.module, group.phase)
        mine.merge(group)


def rank_top_ops(summaries: list[OpSummary], top: int) -> list[OpSummary]:
    """The ops that introduce the most error, each op once (ranked_pool: API calls, and the
    modules that measure what API calls cannot); rank_groups says how."""
    groups: dict = {}
    places: dict = {}  # (step, rank) -> its number, in the order met
    for number, summary in enumerate(summaries):
        add_summary(groups, summary, (number,), places.setdefault((summary.step, summary.rank), len(places)))
    return rank_groups(groups, list(places), top)


def rank_groups(groups: dict, pairs, top: int) -> list[OpSummary]:
    """Top ops from folded calls (OpGroup); pairs: place -> (step, rank).

    Calls are grouped by (module, op, index, phase) over steps and ranks; a group is shown by
    its worst call (the one adding the most error), with ``where`` = every step file in which
    the op adds error (in which it diverges, when its worst call diverges). Ranked by that worst error in tolerance units; ops whose divergence is
    only inherited come after every op that introduces error or stays within tolerance."""
    rule = PoolRule((group.kind, group.module, group.phase) for group in groups.values())
    merged: dict = {}  # (module, op, index, phase, target) -> OpGroup, API calls first as ranked_pool lists them
    for key, group in groups.items():
        if group.first is None or not rule.admits(group):
            continue
        if key[1:] not in merged:
            merged[key[1:]] = OpGroup(group.kind, group.module, group.phase)
        merged[key[1:]].merge(group)
    ranked = []
    for group in merged.values():
        worst = group.worst.item
        # an op that diverges somewhere is shown where it diverges: a fault on rank 1 only is
        # not also "where" rank 0 merely rounds a little differently
        bits = group.where_diverged if worst.diverged else group.where
        ranked.append((group.first, replace(worst, where=where_pairs(bits, pairs), diverged_in=group.diverged_in)))
    ranked.sort(key=lambda item: (_only_inherited(item[1]), -item[1].introduced, item[1].step, item[1].rank,
                                  item[1].key, item[0]))
    return [summary for _, summary in ranked[:top]]


def _only_inherited(summary: OpSummary) -> bool:
    # an op that only passes on an error it inherited goes after those that add their own
    return summary.diverged and summary.origin == INHERITED


@dataclass
class PrecisionTally:
    """What the precision rule found over every step file of a compare."""

    autocast: Counter = field(default_factory=Counter)  # ("A"/"B", dtype) -> ops under autocast
    unknown: Counter = field(default_factory=Counter)  # ("A"/"B", dtype) -> ops, autocast not recorded
    dtypes_a: Counter = field(default_factory=Counter)  # dtype -> api forward outputs of A
    dtypes_b: Counter = field(default_factory=Counter)
    findings: int = 0  # precision divergences
    #: precision findings within the coarser side's rounding envelope: not divergences
    within: list = field(default_factory=list)

    @classmethod
    def total(cls, tallies) -> "PrecisionTally":
        """Every step file pair's tally added up, in step file order."""
        total = cls()
        for tally in tallies:
            if tally is None:
                continue
            for name in ("autocast", "unknown", "dtypes_a", "dtypes_b"):
                getattr(total, name).update(getattr(tally, name))
            total.findings += tally.findings
            total.within.extend(tally.within)
        return total

    def notes(self) -> list[str]:
        out = []
        if self.within:
            more = len(self.within) - 1
            also = f" and {more} more op{'s' if more != 1 else ''}" if more else ""
            listed = f": {'; '.join(self.within[1:6])}{'; ...' if more > 5 else ''}" if more else ""
            out.append(f"{PRECISION_FINDING} {self.within[0]}{also}{PRECISION_WHY}{listed}")
        for (side, dtype), count in sorted(self.autocast.items()):
            other = "B" if side == "A" else "A"
            out.append(f"{side} ran {count} op{'s' if count != 1 else ''} in {dtype} under autocast where {other} "
                       "computes in a finer dtype: expected (autocast chose that precision), not a divergence")
        for (side, dtype), count in sorted(self.unknown.items()):
            out.append(f"{side} ran {count} op{'s' if count != 1 else ''} in {dtype} where the other run computes in a "
                       "finer dtype; this dump does not record whether autocast was on, so it is judged at "
                       f"{dtype}'s tolerance and not reported as a precision divergence")
        return out

    def differences(self) -> list[dict]:
        """The "the runs differ in" entry for the dtypes each run computed in."""
        if set(self.dtypes_a) == set(self.dtypes_b) and not self.findings and not self.autocast and not self.within:
            return []
        return [{"setting": "compute dtypes", "a": _describe(self.dtypes_a), "b": _describe(self.dtypes_b)}]


#: how a precision finding within the coarser side's envelope starts, in a row's notes and the result's
PRECISION_FINDING = "precision finding:"
PRECISION_WHY = (": the model's own casts, the values within the coarser dtype's rounding envelope (a finding, "
                 "not a divergence)")


def _describe(dtypes: Counter) -> str:
    if not dtypes:
        return "not recorded"
    return ", ".join(f"{dtype} ({count} op{'s' if count != 1 else ''})" for dtype, count in dtypes.most_common())


def headline(summary: dict | None) -> str:
    """"the runs differ by rounding only (largest difference 0.4x what rounding makes)", or ""
    unless the runs differ, every output's size is known from above (tensors, sketches), none
    is beyond its envelope (a pass only by the fixed tolerance) or more than FACTOR x it
    without another explanation, and --strict did not ask for the fixed tolerance alone."""
    if not summary or not summary["rounding_only"] or summary["largest_gap"] is None:
        return ""
    uncertain = f"; {summary['uncertain']} uncertain" if summary["uncertain"] else ""
    measured = " as the baseline measured it" if summary.get("baseline") else ""
    gap = summary["largest_gap"]
    # an op's own error may reach FACTOR x its rounding (envelope.py): above 1x is still rounding
    margin = f", within the {FACTOR:g}x margin an op's own rounding may take" if gap > 1 else ""
    if gap > FACTOR:  # an output whose inputs' accepted differences explain it (amplified)
        margin = ", its inputs' accepted differences explaining the rest (amplified rounding)"
    return f"the runs differ by rounding only (largest difference {gap:.2g}x what rounding makes{measured}{margin}{uncertain})"


#: the divergent records a result lists (JSON ``divergences``)
MAX_DIVERGENT = 50
