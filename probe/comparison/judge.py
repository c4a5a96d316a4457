"""Judge stage: every paired record against its tolerance, then each call's records together.

Records are judged in A's execution order (verdict.py's record rules; a checksum change is
a divergence only where nothing computed the tensor yet), then call by call in the order
their outputs were made, so that what made a call's inputs is judged before it
(explain.py: introduced, inherited, explained as amplified rounding). Where the tensors
were dumped, an output accepted as amplified by an elementwise op is checked by replaying
the op in float64 on each run's own inputs (elementwise.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from probe.comparison.kernels import explain_different_kernels
from probe.comparison import elementwise, rounding, verdict
from probe.comparison import result as R
from probe.comparison.explain import (
    accepted_difference, explain, explain_module_by_its_calls, is_accepted_carry, judge_call, unexplain,
)
from probe.comparison.optimizer_calls import base_op
from probe.comparison.measure import ABSENT, MIXED, SCALAR, SHAPE, VALUE, MeasuredStep, Measurement
from probe.comparison.provenance import Provenance
from probe.comparison.records import content_key, is_param_slot
from probe.comparison.stale import StaleRecords
from probe.comparison.sizes import rel_error, sci


@dataclass
class JudgedStep:
    measured: MeasuredStep
    rows: list[R.RecordRow]  # every row of the step file pair, in execution order
    #: (rows, forward rows) of each paired call, in the order they were judged
    calls: list[tuple[list[R.RecordRow], list[R.RecordRow]]]
    #: content_key -> key of A's records whose difference was accepted, and ("param", name) ->
    #: the accepted gradient the optimizer updated that parameter from: what the next step
    #: file of the rank accepts again (StepOutcome.explained)
    explained: dict


def judge(measured: MeasuredStep, previous_explained: dict | None = None, strict: bool = False,
          baseline: dict | None = None) -> JudgedStep:
    """Judge one measured step file pair.

    previous_explained: StepOutcome.explained of A's previous step file of the same rank: a
    record holding the same values as an accepted difference there (a parameter AdamW
    updated from rounding noise) carries that accepted difference. strict: the fixed
    tolerance decides alone; each output's rounding envelope is information only (rounding.py).
    baseline: A's output key -> what a trusted second run differs from A by there (--baseline)."""
    aligned = measured.aligned
    per_pair = aligned.per_pair
    judged, stale = _judge_records(measured, previous_explained, strict)
    stale.resolve(lambda number: [row for row, ra, rb in per_pair[number]
                                  if row.io == "out" and ra is not None and rb is not None
                                  and row.metrics is not None and row.metrics.evidence != "value"])
    rows: list[R.RecordRow] = []
    calls = []
    forwards = _forward_rows(aligned.pairs, per_pair)
    forward_items = _forward_rows(aligned.pairs, per_pair, items=True)
    # every record of A, paired or not: an input made by a call only A has names that call
    rows_of_a = {row_a: row for call_rows in per_pair for row, row_a, _ in call_rows if row_a is not None}
    # calls in the order their outputs were made: what made a call's inputs is judged before it,
    # and a module call after the api calls inside it (explain.explain_module_by_its_calls)
    for pair, call_rows in sorted(zip(aligned.pairs, per_pair), key=lambda item: max(row.order for row, _, _ in item[1])):
        if pair.a is not None and pair.b is not None:
            lookup = {id(row): row_a for row, row_a, _ in call_rows}

            def input_kind(row, _lookup=lookup):
                kind, producer = measured.origins.get(_lookup[id(row)], ("external", None))
                return kind, (judged.get(producer) or rows_of_a.get(producer)) if producer is not None else None

            forward = forwards.get(_call_key(call_rows), ()) if pair.phase == "backward" else ()
            judge_call([row for row, _, _ in call_rows], input_kind, forward)
            explain_different_kernels([row for row, _, _ in call_rows])
            explain_module_by_its_calls([row for row, _, _ in call_rows], rows)
            _check_amplified(call_rows, measured)
            cols_a = aligned.records_a.columns
            rounding.judge_envelopes(_with_stats(call_rows, cols_a), _with_stats(
                forward_items.get(_call_key(call_rows), ()), cols_a) if pair.phase == "backward" else (),
                input_kind, strict, baseline)
            calls.append(([row for row, _, _ in call_rows], forward))
        rows.extend(row for row, _, _ in call_rows)
    rows.sort(key=lambda row: row.order)
    return JudgedStep(measured, rows, calls, _explained(aligned, rows))


