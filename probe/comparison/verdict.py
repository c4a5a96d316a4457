"""Judge aligned records, tell introduced from inherited error, pick the first divergence.

Rules (docs/compare.md explains them for users):

* A tensor record is beyond tolerance when ``||a - b|| > rtol * ||a|| + atol * sqrt(n)``
  (``score`` = the left side over the right side, > 1 fails), with the tolerance of the
  lower-precision dtype; or when NaN or Inf sit on one side only; or when the shapes differ.
  A dtype difference alone is a note.
* A non-tensor argument (value column) compares exactly. A changed argument is a cause: the
  row is a divergence of kind "argument" and every output of that call counts as diverged
  and introduced there. Dtype-valued arguments (``x.to(torch.bfloat16)``) are notes.
* A parameter record (slot ``param.*``) beyond tolerance is a divergence of kind "param".
* Checksum evidence: a pair whose checksums differ while its statistics agree within
  tolerance is CHANGED (within tolerance, not bit-equal, size unknown), or a divergence
  when rounding cannot explain it (judge_checksum_change).
* The inputs of a call are classified through the step's records: *produced* when an
  earlier record outputs the same tensor (same tensor_id, or same checksum/statistics; a
  backward grad_output may be recorded before the grad_input that made it), *param* when it
  is a parameter, *carried* when the previous step file of the rank holds the same values
  (optimizer state, a parameter updated in place), *unrecorded* when no record made it and
  it first shows up after the backward began (a .grad autograd accumulated), else
  *external* (data, buffers, constants, weights of an api-level dump, read by the forward).
  A produced input that differs although its producer agreed was changed by something
  unrecorded in between: *changed*.
* Carriers pass on error made upstream: produced, carried and unrecorded inputs, and any
  input still within tolerance (its error counts even when its scaled output crosses the
  absolute floor). Sources are where error enters: changed arguments, and divergent params, changed
  and external inputs.
* The backward of a call computes from the values its forward saw: when judging a backward
  call, the tensor records of the same call's forward (inputs and outputs, matched by step,
  rank, module, op and index) are carriers too (kind *forward*). A loss's grad_input whose
  grad_output is 1.0 in both runs inherits the error of its forward logits.
* A divergent output is ``introduced`` when an argument changed, when a source's rel L2 is
  at least the largest carrier's, or when its own rel L2 exceeds AMPLIFICATION times the
  largest carrier's; otherwise ``inherited``.
* The first divergence is the earliest divergent output record in A's execution order
  (seq; forward and backward as they ran). Records that exist on one side only are never
  a pass and never a divergence: they are counted as only_a / only_b.
"""

from __future__ import annotations

import math

from probe.comparison import devices
from probe.comparison import result as R
from probe.comparison.metrics import Metrics, parse_value, same_extremes
from probe.comparison.records import is_param_slot
from probe.comparison.tolerances import MANTISSA_BITS, Tolerance

#: an output whose rel L2 error is this many times its inputs' is called introduced
AMPLIFICATION = 10.0

_DTYPE_WORDS = set(MANTISSA_BITS) | {
    "bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64", "half",
    "float", "double", "long", "int", "short",
}


def sci(value: float) -> str:
    """An error in scientific notation, as every report writes them: 1.15e-04 (0 stays 0)."""
    return "0" if value == 0 else f"{value:.2e}"


def is_dtype_value(text: str) -> bool:
    value = parse_value(text)
    return isinstance(value, str) and value.removeprefix("torch.") in _DTYPE_WORDS


def _dtype_limits() -> dict[float, set]:
    """value -> names ("max", "tiny", "eps", negated "-max"...) of the float dtypes' limits
    (torch.finfo), for arguments such as clamp(min=-torch.finfo(x.dtype).max)."""
    import numpy as np

    limits: dict[float, set] = {}

    def add(value: float, name: str) -> None:
        limits.setdefault(float(value), set()).add(name)
        limits.setdefault(-float(value), set()).add("-" + name)

    for dtype in (np.float16, np.float32, np.float64):
        info = np.finfo(dtype)
        add(info.max, "max")
        add(info.tiny, "tiny")
        add(info.eps, "eps")
    add(3.3895313892515355e38, "max")  # bfloat16 (its tiny is float32's)
    add(0.0078125, "eps")
    for value in (448.0, 240.0, 57344.0):  # float8 e4m3fn, e4m3fnuz, e5m2(fnuz) max
        add(value, "max")
    return limits


_LIMITS = _dtype_limits()


