"""Judge stage: every paired record against its tolerance, then each call's records together.

Records are judged in A's execution order (record_rules.py: the record rules; a checksum
change is a divergence only where nothing computed the tensor yet), then call by call in the
order their outputs were made, so that what made a call's inputs is judged before it
(call_rules.py: introduced, inherited, explained as amplified rounding; two kernels of one
computation). Where the tensors were dumped, an output accepted as amplified by an
elementwise op is checked by replaying the op in float64 on each run's own inputs
(recheck.py). Last, the precision rule: an op one run computes in a lower dtype by the
model's own casts. Every verdict on a record is made here, so the op summaries the attribute
stage makes from the rows agree with them. The judge reads no record column: measure put
what it needs into each Measurement.

Precision
---------

Precision is a finding: an op one run computes in a lower dtype than the other.

A lower dtype on one side is judged at that dtype's tolerance, so its rounding alone never
fails a compare; without this module such an op passed in silence. The rules, per paired
API forward call whose floating output has a coarser dtype on one side (``X``):

* the call ran under autocast on X (root attribute ``autocast``, probe/capture/eager/autocast.py):
  expected, autocast chose that precision. Counted in a note, not a divergence.
* the runs compute in different dtypes throughout (their most common output dtypes differ:
  a float32 run against a ``model.double()`` one): a choice of the whole run, listed under
  "the runs differ in", not a divergence.
* otherwise the model's own casts chose it: a divergence of kind ``precision`` at that op,
  introduced there: "B computes fc1 functional.linear in bfloat16 where A uses float32".
  Dumps that do not record autocast (older versions) cannot tell, and keep the note only.

Either way the dtypes each run computed in are listed under "the runs differ in" when they
differ. Torch-free.
"""

from __future__ import annotations

from collections import Counter

from probe.comparison import result as R
from probe.comparison.call_rules import (
    accepted_difference, explain, explain_different_kernels, explain_module_by_its_calls, is_accepted_carry,
    judge_call,
)
from probe.comparison.record_rules import (
    StaleRecords, judge_checksum_change, judge_shape, judge_tensor, judge_uninitialized, judge_value,
)
from probe.comparison.measure import STATS
from probe.comparison.recheck import recheck_amplified
from probe.comparison.rounding import judge_envelopes, judge_untouched
from probe.comparison.records import is_param_slot
from probe.comparison.structs import (
    ABSENT, MIXED, SCALAR, SHAPE, VALUE, JudgedStep, MeasuredStep, Measurement, Slot, rel_error, sci,
)


def judge(measured: MeasuredStep, previous_explained: dict | None = None, autocast: tuple = (None, None),
          strict: bool = False, baseline: dict | None = None) -> JudgedStep:
    """Judge one measured step file pair.

    previous_explained: StepOutcome.explained of A's previous step file of the same rank: a
    record holding the same values as an accepted difference there (a parameter AdamW
    updated from rounding noise) carries that accepted difference.
    autocast: the step files' root attribute ``autocast`` of A and B (None where not recorded),
    for the precision rule. strict: the fixed tolerance decides alone; each output's rounding
    envelope is information only (rounding.py). baseline: A's output key -> what a trusted
    second run differs from A by there (--baseline)."""
    aligned = measured.aligned
    per_pair = aligned.per_pair
    stale = _judge_records(measured, previous_explained, strict)
    stale.resolve(lambda number: [slot.row for slot in per_pair[number]
                                  if slot.row.io == "out" and slot.paired
                                  and slot.row.metrics is not None and slot.row.metrics.evidence != "value"])
    of_row = {id(m.row): m for m in measured.measurements}
    rows: list[R.RecordRow] = []
    calls = []
    forwards = _forward_rows(aligned.pairs, per_pair)
    forward_slots = _forward_rows(aligned.pairs, per_pair, slots=True)
    # every record of A, paired or not: an input made by a call only A has names that call
    rows_of_a = {slot.a: slot.row for slots in per_pair for slot in slots if slot.a is not None}
    judged = {m.slot.a: m.row for m in measured.measurements}

    def input_kind(row):
        m = of_row[id(row)]
        if row.io != "in":
            return "external", None
        producer = m.producer
        return m.kind, (judged.get(producer) or rows_of_a.get(producer)) if producer is not None else None

    def values(row):
        return of_row[id(row)].values

    # calls in the order their outputs were made: what made a call's inputs is judged before it,
    # and a module call after the api calls inside it (call_rules.explain_module_by_its_calls)
    for pair, slots in sorted(zip(aligned.pairs, per_pair), key=lambda item: max(s.row.order for s in item[1])):
        call = [slot.row for slot in slots]
        if pair.a is not None and pair.b is not None:
            forward = forwards.get(_call_key(slots), ()) if pair.phase == "backward" else ()
            judge_call(call, input_kind, forward, values)
            explain_different_kernels(call)
            explain_module_by_its_calls(call, rows)
            recheck_amplified(slots, measured)
            judge_envelopes(_with_stats(slots, of_row), _with_stats(forward_slots.get(_call_key(slots), ()), of_row)
                            if pair.phase == "backward" else (), input_kind, strict, baseline)
            calls.append((call, forward))
        rows.extend(call)
    rows.sort(key=lambda row: row.order)
    explained = _explained(per_pair, of_row, rows)
    precision = R.PrecisionTally()
    judge_precision(rows, autocast[0], autocast[1], precision)
    return JudgedStep(measured, rows, calls, explained, precision)


