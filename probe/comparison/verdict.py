"""Judge stage, record rules: one paired record against its tolerance.

Rules (docs/compare-rules.md explains them for users):

* A tensor record is beyond tolerance when ``||a - b|| > rtol * ||a|| + atol * sqrt(n)``
  (``score`` = the left side over the right side, > 1 fails), with the tolerance of the
  lower-precision dtype; or when NaN or Inf sit on one side only; or when the shapes differ.
  A dtype difference alone is a note.
* A non-tensor argument (value column) compares exactly. A changed argument is a cause: the
  row is a divergence of kind "argument" and every output of that call counts as diverged
  and introduced there (explain.py). Dtype-valued arguments (``x.to(torch.bfloat16)``) are notes.
* Checksum evidence: a pair whose checksums differ while its statistics agree within
  tolerance is CHANGED (within tolerance, not bit-equal, size unknown), or a divergence
  when rounding cannot explain it (judge_checksum_change).

How a call's records explain each other (explained, amplified, introduced, inherited) is
explain.py; the first divergence and the likely cause of a whole compare are story.py.
"""

from __future__ import annotations

import math

from probe.comparison import devices
from probe.comparison import result as R
from probe.comparison.metrics import Metrics, parse_value, same_extremes
from probe.comparison.sizes import sci
from probe.comparison.tolerances import MANTISSA_BITS, Tolerance

_DTYPE_WORDS = set(MANTISSA_BITS) | {
    "bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64", "half",
    "float", "double", "long", "int", "short",
}


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
    if m.sketch is not None:  # the sketches measured the change, and it is within tolerance
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