def is_dtype_limit_pair(text_a: str, text_b: str) -> bool:
    """Both values are the same limit of two float dtypes (float64's max against float32's)."""
    a, b = parse_value(text_a), parse_value(text_b)
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (a, b)):
        return False
    return bool(_LIMITS.get(float(a), set()) & _LIMITS.get(float(b), set()))


def score_of(metrics: Metrics, tol: Tolerance) -> float:
    budget = tol.budget(metrics.ref_norm, metrics.numel)
    if metrics.err_l2 == 0:
        return 0.0
    if budget <= 0:
        return math.inf
    return metrics.err_l2 / budget


def judge_tensor(row: R.RecordRow, metrics: Metrics, tol: Tolerance) -> None:
    """Set score, status and reasons of a paired tensor row from its metrics."""
    row.metrics = metrics
    row.rtol, row.atol = tol.rtol, tol.atol
    row.score = score_of(metrics, tol)
    reasons = []
    if metrics.nan_mismatch:
        what = "positions" if metrics.evidence == "tensor" else "in the NaN count"
        reasons.append(f"NaN on one side only ({metrics.nan_mismatch} {what})")
    if metrics.inf_mismatch:
        what = "positions" if metrics.evidence == "tensor" else "in the Inf count"
        reasons.append(f"Inf on one side only ({metrics.inf_mismatch} {what})")
    if row.score > 1:
        reasons.append(
            f"rel L2 {sci(metrics.rel_l2)} beyond {row.tol_dtype} tolerance "
            f"(score {row.score:.3g}, rtol {tol.rtol:g}, atol {tol.atol:g})"
        )
    row.reasons.extend(reasons)
    row.status = R.DIVERGED if reasons else R.MATCH


def judge_checksum_change(row: R.RecordRow, untouched: bool) -> None:
    """A pair whose checksums differ while its statistics agree within tolerance.

    Statistics cannot size the change, and rounding cannot explain every such change:
    rounding comes from computing, and it moves nearly every value, extremes included. So
    the record is a divergence ("changed, size unknown") when nothing has computed it yet
    (untouched: a parameter, or an input no recorded op made, read by the forward of step 0
    before any record differed, as the engine decides) and its min, max and NaN/Inf counts
    are bit-identical (the same values in another order, or a few inner values edited: a
    transposed square weight, a shuffled batch). Anywhere else it is status CHANGED: within
    tolerance, but not bit-equal, and said so.
    """
    m = row.metrics
    if row.status != R.MATCH or m is None or m.evidence != "checksum" or m.bit_equal is not False:
        return
    if m.sketch is not None:  # issue 10: the sketches measured the change, and it is within tolerance
        row.status = R.CHANGED
        row.notes.append(f"checksum differs; rel L2 {sci(m.rel_l2)} {m.sketch['text']}, within tolerance")
        return
    if untouched and same_extremes(m):
        row.status = R.DIVERGED
        row.reasons.append(
            f"{R.SIZE_UNKNOWN}: min, max and NaN/Inf counts are identical, so the same values are in other "
            "places or a few were edited; nothing computed this tensor yet, so rounding cannot explain it")
        return
    row.status = R.CHANGED
    if untouched:
        why = "its min or max moved too, as rounding every element would (a reordering keeps them)"
    else:
        why = "rounding can explain it (a computed value, or one an earlier step updated)"
    row.notes.append(f"{R.SIZE_UNKNOWN}: {why}")


def judge_shape(row: R.RecordRow) -> None:
    row.status = R.DIVERGED
    row.reasons.append(f"shape {row.shape_a} in A, {row.shape_b} in B")


def judge_value(row: R.RecordRow, metrics: Metrics) -> None:
    row.metrics = metrics
    row.score = 0.0 if metrics.bit_equal else math.inf
    if metrics.bit_equal:
        row.status = R.MATCH
    elif row.io == "in" and is_dtype_value(metrics.value_a or "") and is_dtype_value(metrics.value_b or ""):
        row.status = R.MATCH  # a dtype choice, never an error by itself
        row.notes.append(f"dtype argument {metrics.value_a} in A, {metrics.value_b} in B")
    elif row.io == "in" and devices.is_placement_pair(row.slot, metrics.value_a or "", metrics.value_b or ""):
        row.status = R.MATCH  # where a tensor lives, never a numerical difference
        row.notes.append(f"{R.PLACEMENT_NOTE} {metrics.value_a} in A, {metrics.value_b} in B (not compared)")
    else:
        row.status = R.DIVERGED
        row.reasons.append(f"value {metrics.value_a} in A, {metrics.value_b} in B")


