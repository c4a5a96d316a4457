"""Judge stage, call rules: which differences of one call pair explain the others.

* The inputs of a call are classified through the step's records (measure.py):
  *produced* when an earlier record outputs the same tensor, *param* when it is a parameter,
  *carried* when the previous step file of the rank holds the same values, *unrecorded*
  when no record made it and it first shows up after the backward began, else *external*.
  A produced input that differs although its producer agreed was changed by something
  unrecorded in between: *changed*.
* A parameter record (slot ``param.*``) beyond tolerance is a divergence of kind "param".
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
  largest carrier's; otherwise ``inherited``. An output whose inputs' accepted differences
  explain it is ``explained`` (origin ``amplified``): not a divergence.

"""

from __future__ import annotations

import math

from probe.comparison import result as R
from probe.comparison.op_envelopes import LOW_PRECISION, UNIT_ROUNDOFF as _ROUNDOFF
from probe.comparison.ops import BATCH_NORM_TRAINING, MEANS, RUNNING_STATISTICS, is_batch_norm
from probe.comparison.records import LOCAL_GRAD, is_param_slot, param_name
from probe.comparison.structs import (
    CARRIED, CARRIERS, CHANGED_INPUT, EXTERNAL, FORWARD, PARAM_INPUT, PARAM_UPDATE, PRODUCED, UNPAIRED, UNRECORDED,
    forward_carriers, is_carrier, rel_error, sci,
)

#: an output whose rel L2 error is this many times its inputs' is called introduced
AMPLIFICATION = 10.0


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


def is_dtype_limit_pair(a, b) -> bool:
    """Both (parsed) values are the same limit of two float dtypes (float64's max against float32's)."""
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (a, b)):
        return False
    return bool(_LIMITS.get(float(a), set()) & _LIMITS.get(float(b), set()))


