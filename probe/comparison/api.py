"""``probe.compare(a, b, **options) -> CompareResult``: the Python face of ``probe compare``.

A and B are dump files or dump folders. Folders pair their step files by (step, rank);
a step or rank found on one side only is an error (CompareError) unless
``allow_missing=True``, which compares the common ones and lists the rest in
``result.missing``. Two files compare with each other whatever their step numbers.
A is the reference: relative errors are relative to A.
"""

from __future__ import annotations

import os
from typing import Callable, Iterable

from probe.comparison import result as R
from probe.comparison import devices, groups, model_overlap, run_info, verdict
from probe.comparison.drift import apply_drift
from probe.comparison.entering import rank_entering
from probe.comparison.engine import StepOutcome, compare_step, content_keys, count_rows
from probe.comparison.mapping import NameMapping, load_mapping, mapping_from_dict
from probe.comparison.precision import PrecisionTally, judge_precision, shared_autocast
from probe.comparison.records import Records
from probe.comparison.sketch import sketch_note
from probe.comparison.tolerances import Tolerances
from probe.errors import CompareError

DEFAULT_TOP = 10
_EVIDENCE_ORDER = ("statistics", "checksum", "tensor")  # weakest first


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
    replay: int | None = None,
    replay_budget: float = 60.0,
    replay_progress: Callable | None = None,
) -> R.CompareResult:
    """Compare dump A (the reference) with dump B.

    rtol/atol: override every floating dtype; tol: ["bfloat16=1e-2,1e-5", ...];
    tol_file: YAML {dtype: {rtol, atol}}; tolerances: {dtype: (rtol, atol)} (Python form).
    mapping: a YAML path, a dict {"modules": {...}, "ops": {...}} or a NameMapping.
    steps/ranks: compare only these. strict: records present on one side only count as a
    divergence. progress(fraction_done, tensor_bytes_read) is called as the compare goes.
    replay: replay the first divergence, the likely cause and the top ``replay`` ops in
    float64 from each side's dumped inputs (task "tensor"; imports torch), within
    replay_budget seconds; the verdicts land in ``result.replay`` (probe.replay).
    replay_progress(done, total, call_name, verdict_or_None) follows it.
    """
    from probe.dump.reader import load

    if isinstance(top, bool) or not isinstance(top, int) or top < 0:
        raise CompareError(f"top must be an integer >= 0, found {top!r}")
    _check_replay(replay, replay_budget)
    table = Tolerances.build(rtol=rtol, atol=atol, per_dtype=tol, tol_file=tol_file, overrides=tolerances)
    names = _mapping(mapping)
    path_a, path_b = os.fspath(a), os.fspath(b)
    dump_a, dump_b = load(path_a), load(path_b)
    pairs, missing = _pair_files(dump_a, dump_b, path_a, path_b, allow_missing, steps, ranks)

    notes = [f"A: {message}" for message in dump_a.incomplete_messages()]
    notes += [f"B: {message}" for message in dump_b.incomplete_messages()]
    notes += [note for note in (run_info.mixed_runs(dump_a, "A"), run_info.mixed_runs(dump_b, "B")) if note]
    differences: list[dict] = []
    outcomes: list[StepOutcome] = []
    steps_info = []
    total_bytes = 0
    previous: dict[int, set] = {}  # rank -> content keys of A's last compared step file
    devices_ab = ("", "")
    explained: dict[int, dict] = {}  # rank -> accepted differences of A's last compared step file
    precision = PrecisionTally()
    same_model = None
    for position, (key_a, key_b) in enumerate(pairs):
        def report(done, total, read, _position=position):
            if progress is not None:
                progress((_position + done / max(total, 1)) / len(pairs), total_bytes + read)

        with dump_a.open(*key_a) as file_a, dump_b.open(*key_b) as file_b:
            if position == 0:
                notes += _attr_notes(file_a.attrs, file_b.attrs)
                differences = run_info.run_differences(file_a.attrs, file_b.attrs)
                devices_ab = (str(file_a.attrs.get("device") or ""), str(file_b.attrs.get("device") or ""))
            records_a = Records.from_table(file_a.records, file_a.path)
            records_b = Records.from_table(file_b.records, file_b.path)
            if position == 0 and names is None:
                share = model_overlap.overlap(records_a.columns["module"], records_b.columns["module"])
                same_model = model_overlap.different_models_note(share)
            outcome = compare_step(
                records_a,
                records_b,
                file_a.tensor if file_a.tensor_count else None,
                file_b.tensor if file_b.tensor_count else None,
                table,
                names,
                step=key_a[0],
                rank=key_a[1],
                progress=report,
                previous=previous.get(key_a[1]),
                previous_explained=explained.get(key_a[1]),
                autocast=shared_autocast(file_a.attrs.get("autocast"), file_b.attrs.get("autocast")),
            )
            judge_precision(outcome.rows, file_a.attrs.get("autocast"), file_b.attrs.get("autocast"), precision)
            previous[key_a[1]] = content_keys(records_a)
            explained[key_a[1]] = outcome.explained
        total_bytes += outcome.tensor_bytes
        outcomes.append(outcome)
        counts = outcome.counts()
        steps_info.append({
            "step": key_a[0],
            "rank": key_a[1],
            "step_b": key_b[0],
            "rank_b": key_b[1],
            "file_a": dump_a.files[key_a],
            "file_b": dump_b.files[key_b],
            "verdict": _step_verdict(counts, strict),
            "counts": counts,
        })
    result = _assemble(outcomes, steps_info, table, path_a, path_b, missing, notes, top, strict, devices_ab)
    result.run_differences = differences + precision.differences()
    result.notes.extend(precision.notes())
    apply_drift(result)
    rank_entering(result)
    if same_model is not None:
        result.notes.insert(0, same_model)
    if replay is not None:
        # torch is imported here only: a compare without replay stays torch-free
        from probe.replay import replay_result

        replay_result(result, count=replay, budget=replay_budget, progress=replay_progress)
        result.notes.extend(result.replay.notes)
    return result


