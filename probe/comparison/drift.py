"""Drift: two correct runs that part over steps through accumulated rounding, no op at fault.

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
"""

from __future__ import annotations

from probe.comparison import result as R

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


def find_drift(result) -> dict | None:
    """{step, rank, text} when the compare's divergences are drift (see the module docstring)."""
    first = result.first_divergence
    if first is None or result.verdict != "diverged":
        return None
    rank = first.rank
    steps = sorted({info["step"] for info in result.steps if info["rank"] == rank})
    by_step: dict = {}
    for row in result.rows:
        if row.rank == rank:
            by_step.setdefault(row.step, []).append(row)
    if len(steps) < 2 or first.step == steps[0]:
        return None
    if not _differs_at_rounding(by_step.get(steps[0], [])):
        return None  # identical before the divergence: something changed, not rounding
    updates: dict = {}  # (step, parameter) -> largest difference of the optimizer's writes
    for row in result.rows:
        if row.target and row.io == "out" and row.status in R.PAIRED:
            key = (row.step, row.rank, row.target)
            updates[key] = max(updates.get(key, 0.0), _rel(row))
    for row in result.rows:
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


def apply_drift(result) -> None:
    """Set result.drift and take the "introduced" origins back where the compare is drift."""
    found = find_drift(result)
    result.drift = found
    if found is None:
        return
    for row in result.rows:
        if row.status == R.DIVERGED and row.origin == R.INTRODUCED:
            row.origin = R.INHERITED
            row.cause = f"{row.cause}; drift: this difference grew over the earlier steps' updates"
    for op in list(result.top_ops) + list(result.op_summaries):
        if op.origin == R.INTRODUCED:
            op.origin = R.INHERITED
    result.likely_cause = None
    result.notes.insert(0, found["text"])
