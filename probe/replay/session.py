"""Replay the calls a compare points at, within a time budget, and fold the verdicts back in.

Which calls: the first divergence, the likely cause, the top ``count`` ranked ops, then up to
``count`` outputs that compare accepted as amplified rounding (status "explained", largest
first: with statistics alone that acceptance is an assumption about the op, which replay
checks; a note says where it does not hold), each call once. Each is replayed on A from A's dump and on B from B's (probe.replay.execute), one
call's tensors at a time, and judged (probe.replay.judge). When the budget (seconds) runs
out, the calls not yet replayed are listed in ``left`` and a note says so.

Where replay ran, its verdict overrides the statistics-based origin of the first divergence,
the likely cause and the top ops ("introduced by B" and "precision" -> introduced; rounding
"inherited" -> inherited, "amplified" -> amplified), and a note says which origins changed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Callable

from probe.replay import judge as J
from probe.replay.calls import StepSource
from probe.replay.execute import replay_call
from probe.replay.ops import NotReplayable

DEFAULT_COUNT = 20
DEFAULT_BUDGET_S = 60.0


@dataclass
class Target:
    step: int
    rank: int
    kind: str
    module: str
    op: str
    index: int
    phase: str
    prefix_a: str
    prefix_b: str
    roles: list = field(default_factory=list)
    #: input slot -> where compare found it came from, for inputs no recorded op made
    sources: dict = field(default_factory=dict)

    @property
    def call_key(self) -> tuple:
        return (self.step, self.rank, self.prefix_a)

    @property
    def name(self) -> str:
        return self.prefix_a.rstrip("/")


@dataclass
class ReplayReport:
    calls: list = field(default_factory=list)  # [{step, rank, call, module, op, index, phase, roles, replay}]
    left: list = field(default_factory=list)  # call names not replayed: the budget ran out
    budget_s: float = DEFAULT_BUDGET_S
    elapsed_s: float = 0.0
    bytes_read: int = 0
    notes: list = field(default_factory=list)
    by_call: dict = field(default_factory=dict)  # (step, rank, A's key prefix) -> verdict dict

    def verdict_for(self, step: int, rank: int, key: str) -> dict | None:
        """The replay verdict of the call a record key or an OpSummary key belongs to."""
        for prefix in _prefixes(key):
            found = self.by_call.get((step, rank, prefix))
            if found is not None:
                return found
        return None

    def to_dict(self) -> dict:
        replayed = sum(1 for call in self.calls if call["replay"]["verdict"] != J.NOT_REPLAYABLE)
        return {
            "calls": list(self.calls),
            "replayed": replayed,
            "left": list(self.left),
            "budget_s": self.budget_s,
            "elapsed_s": round(self.elapsed_s, 3),
            "bytes_read": self.bytes_read,
            "calls_per_s": round(len(self.calls) / self.elapsed_s, 2) if self.elapsed_s > 0 else None,
            "mb_per_s": round(self.bytes_read / 1e6 / self.elapsed_s, 2) if self.elapsed_s > 0 else None,
            "notes": list(self.notes),
        }


def _prefixes(key: str):
    """A's key prefix candidates: an OpSummary key ("m/op#0/forward") or a record key."""
    yield key if key.endswith("/") else key + "/"
    for phase in ("/forward/", "/backward/"):
        at = key.find(phase)
        if at >= 0:
            yield key[: at + len(phase)]


