"""Judge stage: every paired record against its tolerance, then each call's records together.

Records are judged in A's execution order (record_rules.judge_records: the record rules; a
checksum change is a divergence only where nothing computed the tensor yet), then call by
call in the order their outputs were made, so that what made a call's inputs is judged
before it (call_rules.py: introduced, inherited, explained as amplified rounding; below: two
kernels of one computation; rounding.py: each output against its rounding envelope, and
where the tensors were dumped an output accepted as amplified replayed in float64). The
rounding rules return Findings; ``apply`` writes them. A module call is then judged by the
api calls recorded inside it, and last comes the precision rule: an op one run computes in a
lower dtype by the model's own casts. The rules over every step file (story.py) come after;
the op summaries are made from the rows after them (assemble.py). The judge reads no record
column: measure put what it needs into each Measurement.

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
* otherwise the model's own casts chose it. One rule: where the op's values lie within the
  coarser side's rounding envelope (or, without an envelope model, its tolerance) and no
  divergence follows in the step file, a finding, named in the headline and the notes
  (PrecisionTally.within), exit 0; beyond it, a divergence of kind ``precision`` at that op,
  introduced there: "B computes fc1 functional.linear in bfloat16 where A uses float32".
  Dumps that do not record autocast (older versions) cannot tell, and keep the note only.

Either way the dtypes each run computed in are listed under "the runs differ in" when they
differ.

Kernels
-------

Two kernels for one computation in a low precision: their roundings differ by more than one.

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

Torch-free.
"""

from __future__ import annotations

import math
from collections import Counter

from probe.comparison import result as R
from probe.comparison.align import CLASS
from probe.comparison.call_rules import AMPLIFICATION, judge_call
from probe.comparison.measure import MASK_NOTE
from probe.comparison.op_envelopes import LOW_PRECISION, UNIT_ROUNDOFF
from probe.comparison.record_rules import judge_records
from probe.comparison.rounding import (
    ACCEPTED, REPLAYED_DIFFERENTLY, Bands, judge_envelopes, judge_untouched, recheck_amplified,
)
from probe.comparison.records import is_param_slot, module_within, param_name
from probe.comparison.structs import EXTERNAL, PARAM_INPUT, MeasuredStep, Slot, StepOutcome, rel_error, sci


def judge(measured: MeasuredStep, previous_explained: dict | None = None, autocast: tuple = (None, None),
          strict: bool = False, baseline: dict | None = None) -> StepOutcome:
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
    stale, untouched = judge_records(measured, previous_explained)
    if not strict:  # nothing computed these yet: rounding makes no difference in them
        apply([found for row, kind in untouched if (found := judge_untouched(row, kind)) is not None])
    stale.resolve(lambda number: [slot.row for slot in per_pair[number]
                                  if slot.row.io == "out" and slot.paired
                                  and slot.row.metrics is not None and slot.row.metrics.evidence != "value"])
    of_row = {id(m.row): m for m in measured.measurements}
    rows: list[R.RecordRow] = []
    calls = []
    forward_slots = _forward_rows(aligned.pairs, per_pair)
    forwards = {key: [slot.row for slot in slots] for key, slots in forward_slots.items()}
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

    # where the first output that is not accepted was made (A's order), and the largest
    # difference of the outputs judged within tolerance per phase: what unrecorded code made
    # before that is made from accepted values (call_rules.accept_unrecorded)
    bands = Bands()  # every row's error band, once: no rule below changes what it reads
    unaccepted_from = [(float("inf"),)]
    largest: dict = {}

    def clean_before(row):
        # the first backward call's gradient comes from the forward's values (the loss's backward)
        found = largest.get(row.phase) or max(largest.values(), default=0.0)
        return found if row.order < unaccepted_from[0] else None

    # calls in the order their outputs were made: what made a call's inputs is judged before it,
    # and a module call after the api calls inside it (call_rules.explain_module_by_its_calls)
    for pair, slots in sorted(zip(aligned.pairs, per_pair), key=lambda item: max(s.row.order for s in item[1])):
        call = [slot.row for slot in slots]
        if pair.a is not None and pair.b is not None:
            forward = forwards.get(_call_key(slots), ()) if pair.phase == "backward" else ()
            judge_call(call, input_kind, forward, values, None if strict else clean_before)
            if call[0].paired_by == CLASS:
                _class_changed([row for row in call if row.io == "out"])
            _name_mask_forms(call)
            explain_different_kernels(call)
            explain_module_by_its_calls(call, rows)
            apply(recheck_amplified(slots, measured))
            apply(judge_envelopes(_with_operands(slots, of_row),
                                  _with_operands(forward_slots.get(_call_key(slots), ()), of_row)
                                  if pair.phase == "backward" else (), input_kind, strict, baseline, bands))
            calls.append((call, forward))
            _track(call, lambda row: of_row[id(row)].kind, unaccepted_from, largest)
        rows.extend(call)
    rows.sort(key=lambda row: row.order)
    explained = _explained(per_pair, of_row, rows)
    precision = R.PrecisionTally()
    judge_precision(rows, autocast[0], autocast[1], precision)
    return StepOutcome(aligned.step, aligned.rank, rows, calls, measured.evidence, measured.bytes_read,
                       devices=measured.devices, explained=explained, precision=precision,
                       content_keys=measured.content_keys)


