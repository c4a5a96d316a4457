"""Result stage: every step's outcome put together into one CompareResult (data only).

The verdict of each step file pair and of the whole compare, the first divergence and the
likely cause (story.story), the top ops (groups.py) and the notes a reader needs: the
evidence the metrics rest on, devices, records without partner, explained outputs.
"""

from __future__ import annotations

from probe.comparison import devices, groups
from probe.comparison import result as R
from probe.comparison.result import count_rows
from probe.comparison.sketch import sketch_note
from probe.comparison.story import story
from probe.comparison.sizes import sci

_EVIDENCE_ORDER = ("statistics", "checksum", "tensor")  # weakest first


def _unpaired_fails(counts: dict, strict: bool) -> bool:
    """Unmatched records fail a step with --strict, or when nothing at all could be paired
    (an empty or unrelated dump must never pass)."""
    unmatched = counts["only_a"] + counts["only_b"]
    # nothing paired is never a pass: two empty dumps (a scope typo) compared nothing at all
    return counts["matched"] == 0 or (bool(unmatched) and strict)


def step_verdict(counts: dict, strict: bool) -> str:
    return "diverged" if counts["diverged"] or _unpaired_fails(counts, strict) else "pass"


def assemble(outcomes, steps_info, table, path_a, path_b, missing, notes, top, strict,
              devices_ab=("", "")) -> R.CompareResult:
    for info in steps_info:
        if info.get("verdict") is None:
            info["verdict"] = step_verdict(info["counts"], strict)
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
    first, cause = story(outcomes)
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
    if "sketch" in used:
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
            f"rank {worst.rank}, rel L2 {sci(worst.metrics.rel_l2)}: {worst.cause}")
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