def replay_result(result, count: int = DEFAULT_COUNT, budget: float = DEFAULT_BUDGET_S,
                  progress: Callable[[int, int, str, dict | None], None] | None = None,
                  calls=()) -> ReplayReport:
    """Replay the calls result points at; attach the report as result.replay and return it.

    calls: more calls to replay, after those: (step, rank, key) with key a record key of A or
    a call key ("module/op#index/phase"), e.g. every divergent optimizer call.
    """
    report = ReplayReport(budget_s=budget)
    files = {(info["step"], info["rank"]): (info["file_a"], info["file_b"]) for info in result.steps}
    targets = _targets(result, count, calls)
    if result.evidence != "tensor":
        report.notes.append(f"replay needs full tensors (task 'tensor'); these dumps hold {result.evidence} only")
    sources: dict[str, StepSource] = {}
    start = time.monotonic()
    try:
        for position, target in enumerate(targets):
            if time.monotonic() - start > budget:
                report.left = [t.name for t in targets[position:]]
                report.notes.append(f"replay stopped at its {budget:g} s budget: {len(report.left)} of "
                                    f"{len(targets)} calls not replayed ({', '.join(report.left[:3])}"
                                    f"{' ...' if len(report.left) > 3 else ''}); raise --replay-budget to replay them")
                break
            if progress is not None:
                progress(position, len(targets), target.name, None)
            verdict = _replay_target(target, files, sources, report)
            report.by_call[target.call_key] = verdict
            report.calls.append({
                "step": target.step, "rank": target.rank, "call": target.name, "module": target.module,
                "op": target.op, "index": target.index, "phase": target.phase, "roles": list(target.roles),
                "replay": verdict,
            })
            if progress is not None:
                progress(position + 1, len(targets), target.name, verdict)
    finally:
        report.elapsed_s = time.monotonic() - start
        for source in sources.values():
            report.bytes_read += source.bytes_read
            source.close()
    _override_origins(result, report)
    _check_explained(report)
    result.replay = report
    return report


def _check_explained(report: ReplayReport) -> None:
    """Say where replay contradicts compare's acceptance of an output as amplified rounding."""
    wrong = [call["call"] for call in report.calls if "explained by compare" in call["roles"]
             and call["replay"]["verdict"] in (J.INTRODUCED_A, J.INTRODUCED_B)]
    if wrong:
        report.notes.append(
            f"replay finds {len(wrong)} call(s) that compare accepted as amplified rounding computing "
            f"beyond rounding on one side: {', '.join(wrong[:3])}{' ...' if len(wrong) > 3 else ''}")


def _replay_target(target: Target, files: dict, sources: dict, report: ReplayReport) -> dict:
    paths = files.get((target.step, target.rank))
    if paths is None:
        return J.not_replayable(f"no step file for step {target.step} rank {target.rank}")
    try:
        side_a = replay_call(_source(sources, paths[0]), target.prefix_a, target.kind, target.op, target.phase)
        side_b = replay_call(_source(sources, paths[1]), target.prefix_b, target.kind, target.op, target.phase)
    except NotReplayable as reason:
        return J.not_replayable(str(reason))
    except (MemoryError, RecursionError) as error:
        return J.not_replayable(f"replay ran out of resources: {type(error).__name__}")
    except Exception as error:  # noqa: BLE001 - any op may fail in its own way; one call must not end the compare
        return J.not_replayable(f"replay failed: {type(error).__name__}: {str(error).splitlines()[0][:200] if str(error) else ''}")
    return J.judge(side_a, side_b, target.sources)


def _source(sources: dict, path: str) -> StepSource:
    if path not in sources:
        sources[path] = StepSource(path)
    return sources[path]


# ---------------------------------------------------------------------------- targets

def _call_prefix(key: str, slot: str) -> str | None:
    if not key or not slot or not key.endswith(slot):
        return None
    return key[: len(key) - len(slot)]