def _track(call: list[R.RecordRow], kind_of, unaccepted_from: list, largest: dict) -> None:
    """After a call is judged: where the first paired tensor record is that is not known to
    differ by rounding (an output not accepted, or a parameter, or data read at step 0, that
    differs and is accepted by the fixed tolerance alone: a difference that entered, not one
    rounding made), and the largest difference (rel L2) of accepted outputs, per phase."""
    for row in call:
        if row.status not in R.PAIRED or row.metrics is None or row.metrics.evidence == "value":
            continue
        if row.io == "in":
            # data that differs at step 0 entered there; later, the data can be made from the
            # model the previous steps accepted (a policy's rollouts), which is no entry
            entered = is_param_slot(row.slot) or kind_of(row) == PARAM_INPUT or (
                kind_of(row) == EXTERNAL and row.step == 0)
            if entered and row.accepted is None and row.status != R.EXPLAINED and row.metrics.err_l2 != 0:
                unaccepted_from[0] = min(unaccepted_from[0], row.order)
        elif not row.is_accepted:
            unaccepted_from[0] = min(unaccepted_from[0], row.order)
        elif math.isfinite(rel_error(row)):
            largest[row.phase] = max(largest.get(row.phase, 0.0), rel_error(row))


def explain_module_by_its_calls(call: list[R.RecordRow], judged: list[R.RecordRow]) -> None:
    """Level "mix": a module call is the composition of the api calls recorded inside it.

    call: the rows of one module call pair; judged: the rows of the calls judged before it
    (every call whose outputs were made earlier, so every api call inside this one).
    When every api call recorded inside the module call (same phase, between the module
    call's first and last record, in the module or below it) is within tolerance or explained,
    a divergent output of the module call is what those calls computed, put together by code
    probe does not record (autograd summing the gradient of an input used twice): explained
    when it is within AMPLIFICATION times their largest difference, not an error of its own.
    """
    if not call or call[0].kind != "module":
        return
    outputs = [r for r in call if r.io == "out" and r.status == R.DIVERGED and r.origin == R.INTRODUCED
               and r.divergence == R.OUTPUT and r.explainable]
    orders = [r.order for r in call if r.order]
    if not outputs or not orders:
        return
    head = call[0]
    first, last = min(orders), max(orders)
    inside = [r for r in judged if r.kind == "api" and r.io == "out" and r.status in R.PAIRED
              and r.step == head.step and r.rank == head.rank and r.phase == head.phase
              and r.order and first < r.order < last
              and module_within(r.module, head.module)]
    if not inside or any(r.status == R.DIVERGED for r in inside):
        return
    worst = max(inside, key=rel_error)
    for row in outputs:
        if rel_error(row) <= AMPLIFICATION * rel_error(worst):
            row.explain(f"every api call recorded inside {head.module or 'the root module'} agrees or is "
                         f"explained (largest: {worst.key}, rel L2 {sci(rel_error(worst))}); this output puts their "
                         f"results together (rel L2 {sci(rel_error(row))}) in code probe does not record")


#: how many times its tolerance a record made through different kernels may differ
KERNEL_SLACK = 2.0


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
        row.explain(f"the runs compute its input with different kernels ({producers} has no partner), "
                             f"whose {row.tol_dtype} roundings differ by more than the tolerance's two: within "
                             f"{KERNEL_SLACK:g}x it (score {row.score:.3g}), not a divergence", R.INHERITED)


def _slack(row) -> bool:
    return row.tol_dtype in LOW_PRECISION and row.score is not None and row.score <= KERNEL_SLACK