#: input kinds (engine._Provenance): where the tensor an input slot holds came from
PRODUCED, PARAM_INPUT, PARAM_UPDATE, CARRIED, UNRECORDED, EXTERNAL, CHANGED = (
    "produced", "param", "param_update", "carried", "unrecorded", "external", "changed")
#: a produced input whose producing call has no partner in the other run
UNPAIRED = "unpaired"
#: a tensor record of the forward of the call whose backward is judged: the values the
#: backward computes from (saved activations, the weight the forward read)
FORWARD = "forward"
#: inputs that pass on an error made upstream, divergent or not; parameters and external
#: inputs carry their error too while within tolerance, and are sources once beyond it
CARRIERS = (PRODUCED, PARAM_UPDATE, CARRIED, UNRECORDED, FORWARD)


def is_carrier(kind: str, status: str) -> bool:
    return kind in CARRIERS or status != R.DIVERGED


def forward_carriers(forward: list[R.RecordRow]) -> list[R.RecordRow]:
    """The tensor records of a call's forward that its backward computes from: paired,
    measured as tensors (not plain values)."""
    return [r for r in forward if r.status in R.PAIRED and r.metrics is not None and r.metrics.evidence != "value"]


def judge_call(rows: list[R.RecordRow], input_kind, forward: list[R.RecordRow] = ()) -> None:
    """Classify the divergent rows of one call pair and give its outputs an origin.

    input_kind(row) -> (kind, producer) for an input-side tensor row: kind is "produced",
    "param", "carried" or "external"; producer is the RecordRow of the earlier output that
    made the tensor (None when unknown).

    Carriers pass on error made upstream, whatever their own judgement (a within-tolerance
    input can hand an op an error that its scaled output no longer fits under the absolute
    floor): produced and carried inputs, and every input still within tolerance. Sources are
    where error enters: changed arguments, divergent parameters, produced inputs that differ
    although their producer agreed (changed in between), and divergent external inputs
    (data, a weight of an api-level dump). A
    divergent output is introduced when an argument changed, when a source's rel L2 is at
    least the largest carrier's, or when its own rel L2 exceeds AMPLIFICATION times the
    largest carrier's; otherwise it inherits the error it was given.

    forward: for a backward call, the rows of the same call's forward (already judged). Its
    tensor records are carriers too: a backward recomputes from the forward's values, so a
    grad_input can differ while its grad_output agrees (a loss whose forward logits differ).
    """
    carriers, changed_args, dtype_args, sources = [], [], [], []
    kinds, producers = {}, {}
    dtypes_differ = any(r.dtype_a and r.dtype_b and r.dtype_a != r.dtype_b for r in rows)
    for row in rows:
        if row.io != "in" or row.status not in R.PAIRED:
            continue
        if row.metrics is not None and row.metrics.evidence == "value":
            m = row.metrics
            if row.status == R.DIVERGED and dtypes_differ and is_dtype_limit_pair(m.value_a, m.value_b):
                # clamp(min=-torch.finfo(x.dtype).max) in a float64 run against a float32 one:
                # the argument follows the dtype, which is a note, not an error
                row.status = R.MATCH
                row.reasons.clear()
                row.notes.append(f"dtype limit argument {m.value_a} in A, {m.value_b} in B (the call's dtype differs)")
            if row.status == R.DIVERGED:
                row.divergence = R.ARGUMENT
                row.origin = R.INTRODUCED
                changed_args.append(row)
            elif not row.metrics.bit_equal:
                dtype_args.append(row)  # a dtype choice: named as a cause, never an error alone
            continue
        kind, producer = (PARAM_INPUT, None) if is_param_slot(row.slot) else input_kind(row)
        if kind == PRODUCED and row.status == R.DIVERGED and producer is not None:
            if producer.status == R.EXPLAINED and _explainable(row) and _rel(row) <= 2 * _rel(producer) + 1e-12:
                # the same tensor, whose difference was accepted where it was made
                explain(row, f"carries the accepted difference made by {producer.key} "
                             f"(rel L2 {sci(_rel(producer))}): {producer.cause or 'amplified rounding'}")
            elif producer.status in (R.ONLY_A, R.ONLY_B):
                # made by a call the other run does not have: the runs compute it differently
                kind = UNPAIRED
            elif producer.status in R.WITHIN and producer.order < row.order:
                # the op that made this tensor agreed, yet it differs here: something that was
                # not recorded changed it in between (a custom autograd Function, a hook, ...)
                kind = CHANGED
        kinds[id(row)] = kind
        if kind == CARRIED and row.status in R.WITHIN and row.accepted is None:
            # state from the previous step, judged there: within tolerance here, accepted
            row.accepted = True
        if producer is not None:
            producers[id(row)] = producer
            if row.status in R.WITHIN and row.status != R.EXPLAINED and kind == PRODUCED:
                # the same tensor as its producer's output: accepted as that one was
                row.accepted = bool(row.accepted) or rounding_ok(row) or is_accepted(producer)
        (carriers if is_carrier(kind, row.status) else sources).append(row)
        if row.status == R.DIVERGED:
            row.divergence = R.PARAM if kind == PARAM_INPUT else R.INPUT
            row.origin = R.INHERITED if kind in CARRIERS else R.INTRODUCED
    for row in forward_carriers(forward):
        carriers.append(row)
        kinds[id(row)] = FORWARD
    carried_rel = max((_rel(r) for r in carriers), default=0.0)
    source_rel = max((_rel(r) for r in sources), default=0.0)
    # every input agreed or its difference was accepted: what the output may differ by is
    # what those differences explain through the op (judged below), not a new error
    accepted = not sources and not changed_args and all(is_accepted(r) for r in carriers)
    amplifier = amplifies(rows[0].op) if rows else False
    summary = [_input_summary(r, kinds[id(r)], producers.get(id(r))) for r in rows if id(r) in kinds]
    summary += [_input_summary(r, FORWARD, None) for r in carriers if kinds[id(r)] == FORWARD]
    outputs = [row for row in rows if row.io == "out" and row.status in R.PAIRED]
    if changed_args and _identical(outputs):
        # use_cache=True against False: the call computed exactly the same; no effect here
        for arg in changed_args:
            arg.status, arg.origin, arg.divergence = R.MATCH, "", ""
            arg.reasons.clear()
            arg.notes.append(f"argument {arg.slot} differs ({arg.metrics.value_a} in A, {arg.metrics.value_b} in B) "
                             "but every output of the call is identical: no effect here")
        changed_args = []
    _reduction_scales(rows, outputs)
    for row in outputs:
        row.input_errors = summary
        if changed_args and row.status in R.WITHIN:
            row.status = R.DIVERGED
            row.reasons.append("computed with a changed argument")
        if row.status != R.DIVERGED:
            if row.status in R.WITHIN and not changed_args:
                row.accepted = bool(row.accepted) or rounding_ok(row) or (accepted and (
                    _explains(carriers, _rel(row), carried_rel) or (amplifier and carried_rel > 0)))
            continue
        if not changed_args and _within_scaled_budget(row):
            explain(row, f"a cancelling sum: tiny against the tensor it was reduced from (norm "
                         f"{row.scale_norm:.3g}, its own {row.metrics.ref_norm:.3g}); judged against that scale it "
                         f"is within tolerance", R.AMPLIFIED)
            continue
        row.divergence = R.OUTPUT
        out_rel = _rel(row)
        from_source = bool(sources) and not source_rel < carried_rel
        within_ratio = _explains(carriers, out_rel, carried_rel)
        conditioned = amplifier and carried_rel > 0 and math.isfinite(out_rel)
        if changed_args or from_source:
            row.origin = R.INTRODUCED
            row.cause = _cause(changed_args + dtype_args, sources if from_source else [], kinds, producers,
                               False, carriers, out_rel, carried_rel)
        elif accepted and _explainable(row) and (within_ratio or conditioned):
            explain(row, _amplified_cause(row, carriers, out_rel, carried_rel, within_ratio), R.AMPLIFIED)
        elif within_ratio:
            row.origin = R.INHERITED
            worst = max(carriers, key=_rel)
            row.cause = _inherited_cause(worst, kinds[id(worst)], producers.get(id(worst)), out_rel)
        elif conditioned and _explainable(row):
            row.origin = R.AMPLIFIED
            row.cause = _amplified_cause(row, carriers, out_rel, carried_rel, False)
        else:
            row.origin = R.INTRODUCED
            row.cause = _cause(changed_args + dtype_args, [], kinds, producers, True, carriers, out_rel, carried_rel)
            if row.kind != "api":
                row.cause += ": the error arises inside this module"
    stale = [r for r in rows if r.io == "in" and r.stale]
    for row in outputs:
        if stale and row.status == R.DIVERGED and row.origin == R.INTRODUCED:
            row.cause += (f"; input {stale[0].slot} was not compared ({stale[0].stale}'s record holds the values from "
                          "before an in-place write): if that write did not happen, the error entered there")
    _unused_inputs(rows, outputs, kinds)


