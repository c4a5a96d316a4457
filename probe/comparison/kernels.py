"""Two kernels for one computation in a low precision: their roundings differ by more than one.

A bf16 model with sdpa attention in one run and eager attention (matmul, softmax, matmul) in
the other computes the same function with different ops. Those ops have no partner, so the
tensors they make are sources (docs/compare.md, "made by a call that has no partner"), and
in backward the gradient they send back differs by a few bfloat16 roundings: each kernel
rounds its own intermediates. The bfloat16 tolerance allows about two roundings, so a clean
pair false-alarms there.

The rule: in a call whose only divergent inputs were made by unpartnered calls, a divergent
output judged at a 16-bit or coarser tolerance, within KERNEL_SLACK times that tolerance, is
explained ("two kernels round differently"), and so are those inputs. A different function
in the other run (SiLU against GELU) is far beyond it and stays introduced. Float32 and
float64 records are not touched: there, other ops by either run are findings.
"""

from __future__ import annotations

from probe.comparison import result as R
from probe.comparison.explain import explain

#: how many times its tolerance a record made through different kernels may differ
KERNEL_SLACK = 2.0
_LOW = ("bfloat16", "float16", "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz")


def explain_different_kernels(rows: list) -> None:
    """Explain the rounding of different kernels in one judged call (see the module docstring)."""
    outputs = [row for row in rows if row.io == "out" and row.status == R.DIVERGED and row.divergence == R.OUTPUT]
    if not outputs or not all(_slack(row) for row in outputs):
        return
    entries = outputs[0].input_errors
    divergent = [item for item in entries if item.get("status") == R.DIVERGED]
    if not divergent or any(item.get("source") != "unpaired" for item in divergent):
        return
    slots = {item["slot"] for item in divergent}
    inputs = [row for row in rows if row.io == "in" and row.slot in slots and row.status == R.DIVERGED]
    if not all(_slack(row) for row in inputs):
        return
    producers = ", ".join(sorted({item.get("producer") or "?" for item in divergent}))
    for row in inputs + outputs:
        explain(row, f"the runs compute its input with different kernels ({producers} has no partner), "
                             f"whose {row.tol_dtype} roundings differ by more than the tolerance's two: within "
                             f"{KERNEL_SLACK:g}x it (score {row.score:.3g}), not a divergence", R.INHERITED)


def _slack(row) -> bool:
    return row.tol_dtype in _LOW and row.score is not None and row.score <= KERNEL_SLACK