def _check_replay(replay, budget) -> None:
    if replay is not None and (isinstance(replay, bool) or not isinstance(replay, int) or replay < 0):
        raise CompareError(f"replay must be an integer >= 0 (how many top ops to replay), found {replay!r}")
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not budget > 0:
        raise CompareError(f"replay_budget must be a number of seconds > 0, found {budget!r}")


def _mapping(mapping) -> NameMapping | None:
    if mapping is None or isinstance(mapping, NameMapping):
        return mapping
    if isinstance(mapping, dict):
        return mapping_from_dict(mapping)
    return load_mapping(os.fspath(mapping))


def _pair_files(dump_a, dump_b, path_a, path_b, allow_missing, steps, ranks):
    files_a, files_b = dict(dump_a.files), dict(dump_b.files)
    if os.path.isfile(path_a) and os.path.isfile(path_b):
        return [(next(iter(files_a)), next(iter(files_b)))], []
    keep_steps = None if steps is None else set(steps)
    keep_ranks = None if ranks is None else set(ranks)

    def wanted(key):
        return (keep_steps is None or key[0] in keep_steps) and (keep_ranks is None or key[1] in keep_ranks)

    keys_a = {key for key in files_a if wanted(key)}
    keys_b = {key for key in files_b if wanted(key)}
    if os.path.isfile(path_a) or os.path.isfile(path_b):
        # one file against a folder: the folder's file for the same step and rank
        single, side = (keys_a, "B") if os.path.isfile(path_a) else (keys_b, "A")
        other = keys_b if side == "B" else keys_a
        key = next(iter(single))
        if key not in other:
            folder = path_b if side == "B" else path_a
            raise CompareError(f"{folder} has no step {key[0]} rank {key[1]} to compare with the file given for {'A' if side == 'B' else 'B'}")
        return [(key, key)], []
    if not keys_a or not keys_b:
        empty = path_a if not keys_a else path_b
        raise CompareError(f"{empty} has no step file for the selected steps {sorted(keep_steps or [])} and ranks {sorted(keep_ranks or [])}")
    only_a, only_b = sorted(keys_a - keys_b), sorted(keys_b - keys_a)
    missing = [f"step {s} rank {r} only in A" for s, r in only_a]
    missing += [f"step {s} rank {r} only in B" for s, r in only_b]
    common = sorted(keys_a & keys_b)
    if missing and not common:
        # --allow-missing would fail too: nothing in common. Two files compare whatever their steps.
        example_a, example_b = files_a[min(keys_a)], files_b[min(keys_b)]
        raise CompareError(
            f"the dumps have no step and rank in common ({_describe(only_a, 'A')}; {_describe(only_b, 'B')}); "
            f"to compare two step files whatever their step numbers, name them: "
            f"probe compare {example_a} {example_b}"
        )
    if missing and not allow_missing:
        raise CompareError(
            f"the dumps hold different steps or ranks ({_describe(only_a, 'A')}{'; ' if only_a and only_b else ''}"
            f"{_describe(only_b, 'B')}); pass --allow-missing to compare the {len(common)} common ones"
        )
    if not common:
        raise CompareError(
            f"{path_a} (steps {dump_a.steps}, ranks {dump_a.ranks}) and {path_b} (steps {dump_b.steps}, "
            f"ranks {dump_b.ranks}) have no step and rank in common"
        )
    return [(key, key) for key in common], missing