def judge_call(rows: list[R.RecordRow], input_kind, forward: list[R.RecordRow] = (), values=None,
               clean_before=None) -> None:
    """Classify the divergent rows of one call pair and give its outputs an origin.

    values(row) -> both runs' parsed values of a plain-value row (Measurement.values).
    clean_before(row) -> whether every tensor output the step file made before this input
    is accepted (accept_unrecorded); None: not known.
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
    unread = _unread_running_statistics(rows)
    for row in rows:
        if row.io != "in" or row.status not in R.PAIRED:
            continue
        if row.slot in unread:
            if row.status == R.DIVERGED and row.explainable:
                row.explain(f"differs (rel L2 {sci(rel_error(row))}) but a batch norm in training mode normalizes with "
                             "the batch's statistics: its running statistics only receive an update, they make no "
                             "part of the output", "")
            continue
        if row.metrics is not None and row.metrics.evidence == "value":
            m = row.metrics
            if row.status == R.DIVERGED and dtypes_differ and is_dtype_limit_pair(*values(row)):
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
            if producer.status == R.EXPLAINED and row.explainable and rel_error(row) <= 2 * rel_error(producer) + 1e-12:
                # the same tensor, whose difference was accepted where it was made
                row.explain(f"carries the accepted difference made by {producer.key} "
                             f"(rel L2 {sci(rel_error(producer))}): {producer.cause or 'amplified rounding'}")
            elif producer.status in (R.ONLY_A, R.ONLY_B):
                # made by a call the other run does not have: the runs compute it differently
                kind = UNPAIRED
            elif producer.status in R.WITHIN and producer.order < row.order:
                # the op that made this tensor agreed, yet it differs here: something that was
                # not recorded changed it in between (a custom autograd Function, a hook, ...)
                kind = CHANGED_INPUT
        kinds[id(row)] = kind
        if kind == CARRIED and row.status in R.WITHIN and row.accepted is None:
            # state from the previous step, judged there: within tolerance here, accepted
            row.accepted = True
        if producer is not None:
            producers[id(row)] = producer
            if row.status in R.WITHIN and row.status != R.EXPLAINED and kind == PRODUCED:
                # the same tensor as its producer's output: accepted as that one was
                row.accepted = bool(row.accepted) or row.rounding_ok or producer.is_accepted
                if producer.status in (R.ONLY_A, R.ONLY_B) and row.tol_dtype in LOW_PRECISION and clean_before is not None:
                    # another kernel of the same computation made it (explain_different_kernels)
                    row.accepted = row.accepted or None
                    accept_unrecorded(row, clean_before)
        (carriers if is_carrier(kind, row.status) else sources).append(row)
        if row.status == R.DIVERGED:
            row.divergence = R.PARAM if kind == PARAM_INPUT else R.INPUT
            row.origin = R.INHERITED if kind in CARRIERS else R.INTRODUCED
    _accept_assembled(carriers, kinds)
    for row in carriers if clean_before is not None else ():
        kind = kinds[id(row)]
        if kind == UNRECORDED or (kind == EXTERNAL and row.step > 0 and row.status in R.WITHIN):
            # data after step 0 may be made from the model the earlier steps accepted (rollouts)
            accept_unrecorded(row, clean_before)
    for row in forward_carriers(forward):
        carriers.append(row)
        kinds[id(row)] = FORWARD
    carried_rel = max((rel_error(r) for r in carriers), default=0.0)
    source_rel = max((rel_error(r) for r in sources), default=0.0)
    # every input agreed or its difference was accepted: what the output may differ by is
    # what those differences explain through the op (judged below), not a new error
    accepted = not sources and not changed_args and all(r.is_accepted for r in carriers)
    amplifier = bool(rows) and (rows[0].spec.amplifies or (rows[0].phase == "backward"
                                                           and rows[0].spec.backward_amplifies))
    summary = [input_summary(r, kinds[id(r)], producers.get(id(r))) for r in rows if id(r) in kinds]
    summary += [input_summary(r, FORWARD, None) for r in carriers if kinds[id(r)] == FORWARD]
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
                row.accepted = bool(row.accepted) or row.rounding_ok or (accepted and (
                    _explains(carriers, rel_error(row), carried_rel) or (amplifier and carried_rel > 0)))
            continue
        if not changed_args and _within_scaled_budget(row):
            row.explain(f"a cancelling sum: tiny against the tensor it was reduced from (norm "
                         f"{row.scale_norm:.3g}, its own {row.metrics.ref_norm:.3g}); judged against that scale it "
                         f"is within tolerance", R.AMPLIFIED)
            continue
        row.divergence = R.OUTPUT
        out_rel = rel_error(row)
        from_source = bool(sources) and not source_rel < carried_rel
        within_ratio = _explains(carriers, out_rel, carried_rel)
        conditioned = amplifier and carried_rel > 0 and math.isfinite(out_rel)
        if changed_args or from_source:
            row.origin = R.INTRODUCED
            row.cause = cause_text(changed_args + dtype_args, sources if from_source else [], kinds, producers,
                               False, carriers, out_rel, carried_rel)
        elif accepted and row.explainable and (within_ratio or conditioned):
            row.explain(amplified_cause(row, carriers, out_rel, carried_rel, within_ratio), R.AMPLIFIED)
        elif within_ratio:
            row.origin = R.INHERITED
            worst = max(carriers, key=rel_error)
            row.cause = inherited_cause(worst, kinds[id(worst)], producers.get(id(worst)), out_rel)
        elif conditioned and row.explainable:
            row.origin = R.AMPLIFIED
            row.cause = amplified_cause(row, carriers, out_rel, carried_rel, False)
        else:
            row.origin = R.INTRODUCED
            row.cause = cause_text(changed_args + dtype_args, [], kinds, producers, True, carriers, out_rel, carried_rel)
            if row.kind != "api":
                row.cause += ": the error arises inside this module"
    stale = [r for r in rows if r.io == "in" and r.stale]
    for row in outputs:
        if stale and row.status == R.DIVERGED and row.origin == R.INTRODUCED:
            row.cause += (f"; input {stale[0].slot} was not compared ({stale[0].stale}'s record holds the values from "
                          "before an in-place write): if that write did not happen, the error entered there")
    if _unused_inputs(rows, outputs, kinds) and not changed_args and not sources \
            and all(r.is_accepted for r in carriers):
        # the inputs it explained count as accepted now: so do the outputs they explain
        for row in outputs:
            if row.status in R.WITHIN and not row.accepted:
                row.accepted = row.rounding_ok or _explains(carriers, rel_error(row), carried_rel) or (
                    amplifier and carried_rel > 0)


def accept_unrecorded(row: R.RecordRow, clean_before) -> None:
    """An input that unrecorded code made after the backward began (autograd summing the
    gradients of a tensor read twice, a parameter's gradient accumulated), or a kernel the
    other run does not have, has no envelope of its own. When every paired output recorded
    before it is accepted, it is made from accepted values by a few more roundings: its
    difference is accepted while it is within AMPLIFICATION times the largest difference of
    those outputs (clean_before(row): that difference, None when one of them is not
    accepted), and explained where beyond its tolerance. The fixed rtol says nothing
    there: a 16-bit backward several ops deep differs by more than the two roundings rtol
    allows, however correct (and drift over steps does the same)."""
    if row.accepted is not None or row.status == R.EXPLAINED or row.rounding_ok or not row.explainable:
        return
    largest = clean_before(row)
    rel = rel_error(row)
    if largest is None or largest <= 0 or rel > AMPLIFICATION * largest:
        return
    if row.status in R.WITHIN:
        row.accepted = True
    elif row.status == R.DIVERGED:
        row.explain(f"made by code probe does not record (autograd summing the gradients of a tensor read more "
                    f"than once, a kernel the other run does not have) from values that all agree or are accepted "
                    f"(largest difference rel L2 {sci(largest)}; this one {sci(rel)}): accumulated rounding")


def _accept_assembled(carriers, kinds) -> None:
    """A buffer that unrecorded framework code assembled from gradients linked to the call
    (FSDP2's reduce-scatter input: the flat copy of its module's local gradients, linked as
    ``local_grad.*`` by normalize.py) differs as they do: when every linked gradient's
    difference is accepted and the buffer's is within twice the largest (a cast to the
    reduce dtype rounds once more), the buffer's is accepted too."""
    linked = [r for r in carriers if r.slot.startswith(LOCAL_GRAD)]
    if not linked or not all(r.is_accepted for r in linked):
        return
    largest = max(linked, key=rel_error)
    bound = 2 * rel_error(largest) + 1e-12
    for row in carriers:
        if kinds[id(row)] != UNRECORDED or not row.explainable or rel_error(row) > bound:
            continue
        if row.status == R.DIVERGED:
            row.explain(f"assembled from the local gradients linked to this call, whose differences are "
                         f"accepted (largest: {largest.key}, rel L2 {sci(rel_error(largest))})")
        elif row.status in R.WITHIN and row.accepted is None:
            row.accepted = True


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
        sums = ""
    else:
        sums = head.spec.sums
        source = next((r for r in rows if r.slot == "input.0" and r.metrics is not None
                       and r.metrics.evidence != "value"), None) if sums else None
    if source is None or not source.metrics.numel:
        return
    for row in outputs:
        m = row.metrics
        if m is None or m.evidence == "value" or not m.numel or m.numel >= source.metrics.numel:
            continue
        if head.phase == "backward" and (row.shape_a or "").count(",") > 0:
            continue  # a weight gradient is a product, not a plain sum
        scale = source.metrics.ref_norm
        if sums == MEANS:
            scale /= source.metrics.numel / m.numel
        row.scale_norm = max(row.scale_norm, scale)