#: ops whose output can differ far more than their inputs (relatively) without any error of
#: their own: a division or reciprocal by values near their own error, a square root near 0,
#: a subtraction of nearly equal values, exp/pow of a difference, and the optimizer updates
#: built on them (Adam's m / (sqrt(v) + eps) is about sign(g) whatever |g|)
_AMPLIFIERS = frozenset({
    "div", "divide", "true_divide", "addcdiv", "reciprocal", "rsqrt", "sqrt", "sub", "rsub", "subtract",
    "exp", "exp2", "expm1", "pow", "log", "log1p", "log_softmax", "softmax", "adam", "adamw", "sgd",
    "fused_adam", "fused_adamw", "fused_sgd", "normalize", "batch_norm", "layer_norm", "group_norm",
    "instance_norm", "rms_norm", "var", "std", "var_mean", "std_mean", "atan2", "tan",
})


def accepted_difference(row: R.RecordRow) -> bool:
    """An accepted output that differs at all: the next step file accepts the same values again
    when it reads them (a parameter the optimizer updated, judged here with the precision of
    what it was computed from, read there as a float32 parameter)."""
    m = row.metrics
    return is_accepted(row) and m is not None and m.evidence != "value" and m.err_l2 > 0


def is_accepted_carry(row: R.RecordRow) -> bool:
    """A divergent record that may carry an accepted difference from an earlier step (sized)."""
    return _explainable(row)


