"""Judge stage, record rules: one paired record against its tolerance.

Rules (docs/compare-rules.md explains them for users):

* A tensor record is beyond tolerance when ``||a - b|| > rtol * ||a|| + atol * sqrt(n)``
  (``score`` = the left side over the right side, > 1 fails), with the tolerance of the
  lower-precision dtype; or when NaN or Inf sit on one side only; or when the shapes differ.
  A dtype difference alone is a note.
* A non-tensor argument (value column) compares exactly. A changed argument is a cause: the
  row is a divergence of kind "argument" and every output of that call counts as diverged
  and introduced there (call_rules.py). Dtype-valued arguments (``x.to(torch.bfloat16)``) are notes.
* Checksum evidence: a pair whose checksums differ while its statistics agree within
  tolerance is CHANGED (within tolerance, not bit-equal, size unknown), or a divergence
  when rounding cannot explain it (judge_checksum_change).

How a call's records explain each other (explained, amplified, introduced, inherited), and
the cause texts, are call_rules.py; the first divergence and the likely cause of a whole
compare are story.py.

Devices
-------

Where a tensor lives is not a numerical difference.

Two runs of the same code on a CPU and on a GPU (or an NPU, XPU, MPS device) pass the
device around: ``torch.arange(n, device=x.device)``, ``x.to(device)``, ``x.cuda()``,
``torch.tensor(1.0, device="cpu")``, ``non_blocking=True``, ``pin_memory=True``. Those
arguments differ between the runs by design, so compare treats them as placement, never as a
changed argument: the row matches, carries a note, and the report says once that the runs
ran on different devices (device_note).

Stale
-----

Records of an in-place write that hold the values from before the write.

An in-place op (``exp_avg.lerp_(grad, 0.1)``, ``torch._foreach_lerp_``) writes into its first
argument, and its output record is that tensor after the call. A capture that takes the
output's statistics from its per-tensor cache (keyed by the tensor's version counter) or
measures it before the write has landed (asynchronous device statistics) records the
*pre-call* values instead: the output record equals the op's own input record, bit for bit.
Seen in real H100 dumps (``_foreach_lerp_`` outputs and the ``_foreach_addcdiv_`` input that
reads the same tensor), while the parameter the step then wrote agreed with the CPU run.

A write that really did not happen looks the same in its own record, so the records decide:
a divergent in-place output that equals its own input.0 in one run while the other run's
changed is a *candidate*; later divergent input records of that run holding the very same
statistics are its *readers*. The candidate and its readers are stale (not compared, a note)
only when some reader's call wrote its own outputs (they are no candidates themselves) and
they agree within tolerance, or the reader is an op that amplifies (Adam's update of a
parameter whose gradient is noise may differ, but it did happen). Otherwise they stay
divergences, and the write that did not happen is where the error entered.

"""

from __future__ import annotations

import math
import re

from probe.comparison import result as R
from probe.comparison.metrics import Metrics
from probe.comparison.records import is_param_slot
from probe.comparison.structs import (
    ABSENT, MIXED, SCALAR, SHAPE, UNINITIALIZED_NOTE, VALUE, MeasuredStep, Measurement, rel_error, sci,
)
from probe.comparison.tolerances import MANTISSA_BITS, Tolerance

_DTYPE_WORDS = set(MANTISSA_BITS) | {
    "bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64", "half",
    "float", "double", "long", "int", "short",
}


def is_dtype_value(value) -> bool:
    """A parsed value that names a dtype ("torch.bfloat16", "float")."""
    return isinstance(value, str) and value.removeprefix("torch.") in _DTYPE_WORDS


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


def same_extremes(metrics: Metrics) -> bool:
    """Statistics evidence: min, max and the NaN/Inf counts are bit-identical on both sides.
    They do not depend on the order of the values (mean and norm are sums whose rounding does),
    so a reordering keeps them exactly, while rounding every element of a computation
    differently nearly always moves one of them."""
    rel = metrics.stat_rel or {}
    return rel.get("min") == 0.0 and rel.get("max") == 0.0 and not metrics.nan_mismatch and not metrics.inf_mismatch


def judge_checksum_change(row: R.RecordRow, untouched: bool) -> None:
    """A pair whose checksums differ while its statistics agree within tolerance.

    Statistics cannot size the change, and rounding cannot explain every such change:
    rounding comes from computing, and it moves nearly every value, extremes included. So
    the record is a divergence ("changed, size unknown") when nothing has computed it yet
    (untouched: a parameter, or an input no recorded op made, read by the forward of step 0
    before any record differed, as the judge decides) and its min, max and NaN/Inf counts
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


def judge_value(row: R.RecordRow, metrics: Metrics, values: tuple) -> None:
    """A plain value against the other run's; values: both, parsed (Measurement.values)."""
    row.metrics = metrics
    row.score = 0.0 if metrics.bit_equal else math.inf
    if metrics.bit_equal:
        row.status = R.MATCH
    elif row.io == "in" and is_dtype_value(values[0]) and is_dtype_value(values[1]):
        row.status = R.MATCH  # a dtype choice, never an error by itself
        row.notes.append(f"dtype argument {metrics.value_a} in A, {metrics.value_b} in B")
    elif row.io == "in" and is_placement_pair(row.slot, *values):
        row.status = R.MATCH  # where a tensor lives, never a numerical difference
        row.notes.append(f"{R.PLACEMENT_NOTE} {metrics.value_a} in A, {metrics.value_b} in B (not compared)")
    else:
        row.status = R.DIVERGED
        row.reasons.append(f"value {metrics.value_a} in A, {metrics.value_b} in B")


