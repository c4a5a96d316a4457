"""Why an op made NaN/Inf from finite inputs, from its call's records alone (no torch).

IEEE 754 tells three ways apart, and each has its own fix:

* **overflow**: a result beyond the dtype's largest value became Inf (``exp`` of a large
  number, a float16 product above 65504). Compute the op in a wider dtype or scale it down.
* **division by zero**: a nonzero value divided by 0 (or ``log`` of 0) became Inf.
  In half precision the 0 is often a value that *underflowed*: AdamW's eps of 1e-8 is below
  float16's smallest positive value (6e-8) and rounds to 0, so ``sqrt(v) + eps`` is 0 where
  ``v`` is. Keep that computation in float32, or use a constant the dtype can hold.
* **invalid operation**: a NaN from finite inputs: 0/0 (its zero denominator is named, as for
  a division by zero), the square root or log of a negative value, ``acos`` beyond [-1, 1], or
  an intermediate that overflowed inside the op and met
  ``inf - inf`` or ``inf / inf`` (a softmax in float16).

The evidence is each record's statistics: a denominator whose min or max is 0 holds a 0 (one
whose range spans 0 may); an input whose min is negative reached the op's invalid domain.
``classify`` returns the cause and the sentences that say so.
"""

from __future__ import annotations

import json
import math

OVERFLOW, DIVISION_BY_ZERO, INVALID = "overflow", "division by zero", "invalid operation"

#: largest finite magnitude of the dtypes that overflow in practice (torch.finfo(dtype).max)
DTYPE_MAX = {
    "float16": 65504.0,
    "bfloat16": 3.3895313892515355e38,
    "float32": 3.4028234663852886e38,
    "float64": 1.7976931348623157e308,
    "float8_e4m3fn": 448.0,
    "float8_e4m3fnuz": 240.0,
    "float8_e5m2": 57344.0,
    "float8_e5m2fnuz": 57344.0,
}
#: smallest positive value (subnormal) of the dtypes whose small constants round to 0
DTYPE_TINY = {
    "float16": 5.960464477539063e-08,
    "bfloat16": 9.183549615799121e-41,
    "float8_e4m3fn": 0.001953125,
    "float8_e4m3fnuz": 0.0009765625,
    "float8_e5m2": 1.52587890625e-05,
    "float8_e5m2fnuz": 7.62939453125e-06,
}
HALF_DTYPES = ("float16", "bfloat16", "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz")

#: op name (the part after the last dot) -> the slots that divide (exactly, or as a prefix for
#: the lists of foreach ops)
_DIVISORS = {
    **dict.fromkeys(("div", "div_", "divide", "divide_", "true_divide", "true_divide_",
                     "__truediv__", "__itruediv__", "_foreach_div", "_foreach_div_"),
                    ("input.1", "kwarg.other")),
    **dict.fromkeys(("addcdiv", "addcdiv_", "_foreach_addcdiv", "_foreach_addcdiv_"),
                    ("input.2", "kwarg.tensor2")),
    **dict.fromkeys(("reciprocal", "reciprocal_", "rsqrt", "rsqrt_", "__rtruediv__", "log", "log_",
                     "log2", "log2_", "log10", "log10_"), ("input.0",)),
}
#: op name -> the lowest input value it is defined for (below it: NaN)
_DOMAIN_LOW = {
    **dict.fromkeys(("sqrt", "sqrt_", "rsqrt", "rsqrt_", "log", "log_", "log2", "log2_", "log10",
                     "log10_", "_foreach_sqrt", "_foreach_sqrt_", "_foreach_log"), 0.0),
    **dict.fromkeys(("log1p", "log1p_", "acos", "acos_", "asin", "asin_", "atanh", "atanh_"), -1.0),
    **dict.fromkeys(("acosh", "acosh_"), 1.0),
}
#: op name -> the highest input value it is defined for (above it: NaN)
_DOMAIN_HIGH = dict.fromkeys(("acos", "acos_", "asin", "asin_", "atanh", "atanh_"), 1.0)


def _name(op: str) -> str:
    return op.rsplit(".", 1)[-1]


def _in_slots(slot: str, wanted: tuple[str, ...]) -> bool:
    return any(slot == w or slot.startswith(w + ".") for w in wanted)