def _within_scaled_budget(row: R.RecordRow) -> bool:
    m = row.metrics
    if not row.scale_norm or row.scale_norm <= m.ref_norm or not row.explainable or row.rtol is None:
        return False
    return m.err_l2 <= row.rtol * row.scale_norm + (row.atol or 0.0) * math.sqrt(max(m.numel, 0))


def _unread_running_statistics(rows) -> frozenset:
    """The running-statistics slots of a batch norm call in training mode (both runs): the
    output reads the batch's own statistics, so a difference there is no input of it."""
    if not rows or rows[0].phase != "forward" or not is_batch_norm(rows[0].op):
        return frozenset()
    for row in rows:
        if row.slot in BATCH_NORM_TRAINING and row.metrics is not None and row.metrics.evidence == "value":
            if str(row.metrics.value_a).lower() == "true" and str(row.metrics.value_b).lower() == "true":
                return RUNNING_STATISTICS
    return frozenset()


def _unused_inputs(rows, outputs, kinds) -> bool:
    """An input read from outside the step's records (a buffer, state carried over) that
    differs while every tensor output of the call agrees had no effect on this call
    (BatchNorm's running statistics in training mode): accepted, with a note. Where the call
    casts it to a coarser dtype (a float32 gradient of a bfloat16 model cast back), the
    difference is one the coarser dtype's tolerance holds. Returns whether it accepted any."""
    tensors = [r for r in outputs if r.metrics is not None and r.metrics.evidence != "value"]
    if not tensors or any(r.status not in R.WITHIN for r in tensors):
        return False
    found = False
    for row in rows:
        if row.io == "in" and row.status == R.DIVERGED and kinds.get(id(row)) in (EXTERNAL, CARRIED, UNRECORDED) \
                and row.explainable:
            coarser = next((r.tol_dtype for r in tensors if _coarser(r.tol_dtype, row.tol_dtype)), "")
            if coarser:
                row.explain(f"differs (rel L2 {sci(rel_error(row))}) in {row.tol_dtype}, and this call casts it to "
                            f"{coarser}, where every output agrees within {coarser}'s tolerance: the difference of "
                            f"values computed from {coarser} ones", "")
            else:
                what = f"buffer {row.buffer}" if row.buffer else "a buffer such as BatchNorm's running statistics " \
                    "in training mode"
                row.explain(f"differs (rel L2 {sci(rel_error(row))}) but every output of this call agrees: it has "
                            f"no effect here ({what})", "")
            found = True
    return found