def _identical(outputs) -> bool:
    """The call has tensor outputs and every one is the same in both runs (no measured
    difference at all, NaN and Inf in the same places)."""
    tensors = [r for r in outputs if r.metrics is not None and r.metrics.evidence != "value"]
    return bool(tensors) and all(
        r.metrics.err_l2 == 0 and not r.metrics.nan_mismatch and not r.metrics.inf_mismatch
        and r.metrics.bit_equal is not False and not (r.shape_a and r.shape_b and r.shape_a != r.shape_b)
        for r in tensors)


def _explains(carriers, out_rel: float, carried_rel: float) -> bool:
    """The output's relative error is no more than its inputs' can make: AMPLIFICATION times
    theirs, and, for inputs that differ by more than their own size (rounding noise compared
    with rounding noise), the growth of a product of two such inputs ((1 + e)^2 - 1)."""
    return bool(carriers) and out_rel <= AMPLIFICATION * carried_rel * max(1.0, 1.0 + carried_rel)


def rounding_ok(row: R.RecordRow) -> bool:
    """Its difference is within the relative tolerance of its scale (its own norm, or the norm
    of what it was reduced from): rounding, not a small real difference hidden under the
    absolute floor atol."""
    m = row.metrics
    if m is None or m.evidence == "value" or m.err_l2 == 0:
        return True
    if m.nan_mismatch or m.inf_mismatch or not math.isfinite(m.err_l2):
        return False
    # statistics and checksum evidence: the lower bound is all there is (as for the status)
    return m.err_l2 <= (row.rtol or 0.0) * max(m.ref_norm, row.scale_norm)


def is_accepted(row: R.RecordRow) -> bool:
    """The row's difference is one a correct run may have: explained, or within tolerance and
    rounding (or explained by accepted differences, as judge_call decided for outputs)."""
    if row.status == R.EXPLAINED:
        return True
    if row.status not in R.WITHIN:
        return False
    return row.accepted if row.accepted is not None else rounding_ok(row)


def _reduction_scales(rows, outputs) -> None:
    """Outputs that sum over many elements of an input (a bias gradient sums grad_output over
    all but one dimension; torch.sum, torch.mean) get that input's scale: a cancelling sum is
    tiny against its summands, and so is the rounding it carries."""
    head = rows[0] if rows else None
    if head is None:
        return
    if head.phase == "backward":
        source = next((r for r in rows if r.slot == "grad_output.0" and r.metrics is not None
                       and r.metrics.evidence != "value"), None)
        name = None
    else:
        name = head.op.rsplit(".", 1)[-1]
        source = next((r for r in rows if r.slot == "input.0" and r.metrics is not None
                       and r.metrics.evidence != "value"), None) if name in ("sum", "mean", "nansum", "nanmean") else None
    if source is None or not source.metrics.numel:
        return
    for row in outputs:
        m = row.metrics
        if m is None or m.evidence == "value" or not m.numel or m.numel >= source.metrics.numel:
            continue
        if head.phase == "backward" and (row.shape_a or "").count(",") > 0:
            continue  # a weight gradient is a product, not a plain sum
        scale = source.metrics.ref_norm
        if name in ("mean", "nanmean"):
            scale /= source.metrics.numel / m.numel
        row.scale_norm = max(row.scale_norm, scale)


