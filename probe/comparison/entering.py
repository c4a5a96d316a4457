"""The likely cause of a low-precision model: where the error entered, even within tolerance.

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

#: an error entering this many unit roundoffs of the dtype is beyond two correct kernels' rounding
ENTERING_UNITS = 1.0
#: an op makes the error itself when its output differs this many times more than its inputs
AMPLIFICATION = 10.0
_UNIT = {"bfloat16": 2.0 ** -8, "float16": 2.0 ** -11, "float8_e4m3fn": 2.0 ** -4, "float8_e4m3fnuz": 2.0 ** -4,
         "float8_e5m2": 2.0 ** -3, "float8_e5m2fnuz": 2.0 ** -3}
_SOURCES = ("param", "external", "changed")
_CARRIED = ("produced", "carried", "unrecorded", "forward", "param_update")


def _rel(value) -> float:
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else 0.0


def _row_rel(row) -> float:
    return _rel(row.metrics.rel_l2) if row.metrics is not None else 0.0


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
    carried = max((_rel(item.get("rel_l2")) for item in row.input_errors if item.get("source") in _CARRIED),
                  default=0.0)
    sources = [item for item in row.input_errors if item.get("source") in _SOURCES]
    entering = max(sources, key=lambda item: _rel(item.get("rel_l2")), default=None)
    size = f"rel L2 {out:.2e}, {out / unit:.3g} units of {row.tol_dtype} roundoff"
    if entering is not None and _rel(entering.get("rel_l2")) >= max(ENTERING_UNITS * unit, carried):
        what = entering.get("producer") or entering["slot"]
        return (f"the error enters here within tolerance: input {entering['slot']} ({entering['source']}: {what}) "
                f"differs by rel L2 {_rel(entering.get('rel_l2')):.2e} ({size} at the output; its produced inputs "
                f"carry {carried:.2e}); two correct kernels differ by well under one unit, and the later "
                "divergence grows from here")
    if out > AMPLIFICATION * max(carried, math.sqrt(carried * unit)):
        return (f"the error enters here within tolerance: the op makes it from inputs that agree ({size}; its "
                f"inputs carry {carried:.2e}); two correct kernels differ by well under one unit, and the later "
                "divergence grows from here")
    return None


def rank_entering(result) -> None:
    """Make the first op where a low-precision error entered the likely cause (module docstring)."""
    first = result.first_divergence
    if first is None or getattr(result, "drift", None):
        return
    cause = result.likely_cause
    rows = sorted((row for row in result.rows if row.step == first.step and row.rank == first.rank
                   and row.order <= first.order), key=lambda row: row.order)
    for row in rows:
        if cause is not None and cause.origin == R.INTRODUCED and cause.step == row.step and cause.order <= row.order:
            return  # an op introduced its error at or before this one
        reason = entering_reason(row)
        if reason is None:
            continue
        if row.status != R.DIVERGED:
            row.origin = R.INTRODUCED
            row.cause = reason
        result.likely_cause = row
        return