def _coarser(dtype: str, than: str) -> bool:
    """dtype's unit roundoff is larger than that of ``than`` (both floating dtypes compare knows)."""
    mine, theirs = _ROUNDOFF.get(dtype), _ROUNDOFF.get(than)
    return mine is not None and theirs is not None and mine > theirs


# ---------------------------------------------------------------------------- causes: why an output differs, in words


def amplified_cause(row, carriers, out_rel, carried_rel, within_ratio) -> str:
    worst = max(carriers, key=rel_error)
    if within_ratio and all(r.slot.startswith(LOCAL_GRAD) for r in carriers):
        return (f"made by a reduce-scatter from rank-local gradients that differ by rel L2 "
                f"{sci(carried_rel)} (largest {worst.slot}; output {sci(out_rel)}): the reduction carries "
                "their accepted differences")
    if within_ratio:
        how = f"{out_rel / carried_rel:.3g}x" if carried_rel > 0 else "no more"
        return (f"amplified: its inputs' accepted differences explain it (largest {worst.slot}, rel L2 "
                f"{sci(carried_rel)}; output {sci(out_rel)}, {how} that)")
    return (f"amplified: {row.op} turns its inputs' small differences (largest {worst.slot}, rel L2 "
            f"{sci(carried_rel)}) into rel L2 {sci(out_rel)} by its conditioning (division by values near their "
            f"own error, cancellation), not by an error of its own")


def _size(row: R.RecordRow) -> str:
    """How much a source differs, in words: "rel L2 1.15e-04" or the unknown-size change."""
    if row.size_unknown:
        return "checksum differs; statistics agree, size unknown"
    return f"rel L2 {sci(rel_error(row))}"


