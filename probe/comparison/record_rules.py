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

How a call's records explain each other (explained, amplified, introduced, inherited) is
call_rules.py; the first divergence and the likely cause of a whole compare are assemble.py.

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

Causes
------

Judge stage, in words: why an output differs (the cause a report prints).
"""

from __future__ import annotations

import math
import re

from probe.comparison import result as R
from probe.comparison.metrics import Metrics
from probe.comparison.records import LOCAL_GRAD
from probe.comparison.structs import (
    CARRIED, CHANGED, EXTERNAL, FORWARD, PARAM_INPUT, PARAM_UPDATE, UNINITIALIZED_NOTE, UNPAIRED, UNRECORDED,
    rel_error, sci,
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
    before any record differed, as the engine decides) and its min, max and NaN/Inf counts
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


#: ops whose output can differ far more than their inputs (relatively) without any error of
#: their own: a division or reciprocal by values near their own error, a square root near 0,
#: a subtraction of nearly equal values, exp/pow of a difference, and the optimizer updates
#: built on them (Adam's m / (sqrt(v) + eps) is about sign(g) whatever |g|)
_AMPLIFIERS = frozenset({
    "div", "divide", "true_divide", "addcdiv", "reciprocal", "rsqrt", "sqrt", "sub", "rsub", "subtract",
    "exp", "exp2", "expm1", "pow", "log", "log1p", "log_softmax", "softmax", "adam", "adamw", "sgd",
    "fused_adam", "fused_adamw", "fused_sgd", "normalize", "batch_norm", "layer_norm", "group_norm",
    "instance_norm", "rms_norm", "var", "std", "var_mean", "std_mean", "atan2", "tan",
})


def amplifies(op: str) -> bool:
    """The op is one whose conditioning can amplify relative error (see _AMPLIFIERS)."""
    name = op.rsplit(".", 1)[-1].removeprefix("_foreach_").removeprefix("_fused_").strip("_")
    if name in _AMPLIFIERS or name.removeprefix("fused_") in _AMPLIFIERS:
        return True
    # a module (kind "module": the class name): BatchNorm2d, LayerNorm, LlamaRMSNorm, Softmax
    lowered = name.lower().rstrip("123d")
    return lowered.endswith(("norm", "softmax"))


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


def is_in_place(op: str) -> bool:
    name = op.rsplit(".", 1)[-1]
    return name.endswith("_") and not name.startswith("__") and not op.startswith("distributed.")


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
        if not is_in_place(row.op) or before is None:
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
                outputs and all((out.status in R.WITHIN or amplifies(out.op)) and id(out) not in candidate_rows
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


def judge_uninitialized(row: R.RecordRow) -> None:
    """A record of memory nothing had written yet in run(s) row.stale (set by measure): an
    empty-family allocation, or a view of it, read before its first write. Its bytes are
    whatever the memory held: not a value of either run, never compared."""
    row.status = R.MATCH
    row.reasons.clear()
    row.notes.append(f"{UNINITIALIZED_NOTE} in {' and '.join(row.stale)} (an empty-family allocation, "
                     "or a view of one, read before anything wrote it)")


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
