"""Result stage: every step's outcome put together into one CompareResult (data only).

The verdict of each step file pair and of the whole compare, the first divergence and the
likely cause (assemble.story), the top ops (attribute.py) and the notes a reader needs: the
evidence the metrics rest on, devices, records without partner, explained outputs.

Story
-----

Result stage: the first divergence and the likely cause, one story for every report.

* The first divergence is the earliest divergent output record in A's execution order
  (seq; forward and backward as they ran). Records that exist on one side only are never
  a pass and never a divergence: they are counted as only_a / only_b.
* The likely cause is the first divergent output that introduced its error (story()).

Drift
-----

Drift: two correct runs that part over steps through accumulated rounding, no op at fault.

Two runs that differ only in summation order (thread count, kernel library) agree within
tolerance at their first step, yet AdamW turns a rounding-noise gradient (a conv bias before
BatchNorm) into an lr-sized update, and some steps later the parameters, and what is computed
from them, are beyond tolerance. Compare then finds ops whose parameter "differs": error
entering through a parameter, which is how a weight bug looks too. The growth pattern tells
them apart:

* drift starts at rounding level at the first compared step: the runs already differ there
  (records not bit-identical) while everything is within tolerance;
* every divergence that is not inherited enters through parameters whose difference the
  recorded optimizer update of the previous step already wrote (the update's output for that
  parameter differs by at least 1/CARRIED_SHARE of the parameter's difference): it grew
  there, step by step;
* nothing else enters: no changed argument, no external or unpartnered input, no precision
  finding, no op that amplifies agreeing inputs on its own.

A fault jumps instead: a weight scaled before step 3 differs at step 3 by far more than the
optimizer of step 2 wrote, and identical runs are bit-identical before it. Then the verdict
stays as it was. When it is drift, no op is named "introduced": the likely cause is None, the
origins that said "introduced" say "inherited" with the reason, and ``result.drift`` holds
{step, rank, text}. Torch-free.

Entering
--------

The likely cause of a low-precision model: where the error entered, even within tolerance.

In a bfloat16 model the tolerance is about two roundings (rel L2 8e-3). A fault smaller than
that (a weight off by 0.5%, a gradient scaled inside one block) passes at the op where it
enters, grows downstream, and the first op beyond tolerance (a backward o_proj, a later
LayerNorm, an embedding's gradient) takes the blame, or the report says no single op
introduced the error. Two correct kernels of one computation differ by well under one unit
roundoff u of the dtype (each result is rounded once, to within u/2); an error entering at
an op is a different thing when it stands far above that level.

So, in the step file of the first divergence and before it, the first API call whose output
is judged at a 16-bit or coarser tolerance and

* differs by at least ENTERING_UNITS x u of that dtype, and
* either takes that difference from a source (a parameter, an external input or a tensor
  changed after its producer made it; not a tensor made by a call the other run does not
  have: different kernels round differently), at least as large as what its produced inputs
  carry, or makes it itself: more than AMPLIFICATION x what its produced inputs carry (and
  the rounding flips that carry causes, sqrt(carried x u)),

becomes the likely cause ("introduced", with the reason), unless an op introduced its error
at or before it. Float32 and float64 records keep the compare's rules (their tolerance is far
above their rounding). Torch-free.
"""

from __future__ import annotations

import math

from probe.comparison import result as R
from probe.comparison import drift_rounding, shard_entry
from probe.comparison.result import count_rows
from probe.comparison.envelope_summary import summarize
from probe.comparison.sketch import sketch_note
from probe.comparison.structs import UNINITIALIZED_NOTE, sci