def _class_changed(outputs) -> None:
    """A module call paired with another class at the same path (align's class pass): the
    code changed there, as an argument does: every output that differs is introduced by it."""
    for row in outputs:
        if row.status not in R.PAIRED or row.metrics is None or row.metrics.evidence == "value":
            continue
        if row.metrics.err_l2 == 0 and row.metrics.bit_equal is not False:
            continue
        other = row.key_b.split("/")[1].rsplit("#", 1)[0] if row.key_b.count("/") >= 3 else "another class"
        text = f"module class changed: {row.op} in A, {other} in B"
        if row.status != R.DIVERGED:
            row.reasons.append(f"computed by another module class ({other} in B)")
        row.status, row.divergence, row.origin = R.DIVERGED, R.OUTPUT, R.INTRODUCED
        row.cause = text + (f"; {row.cause}" if row.cause else "")


def _name_mask_forms(call: list[R.RecordRow]) -> None:
    """A mask the runs give in two forms that mask the same positions (measure.same_mask) is no
    error, but an output the call introduced an error in names the change of form."""
    forms = [(row.slot, note) for row in call if row.io == "in" for note in row.notes if note.startswith(MASK_NOTE)]
    if not forms:
        return
    for row in call:
        if row.io == "out" and row.status == R.DIVERGED and row.origin == R.INTRODUCED:
            row.cause += f"; {forms[0][0]}: {forms[0][1]}"


def _explained(per_pair, of_row: dict, rows: list[R.RecordRow]) -> dict:
    """content_key -> key of A's records whose difference was accepted, and ("param", name)
    -> the accepted gradient the optimizer updated that parameter from."""
    explained: dict = {}
    diverged_params = {param_name(row.module, row.slot) for row in rows
                       if row.slot.startswith("param.") and row.status == R.DIVERGED}
    updated = {row.target for row in rows if row.target}  # parameters a recorded optimizer call updates
    for slot in (slot for slots in per_pair for slot in slots):
        row = slot.row
        if row.io == "out" and slot.a is not None and row.accepted_difference:
            key = of_row[id(row)].content_key
            if key is not None:
                explained[key] = (row.key, row.metrics.rel_l2 if row.metrics is not None else None)
            if row.slot.startswith("param_grad."):
                name = param_name(row.module, row.slot)
                if name not in diverged_params and name not in updated:
                    # the next step's parameter was updated from it by an optimizer probe did not
                    # record (a recorded update is judged itself, and its result carried by value)
                    explained[("param", name)] = f"{row.key}, rel L2 {sci(row.metrics.rel_l2)}"
    return explained


def _call_key(slots: list[Slot]) -> tuple | None:
    """(module, op, index) of a call pair: what ties a backward call to its forward."""
    if not slots:
        return None
    head = slots[0].row
    return head.module, head.op, head.index


def _with_operands(slots, of_row: dict) -> list:
    """[(RecordRow, A's recorded Operand or None)]: what the envelope rules read of a call."""
    found = []
    for slot in slots:
        m = of_row.get(id(slot.row))
        found.append((slot.row, m.operand if m is not None else None))
    return found


def apply(findings) -> None:
    """Write what the rounding rules found (rounding.Finding) into the rows."""
    for found in findings:
        row = found.row
        if found.envelope is not None:
            row.envelope = found.envelope
        if found.verdict == R.EXPLAINED:
            row.explain(found.cause, found.origin)
        elif found.verdict == REPLAYED_DIFFERENTLY:
            row.unexplain(found.cause)
        elif found.verdict == ACCEPTED:
            row.accepted = True
        else:
            row.status = found.verdict or row.status
            row.divergence = row.divergence if found.divergence is None else found.divergence
            row.origin = row.origin if found.origin is None else found.origin
            row.cause = row.cause if found.cause is None else found.cause
            if found.reason:
                row.reasons.append(found.reason)