def _within_scaled_budget(row: R.RecordRow) -> bool:
    m = row.metrics
    if not row.scale_norm or row.scale_norm <= m.ref_norm or not _explainable(row) or row.rtol is None:
        return False
    return m.err_l2 <= row.rtol * row.scale_norm + (row.atol or 0.0) * math.sqrt(max(m.numel, 0))


def amplifies(op: str) -> bool:
    """The op is one whose conditioning can amplify relative error (see _AMPLIFIERS)."""
    name = op.rsplit(".", 1)[-1].removeprefix("_foreach_").removeprefix("_fused_").strip("_")
    if name in _AMPLIFIERS or name.removeprefix("fused_") in _AMPLIFIERS:
        return True
    # a module (kind "module": the class name): BatchNorm2d, LayerNorm, LlamaRMSNorm, Softmax
    lowered = name.lower().rstrip("123d")
    return lowered.endswith(("norm", "softmax"))


def _explainable(row: R.RecordRow) -> bool:
    """A difference that other differences can explain: a sized, finite one (NaN or Inf on
    one side only, a shape change or a tensor against a value never is)."""
    m = row.metrics
    if m is None or m.evidence == "value" or m.nan_mismatch or m.inf_mismatch:
        return False
    if row.size_unknown or (row.shape_a and row.shape_b and row.shape_a != row.shape_b):
        return False
    return math.isfinite(m.rel_l2)


def explain(row: R.RecordRow, cause: str, origin: str = R.AMPLIFIED) -> None:
    """Accept a difference beyond the row's own tolerance that accepted differences explain."""
    row.status = R.EXPLAINED
    row.origin = origin
    row.cause = cause
    row.divergence = ""
    kept = [r for r in row.reasons if not (r.startswith("rel L2 ") and " tolerance (score " in r)]
    row.notes.extend(f"{R.EXPLAINED} ({r})" for r in row.reasons if r not in kept)
    row.reasons = kept


def explain_module_by_its_calls(call: list[R.RecordRow], judged: list[R.RecordRow]) -> None:
    """Level "mix": a module call is the composition of the api calls recorded inside it.

    call: the rows of one module call pair; judged: the rows of the calls judged before it
    (every call whose outputs were made earlier, so every api call inside this one).
    When every api call recorded inside the module call (same phase, between the module
    call's first and last record, in the module or below it) is within tolerance or explained,
    a divergent output of the module call is what those calls computed, put together by code
    probe does not record (autograd summing the gradient of an input used twice): explained
    when it is within AMPLIFICATION times their largest difference, not an error of its own.
    """
    if not call or call[0].kind != "module":
        return
    outputs = [r for r in call if r.io == "out" and r.status == R.DIVERGED and r.origin == R.INTRODUCED
               and r.divergence == R.OUTPUT and _explainable(r)]
    orders = [r.order for r in call if r.order]
    if not outputs or not orders:
        return
    head = call[0]
    first, last = min(orders), max(orders)
    inside = [r for r in judged if r.kind == "api" and r.io == "out" and r.status in R.PAIRED
              and r.step == head.step and r.rank == head.rank and r.phase == head.phase
              and r.order and first < r.order < last
              and (not head.module or r.module == head.module or r.module.startswith(head.module + "."))]
    if not inside or any(r.status == R.DIVERGED for r in inside):
        return
    worst = max(inside, key=_rel)
    for row in outputs:
        if _rel(row) <= AMPLIFICATION * _rel(worst):
            explain(row, f"every api call recorded inside {head.module or 'the root module'} agrees or is "
                         f"explained (largest: {worst.key}, rel L2 {sci(_rel(worst))}); this output puts their "
                         f"results together (rel L2 {sci(_rel(row))}) in code probe does not record")


def unexplain(row: R.RecordRow, cause: str) -> None:
    """Undo explain(): the output is a divergence its own op introduced."""
    row.status = R.DIVERGED
    row.origin = R.INTRODUCED
    row.divergence = R.OUTPUT
    row.cause = cause
    row.reasons.extend(note.removeprefix(f"{R.EXPLAINED} (").removesuffix(")") for note in row.notes
                       if note.startswith(f"{R.EXPLAINED} ("))
    row.notes = [note for note in row.notes if not note.startswith(f"{R.EXPLAINED} (")]