#: torch's device types (torch._C._get_privateuse1_backend_name aside); "cuda:0", "npu:3"
_DEVICE = re.compile(
    r"^(cpu|cuda|npu|xpu|mps|hpu|xla|meta|mtia|ipu|lazy|ve|vulkan|hip|privateuseone|maia|fpga|ort)(:\d+)?$"
)
#: argument names that only say where or how a tensor is placed (never its values)
PLACEMENT_ARGS = ("device", "non_blocking", "pin_memory")


def is_device_value(value) -> bool:
    """A recorded (parsed) value that names a device: "cpu", "cuda:0", torch.device('npu', 1)."""
    if not isinstance(value, str):
        return False
    value = value.strip()
    match = re.match(r"^device\(type='(\w+)'(?:, index=(\d+))?\)$", value)
    if match:
        value = match.group(1) + (f":{match.group(2)}" if match.group(2) else "")
    return bool(_DEVICE.match(value))


def is_placement_slot(slot: str) -> bool:
    """kwarg.device, kwarg.non_blocking, kwarg.pin_memory (nested or not)."""
    return slot.startswith("kwarg.") and slot.split(".")[1] in PLACEMENT_ARGS


def is_placement_pair(slot: str, value_a, value_b) -> bool:
    """Two recorded (parsed) values of one argument that differ only by where the tensor lives: both
    name a device (a positional ``.to("cuda:0")`` included), or the argument is a placement
    argument (device=, non_blocking=, pin_memory=)."""
    if is_placement_slot(slot):
        return True
    return is_device_value(value_a) and is_device_value(value_b)


class StaleRecords:
    """Collect candidates while the records are measured (check), decide after (resolve)."""

    def __init__(self):
        self.candidates: list[tuple[R.RecordRow, int, tuple]] = []  # (row, side, stats)
        self.readers: list[tuple[R.RecordRow, int, tuple, int]] = []  # (row, side, stats, call number)

    def check(self, row: R.RecordRow, stats: tuple, before: tuple | None, number: int) -> None:
        """row was just judged; stats: its records' statistics in A and B, before: those of its
        call's input.0 (None: a run has none), as measure read them (Measurement)."""
        if row.status != R.DIVERGED or row.metrics is None or row.metrics.evidence == "value":
            return
        if row.io == "in":
            for _, side, seen in self.candidates:
                if stats[side] is not None and stats[side] == seen:
                    self.readers.append((row, side, seen, number))
                    return
            return
        if not row.spec.in_place or before is None:
            return
        unchanged = [stats[side] is not None and stats[side] == before[side] for side in (0, 1)]
        if unchanged[0] != unchanged[1]:
            side = 0 if unchanged[0] else 1
            self.candidates.append((row, side, stats[side]))

    def resolve(self, outputs_of) -> None:
        """outputs_of(call number) -> the RecordRows of that call's outputs."""
        candidate_rows = {id(row) for row, _, _ in self.candidates}
        for row, side, seen in self.candidates:
            readers = [(reader, number) for reader, s, stats, number in self.readers if s == side and stats == seen]
            confirmed = any(
                outputs and all((out.status in R.WITHIN or out.spec.amplifies) and id(out) not in candidate_rows
                                for out in outputs)
                for outputs in (outputs_of(number) for _, number in readers))
            if confirmed:
                for stale_row in [row] + [reader for reader, _ in readers]:
                    _mark(stale_row, "AB"[side])


def _mark(row: R.RecordRow, name: str) -> None:
    row.status = R.MATCH
    row.reasons.clear()
    row.stale = name
    row.notes.append(
        f"not compared: {name}'s record holds the values from before the in-place write (identical to the "
        f"call's input.0, while the other run's changed), and the op that read it computed what the other run "
        f"did: the capture measured it too early")


# ---------------------------------------------------------------------------- the records in execution order


def judge_records(measured: MeasuredStep, previous_explained: dict | None) -> tuple[StaleRecords, list]:
    """Judge every paired record in A's execution order. Returns the in-place writes seen on
    the way (resolved once every record is judged), and the (row, input kind) of the records
    nothing has computed yet (rounding.judge_untouched judges them against rounding)."""
    stale = StaleRecords()
    unmade = []
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
        if untouched:
            unmade.append((row, item.kind))
        differed = differed or _differs(row)
    return stale, unmade


def judge_uninitialized(row: R.RecordRow) -> None:
    """A record of memory nothing had written yet in run(s) row.stale (set by measure): an
    empty-family allocation, or a view of it, read before its first write. Its bytes are
    whatever the memory held: not a value of either run, never compared."""
    row.status = R.MATCH
    row.reasons.clear()
    row.notes.append(f"{UNINITIALIZED_NOTE} in {' and '.join(row.stale)} (an empty-family allocation, "
                     "or a view of one, read before anything wrote it)")


def judge_record(item: Measurement) -> None:
    """The record rule for what the record was measured as."""
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
    if earlier is not None and row.status == R.DIVERGED and row.explainable:
        row.explain(f"carries the accepted difference of {earlier} from the previous step")
    elif earlier is not None and row.status in R.WITHIN:
        row.accepted = True
    elif previous_explained and row.status == R.DIVERGED and row.explainable:
        grad = previous_explained.get(("param", item.param))
        if grad is not None:
            row.explain(f"an optimizer step that is not recorded (level \"module\") updated this "
                         f"parameter from a gradient whose difference was accepted ({grad}); Adam-type "
                         "optimizers turn a rounding-noise gradient into an lr-sized update")


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