#: calls that only move a tensor between devices (or pin it): their output equals their input
MOVE_OPS = ("Tensor.cuda", "Tensor.cpu", "Tensor.npu", "Tensor.xpu", "Tensor.mps", "Tensor.pin_memory")
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
    entered = shard_entry.apply(outcomes)
    first, cause = story(outcomes, entered)
    told_first = first
    drifting = find_drift(first, "diverged", steps_info, rows)
    # drift that stays within every op's rounding envelope is rounding: settled before any
    # verdict is counted (drift_rounding.py); then nothing diverges, and there is no story
    settled = drift_rounding.settle(drifting, rows, steps_info, strict)
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
    summaries = [s for outcome in outcomes for s in outcome.summaries]
    unranked = _unranked_backward(rows, summaries)
    if unranked:
        notes.append(unranked)
    diverged = counts["diverged"] > 0 or bool(failing)
    verdict = "diverged" if diverged else "pass"
    tolerances = {"reference": "a", "rule": "||a-b|| <= rtol*||a|| + atol*sqrt(n)", "by_dtype": table.to_dict()}
    top_ops = R.rank_top_ops(summaries, top)
    changes = R.group_changes(rows)
    precision = R.PrecisionTally.total(outcome.precision for outcome in outcomes)
    notes.extend(precision.notes())
    # the story's first divergence is a divergent row, so the verdict was "diverged" above too
    drift = drifting if first is told_first else find_drift(first, verdict, steps_info, rows)
    if drift is not None:  # no op introduced an error: the runs part through accumulated rounding
        apply_drift(drift, rows, list(top_ops) + list(summaries))
        cause = None
        notes.insert(0, drift["text"])
    else:
        cause = entering_cause(first, cause, rows)
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


def first_divergence(rows: list[R.RecordRow]) -> R.RecordRow | None:
    """Earliest divergent output in execution order (inputs only if no output diverged)."""
    diverged = [row for row in rows if row.status == R.DIVERGED]
    outputs = [row for row in diverged if row.divergence in (R.OUTPUT, R.PRECISION)]
    candidates = outputs or [row for row in diverged if row.divergence in (R.PARAM, R.ARGUMENT, R.INPUT)] or diverged
    return min(candidates, key=lambda row: row.order, default=None)


def likely_cause(rows: list[R.RecordRow], first: R.RecordRow | None) -> R.RecordRow | None:
    """The first divergent output that introduced its error; failing that, the first record
    where error entered (a changed parameter or argument, a divergent external input); else
    the first divergence."""
    ordered = sorted((row for row in rows if row.status == R.DIVERGED), key=lambda row: row.order)
    for row in ordered:
        if row.divergence in (R.OUTPUT, R.PRECISION) and row.origin == R.INTRODUCED:
            return row
    for row in ordered:
        if row.divergence in (R.PARAM, R.ARGUMENT, R.INPUT) and row.origin == R.INTRODUCED:
            return row
    return first


def story(outcomes, entered: dict | None = None) -> tuple[R.RecordRow | None, R.RecordRow | None]:
    """(first divergence, likely cause) of a whole compare: one story for every report.

    The earliest step file pair with a divergence decides the step. Among its ranks, a rank
    where an op introduced its error tells the story (on the other ranks the error arrives
    through a collective, DDP's gradient all-reduce, and is only inherited): a rank-1-only
    fault is named on rank 1. When no op of that step introduced its error, the likely cause
    is the first introduced one of a later step file, if any. entered: shard_entry.apply's
    {step: (row, order)}: a shard that differed on entry on one rank tells its step's story
    unless an op introduced an error before it."""
    diverged = [o for o in outcomes if o.diverged]
    if not diverged:
        return None, None
    step = min(o.step for o in diverged)
    shard = (entered or {}).get(step)
    told = []
    for outcome in (o for o in diverged if o.step == step):
        first = first_divergence(outcome.rows)
        told.append((outcome.rank, first, likely_cause(outcome.rows, first)))
    introducing = [t for t in told if t[2] is not None and t[2].origin == R.INTRODUCED]
    if shard is not None and all(shard[1] <= t[2].order for t in introducing):
        return shard[0], shard[0]
    if introducing:
        rank, first, cause = min(introducing, key=lambda t: (t[2].order, t[0]))
        return first, cause
    rank, first, cause = min(told, key=lambda t: (t[1].order, t[0]))
    for outcome in sorted(diverged, key=lambda o: (o.step, o.rank)):
        later = likely_cause(outcome.rows, None)
        if later is not None and later.origin == R.INTRODUCED:
            return first, later
    return first, cause