def _forward_rows(pairs, per_pair) -> dict:
    """(module, op, index) -> the Slots of that paired forward call: the values the call's
    backward computes from (call_rules.judge_call counts their rows as carriers)."""
    found: dict = {}
    for pair, call in zip(pairs, per_pair):
        if pair.a is not None and pair.b is not None and pair.phase == "forward":
            found.setdefault(_call_key(call), call)
    return found


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
                and row.dtype_a in UNIT_ROUNDOFF and row.dtype_b in UNIT_ROUNDOFF):
            calls.setdefault((row.module, row.op, row.index), row)  # the call's first output
    main_a = Counter(row.dtype_a for row in calls.values())
    main_b = Counter(row.dtype_b for row in calls.values())
    tally.dtypes_a.update(main_a)
    tally.dtypes_b.update(main_b)
    whole_run = bool(main_a) and main_a.most_common(1)[0][0] != main_b.most_common(1)[0][0]
    external = _external_inputs_of_lower_precision(rows, calls)
    found = []
    for call, row in calls.items():
        read = None
        if UNIT_ROUNDOFF[row.dtype_a] == UNIT_ROUNDOFF[row.dtype_b]:
            read = external.get(call)
            if read is None:
                continue
        source = read if read is not None else row
        b_coarser = UNIT_ROUNDOFF[source.dtype_b] > UNIT_ROUNDOFF[source.dtype_a]
        side, low, high = ("B", source.dtype_b, source.dtype_a) if b_coarser else ("A", source.dtype_a, source.dtype_b)
        runs, seq = (autocast_b, row.seq_b) if side == "B" else (autocast_a, row.seq_a)
        if _in_runs(seq, runs):
            tally.autocast[(side, low)] += 1
        elif whole_run:
            continue
        elif runs is None:
            tally.unknown[(side, low)] += 1
        else:
            found.append((row, side, low, high, read))
    # one rule: within the coarser side's rounding envelope, a finding; beyond it, or followed
    # by a divergence in this step file (where the difference it made grew), introduced
    within = [item for item in found if _within_coarser(item[0])]
    for item in found:
        if item not in within:
            _mark(*item)
            tally.findings += 1
    diverged_from = min((row.order for row in rows if row.status == R.DIVERGED), default=None)
    for row, side, low, high, read in within:
        if diverged_from is not None and row.order < diverged_from:
            _mark(row, side, low, high, read)
            tally.findings += 1
            continue
        text = _finding(row, side, low, high, read)
        row.notes.append(f"{R.PRECISION_FINDING} {text}, within {low}'s rounding envelope: not a divergence")
        tally.within.append(f"{text} (step {row.step} rank {row.rank})")


def _within_coarser(row: R.RecordRow) -> bool:
    """The output's values lie within the coarser side's envelope: the rounding envelope where
    the op has one (its verdict, at the coarser dtype), else that dtype's tolerance."""
    if row.status not in R.WITHIN:
        return False
    return row.envelope is None or row.envelope.get("verdict") == "within"


def _external_inputs_of_lower_precision(rows: list, calls: dict) -> dict:
    """(module, op, index) -> the input row of a forward api call that reads, in another
    precision on each side, a tensor no recorded op made (a buffer such as a rotary
    embedding's inverse frequencies, data): where the call's outputs agree in dtype, that
    input is where the lower precision enters."""
    found: dict = {}
    for row in rows:
        if (row.kind != "api" or row.phase != "forward" or row.io != "in" or row.status not in R.PAIRED
                or row.dtype_a not in UNIT_ROUNDOFF or row.dtype_b not in UNIT_ROUNDOFF
                or UNIT_ROUNDOFF[row.dtype_a] == UNIT_ROUNDOFF[row.dtype_b]):
            continue
        call = (row.module, row.op, row.index)
        output = calls.get(call)
        if output is None or call in found:
            continue
        sources = {item.get("slot"): item.get("source") for item in output.input_errors}
        if sources.get(row.slot) == "external":
            found[call] = row
    return found


def _finding(row, side: str, low: str, high: str, read=None) -> str:
    """B computes fc1 functional.linear in bfloat16 where A uses float32."""
    other = "A" if side == "B" else "B"
    if read is not None:
        what = f"buffer {read.buffer}" if read.buffer else "no recorded op made it: a buffer, data"
        return f"{side} reads {row.module or '<root>'} {row.op}'s {read.slot} ({what}) in {low} where {other} reads {high}"
    return f"{side} computes {row.module or '<root>'} {row.op} in {low} where {other} uses {high}"


def _mark(row, side: str, low: str, high: str, read=None) -> None:
    text = _finding(row, side, low, high, read)
    earlier = row.cause if row.status == R.DIVERGED and row.cause else ""
    row.status = R.DIVERGED
    row.divergence = R.PRECISION
    row.origin = R.INTRODUCED
    row.cause = text + (f"; {earlier}" if earlier else "")
    row.reasons.append(f"precision: {text} (the model's own cast, not autocast)")
