"""Amplification recheck: an "amplified" verdict checked elementwise where the tensors were dumped.

This is the one stage after measure that reads record columns and fetches tensors: the judge
calls it for each call it has judged, so that a call judged later sees the rechecked verdict.

Check an "amplified" verdict elementwise where the tensors were dumped.

An output that differs far more than its inputs is accepted as amplified when the op's
conditioning can explain it (call_rules.judge_call). With task "tensor" the claim can be
checked instead of assumed, for the elementwise ops optimizers and normalizations are made
of: recompute the op in float64 from each run's *own* recorded inputs. If each run's
output is its own inputs' result up to that run's rounding, the op did its job and the
difference between the runs is what their inputs explain; if one run's output is not, the
op itself computed differently there (introduced).

No torch: the ops are numpy expressions over the decoded arrays.
"""

from __future__ import annotations

import math

import numpy as np

from probe.comparison.call_rules import unexplain
from probe.comparison.ops import NotReplayable, Replay, spec
from probe.comparison.structs import AMPLIFIED, EXPLAINED, MeasuredStep, Slot, sci


def recheck_amplified(slots: list[Slot], measured: MeasuredStep) -> None:
    """Where the tensors were dumped, an output accepted as amplified by an elementwise op is
    checked by replaying the op in float64 on each run's own inputs (recheck.py): an
    output its own inputs do not give was computed differently there (introduced)."""
    outputs = [(s.row, s.a, s.b) for s in slots if s.row.io == "out" and s.row.status == EXPLAINED
               and s.row.origin == AMPLIFIED and s.row.metrics is not None and s.row.metrics.evidence == "tensor"]
    if not outputs or measured.fetch_a is None or measured.fetch_b is None:
        return
    cols_a, cols_b = measured.aligned.records_a.columns, measured.aligned.records_b.columns
    op = slots[0].row.op
    sides = []
    for side, cols, fetch in ((1, cols_a, measured.fetch_a), (2, cols_b, measured.fetch_b)):
        tensors, values = {}, {}
        for slot in slots:
            row, index = slot.row, (slot.a, slot.b)[side - 1]
            if row.io != "in" or index is None:
                continue
            if cols["dtype"][index] == "":
                values[row.slot] = cols["value"][index]
            elif cols["tensor_id"][index] >= 0:
                tensors[row.slot] = fetch(cols["tensor_id"][index]).astype(np.float64)
        sides.append({"tensors": tensors, "values": values})
    for row, ra, rb in outputs:
        errors = []
        for side, cols, fetch, index in ((sides[0], cols_a, measured.fetch_a, ra), (sides[1], cols_b, measured.fetch_b, rb)):
            if cols["tensor_id"][index] < 0:
                return
            errors.append(own_error(op, side, fetch(cols["tensor_id"][index])))
        if None in errors:
            continue
        limit = row.rtol or 0.0
        if max(errors) > limit:
            unexplain(row, f"replayed in float64 from each run's own inputs, {row.op} gives A's output within "
                                   f"rel L2 {sci(errors[0])} and B's within {sci(errors[1])} "
                                   f"(tolerance {limit:g}): the op itself computed differently, not its conditioning")
        else:
            row.cause += (f"; checked elementwise: replayed in float64 from each run's own inputs it gives both "
                          f"outputs (rel L2 {sci(errors[0])} and {sci(errors[1])})")


def replay(op: str, tensors: dict, values: dict):
    """The op's float64 result from its recorded inputs (its spec's replay, ops.py), or None
    when it has none or its arguments are not all known."""
    how = spec(op).replay
    if how is None:
        return None
    with np.errstate(all="ignore"):
        try:
            return how(Replay(tensors, values))
        except NotReplayable:
            return None


def own_error(op: str, side: dict, output: np.ndarray) -> float | None:
    """||output - replay(inputs)|| / ||replay||: how far one run's output is from its own
    inputs' float64 result (None when the op cannot be replayed or shapes do not fit)."""
    expected = replay(op, side["tensors"], side["values"])
    if expected is None:
        return None
    try:
        expected = np.broadcast_to(expected, output.shape)
    except ValueError:
        return None
    out = output.astype(np.float64)
    finite = np.isfinite(expected) & np.isfinite(out)
    if not finite.any():
        return None
    scale = math.sqrt(float(np.sum(expected[finite] ** 2)))
    err = math.sqrt(float(np.sum((out[finite] - expected[finite]) ** 2)))
    return err / scale if scale > 0 else (0.0 if err == 0 else math.inf)