def _amplified_cause(row, carriers, out_rel, carried_rel, within_ratio) -> str:
    worst = max(carriers, key=_rel)
    if within_ratio:
        how = f"{out_rel / carried_rel:.3g}x" if carried_rel > 0 else "no more"
        return (f"amplified: its inputs' accepted differences explain it (largest {worst.slot}, rel L2 "
                f"{sci(carried_rel)}; output {sci(out_rel)}, {how} that)")
    return (f"amplified: {row.op} turns its inputs' small differences (largest {worst.slot}, rel L2 "
            f"{sci(carried_rel)}) into rel L2 {sci(out_rel)} by its conditioning (division by values near their "
            f"own error, cancellation), not by an error of its own")


def _unused_inputs(rows, outputs, kinds) -> None:
    """An input read from outside the step's records (a buffer, state carried over) that
    differs while every tensor output of the call agrees had no effect on this call
    (BatchNorm's running statistics in training mode): accepted, with a note."""
    tensors = [r for r in outputs if r.metrics is not None and r.metrics.evidence != "value"]
    if not tensors or any(r.status not in R.WITHIN for r in tensors):
        return
    for row in rows:
        if row.io == "in" and row.status == R.DIVERGED and kinds.get(id(row)) in (EXTERNAL, CARRIED, UNRECORDED) \
                and _explainable(row):
            explain(row, f"differs (rel L2 {sci(_rel(row))}) but every output of this call agrees: it has no effect "
                         f"here (a buffer such as BatchNorm's running statistics in training mode)", "")


def _rel(row: R.RecordRow) -> float:
    """The rel L2 error of a row; inf when it diverged without one (NaN/Inf on one side,
    shapes differ, a tensor against a plain value, changed bytes of unknown size)."""
    m = row.metrics
    if row.stale:
        return 0.0  # not compared: its record holds values from before an in-place write (stale.py)
    if m is None or m.nan_mismatch or m.inf_mismatch or (row.status == R.DIVERGED and row.size_unknown):
        return math.inf if row.status == R.DIVERGED else 0.0
    return m.rel_l2


def _size(row: R.RecordRow) -> str:
    """How much a source differs, in words: "rel L2 1.15e-04" or the unknown-size change."""
    if row.size_unknown:
        return "checksum differs; statistics agree, size unknown"
    return f"rel L2 {sci(_rel(row))}"


def _input_summary(row: R.RecordRow, kind: str, producer: R.RecordRow | None) -> dict:
    return R.json_safe({
        "slot": f"forward.{row.slot}" if kind == FORWARD else row.slot,
        "source": kind,
        "producer": producer.key if producer is not None else None,
        "status": row.status,
        "rel_l2": row.metrics.rel_l2 if row.metrics is not None else None,
        "max_abs": row.metrics.max_abs if row.metrics is not None else None,
        "score": row.score,
        "size_unknown": row.size_unknown,
    })


_ENTERS = {
    EXTERNAL: "differs and no recorded op produced it in this step (data, a buffer, a weight not recorded as a "
              "parameter)",
    CHANGED: "differs although {producer}, which made it, agreed: something not recorded changed it in between "
             "(a custom autograd Function, a hook, ...)",
    UNPAIRED: "differs and was made by {producer}, which has no partner in the other run: the runs compute it "
              "with different ops",
}


def _cause(changed_args, sources, kinds, producers, amplified, carriers, out_rel, carried_rel) -> str:
    if changed_args:
        arg = changed_args[0]
        return f"argument {arg.slot} changed: {arg.metrics.value_a} in A, {arg.metrics.value_b} in B"
    parts = []
    params = [r for r in sources if kinds[id(r)] == PARAM_INPUT]
    if params:
        names = ", ".join(param_name(r, producers.get(id(r))) for r in params)
        worst = max(params, key=_rel)
        parts.append(f"parameter {names} {R.SIZE_UNKNOWN}" if worst.size_unknown
                     else f"parameter {names} differs ({_size(worst)})")
    for row in sources:
        kind = kinds[id(row)]
        if kind in _ENTERS:
            producer = producers.get(id(row))
            text = _ENTERS[kind].format(producer=producer.key if producer is not None else "the op")
            parts.append(f"input {row.slot} ({_size(row)}) {text}")
    if amplified and not carriers:
        parts.append("it has no recorded tensor input: the op itself computes differently")
    elif amplified:
        if any(r.status == R.DIVERGED for r in carriers):
            ratio = out_rel / carried_rel if carried_rel > 0 else math.inf
            parts.append(f"amplifies its inputs' error {ratio:.3g}x (rel L2 {sci(carried_rel)} -> {sci(out_rel)})")
        else:
            parts.append(f"its inputs agree within tolerance (largest input rel L2 {sci(carried_rel)}, "
                         f"output {sci(out_rel)})")
    return "; ".join(parts)


