"""Judge stage, in words: why an output differs (the cause a report prints)."""

from __future__ import annotations

import math

from probe.comparison import result as R
from probe.comparison.kinds import (
    CARRIED, CHANGED, EXTERNAL, FORWARD, PARAM_INPUT, PARAM_UPDATE, UNPAIRED, UNRECORDED,
)
from probe.comparison.records import LOCAL_GRAD
from probe.comparison.sizes import rel_error, sci


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


def cause_text(changed_args, sources, kinds, producers, amplified, carriers, out_rel, carried_rel) -> str:
    if changed_args:
        arg = changed_args[0]
        return f"argument {arg.slot} changed: {arg.metrics.value_a} in A, {arg.metrics.value_b} in B"
    parts = []
    params = [r for r in sources if kinds[id(r)] == PARAM_INPUT]
    if params:
        names = ", ".join(param_name(r, producers.get(id(r))) for r in params)
        worst = max(params, key=rel_error)
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


def inherited_cause(worst: R.RecordRow, kind: str, producer: R.RecordRow | None, out_rel: float) -> str:
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