#: the previous step's update of a parameter must differ by at least this fraction of the
#: parameter's own difference for that difference to count as carried by the optimizer
CARRIED_SHARE = 10.0


def _rel(row) -> float:
    if row.metrics is None or row.metrics.rel_l2 is None:
        return 0.0
    value = row.metrics.rel_l2
    return float(value) if isinstance(value, (int, float)) else 0.0


def _param_name(module: str, slot: str) -> str:
    name = slot.removeprefix("param.")
    return f"{module}.{name}" if module else name


def _source_params(row) -> list | None:
    """[(parameter name, rel L2)] of the divergent sources of an introduced output, or None
    when any source is not a parameter recorded as one (external data, a changed argument)."""
    found = []
    for item in row.input_errors:
        if item.get("status") != R.DIVERGED or item.get("source") in ("produced", "carried", "unrecorded",
                                                                        "forward", "param_update"):
            continue
        producer = item.get("producer") or ""
        if item.get("source") != "param":
            return None
        if item["slot"].startswith("param."):  # a module's own parameter
            found.append((_param_name(row.module, item["slot"]), item.get("rel_l2") or 0.0))
        elif "/param." in producer:  # an api call's input holding a parameter
            module = producer.split("/", 1)[0]
            found.append((_param_name(module, "param." + producer.rsplit("/param.", 1)[1]), item.get("rel_l2") or 0.0))
        else:
            return None
    return found


def _differs_at_rounding(rows) -> bool:
    tensors = [row for row in rows if row.status in R.WITHIN and row.metrics is not None
               and row.metrics.evidence != "value"]
    return any(_rel(row) > 0 or row.metrics.bit_equal is False for row in tensors)


def find_drift(first, verdict: str, steps_info: list[dict], rows: list) -> dict | None:
    """{step, rank, text} when the compare's divergences are drift (see the module docstring)."""
    if first is None or verdict != "diverged":
        return None
    rank = first.rank
    steps = sorted({info["step"] for info in steps_info if info["rank"] == rank})
    by_step: dict = {}
    for row in rows:
        if row.rank == rank:
            by_step.setdefault(row.step, []).append(row)
    if len(steps) < 2 or first.step == steps[0]:
        return None
    if not _differs_at_rounding(by_step.get(steps[0], [])):
        return None  # identical before the divergence: something changed, not rounding
    updates: dict = {}  # (step, parameter) -> largest difference of the optimizer's writes
    for row in rows:
        if row.target and row.io == "out" and row.status in R.PAIRED:
            key = (row.step, row.rank, row.target)
            updates[key] = max(updates.get(key, 0.0), _rel(row))
    for row in rows:
        if row.status != R.DIVERGED or row.origin != R.INTRODUCED:
            continue
        if row.divergence == R.PARAM and not row.slot.startswith("param."):
            continue  # an api call's input holding a parameter: judged at the parameter's record
        if row.divergence == R.PARAM:
            params = [(_param_name(row.module, row.slot), _rel(row))]
        elif row.divergence == R.OUTPUT:
            params = _source_params(row)
        else:
            return None  # a changed argument, an external input, a precision finding
        if not params:
            return None  # an op that made its error from agreeing inputs
        earlier = [step for step in steps if step < row.step] if row.rank == rank else []
        if not earlier:
            return None
        for name, rel in params:
            if updates.get((earlier[-1], row.rank, name), 0.0) * CARRIED_SHARE < rel:
                return None  # the parameter jumped: not what its last update wrote
    text = (f"drift: the runs part through accumulated rounding; they already differ at rounding level at step "
            f"{steps[0]} (within tolerance), and every divergence from step {first.step} on enters through "
            "parameters whose difference the previous step's optimizer update wrote; no op introduced an error "
            "(replay with --replay on tensor dumps checks that no op computes beyond rounding)")
    return {"step": first.step, "rank": rank, "text": text}