def _explained(per_pair, of_row: dict, rows: list[R.RecordRow]) -> dict:
    """content_key -> key of A's records whose difference was accepted, and ("param", name)
    -> the accepted gradient the optimizer updated that parameter from."""
    explained: dict = {}
    diverged_params = {_own_param(row) for row in rows if row.slot.startswith("param.") and row.status == R.DIVERGED}
    updated = {row.target for row in rows if row.target}  # parameters a recorded optimizer call updates
    for slot in (slot for slots in per_pair for slot in slots):
        row = slot.row
        if row.io == "out" and slot.a is not None and accepted_difference(row):
            key = of_row[id(row)].content_key
            if key is not None:
                explained[key] = (row.key, row.metrics.rel_l2 if row.metrics is not None else None)
            if row.slot.startswith("param_grad."):
                name = f"{row.module}.{row.slot[len('param_grad.'):]}" if row.module else row.slot[len("param_grad."):]
                if name not in diverged_params and name not in updated:
                    # the next step's parameter was updated from it by an optimizer probe did not
                    # record (a recorded update is judged itself, and its result carried by value)
                    explained[("param", name)] = f"{row.key}, rel L2 {sci(row.metrics.rel_l2)}"
    return explained


def _own_param(row: R.RecordRow) -> str:
    name = row.slot[len("param."):]
    return f"{row.module}.{name}" if row.module else name


def _judge_records(measured: MeasuredStep, previous_explained: dict | None, strict: bool = False) -> StaleRecords:
    """Judge every paired record in A's execution order; returns the in-place writes seen on
    the way, resolved once every record is judged."""
    stale = StaleRecords()
    differed = False  # an earlier record of this step file already differs between the runs
    for item in measured.measurements:
        row = item.row
        judge_record(item)
        if row.stale:  # measure found memory nothing had written yet
            judge_uninitialized(row)
            continue
        stale.check(row, item.stats, item.input_stats, item.slot.number)
        _carry_accepted(item, previous_explained)
        untouched = _untouched(row, item.kind, item.order, measured.aligned.step, measured.backward_from, differed)
        judge_checksum_change(row, untouched)
        if untouched and not strict:
            judge_untouched(row, item.kind)
        differed = differed or _differs(row)
    return stale


def judge_record(item: Measurement) -> None:
    """The record rule (record_rules.py) for what the record was measured as."""
    row = item.row
    if item.what == SCALAR:
        judge_value(row, item.metrics, item.values)
        row.notes.append("a one-element tensor on one side, a plain number on the other")
    elif item.what == ABSENT:
        # attention weights from eager attention, None from sdpa: absent, not different
        row.status = R.ONLY_A if item.texts[1] == "null" else R.ONLY_B
        row.reasons.append(f"absent on one side: None in {'B' if row.status == R.ONLY_A else 'A'}, "
                           "a tensor in the other")
    elif item.what == MIXED:
        row.status = R.DIVERGED
        row.reasons.append("a tensor on one side, a plain value on the other")
    elif item.what == VALUE:
        judge_value(row, item.metrics, item.values)
    elif item.what == SHAPE:
        judge_shape(row)
    else:
        judge_tensor(row, item.metrics, item.tol)


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


def _carry_accepted(item: Measurement, previous_explained: dict | None) -> None:
    """A record holding the values of a difference accepted in the previous step file
    carries that acceptance (a parameter the optimizer updated from rounding noise)."""
    row = item.row
    earlier = previous_explained.get(item.content_key) if previous_explained else None
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
        grad = previous_explained.get(("param", item.param))
        if grad is not None:
            explain(row, f"an optimizer step that is not recorded (level \"module\") updated this "
                         f"parameter from a gradient whose difference was accepted ({grad}); Adam-type "
                         "optimizers turn a rounding-noise gradient into an lr-sized update")


def _call_key(slots: list[Slot]) -> tuple | None:
    """(module, op, index) of a call pair: what ties a backward call to its forward."""
    if not slots:
        return None
    head = slots[0].row
    return head.module, head.op, head.index


def _with_stats(slots, of_row: dict) -> list:
    """[(RecordRow, A's statistics by name or None)]: what the envelope rules read of a call."""
    found = []
    for slot in slots:
        m = of_row.get(id(slot.row))
        stats = m.stats[0] if m is not None and m.stats else None
        found.append((slot.row, dict(zip(STATS, stats)) if stats is not None else None))
    return found