def _describe(keys, side) -> str:
    if not keys:
        return ""
    shown = ", ".join(f"step {s} rank {r}" for s, r in keys[:3])
    more = f" and {len(keys) - 3} more" if len(keys) > 3 else ""
    return f"{shown}{more} only in {side}"


def _attr_notes(attrs_a: dict, attrs_b: dict) -> list[str]:
    notes = []
    for name in ("task", "level"):  # a device difference is the one device note (_assemble)
        if attrs_a.get(name) != attrs_b.get(name):
            notes.append(f"{name} differs: {attrs_a.get(name)!r} in A, {attrs_b.get(name)!r} in B")
    return notes


def _unpaired_fails(counts: dict, strict: bool) -> bool:
    """Unmatched records fail a step with --strict, or when nothing at all could be paired
    (an empty or unrelated dump must never pass)."""
    unmatched = counts["only_a"] + counts["only_b"]
    # nothing paired is never a pass: two empty dumps (a scope typo) compared nothing at all
    return counts["matched"] == 0 or (bool(unmatched) and strict)


def _step_verdict(counts: dict, strict: bool) -> str:
    return "diverged" if counts["diverged"] or _unpaired_fails(counts, strict) else "pass"


def _assemble(outcomes, steps_info, table, path_a, path_b, missing, notes, top, strict,
              devices_ab=("", "")) -> R.CompareResult:
    rows = [row for outcome in outcomes for row in outcome.rows]
    counts = count_rows(rows)
    placement = sum(1 for row in rows if any(note.startswith(R.PLACEMENT_NOTE) for note in row.notes))
    moves = len({(row.step, row.rank, row.key) for row in rows
                 if row.status in (R.ONLY_A, R.ONLY_B) and row.op in devices.MOVE_OPS and row.io == "out"})
    placed: dict = {}  # (device in A, device in B) -> paired tensor records, per record
    for outcome in outcomes:
        for pair, count in outcome.devices.items():
            placed[pair] = placed.get(pair, 0) + count
    if devices_ab[0] == devices_ab[1] and placed:
        devices_ab = max(placed, key=placed.get)  # the root attributes agree; the records do not
    if devices_ab[0] != devices_ab[1] or placement or moves or placed:
        notes.append(devices.device_note(*devices_ab, placement, moves))
    first, cause = verdict.story(outcomes)
    failing = [o for o in outcomes if _unpaired_fails(o.counts(), strict)]
    if first is None and failing:
        lonely = [row for row in failing[0].rows if row.status in (R.ONLY_A, R.ONLY_B)]
        first = min(lonely, key=lambda row: row.order, default=None)
        if failing[0].counts()["matched"] == 0 and not lonely:
            notes.append(
                f"step {failing[0].step} rank {failing[0].rank}: nothing was compared, both step files "
                "hold no records (did scope or list select nothing?); that is not a pass"
            )
        elif failing[0].counts()["matched"] == 0:
            notes.append(
                f"step {failing[0].step} rank {failing[0].rank}: no record could be paired "
                f"({failing[0].counts()['only_a']} in A, {failing[0].counts()['only_b']} in B): the dumps do not describe the same run"
            )
    used = set().union(*(outcome.evidence for outcome in outcomes)) if outcomes else set()
    # the weakest evidence any pair used; "none" when no tensor pair was measured at all
    evidence = next((name for name in _EVIDENCE_ORDER if name in used), "none" if not used - {"value"} else "statistics")
    if "sketch" in used:  # issue 10
        notes.append(sketch_note("tensor" in used))
    elif evidence == "statistics":
        notes.append("statistics only: errors are lower bounds from min/max/mean/norm; dump with task 'tensor' for full evidence")
    elif evidence == "checksum":
        notes.append("checksums tell bit-equal or not; magnitudes are lower bounds from the statistics")
    unmatched = counts["only_a"] + counts["only_b"]
    if unmatched and not strict:
        notes.append(f"{unmatched} records have no partner (only_a {counts['only_a']}, only_b {counts['only_b']}); they are not compared")
    explained = [row for row in rows if row.status == R.EXPLAINED and row.io == "out"]
    if explained:
        worst = max(explained, key=lambda row: row.metrics.rel_l2 if row.metrics else 0.0)
        notes.append(
            f"{len(explained)} outputs are beyond their own dtype's tolerance but explained by accepted differences "
            f"of their inputs (amplified rounding; not divergences); the largest: {worst.key} at step {worst.step} "
            f"rank {worst.rank}, rel L2 {verdict.sci(worst.metrics.rel_l2)}: {worst.cause}")
    summaries = [s for outcome in outcomes for s in outcome.summaries]
    unranked = _unranked_backward(rows, summaries)
    if unranked:
        notes.append(unranked)
    diverged = counts["diverged"] > 0 or bool(failing)
    tolerances = {"reference": "a", "rule": "||a-b|| <= rtol*||a|| + atol*sqrt(n)", "by_dtype": table.to_dict()}
    return R.CompareResult(
        verdict="diverged" if diverged else "pass",
        first_divergence=first,
        likely_cause=cause,
        counts=counts,
        rows=rows,
        top_ops=groups.rank_top_ops(summaries, top),
        tolerances=tolerances,
        evidence=evidence,
        steps=steps_info,
        path_a=path_a,
        path_b=path_b,
        missing=missing,
        notes=notes,
        changes=groups.group_changes(rows),
        op_summaries=summaries,
    )