def input_summary(row: R.RecordRow, kind: str, producer: R.RecordRow | None) -> dict:
    m, safe = row.metrics, R.json_safe  # the numbers are the entries JSON cannot spell
    return {
        "slot": f"forward.{row.slot}" if kind == FORWARD else row.slot,
        "source": kind,
        "producer": producer.key if producer is not None else None,
        "buffer": row.buffer or None,
        "status": row.status,
        "rel_l2": safe(m.rel_l2) if m is not None else None,
        "max_abs": safe(m.max_abs) if m is not None else None,
        "score": safe(row.score),
        "size_unknown": row.size_unknown,
    }


_ENTERS = {
    EXTERNAL: "differs and no recorded op produced it in this step (data, a buffer, a weight not recorded as a "
              "parameter)",
    CHANGED_INPUT: "differs although {producer}, which made it, agreed: something not recorded changed it in between "
             "(a custom autograd Function, a hook, ...)",
    UNPAIRED: "differs and was made by {producer}, which has no partner in the other run: the runs compute it "
              "with different ops",
}


def cause_text(changed_args, sources, kinds, producers, amplified, carriers, out_rel, carried_rel) -> str:
    if changed_args:
        arg = changed_args[0]
        return f"argument {arg.slot} changed: {arg.metrics.value_a} in A, {arg.metrics.value_b} in B"
    parts = []
    params = [r for r in sources if kinds[id(r)] == PARAM_INPUT]
    if params:
        names = ", ".join(_param_of(r, producers.get(id(r))) for r in params)
        worst = max(params, key=rel_error)
        parts.append(f"parameter {names} {R.SIZE_UNKNOWN}" if worst.size_unknown
                     else f"parameter {names} differs ({_size(worst)})")
    for row in sources:
        kind = kinds[id(row)]
        if kind == EXTERNAL and row.buffer:
            parts.append(f"input {row.slot} ({_size(row)}) differs and no recorded op produced it in this step: "
                         f"it is buffer {row.buffer}, which the model registered")
        elif kind in _ENTERS:
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


def _param_of(row: R.RecordRow, record: R.RecordRow | None) -> str:
    """blocks.1.fc.weight: from the param.* record (its own, or the one holding the same tensor)."""
    record = record if record is not None else row
    return param_name(record.module, record.slot) if record.slot.startswith("param.") else row.slot


def inherited_cause(worst: R.RecordRow, kind: str, producer: R.RecordRow | None, out_rel: float) -> str:
    if kind == CARRIED:
        origin = "state carried over from the previous step (optimizer state, a parameter or buffer updated in place)"
    elif kind == PARAM_UPDATE:
        origin = (f"parameter {_param_of(worst, producer)}, read after the backward began (an optimizer update); "
                  "its difference entered where the forward read it")
    elif kind == PARAM_INPUT:
        origin = f"parameter {_param_of(worst, producer)}, within tolerance"
    elif kind == UNRECORDED:
        origin = ("made after the backward began by something not recorded (a parameter gradient accumulated by "
                  "autograd, optimizer state)")
    elif kind == EXTERNAL:
        origin = (f"buffer {worst.buffer}, which the model registered, within tolerance" if worst.buffer
                  else "read from outside the recorded ops (data, a buffer), within tolerance")
    elif kind == FORWARD:
        return (f"forward {worst.slot} of this call {_carries(worst)} (rel L2 {sci(rel_error(worst))}, "
                f"output {sci(out_rel)}); the backward computes from the values its forward saw")
    elif producer is not None:
        origin = f"made by {producer.key}"
    else:
        origin = "made upstream"
    return (f"input {worst.slot} {_carries(worst)} (rel L2 {sci(rel_error(worst))}, output {sci(out_rel)}); "
            f"it was {origin}")


def _carries(row: R.RecordRow) -> str:
    """How an input hands on its error, in words that agree with its own status."""
    if row.status == R.DIVERGED:
        return "already carries the error"
    if row.status == R.EXPLAINED:
        return "carries an accepted difference"
    return ("carries a difference within its own tolerance (under the absolute floor atol, not rounding) that "
            "this op scales beyond the output's")