def _forward_rows(pairs, per_pair, slots: bool = False) -> dict:
    """(module, op, index) -> RecordRows of that paired forward call: the values the call's
    backward computes from (call_rules.judge_call counts them as carriers); slots: its Slots."""
    found: dict = {}
    for pair, call in zip(pairs, per_pair):
        if pair.a is not None and pair.b is not None and pair.phase == "forward":
            found.setdefault(_call_key(call), list(call) if slots else [slot.row for slot in call])
    return found


def _untouched(row: R.RecordRow, kind: str, order: tuple, step: int, backward_from: float,
               differed: bool) -> bool:
    """Nothing in either run has computed this tensor yet, so rounding cannot have changed it:
    read by the forward of step 0 (no optimizer update yet), and a parameter, or an input
    no recorded op made (data, a weight of an api-level dump) read before any record of the
    step file differed (an unrecorded op could have carried a rounding difference into it)."""
    if step != 0 or row.io != "in" or order[0] >= backward_from:
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


#: machine epsilon by dtype name: which of two dtypes is coarser
_EPS = {"float64": 2.0 ** -52, "float32": 2.0 ** -23, "float16": 2.0 ** -10, "bfloat16": 2.0 ** -7,
        "float8_e4m3fn": 2.0 ** -3, "float8_e4m3fnuz": 2.0 ** -3, "float8_e5m2": 2.0 ** -2,
        "float8_e5m2fnuz": 2.0 ** -2}


def _in_runs(seq, runs) -> str:
    if seq is None or not runs:
        return ""
    for first, last, dtype in runs:
        if first <= seq <= last:
            return dtype
    return ""


def judge_precision(rows: list, autocast_a, autocast_b, tally: R.PrecisionTally) -> None:
    """Mark the precision divergences of one step file pair and count the rest in tally.

    autocast_a/_b: the step files' root attribute ``autocast`` (None where not recorded)."""
    calls: dict = {}
    for row in rows:
        if (row.kind == "api" and row.phase == "forward" and row.io == "out" and row.status in R.PAIRED
                and row.dtype_a in _EPS and row.dtype_b in _EPS):
            calls.setdefault((row.module, row.op, row.index), row)  # the call's first output
    main_a = Counter(row.dtype_a for row in calls.values())
    main_b = Counter(row.dtype_b for row in calls.values())
    tally.dtypes_a.update(main_a)
    tally.dtypes_b.update(main_b)
    whole_run = bool(main_a) and main_a.most_common(1)[0][0] != main_b.most_common(1)[0][0]
    external = _external_inputs_of_lower_precision(rows, calls)
    for call, row in calls.items():
        read = None
        if _EPS[row.dtype_a] == _EPS[row.dtype_b]:
            read = external.get(call)
            if read is None:
                continue
        source = read if read is not None else row
        side, low, high = ("B", source.dtype_b, source.dtype_a) if _EPS[source.dtype_b] > _EPS[source.dtype_a] \
            else ("A", source.dtype_a, source.dtype_b)
        runs, seq = (autocast_b, row.seq_b) if side == "B" else (autocast_a, row.seq_a)
        if _in_runs(seq, runs):
            tally.autocast[(side, low)] += 1
        elif whole_run:
            continue
        elif runs is None:
            tally.unknown[(side, low)] += 1
        else:
            _mark(row, side, low, high, read)
            tally.findings += 1


def _external_inputs_of_lower_precision(rows: list, calls: dict) -> dict:
    """(module, op, index) -> the input row of a forward api call that reads, in another
    precision on each side, a tensor no recorded op made (a buffer such as a rotary
    embedding's inverse frequencies, data): where the call's outputs agree in dtype, that
    input is where the lower precision enters."""
    found: dict = {}
    for row in rows:
        if (row.kind != "api" or row.phase != "forward" or row.io != "in" or row.status not in R.PAIRED
                or row.dtype_a not in _EPS or row.dtype_b not in _EPS or _EPS[row.dtype_a] == _EPS[row.dtype_b]):
            continue
        call = (row.module, row.op, row.index)
        output = calls.get(call)
        if output is None or call in found:
            continue
        sources = {item.get("slot"): item.get("source") for item in output.input_errors}
        if sources.get(row.slot) == "external":
            found[call] = row
    return found


def _mark(row, side: str, low: str, high: str, read=None) -> None:
    other = "A" if side == "B" else "B"
    text = f"{side} computes {row.module or '<root>'} {row.op} in {low} where {other} uses {high}"
    if read is not None:
        text = (f"{side} reads {row.module or '<root>'} {row.op}'s {read.slot} (no recorded op made it: a buffer, "
                f"data) in {low} where {other} reads {high}")
    earlier = row.cause if row.status == R.DIVERGED and row.cause else ""
    row.status = R.DIVERGED
    row.divergence = R.PRECISION
    row.origin = R.INTRODUCED
    row.cause = text + (f"; {earlier}" if earlier else "")
    row.reasons.append(f"precision: {text} (the model's own cast, not autocast)")