def _explained(aligned, rows: list[R.RecordRow]) -> dict:
    """content_key -> key of A's records whose difference was accepted, and ("param", name)
    -> the accepted gradient the optimizer updated that parameter from."""
    cols_a = aligned.records_a.columns
    explained: dict = {}
    diverged_params = {param_name(cols_a, row, None, {}) for row in rows
                       if row.slot.startswith("param.") and row.status == R.DIVERGED}
    updated = {row.target for row in rows if row.target}  # parameters a recorded optimizer call updates
    for row, row_a, _ in (item for call_rows in aligned.per_pair for item in call_rows):
        if row.io == "out" and row_a is not None and accepted_difference(row):
            key = content_key(cols_a, row_a)
            if key is not None:
                explained[key] = (row.key, row.metrics.rel_l2 if row.metrics is not None else None)
            if row.slot.startswith("param_grad."):
                name = f"{row.module}.{row.slot[len('param_grad.'):]}" if row.module else row.slot[len("param_grad."):]
                if name not in diverged_params and name not in updated:
                    # the next step's parameter was updated from it by an optimizer probe did not
                    # record (a recorded update is judged itself, and its result carried by value)
                    explained[("param", name)] = f"{row.key}, rel L2 {sci(row.metrics.rel_l2)}"
    return explained


def _judge_records(measured: MeasuredStep, previous_explained: dict | None,
                   strict: bool = False) -> tuple[dict, StaleRecords]:
    """Judge every paired record in A's execution order: (A's row -> its RecordRow, the
    in-place writes seen on the way, resolved once every record is judged)."""
    aligned = measured.aligned
    cols_a, cols_b = aligned.records_a.columns, aligned.records_b.columns
    stale = StaleRecords(cols_a, cols_b)
    firsts = {number: next(((ra, rb) for r, ra, rb in call_rows if r.slot == "input.0"), (None, None))
              for number, call_rows in enumerate(aligned.per_pair)}
    judged: dict = {}
    differed = False  # an earlier record of this step file already differs between the runs
    for item in measured.measurements:
        row, ra, rb = item.row, item.row_a, item.row_b
        judge_record(item, cols_b)
        stale.check(row, (ra, rb), firsts[item.number], item.number)
        _carry_accepted(row, ra, cols_a, previous_explained, measured.origins)
        untouched = _untouched(row, item.kind, item.order, aligned.step, measured.provenance, differed)
        verdict.judge_checksum_change(row, untouched)
        if untouched and not strict:
            rounding.judge_untouched(row, item.kind)
        differed = differed or _differs(row)
        judged[ra] = row
    return judged, stale


def judge_record(item: Measurement, cols_b: dict) -> None:
    """The record rule (verdict.py) for what the record was measured as."""
    row = item.row
    if item.what == SCALAR:
        verdict.judge_value(row, item.metrics)
        row.notes.append("a one-element tensor on one side, a plain number on the other")
    elif item.what == ABSENT:
        # attention weights from eager attention, None from sdpa: absent, not different
        row.status = R.ONLY_A if cols_b["value"][item.row_b] == "null" else R.ONLY_B
        row.reasons.append(f"absent on one side: None in {'B' if row.status == R.ONLY_A else 'A'}, "
                           "a tensor in the other")
    elif item.what == MIXED:
        row.status = R.DIVERGED
        row.reasons.append("a tensor on one side, a plain value on the other")
    elif item.what == VALUE:
        verdict.judge_value(row, item.metrics)
    elif item.what == SHAPE:
        verdict.judge_shape(row)
    else:
        verdict.judge_tensor(row, item.metrics, item.tol)


#: a record that holds the values accepted in the previous step differs by the same amount
#: (the same tensors on both sides), up to this factor (sketch estimates of the same values)
SAME_CARRY = 2.0


def carries_the_same(row, earlier) -> bool:
    """Whether row differs by about what the previous step accepted for the same values of A
    (earlier: (key, rel L2) of that accepted record). Growth is carried; a jump is a change."""
    _, accepted_rel = earlier
    rel = rel_error(row)
    if accepted_rel is None or not isinstance(accepted_rel, (int, float)):
        return True
    return rel <= SAME_CARRY * accepted_rel + 1e-300