def param_name(row: R.RecordRow, record: R.RecordRow | None) -> str:
    """blocks.1.fc.weight: from the param.* record (its own, or the one holding the same tensor)."""
    record = record if record is not None else row
    if not record.slot.startswith("param."):
        return row.slot
    name = record.slot.removeprefix("param.")
    return f"{record.module}.{name}" if record.module else name


def _inherited_cause(worst: R.RecordRow, kind: str, producer: R.RecordRow | None, out_rel: float) -> str:
    if kind == CARRIED:
        origin = "state carried over from the previous step (optimizer state, a parameter or buffer updated in place)"
    elif kind == PARAM_UPDATE:
        origin = (f"parameter {param_name(worst, producer)}, read after the backward began (an optimizer update); "
                  "its difference entered where the forward read it")
    elif kind == PARAM_INPUT:
        origin = f"parameter {param_name(worst, producer)}, within tolerance"
    elif kind == UNRECORDED:
        origin = ("made after the backward began by something not recorded (a parameter gradient accumulated by "
                  "autograd, optimizer state)")
    elif kind == EXTERNAL:
        origin = "read from outside the recorded ops (data, a buffer), within tolerance"
    elif kind == FORWARD:
        return (f"forward {worst.slot} of this call {_carries(worst)} (rel L2 {sci(_rel(worst))}, "
                f"output {sci(out_rel)}); the backward computes from the values its forward saw")
    elif producer is not None:
        origin = f"made by {producer.key}"
    else:
        origin = "made upstream"
    return (f"input {worst.slot} {_carries(worst)} (rel L2 {sci(_rel(worst))}, output {sci(out_rel)}); "
            f"it was {origin}")


def _carries(row: R.RecordRow) -> str:
    """How an input hands on its error, in words that agree with its own status."""
    if row.status == R.DIVERGED:
        return "already carries the error"
    if row.status == R.EXPLAINED:
        return "carries an accepted difference"
    return ("carries a difference within its own tolerance (under the absolute floor atol, not rounding) that "
            "this op scales beyond the output's")


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


def story(outcomes) -> tuple[R.RecordRow | None, R.RecordRow | None]:
    """(first divergence, likely cause) of a whole compare: one story for every report.

    The earliest step file pair with a divergence decides the step. Among its ranks, a rank
    where an op introduced its error tells the story (on the other ranks the error arrives
    through a collective, DDP's gradient all-reduce, and is only inherited): a rank-1-only
    fault is named on rank 1. When no op of that step introduced its error, the likely cause
    is the first introduced one of a later step file, if any."""
    diverged = [o for o in outcomes if o.diverged]
    if not diverged:
        return None, None
    step = min(o.step for o in diverged)
    told = []
    for outcome in (o for o in diverged if o.step == step):
        first = first_divergence(outcome.rows)
        told.append((outcome.rank, first, likely_cause(outcome.rows, first)))
    introducing = [t for t in told if t[2] is not None and t[2].origin == R.INTRODUCED]
    if introducing:
        rank, first, cause = min(introducing, key=lambda t: (t[2].order, t[0]))
        return first, cause
    rank, first, cause = min(told, key=lambda t: (t[1].order, t[0]))
    for outcome in sorted(diverged, key=lambda o: (o.step, o.rank)):
        later = likely_cause(outcome.rows, None)
        if later is not None and later.origin == R.INTRODUCED:
            return first, later
    return first, cause


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


def summarize_call(rows: list[R.RecordRow], forward: list[R.RecordRow] = ()) -> R.OpSummary | None:
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
    input_rel = max((_rel(r) for r in rows if r.io == "in" and r.slot in carried), default=0.0)
    input_rel = max([input_rel] + [_rel(r) for r in forward_carriers(forward)])
    # an explained output adds nothing: its inputs' accepted differences account for it
    added = [(0.0 if r.status == R.EXPLAINED else added_score(_score(r), _rel(r), input_rel), _score(r), r)
             for r in outputs]
    introduced, _, worst = max(added, key=lambda item: (item[0], item[1]))
    out_rel = _rel(worst)
    head = rows[0]
    return R.OpSummary(
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
        diverged=any(r.status == R.DIVERGED for r in outputs),
        origin=worst.origin,
        source=worst.source,
        target=head.target,
    )


def _score(row: R.RecordRow) -> float:
    if row.score is None:
        return math.inf if row.status == R.DIVERGED else 0.0
    return row.score


def _number(value) -> float:
    if isinstance(value, (int, float)):
        return float(value)
    return {"inf": math.inf, "-inf": -math.inf}.get(value, 0.0)