def _number(row: dict) -> float | None:
    """A non-tensor argument's value as a float, else None."""
    try:
        value = json.loads(row.get("value") or "null")
    except ValueError:
        return None
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _holds_zero(row: dict) -> str:
    """How a record shows a 0: "holds 0", "may hold 0" (its range spans 0) or ""."""
    if not row["dtype"]:
        return "is 0" if _number(row) == 0 else ""
    low, high = row["min"], row["max"]
    if not (math.isfinite(low) and math.isfinite(high)):
        return ""
    if low == 0 or high == 0:
        return "holds 0"
    return "may hold 0" if low < 0 < high else ""


def _range(row: dict) -> str:
    if not row["dtype"]:
        return f"value {row.get('value')}"
    return f"{row['dtype']}, min {row['min']:.4g}, max {row['max']:.4g}"


def _underflow_hint(row: dict) -> str:
    tiny = DTYPE_TINY.get(row["dtype"])
    if tiny is None:
        return ""
    return (f"; in {row['dtype']} a value below {tiny:.3g} (the smallest positive {row['dtype']}) "
            "rounds to 0, so a small constant added to keep it nonzero (AdamW's eps 1e-8) "
            "may have underflowed: keep this computation (the optimizer's state) in float32, "
            f"or use a constant of at least {tiny:.3g}")


def classify(first: dict, rows: list[dict]) -> tuple[str, list[str]]:
    """(cause, notes) for the call that introduced a NaN/Inf. ``first``: its first non-finite
    output row; ``rows``: every record of the call (tensors and values), dicts with slot, io,
    dtype, value, min, max, nan_count, inf_count. cause is OVERFLOW, DIVISION_BY_ZERO,
    INVALID or "" (nothing in the records says which)."""
    name = _name(first["op"])
    inputs = [row for row in rows if row["io"] == "in"]
    divisors = _DIVISORS.get(name, ())
    zeros = [(row, how) for row in inputs if _in_slots(row["slot"], divisors)
             for how in (_holds_zero(row),) if how]
    made_nan, made_inf = first["nan_count"] > 0, first["inf_count"] > 0
    is_log = name.startswith("log")
    low, high = _DOMAIN_LOW.get(name), _DOMAIN_HIGH.get(name)
    outside = [row for row in inputs if row["dtype"] and math.isfinite(row["min"])
               and ((low is not None and row["min"] < low) or (high is not None and row["max"] > high))]
    if zeros and not is_log:
        row, how = zeros[0]
        where = f"its denominator {row['slot']} ({_range(row)}) {how}"
        if made_nan and not made_inf:  # IEEE 754 calls 0/0 invalid; the zero is still the cause
            return INVALID, [f"invalid operation: 0/0: {where}, and a zero divided by zero is "
                             f"NaN{_underflow_hint(row)}"]
        return DIVISION_BY_ZERO, [f"division by zero: {where}; a finite value divided by 0 is Inf"
                                  + (" and 0/0 is NaN" if made_nan else "") + _underflow_hint(row)]
    if made_nan and outside:
        row = outside[0]
        bounds = f"[{low:g}, {high:g}]" if high is not None else f">= {low:g}"
        return INVALID, [
            f"invalid operation: {name} of a value outside its domain {bounds}: {row['slot']} "
            f"({_range(row)}) reaches it, and the result there is NaN"]
    if zeros and made_inf:
        row, how = zeros[0]
        return DIVISION_BY_ZERO, [
            f"division by zero: {name} of 0 is -Inf (IEEE 754 counts it as a division by zero): its "
            f"argument {row['slot']} ({_range(row)}) {how}{_underflow_hint(row)}"]
    if made_nan:
        return INVALID, [
            "invalid operation: NaN from finite inputs: an intermediate result likely overflowed "
            "inside the op and met inf - inf, inf / inf or 0 * inf (a softmax or norm in half "
            "precision); compute this op in float32"]
    limit = DTYPE_MAX.get(first["dtype"])
    if made_inf and limit is not None:
        wider = "float64" if first["dtype"] == "float32" else "float32"
        return OVERFLOW, [
            f"{first['dtype']} overflow: a result beyond {limit:g}, the largest {first['dtype']} "
            f"value, became Inf (compute this op in {wider}, or scale it down)"]
    return "", []


__all__ = ["classify", "DTYPE_MAX", "DTYPE_TINY", "HALF_DTYPES", "OVERFLOW", "DIVISION_BY_ZERO", "INVALID"]