def _targets(result, count: int, calls=()) -> list[Target]:
    by_a: dict = {}  # (step, rank, A prefix) -> (row, B prefix)
    for row in result.rows:
        prefix_a, prefix_b = _call_prefix(row.key_a, row.slot), _call_prefix(row.key_b, row.slot)
        if prefix_a and prefix_b:
            by_a.setdefault((row.step, row.rank, prefix_a), (row, prefix_b))
    targets: dict = {}
    sources = _source_inputs(result.rows)

    def add(step, rank, prefix_a, role):
        entry = by_a.get((step, rank, prefix_a))
        if entry is None:
            return
        row, prefix_b = entry
        target = targets.get((step, rank, prefix_a))
        if target is None:
            kind = "api" if row.kind == "api" else ("param" if row.kind == "param" else "module")
            target = targets[(step, rank, prefix_a)] = Target(
                step, rank, kind, row.module, row.op, row.index, row.phase, prefix_a, prefix_b,
                sources=sources.get((step, rank, prefix_a), {}))
        target.roles.append(role)

    for row, role in ((result.first_divergence, "first divergence"), (result.likely_cause, "likely cause")):
        if row is not None:
            prefix = _call_prefix(row.key_a, row.slot)
            if prefix:
                add(row.step, row.rank, prefix, role)
    for rank_number, op in enumerate(_ranked(result, count), 1):
        add(op.step, op.rank, op.key + "/", f"top op {rank_number}")
    ranked = len(targets)
    # outputs compare accepted as amplified rounding: with statistics that is an assumption
    # about the op, and replay is the judge that can check it (largest first, count at most)
    explained = sorted((row for row in result.rows if row.status == "explained" and row.io == "out"),
                       key=lambda row: -(row.score or 0.0))
    for row in explained:
        if len(targets) - ranked >= count:
            break
        prefix = _call_prefix(row.key_a, row.slot)
        if prefix:
            add(row.step, row.rank, prefix, "explained by compare")
    for step, rank, key in calls:
        for prefix in _prefixes(key):
            add(step, rank, prefix, "asked")
    return list(targets.values())


#: input kinds (compare's provenance) that no recorded op of the step made: a difference
#: they carry enters the computation at the call that reads them
SOURCE_KINDS = ("param", "external", "changed", "unpaired")


def _source_inputs(rows) -> dict:
    """(step, rank, A's call prefix) -> {input slot: kind} of the inputs compare classified
    as sources (a parameter, a buffer or the data, a tensor made by an unpartnered call)."""
    found: dict = {}
    for row in rows:
        if row.io != "out" or not row.input_errors:
            continue
        prefix = _call_prefix(row.key_a, row.slot)
        if prefix is None or (row.step, row.rank, prefix) in found:
            continue
        found[(row.step, row.rank, prefix)] = {item["slot"]: item["source"] for item in row.input_errors
                                               if item.get("source") in SOURCE_KINDS}
    return found


def _ranked(result, count: int) -> list:
    if count <= len(result.top_ops):
        return list(result.top_ops[:count])
    try:  # more than the report lists: rank again from every call pair
        from probe.comparison.result import rank_top_ops

        return list(rank_top_ops(list(result.op_summaries), count))
    except (ImportError, TypeError, AttributeError):
        return list(result.top_ops)


# ---------------------------------------------------------------------------- origins

_ORIGIN = {J.INTRODUCED_A: "introduced", J.INTRODUCED_B: "introduced", J.PRECISION: "introduced",
           J.ARGUMENTS: "introduced"}


def replay_origin(verdict: dict) -> str | None:
    """The origin a replay verdict establishes, or None where it does not decide one."""
    if verdict["verdict"] in _ORIGIN:
        return _ORIGIN[verdict["verdict"]]
    if verdict["verdict"] == J.ROUNDING and verdict.get("rounding") in ("inherited", "amplified"):
        return verdict["rounding"]
    if verdict["verdict"] == J.ROUNDING and verdict.get("rounding") == J.ENTERS:
        return "introduced"  # faithful kernels, but the difference enters at this call
    return None


def _override_origins(result, report: ReplayReport) -> None:
    changed = []
    rows = [row for row in (result.first_divergence, result.likely_cause) if row is not None]
    for position, item in enumerate(rows + list(result.top_ops)):
        key = item.key_a if hasattr(item, "key_a") else item.key
        verdict = report.verdict_for(item.step, item.rank, key)
        if verdict is None:
            continue
        origin = replay_origin(verdict)
        if origin is None or not item.origin:
            continue
        verdict["statistics_origin"] = item.origin
        if item.origin != origin:
            changed.append(f"{key.rstrip('/')} {item.origin} -> {origin}")
            if position < len(rows):
                item.origin = origin
            else:  # an op summary is never written: one with the replay's origin takes its place
                result.top_ops[position - len(rows)] = replace(item, origin=origin)
    if changed:
        unique = list(dict.fromkeys(changed))
        report.notes.append("replay overrides the statistics-based origin where it ran: " + "; ".join(unique))
