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
* The inputs of a call are classified through the step's records: *produced* when an
  earlier record outputs the same tensor (same tensor_id, or same checksum/statistics),
  *param* when it is a parameter, else *external* (data, buffers, constants). A produced
  input that differs although its producer agreed was changed by something unrecorded in
  between (a custom autograd Function, a hook): it counts as a source, like a parameter.
* A divergent output is ``introduced`` when no produced input is beyond tolerance (a
  changed parameter, argument or external input enters the computation here), or when its
  relative L2 error exceeds AMPLIFICATION times the largest relative L2 error of its
  produced inputs; otherwise ``inherited``.
* The first divergence is the earliest divergent output record in A's execution order
  (seq; forward and backward as they ran). Records that exist on one side only are never
  a pass and never a divergence: they are counted as only_a / only_b.
"""

from __future__ import annotations

import math

from probe.comparison import result as R
from probe.comparison.metrics import Metrics, parse_value
from probe.comparison.records import is_param_slot
from probe.comparison.tolerances import MANTISSA_BITS, Tolerance

#: an output whose rel L2 error is this many times its inputs' is called introduced
AMPLIFICATION = 10.0

_DTYPE_WORDS = set(MANTISSA_BITS) | {
    "bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64", "half",
    "float", "double", "long", "int", "short",
}


def is_dtype_value(text: str) -> bool:
    value = parse_value(text)
    return isinstance(value, str) and value.removeprefix("torch.") in _DTYPE_WORDS


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
            f"rel L2 {metrics.rel_l2:.3g} beyond {row.tol_dtype} tolerance "
            f"(score {row.score:.3g}, rtol {tol.rtol:g}, atol {tol.atol:g})"
        )
    row.reasons.extend(reasons)
    row.status = R.DIVERGED if reasons else R.MATCH


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
    else:
        row.status = R.DIVERGED
        row.reasons.append(f"value {metrics.value_a} in A, {metrics.value_b} in B")


def judge_call(rows: list[R.RecordRow], input_kind) -> None:
    """Classify the divergent rows of one call pair and give its outputs an origin.

    input_kind(row) -> (kind, producer) for an input-side tensor row: kind is "produced",
    "param" or "external"; producer is the RecordRow of the earlier output that made the
    tensor (None when unknown).
    """
    inputs, changed_args, dtype_args, params, external, between = [], [], [], [], [], []
    kinds = {}
    for row in rows:
        if row.io != "in" or row.status not in (R.MATCH, R.DIVERGED):
            continue
        if row.metrics is not None and row.metrics.evidence == "value":
            if row.status == R.DIVERGED:
                row.divergence = R.ARGUMENT
                row.origin = R.INTRODUCED
                changed_args.append(row)
            elif not row.metrics.bit_equal:
                dtype_args.append(row)  # a dtype choice: named as a cause, never an error alone
            continue
        kind, producer = ("param", None) if is_param_slot(row.slot) else input_kind(row)
        if kind == "produced" and row.status == R.DIVERGED and producer is not None and producer.status == R.MATCH:
            # the op that made this tensor agreed, yet it differs here: something that was
            # not recorded changed it in between (a custom autograd Function, a hook, ...)
            kind = "changed"
            between.append((row, producer))
        kinds[id(row)] = kind
        if row.status == R.DIVERGED:
            row.divergence = R.PARAM if kind == "param" else R.INPUT
            row.origin = R.INHERITED if kind == "produced" else R.INTRODUCED
        if kind == "param":
            if row.status == R.DIVERGED:
                params.append(row)
        elif kind == "produced":
            inputs.append(row)
        elif kind == "external" and row.status == R.DIVERGED:
            external.append(row)
    input_rel = max((_rel(r) for r in inputs), default=0.0)
    inherited = [r for r in inputs if r.status == R.DIVERGED]
    summary = [_input_summary(r, kinds.get(id(r), "external")) for r in rows if id(r) in kinds]
    for row in rows:
        if row.io != "out" or row.status not in (R.MATCH, R.DIVERGED):
            continue
        row.input_errors = summary
        if changed_args and row.status == R.MATCH:
            row.status = R.DIVERGED
            row.reasons.append("computed with a changed argument")
        if row.status != R.DIVERGED:
            continue
        row.divergence = R.OUTPUT
        out_rel = _rel(row)
        amplified = bool(inherited) and out_rel > AMPLIFICATION * input_rel
        if not inherited or amplified or changed_args:
            row.origin = R.INTRODUCED
            row.cause = _cause(changed_args + dtype_args, params, external, between, amplified, out_rel, input_rel)
        else:
            row.origin = R.INHERITED
            worst = max(inherited, key=_rel)
            row.cause = f"input {worst.slot} already differs (rel L2 {_rel(worst):.3g})"


def _rel(row: R.RecordRow) -> float:
    return row.metrics.rel_l2 if row.metrics is not None else 0.0


def _input_summary(row: R.RecordRow, kind: str) -> dict:
    return R.json_safe({
        "slot": row.slot,
        "source": kind,
        "status": row.status,
        "rel_l2": row.metrics.rel_l2 if row.metrics is not None else None,
        "max_abs": row.metrics.max_abs if row.metrics is not None else None,
        "score": row.score,
    })


def _cause(changed_args, params, external, between, amplified, out_rel, input_rel) -> str:
    if changed_args:
        arg = changed_args[0]
        return f"argument {arg.slot} changed: {arg.metrics.value_a} in A, {arg.metrics.value_b} in B"
    parts = []
    if params:
        names = ", ".join(r.slot.removeprefix("param.") for r in params)
        parts.append(f"parameter {names} differs (rel L2 {max(_rel(r) for r in params):.3g})")
    if external:
        names = ", ".join(r.slot for r in external)
        parts.append(f"input {names} differs and no recorded op produced it")
    for row, producer in between:
        parts.append(
            f"input {row.slot} differs (rel L2 {_rel(row):.3g}) although {producer.key}, which produced it, "
            "agreed: something not recorded changed it in between (a custom autograd Function, a hook, ...)"
        )
    if amplified:
        ratio = out_rel / input_rel if input_rel > 0 else math.inf
        parts.append(f"amplifies its inputs' error {ratio:.3g}x (rel L2 {input_rel:.3g} -> {out_rel:.3g})")
    if not parts:
        parts.append(f"its inputs agree within tolerance (largest input rel L2 {input_rel:.3g})")
    return "; ".join(parts)


def first_divergence(rows: list[R.RecordRow]) -> R.RecordRow | None:
    """Earliest divergent output in execution order (inputs only if no output diverged)."""
    diverged = [row for row in rows if row.status == R.DIVERGED]
    outputs = [row for row in diverged if row.divergence == R.OUTPUT]
    candidates = outputs or [row for row in diverged if row.divergence in (R.PARAM, R.ARGUMENT, R.INPUT)] or diverged
    return min(candidates, key=lambda row: row.order, default=None)


def likely_cause(rows: list[R.RecordRow], first: R.RecordRow | None) -> R.RecordRow | None:
    """The first divergent output that introduced its error (the first divergence if none)."""
    for row in sorted(rows, key=lambda row: row.order):
        if row.status == R.DIVERGED and row.divergence == R.OUTPUT and row.origin == R.INTRODUCED:
            return row
    return first


def summarize_call(rows: list[R.RecordRow]) -> R.OpSummary | None:
    """Error this call pair introduces, in tolerance units: its worst output's score minus
    the largest score of its produced inputs (parameters and other sources count as 0)."""
    outputs = [r for r in rows if r.io == "out" and r.metrics is not None and r.metrics.evidence != "value"]
    if not outputs:
        return None
    worst = max(outputs, key=_score)
    produced = [e for e in worst.input_errors if e["source"] == "produced"]
    input_score = max((_number(e["score"]) for e in produced), default=0.0)
    input_rel = max((_number(e["rel_l2"]) for e in produced), default=0.0)
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
        introduced=_score(worst) - input_score,
        output_rel_l2=out_rel,
        input_rel_l2=input_rel,
        ratio=(out_rel / input_rel) if input_rel > 0 else None,
        diverged=any(r.status == R.DIVERGED for r in outputs),
        origin=worst.origin,
        source=worst.source,
    )


def _score(row: R.RecordRow) -> float:
    if row.score is None:
        return math.inf if row.status == R.DIVERGED else 0.0
    return row.score


def _number(value) -> float:
    if isinstance(value, (int, float)):
        return float(value)
    return {"inf": math.inf, "-inf": -math.inf}.get(value, 0.0)