def _unranked_backward(rows, summaries) -> str:
    """A note naming the backward API calls whose error no record measures: with capture's
    COMPOSITE_GRAD_INPUT off (or where it records nothing: a tensor in two slots of one
    call), an op autograd runs as several nodes (F.linear: a transpose and a matmul) records the gradient flowing
    into its output but not what it sends back, so the error its backward adds shows up in
    the next recorded gradient, carried and unranked. Their leaf module (level "mix") measures
    it; the note names the ones no module covers."""
    has_out: dict[tuple, bool] = {}
    for row in rows:
        if row.kind == "api" and row.phase == "backward" and row.status in R.PAIRED:
            call = (row.module, row.op, row.index)
            has_out[call] = has_out.get(call, False) or row.io == "out"
    covered = {s.module for s in groups.ranked_pool(summaries) if s.kind != "api" and s.phase == "backward"}
    missing = sorted({op for (module, op, _), out in has_out.items() if not out and module not in covered})
    if not missing:
        return ""
    modules = any(row.kind == "module" for row in rows)
    advice = "" if modules else "; level \"mix\" measures them through their modules (Linear)"
    shown = ", ".join(missing[:4]) + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
    return (f"no record measures the backward of {shown}: autograd runs each as several nodes, so only the "
            f"gradient into its outputs is recorded, and the error its backward adds is carried, unranked, into "
            f"the next recorded gradient{advice}")
