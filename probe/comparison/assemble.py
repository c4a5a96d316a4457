"""Result stage: every step's outcome put together into one CompareResult (data only).

The verdict of each step file pair and of the whole compare, the first divergence and the
likely cause (story.py), the op summaries and top ops (result.py), made from the rows
after the last rule, and the notes a reader needs: the
evidence the metrics rest on, devices, records without partner, explained outputs.

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

from probe.comparison import result as R
from probe.comparison.envelope import FACTOR
from probe.comparison.ops import MOVE_OPS
from probe.comparison.result import count_rows
from probe.comparison.sketch import sketch_note
from probe.comparison.story import (
    apply_drift, entering_cause, find_drift, settle_drift, shard_entries, story,
)
from probe.comparison.structs import UNINITIALIZED_NOTE, sci

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
             devices_ab=("", ""), run_differences=(), same_model=None, baseline=None) -> R.CompareResult:
    """The CompareResult of every step file pair's outcome, built once: every rule that looks
    across step files (the story, drift, where a low-precision error entered, the top ops)
    runs here, before it exists. run_differences: the recorded settings the runs differ in;
    same_model: the note that the dumps record different models, or None; baseline: the
    trusted third dump that measured the envelopes (--baseline), or None."""
    rows = [row for outcome in outcomes for row in outcome.rows]
    # a parameter shard that differs on one rank, gathered by every rank: judged across ranks
    entered = shard_entries(outcomes)
    first, cause = story(outcomes, entered)
    told_first = first
    drifting = find_drift(first, "diverged", steps_info, rows)
    # drift that stays within every op's rounding envelope is rounding: settled before any
    # verdict is counted (story.settle_drift); then nothing diverges, and there is no story
    settled = settle_drift(drifting, rows, steps_info, strict)
    if settled is not None:
        first, cause = None, None
    for info in steps_info:
        if info.get("verdict") is None:
            info["verdict"] = step_verdict(info["counts"], strict)
    counts = count_rows(rows)
    placement = sum(1 for row in rows if any(note.startswith(R.PLACEMENT_NOTE) for note in row.notes))
    moves = len({(row.step, row.rank, row.key) for row in rows
                 if row.status in (R.ONLY_A, R.ONLY_B) and row.op in MOVE_OPS and row.io == "out"})
    placed: dict = {}  # (device in A, device in B) -> paired tensor records, per record
    for outcome in outcomes:
        for pair, count in outcome.devices.items():
            placed[pair] = placed.get(pair, 0) + count
    if devices_ab[0] == devices_ab[1] and placed:
        devices_ab = max(placed, key=placed.get)  # the root attributes agree; the records do not
    if devices_ab[0] != devices_ab[1] or placement or moves or placed:
        notes.append(device_note(*devices_ab, placement, moves))
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
        sharded = (f"; {counts['sharded_only']} of them only a sharded run makes (collectives, reduced "
                   "gradient shards)") if counts["sharded_only"] else ""
        notes.append(f"{unmatched} records have no partner (only_a {counts['only_a']}, only_b {counts['only_b']})"
                     f"{sharded}; they are not compared")
    unwritten = sum(1 for row in rows if any(note.startswith(UNINITIALIZED_NOTE) for note in row.notes))
    if unwritten:
        notes.append(f"{unwritten} records hold memory nothing had written yet (an empty-family allocation, or "
                     "a view of one, read before its first write); they are not compared")
    reduced = reduced_gradients_note(rows)
    if reduced:
        notes.append(reduced)
    explained = [row for row in rows if row.status == R.EXPLAINED and row.io == "out"]
    if explained:
        worst = max(explained, key=lambda row: row.metrics.rel_l2 if row.metrics else 0.0)
        notes.append(
            f"{len(explained)} outputs are beyond their own dtype's tolerance but explained by accepted differences "
            f"of their inputs (amplified rounding; not divergences); the largest: {worst.key} at step {worst.step} "
            f"rank {worst.rank}, rel L2 {sci(worst.metrics.rel_l2)}: {worst.cause}")
    unranked_at = len(notes)  # the note on backward calls no record measures goes here
    diverged = counts["diverged"] > 0 or bool(failing)
    verdict = "diverged" if diverged else "pass"
    tolerances = {"reference": "a", "rule": "||a-b|| <= rtol*||a|| + atol*sqrt(n)", "by_dtype": table.to_dict()}
    changes = R.group_changes(rows)
    precision = R.PrecisionTally.total(outcome.precision for outcome in outcomes)
    notes.extend(precision.notes())
    # the story's first divergence is a divergent row, so the verdict was "diverged" above too
    drift = drifting if first is told_first else find_drift(first, verdict, steps_info, rows)
    if drift is not None:  # no op introduced an error: the runs part through accumulated rounding
        apply_drift(drift, rows)
        cause = None
    else:
        cause = entering_cause(first, cause, rows)
    # the last rule has run: the summaries say what the rows say
    summaries = R.op_summaries(outcomes)
    top_ops = R.rank_top_ops(summaries, top)
    unranked = _unranked_backward(rows, summaries)
    if unranked:
        notes.insert(unranked_at, unranked)
    if drift is not None:
        notes.insert(0, drift["text"])
    if settled is not None:
        notes.insert(0, settled)
    if same_model is not None:
        notes.insert(0, same_model)
    envelope = summarize(rows, notes, strict, baseline)
    return R.CompareResult(
        verdict=verdict,
        first_divergence=first,
        likely_cause=cause,
        counts=counts,
        rows=rows,
        top_ops=top_ops,
        tolerances=tolerances,
        evidence=evidence,
        steps=steps_info,
        path_a=path_a,
        path_b=path_b,
        missing=missing,
        notes=notes,
        changes=changes,
        op_summaries=summaries,
        run_differences=list(run_differences) + precision.differences(),
        drift=drift,
        envelope=envelope,
    )


def reduced_gradients_note(rows) -> str:
    """Like with like: FSDP2 records each gradient twice (param_grad call 0: this rank's, before
    the reduce-scatter; call 1: the reduced shard); DDP and one device record call 0 alone.
    The reduced ones then have no partner, and the note says which quantity was compared."""
    lonely = {"A": 0, "B": 0}
    for row in R.sharded_only_rows(rows):
        if row.slot.startswith("param_grad."):
            lonely["A" if row.status == R.ONLY_A else "B"] += 1
    side = next((name for name, count in lonely.items() if count), None)
    if side is None:
        return ""
    other = "B" if side == "A" else "A"
    return (f"{lonely[side]} reduced gradients of {side} (param_grad call 1: FSDP2's reduce-scatter shards) have no "
            f"partner: {other} recorded each gradient once, before any reduction, and that pairs with {side}'s call 0 "
            "(each rank's own gradient); the reduced ones are not compared with it")


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
    covered = {s.module for s in R.ranked_pool(summaries) if s.kind != "api" and s.phase == "backward"}
    missing = sorted({op for (module, op, _), out in has_out.items() if not out and module not in covered})
    if not missing:
        return ""
    modules = any(row.kind == "module" for row in rows)
    advice = "" if modules else "; level \"mix\" measures them through their modules (Linear)"
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


#: how many uncertain outputs the note names by key
NAMED = 3


def summarize(rows, notes: list, strict: bool = False, baseline=None) -> dict | None:
    """{largest_gap, at, step, rank, differ, outputs, rounding, uncertain, beyond, strict,
    rounding_only, baseline}; None when no output has an envelope (ops the model does not
    know, dumps of values only)."""
    judged = [row for row in rows if row.envelope is not None and row.status in R.PAIRED]
    if not judged:
        return None
    # outputs the judge explained by their inputs' accepted differences through the op's
    # conditioning (amplified) are settled by that rule, not by their envelope's gap
    gapped = [row for row in judged if math.isfinite(row.envelope["gap"])
              and not (row.status == R.EXPLAINED and row.origin == R.AMPLIFIED)]
    worst = max(gapped, key=lambda row: row.envelope["gap"], default=None)
    differ = any(row.envelope["seen"] > 0 for row in judged) or any(
        row.metrics is not None and row.metrics.bit_equal is False for row in rows if row.status in R.PAIRED)
    uncertain = [row for row in judged if row.status == R.EXPLAINED and row.origin == "uncertain"]
    beyond = [row for row in judged if row.envelope["verdict"] == "beyond"]
    # the claim "rounding only" needs every size known from above (a statistics lower bound
    # without a sketch is not) and every gap within FACTOR x what rounding makes
    measured = all(row.envelope["high"] is not None for row in judged if row.envelope["seen"] > 0)
    settled = all(row.envelope["seen"] == 0 or row.envelope["gap"] <= FACTOR or row.status == R.EXPLAINED
                  for row in judged)
    summary = {
        "largest_gap": worst.envelope["gap"] if worst is not None else None,
        "at": worst.key if worst is not None else None,
        "step": worst.step if worst is not None else None,
        "rank": worst.rank if worst is not None else None,
        "differ": differ,
        "outputs": len(judged),
        "rounding": sum(1 for row in judged if row.status == R.EXPLAINED and row.origin == "rounding"),
        "uncertain": len(uncertain),
        "beyond": len(beyond),
        "strict": strict,
        "rounding_only": differ and not beyond and measured and settled and not strict,
        "baseline": str(baseline) if baseline is not None else None,
    }
    if uncertain:
        shown = "; ".join(f"{row.key} at step {row.step} rank {row.rank} ({row.envelope['text']})"
                          for row in uncertain[:NAMED])
        more = f" and {len(uncertain) - NAMED} more" if len(uncertain) > NAMED else ""
        notes.append(
            f"{len(uncertain)} output{'s are' if len(uncertain) != 1 else ' is'} uncertain: beyond the fixed "
            f"tolerance, and the sketch's band straddles {'their' if len(uncertain) != 1 else 'its'} rounding "
            f"envelope (not counted as divergences): {shown}{more}; the cause of each names the config line "
            "that dumps it as a tensor")
    return summary