def _carry_accepted(row, ra, cols_a, previous_explained, origins) -> None:
    """A record holding the values of a difference accepted in the previous step file
    carries that acceptance (a parameter the optimizer updated from rounding noise)."""
    earlier = previous_explained.get(content_key(cols_a, ra)) if previous_explained else None
    if earlier is not None and not carries_the_same(row, earlier):
        # A's values are what was accepted last step, B's moved since: a change (a weight
        # edited between steps), not the accepted difference carried over
        earlier = None
    elif earlier is not None:
        earlier = earlier[0]
    if earlier is not None and row.status == R.DIVERGED and is_accepted_carry(row):
        explain(row, f"carries the accepted difference of {earlier} from the previous step")
    elif earlier is not None and row.status in R.WITHIN:
        row.accepted = True
    elif previous_explained and row.status == R.DIVERGED and is_accepted_carry(row):
        grad = previous_explained.get(("param", param_name(cols_a, row, ra, origins)))
        if grad is not None:
            explain(row, f"an optimizer step that is not recorded (level \"module\") updated this "
                         f"parameter from a gradient whose difference was accepted ({grad}); Adam-type "
                         "optimizers turn a rounding-noise gradient into an lr-sized update")


def param_name(cols: dict, row: R.RecordRow, row_a: int | None, origins: dict) -> str | None:
    """fc1.weight for a param.* record, or for an input holding that parameter's tensor."""
    if row.slot.startswith("param."):
        name = row.slot[len("param."):]
        return f"{row.module}.{name}" if row.module else name
    kind, producer = origins.get(row_a, (None, None)) if row_a is not None else (None, None)
    if kind == "param" and producer is not None:
        name = cols["slot"][producer][len("param."):]
        module = cols["module"][producer]
        return f"{module}.{name}" if module else name
    return None


def _check_amplified(call_rows, measured: MeasuredStep) -> None:
    """Where the tensors were dumped, an output accepted as amplified by an elementwise op is
    checked by replaying the op in float64 on each run's own inputs (elementwise.py): an
    output its own inputs do not give was computed differently there (introduced)."""
    outputs = [(row, ra, rb) for row, ra, rb in call_rows if row.io == "out" and row.status == R.EXPLAINED
               and row.origin == R.AMPLIFIED and row.metrics is not None and row.metrics.evidence == "tensor"]
    if not outputs or measured.fetch_a is None or measured.fetch_b is None:
        return
    cols_a, cols_b = measured.aligned.records_a.columns, measured.aligned.records_b.columns
    op = base_op(call_rows[0][0].op)
    sides = []
    for side, cols, fetch in ((1, cols_a, measured.fetch_a), (2, cols_b, measured.fetch_b)):
        tensors, values = {}, {}
        for row, *rows in call_rows:
            index = rows[side - 1]
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
            errors.append(elementwise.own_error(op, side, fetch(cols["tensor_id"][index])))
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


def _call_key(call_rows) -> tuple | None:
    """(module, op, index) of a call pair: what ties a backward call to its forward."""
    if not call_rows:
        return None
    head = call_rows[0][0]
    return head.module, head.op, head.index


#: A's statistics the envelope rules read (rounding.operand)
_STATS = ("min", "max", "mean", "norm", "numel", "shape", "dtype")


def _with_stats(call_rows, cols_a: dict) -> list:
    """[(RecordRow, A's statistics by name or None)]: what the envelope rules read of a call."""
    return [(row, {name: cols_a[name][ra] for name in _STATS} if ra is not None else None)
            for row, ra, _ in call_rows]


def _forward_rows(pairs, per_pair, items: bool = False) -> dict:
    """(module, op, index) -> RecordRows of that paired forward call: the values the call's
    backward computes from (explain.judge_call counts them as carriers); items: the
    (RecordRow, A's row, B's row) triples instead."""
    found: dict = {}
    for pair, call_rows in zip(pairs, per_pair):
        if pair.a is not None and pair.b is not None and pair.phase == "forward":
            found.setdefault(_call_key(call_rows), list(call_rows) if items else [row for row, _, _ in call_rows])
    return found


def _untouched(row: R.RecordRow, kind: str, order: tuple, step: int, provenance: Provenance,
               differed: bool) -> bool:
    """Nothing in either run has computed this tensor yet, so rounding cannot have changed it:
    read by the forward of step 0 (no optimizer update yet), and a parameter, or an input
    no recorded op made (data, a weight of an api-level dump) read before any record of the
    step file differed (an unrecorded op could have carried a rounding difference into it)."""
    if step != 0 or row.io != "in" or order[0] >= provenance.backward_from:
        return False
    if is_param_slot(row.slot) or kind == "param":
        return True
    return kind == "external" and not differed


def _differs(row: R.RecordRow) -> bool:
    """The record shows any difference between the runs (beyond tolerance or not)."""
    if row.status not in R.PAIRED:
        return False
    m = row.metrics
    if row.status != R.MATCH or m is None:
        return True
    return m.bit_equal is False or (m.bit_equal is None and m.err_l2 > 0)