def apply_drift(found: dict, rows: list, ops: list) -> None:
    """Take the "introduced" origins of rows and op summaries back where the compare is drift."""
    for row in rows:
        if row.status == R.DIVERGED and row.origin == R.INTRODUCED:
            row.origin = R.INHERITED
            row.cause = f"{row.cause}; drift: this difference grew over the earlier steps' updates"
    for op in ops:
        if op.origin == R.INTRODUCED:
            op.origin = R.INHERITED


#: an error entering this many unit roundoffs of the dtype is beyond two correct kernels' rounding
ENTERING_UNITS = 1.0
#: an op makes the error itself when its output differs this many times more than its inputs
AMPLIFICATION = 10.0
_UNIT = {"bfloat16": 2.0 ** -8, "float16": 2.0 ** -11, "float8_e4m3fn": 2.0 ** -4, "float8_e4m3fnuz": 2.0 ** -4,
         "float8_e5m2": 2.0 ** -3, "float8_e5m2fnuz": 2.0 ** -3}
_SOURCES = ("param", "external", "changed")
_CARRIED = ("produced", "carried", "unrecorded", "forward", "param_update")


def _finite(value) -> float:
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else 0.0


def _row_rel(row) -> float:
    return _finite(row.metrics.rel_l2) if row.metrics is not None else 0.0


def entering_reason(row) -> str | None:
    """Why the error enters at this output row, or None when it does not (module docstring)."""
    unit = _UNIT.get(row.tol_dtype)
    if unit is None or row.kind != "api" or row.io != "out" or row.status not in R.PAIRED:
        return None
    if row.metrics is None or row.metrics.evidence == "value":
        return None
    out = _row_rel(row)
    if out < ENTERING_UNITS * unit:
        return None
    carried = max((_finite(item.get("rel_l2")) for item in row.input_errors if item.get("source") in _CARRIED),
                  default=0.0)
    sources = [item for item in row.input_errors if item.get("source") in _SOURCES]
    entering = max(sources, key=lambda item: _finite(item.get("rel_l2")), default=None)
    size = f"rel L2 {out:.2e}, {out / unit:.3g} units of {row.tol_dtype} roundoff"
    if entering is not None and _finite(entering.get("rel_l2")) >= max(ENTERING_UNITS * unit, carried):
        what = entering.get("producer") or entering["slot"]
        return (f"the error enters here within tolerance: input {entering['slot']} ({entering['source']}: {what}) "
                f"differs by rel L2 {_finite(entering.get('rel_l2')):.2e} ({size} at the output; its produced inputs "
                f"carry {carried:.2e}); two correct kernels differ by well under one unit, and the later "
                "divergence grows from here")
    if out > AMPLIFICATION * max(carried, math.sqrt(carried * unit)):
        return (f"the error enters here within tolerance: the op makes it from inputs that agree ({size}; its "
                f"inputs carry {carried:.2e}); two correct kernels differ by well under one unit, and the later "
                "divergence grows from here")
    return None


def entering_cause(first, cause, rows: list):
    """The likely cause, made the first op where a low-precision error entered when there is
    one before any op introduced its error (module docstring)."""
    if first is None:
        return cause
    rows = sorted((row for row in rows if row.step == first.step and row.rank == first.rank
                   and row.order <= first.order), key=lambda row: row.order)
    for row in rows:
        if cause is not None and cause.origin == R.INTRODUCED and cause.step == row.step and cause.order <= row.order:
            return cause  # an op introduced its error at or before this one
        reason = entering_reason(row)
        if reason is None:
            continue
        if row.status != R.DIVERGED:
            row.origin = R.INTRODUCED
            row.cause = reason
        return row
    return cause


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
