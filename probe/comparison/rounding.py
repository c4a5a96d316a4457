"""Judge stage, envelope rules: is each op's gap what rounding alone would make?

For every paired output of a paired call the envelope model (envelope.py) gives what
rounding alone can make it differ by: the op's own rounding from its dtype, reduction length
and conditioning, plus what its inputs' measured differences make through it. Then:

* an output beyond the fixed tolerance whose inputs are all within tolerance or accepted,
  and whose own error (what its inputs do not explain) is within envelope.FACTOR x its
  rounding, is **rounding** (status explained, origin "rounding"): "expected from rounding:
  X, seen: Y". With sketch evidence the band of the estimate decides: the whole band within
  is rounding, a band that straddles the limit is **uncertain** (not a divergence; the note
  names the config line that dumps that op as a tensor), only a band whose low end is beyond
  is an error;
* an output within the fixed tolerance whose inputs agree (within tolerance) while its own
  error is beyond FACTOR x its rounding, with the low end of its evidence, is a divergence
  the op **introduced**: a well-conditioned op's envelope is tighter than the tolerance, so an
  error that enters below the tolerance is found where it enters;
* an input that differs by more than the output that made it, where nothing was computed in
  between (a copy rounds nothing), was **changed** by something not recorded (a gradient hook,
  a custom autograd Function): the call that reads it is where the difference enters.

``strict`` (``probe compare --strict``) keeps the envelopes as information only: the fixed
tolerance decides alone.

The float64 recheck
-------------------

An output that differs far more than its inputs is accepted as amplified when the op's
conditioning can explain it (call_rules.judge_call). Where the tensors were dumped (task
"tensor") the claim is checked instead of assumed, for the elementwise ops optimizers and
normalizations are made of (their spec's replay, ops.py): the op recomputed in float64 from
each run's *own* recorded inputs. If each run's output is its own inputs' result up to that
run's rounding, the op did its job; if one run's output is not, the op itself computed
differently there (introduced). It is the one rule after measure that reads record columns
and fetches tensors.

These rules write no row: they return Findings, which the judge writes (judge.apply), so a
call judged later sees them. Torch-free: the replays are numpy expressions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from probe.comparison import result as R
from probe.comparison.envelope import (
    ELEMENTWISE_ULPS, FACTOR, LAMBDA, Envelope, Operand, expected_text,
)
from probe.comparison.metrics import parse_value
from probe.comparison.op_envelopes import UNIT_ROUNDOFF, judged, unit_roundoff
from probe.comparison.ops import NotReplayable, OpSpec, Replay
from probe.comparison.records import is_param_slot
from probe.comparison.sketch import band as sketch_band
from probe.comparison.structs import AMPLIFIED, EXPLAINED, PARAM_INPUT, PRODUCED, MeasuredStep, Slot, sci
from probe.comparison.tolerances import tolerance_dtype

#: the origin of an output whose difference its rounding envelope explains
ROUNDING = "rounding"
#: the origin of an output whose sketch band straddles its envelope: not an error, not cleared
UNCERTAIN = "uncertain"


@dataclass
class Finding:
    """What a rounding rule found about one row, for the judge to write (judge.apply): its
    envelope, and a verdict: EXPLAINED (explain), DIVERGED (the fields given set; None: left
    as they are), REPLAYED_DIFFERENTLY (unexplain), ACCEPTED (accepted where read again), or
    "" (the envelope and the cause only)."""

    row: R.RecordRow
    verdict: str = ""
    origin: str | None = None
    divergence: str | None = None
    cause: str | None = None
    reason: str = ""
    envelope: dict | None = None


#: Finding.verdict of an accepted rounding difference, and of an amplified output its own
#: inputs do not give when replayed in float64
ACCEPTED, REPLAYED_DIFFERENTLY = "accepted", "replayed differently"


def error_band(row: R.RecordRow) -> tuple[float, float, float] | None:
    """(low, estimate, high) of ||a - b|| as the row's evidence knows it; None when it has no
    size (a value, NaN or Inf on one side, a shape change, a stale record)."""
    m = row.metrics
    if m is None or m.evidence == "value" or row.stale or m.nan_mismatch or m.inf_mismatch:
        return None
    if row.shape_a and row.shape_b and row.shape_a != row.shape_b:
        return None
    if not math.isfinite(m.err_l2):
        return None
    if m.evidence == "tensor" or m.bit_equal is True:
        return m.err_l2, m.err_l2, m.err_l2
    found = m.sketch
    proven = _proven_bound(m)
    if found is not None:
        bound = float(found.get("lower_bound") or 0.0)
        if found.get("within_floor"):
            _, high = sketch_band(int(found["k"]))
            return proven, m.err_l2, max(bound, float(found["floor"]) * high)
        # the sketches' own rounding (at most their floor) may sit in the estimate
        low = max(proven, float(found["low"]) - float(found["floor"]))
        return low, m.err_l2, max(bound, float(found["high"]))
    return proven, m.err_l2, math.inf  # statistics alone: a lower bound


def _proven_bound(m) -> float:
    """The part of the statistics' lower bound that rounding cannot make: the extremes are
    exact whatever the order of the sums, the norm and the mean are sums the capture itself
    computed in another order on each side (see below)."""
    rel = m.stat_rel or _NO_STATISTICS
    numel = int(m.numel)
    numel = numel if numel > 1 else 1
    root = math.sqrt(numel)
    ref = m.ref_norm
    rms = ref / root if ref else 0.0
    # max() spelled out (its four calls were a fifth of this function's time): the same
    # operands in the same order, so a NaN goes where max() would put it
    low, high = (rel.get("min") or 0.0) * rms, (rel.get("max") or 0.0) * rms
    extremes = high if high > low else low
    # a float32 sum of n values errs by lambda sqrt(n) u sum|x| (sum|x| <= sqrt(n) ||x||): the
    # mean times sqrt(n) by lambda sqrt(n) u ||x||, the norm (a sum of squares, rooted) by half that
    own = LAMBDA * root * UNIT_ROUNDOFF["float32"] * (ref + m.other_norm)
    norm_part, mean_part = (rel.get("norm") or 0.0) * ref - own / 2, (rel.get("mean") or 0.0) * rms * root - own
    proven = extremes
    if (sums := mean_part if mean_part > norm_part else norm_part) > proven:
        proven = sums
    if 0.0 > proven:
        proven = 0.0
    return min(proven, m.err_l2) if math.isfinite(proven) else 0.0


_NO_STATISTICS: dict = {}


class Bands:
    """error_band of each row, computed once. Valid while no row's metrics, stale mark or
    shapes change: from the judge's call loop on (record_rules set those before it)."""

    def __init__(self):
        self._found: dict = {}

    def of(self, row: R.RecordRow):
        key = id(row)
        found = self._found.get(key, _UNKNOWN)
        if found is _UNKNOWN:
            found = self._found[key] = error_band(row)
        return found


_UNKNOWN = object()


def operand(recorded: Operand | None, row: R.RecordRow, found=False) -> Operand | None:
    """A's recorded tensor (recorded: its statistics as measure read them, None when A has no
    record) with the high end of B's difference (what may propagate), in the dtype it is judged
    in. found: the row's error_band, when the caller has it."""
    if recorded is None or row.metrics is None or row.metrics.evidence == "value":
        return None
    if found is False:
        found = error_band(row)
    err = found[2] if found is not None else math.inf
    dtype = tolerance_dtype(row.dtype_a, row.dtype_b) if row.dtype_a and row.dtype_b else recorded.dtype
    return Operand(recorded.numel, recorded.norm, recorded.min, recorded.max, recorded.mean, recorded.shape, dtype, err)


def tensor_line(row: R.RecordRow) -> str:
    """The config line that dumps this op's call as full tensors (so compare measures it exactly)."""
    scope = f'"scope": ["{row.module}"], ' if row.module else ""
    return f'{{"task": "tensor", {scope}"list": ["{row.op}"], "step": [{row.step}]}}'


def measured_envelopes(rows) -> dict:
    """(step, rank) -> {A's output key: the high end of what a trusted run differs from A by
    there}: the envelopes ``probe compare A B --baseline C`` measures from the compare of A and C."""
    found: dict = {}
    for row in rows:
        if row.io != "out" or row.status not in R.PAIRED or not row.key_a:
            continue
        band = error_band(row)
        if band is not None and math.isfinite(band[2]):
            found.setdefault((row.step, row.rank), {})[row.key_a] = band[2]
    return found


def judge_envelopes(call_rows, forward_items, input_kind, strict: bool = False,
                    baseline: dict | None = None, bands: Bands | None = None) -> list[Finding]:
    """Every paired output of one call pair with its envelope, and what the rules above find.

    call_rows: [(RecordRow, A's recorded Operand or None)] of the call pair; forward_items: the
    same for the forward call of a backward one (() otherwise); input_kind(row) -> (kind,
    producer row); baseline: A's output key -> what a trusted second run differs from A by
    there (with it, B - A is judged against C - A, see with_baseline); bands: the rows' error
    bands so far (Bands), shared by the calls of one step file."""
    if not call_rows:
        return []
    bands = bands or Bands()
    head = call_rows[0][0]
    findings: list[Finding] = []
    changed = None if strict else _changed_input(call_rows, input_kind, bands)
    source_found = changed is None or changed[0].status == R.DIVERGED
    known = head.spec.family is not None or bool(baseline and any(row.key_a in baseline for row, _ in call_rows))
    call = _Call(call_rows, forward_items, bands) if known else None
    for row, recorded in call_rows:
        if row.io != "out" or row.status not in R.PAIRED or recorded is None:
            continue
        found = bands.of(row)
        if found is None:
            continue
        env, envelope = call.envelope(head, row, recorded, found, baseline) if call is not None else (None, None)
        if strict or found[1] == 0:
            finding = None
        elif changed is not None:  # whatever the op: a copy rounds nothing
            if not source_found:
                findings.append(_changed_source(changed))
                source_found = True
            finding = _enters_here(row, changed)
        elif env is not None:
            finding = _apply(row, env, envelope, found, call)
        else:
            finding = None
        if finding is None and envelope is not None:
            finding = Finding(row)
        if finding is not None:
            finding.envelope = envelope
            findings.append(finding)
    return findings


class _Call:
    """What the envelope rules read of one call pair: its inputs as Operands, and whether they agree."""

    def __init__(self, call_rows, forward_items, bands: Bands):
        self.inputs, self.values, self.forward = {}, {}, {}
        self.tensor_in, self.divergent, self.untouched = [], set(), []
        paired = R.PAIRED
        # every input's difference is one a correct run may have (rounding, or accepted
        # upstream), not a difference hidden under the absolute floor
        accepted = []  # the tensor inputs and forward tensors, whose is_accepted decides agree
        self.agree = True
        # one precision on both sides, here and upstream: where the runs compute in different
        # dtypes (autocast, or the model's own casts) the precision rules decide
        self.one_precision = True
        for row, recorded in call_rows:
            if row.status not in paired:
                continue
            self.one_precision = self.one_precision and _one_precision(row)
            if row.io != "in":
                continue
            diverged = row.status == R.DIVERGED
            if diverged:
                self.divergent.add(row.slot)
                self.agree = False
                if row.envelope is not None and row.envelope["family"] == "untouched":
                    self.untouched.append(row)
            m = row.metrics
            if m is not None and m.evidence == "value":
                self.values[row.slot] = parse_value(m.value_a or "")
                continue
            if (found := operand(recorded, row, bands.of(row))) is not None:
                self.inputs[row.slot] = found
            if m is not None:
                self.tensor_in.append(row)
                accepted.append(row)
        for row, recorded in forward_items:
            if row.status not in paired:
                continue
            self.one_precision = self.one_precision and _one_precision(row)
            if (found := operand(recorded, row, bands.of(row))) is not None:
                self.forward[row.slot] = found
            if row.metrics is not None and row.metrics.evidence != "value":
                accepted.append(row)
                if row.status == R.DIVERGED:
                    self.divergent.add(f"forward.{row.slot}")
        self.agree = self.agree and all(row.is_accepted for row in accepted)

    def envelope(self, head, row, recorded, found, baseline) -> tuple[Envelope | None, dict | None]:
        """(its envelope, what the row reports of it) of one output; (None, None): none."""
        out = operand(recorded, row, found)
        if out is None:
            return None, None
        measured = baseline.get(row.key_a) if baseline is not None else None
        return judged(head.spec, head.phase, row.slot, out, self.inputs, self.forward, self.values, found,
                      self.divergent, measured)


def _apply(row: R.RecordRow, env: Envelope, envelope: dict, found, call: _Call) -> Finding | None:
    """The rules of the module docstring, for one output with a difference."""
    low, _, high = found
    verdict, text = envelope["verdict"], envelope["text"]
    if call.untouched and row.status in (R.MATCH, R.CHANGED):
        source = call.untouched[0]
        return Finding(row, R.DIVERGED, R.INTRODUCED, R.OUTPUT,
                       f"parameter {source.slot} ({source.key}) differs before anything computed it "
                       f"(||a - b|| {sci(source.envelope['seen'])}, below the tolerance; rounding makes none): "
                       f"the difference enters here ({text})",
                       f"reads {source.slot}, which differs beyond its rounding envelope")
    if not call.agree or not call.one_precision:
        return None
    if row.status in (R.MATCH, R.CHANGED) and verdict == "within" and not row.is_accepted:
        # within tolerance only by the absolute floor, yet within what rounding makes from
        # inputs that agree: a rounding difference, accepted where it is read again
        return Finding(row, ACCEPTED)
    if row.status == R.DIVERGED and row.divergence in (R.OUTPUT, "") and verdict == "within":
        return Finding(row, R.EXPLAINED, ROUNDING, cause=f"rounding: {text} ({env.describe()}); its own error is "
                                                          f"within {FACTOR:g}x what rounding alone makes")
    if row.status == R.DIVERGED and row.divergence in (R.OUTPUT, "") and verdict == UNCERTAIN:
        return Finding(row, R.EXPLAINED, UNCERTAIN, cause=(
            f"uncertain: {text} ({env.describe()}); the estimate's band [{sci(low)}, {sci(high)}] straddles "
            f"{FACTOR:g}x the rounding envelope: dump this op as a tensor to decide, with the config line "
            f"{tensor_line(row)}"))
    if row.status in (R.MATCH, R.CHANGED) and verdict == "beyond" and row.divergence == "" and call.tensor_in \
            and low > (row.atol or 0.0) * math.sqrt(max(row.metrics.numel, 0)):
        return Finding(row, R.DIVERGED, R.INTRODUCED, R.OUTPUT,
                       f"beyond its rounding envelope within tolerance: {text} ({env.describe()}); its inputs "
                       "agree, so the op itself computed differently", f"beyond its rounding envelope: {text}")
    if row.status == R.DIVERGED and verdict == "beyond":
        return Finding(row, cause=f"{row.cause}; {text}" if row.cause else text)
    return None


def _one_precision(row: R.RecordRow) -> bool:
    """A value record, or a tensor of one dtype in both runs judged at that dtype's tolerance
    (no coarser precision upstream)."""
    if row.metrics is None or row.metrics.evidence == "value" or not row.tol_dtype:
        return True
    return row.dtype_a == row.dtype_b and row.tol_dtype == tolerance_dtype(row.dtype_a, row.dtype_b)


def _changed_input(call_rows, input_kind, bands: Bands):
    """(input row, its producer, their bands) of an input that differs by more than the output
    that made it, with nothing computed in between; None when there is none."""
    for row, _ in call_rows:
        if row.io != "in" or row.status not in R.WITHIN or row.metrics is None or row.metrics.evidence == "value":
            continue
        kind, producer = input_kind(row)
        if kind != PRODUCED or producer is None or producer.status not in R.PAIRED or producer.order >= row.order:
            continue
        if (row.dtype_a, row.dtype_b) != (producer.dtype_a, producer.dtype_b):
            continue  # a cast in between (autograd casting a gradient back to bfloat16) rounds
        mine, theirs = bands.of(row), bands.of(producer)
        if mine is None or theirs is None or not math.isfinite(theirs[2]):
            continue
        norm = row.metrics.ref_norm or 0.0
        if mine[0] > 2.0 * theirs[2] + 1e-9 * norm and mine[0] > 0:
            return row, producer, mine, theirs
    return None


def _changed_source(changed) -> Finding:
    """The input changed after it was made: where the difference enters."""
    source, producer, mine, theirs = changed
    return Finding(source, R.DIVERGED, R.INTRODUCED, R.INPUT,
                   reason=f"differs by {sci(mine[1])} although {producer.key}, which made it, differs by "
                          f"{sci(theirs[1])}: changed in between, and a copy rounds nothing")


def _enters_here(row: R.RecordRow, changed) -> Finding | None:
    """The call reads an input changed after it was made: the difference enters here."""
    source, producer, mine, theirs = changed
    if row.status == R.DIVERGED and row.origin == R.INTRODUCED:
        return None
    return Finding(row, R.DIVERGED, R.INTRODUCED, R.OUTPUT,
                   f"input {source.slot} differs (||a - b|| {sci(mine[1])}) although {producer.key}, which made it, "
                   f"differs by {sci(theirs[1])}: something not recorded changed it in between (a gradient hook, a "
                   "custom autograd Function); nothing computes between the two, so rounding explains none of it",
                   f"its input {source.slot} was changed after it was made")


def judge_untouched(row: R.RecordRow, kind: str) -> Finding | None:
    """A parameter read by the forward of step 0 has not been computed by anything yet: its
    rounding envelope is 0, and any difference the evidence proves (the low end of its band)
    is a change, however far below the tolerance (a weight scaled by 1 + 1e-6)."""
    if row.status not in (R.MATCH, R.CHANGED) or not (is_param_slot(row.slot) or kind == PARAM_INPUT):
        return None
    found = error_band(row)
    if found is None or row.metrics is None:
        return None
    # its initialization: a few flops per value, computed in another order or on another device
    # (a few ulps), and one rounding more where a run holds it in a coarser dtype
    u = unit_roundoff(tolerance_dtype(row.dtype_a, row.dtype_b)) or 0.0
    rounding = (ELEMENTWISE_ULPS + (1.0 if row.dtype_a != row.dtype_b else 0.0)) * u * row.metrics.ref_norm
    if found[0] <= FACTOR * rounding:
        return None
    gap = found[1] / rounding if rounding > 0 else math.inf
    envelope = {"family": "untouched", "k": 1, "u": u, "conditioning": 1.0, "rounding": rounding,
                "propagated": 0.0, "expected": rounding, "seen": found[1], "low": found[0],
                "high": found[2] if math.isfinite(found[2]) else None, "gap": gap, "verdict": "beyond",
                "text": expected_text(rounding, found[1]), "divergent_inputs": []}
    return Finding(row, R.DIVERGED, reason=f"differs (||a - b|| at least {sci(found[0])}) before anything but its "
                                           f"initialization computed it (step 0, read by the forward): more than "
                                           f"{ELEMENTWISE_ULPS:g} ulps of rounding make; within the fixed tolerance, "
                                           "beyond its rounding envelope", envelope=envelope)


# ---------------------------------------------------------------------------- the float64 recheck

def recheck_amplified(slots: list[Slot], measured: MeasuredStep) -> list[Finding]:
    """Where the tensors were dumped, an output accepted as amplified by an elementwise op is
    checked by replaying the op in float64 on each run's own inputs (its spec's replay,
    ops.py): an output its own inputs do not give was computed differently there (introduced)."""
    findings: list[Finding] = []
    if measured.fetch_a is None or measured.fetch_b is None:
        return findings
    outputs = [(s.row, s.a, s.b) for s in slots if s.row.io == "out" and s.row.status == EXPLAINED
               and s.row.origin == AMPLIFIED and s.row.metrics is not None and s.row.metrics.evidence == "tensor"]
    if not outputs:
        return findings
    cols_a, cols_b = measured.aligned.records_a.columns, measured.aligned.records_b.columns
    op = slots[0].row.spec
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
                return findings
            errors.append(own_error(op, side, fetch(cols["tensor_id"][index])))
        if None in errors:
            continue
        limit = row.rtol or 0.0
        if max(errors) > limit:
            findings.append(Finding(row, REPLAYED_DIFFERENTLY, cause=(
                f"replayed in float64 from each run's own inputs, {row.op} gives A's output within rel L2 "
                f"{sci(errors[0])} and B's within {sci(errors[1])} (tolerance {limit:g}): the op itself computed "
                "differently, not its conditioning")))
        else:
            findings.append(Finding(row, cause=f"{row.cause}; checked elementwise: replayed in float64 from each "
                                               f"run's own inputs it gives both outputs (rel L2 {sci(errors[0])} "
                                               f"and {sci(errors[1])})"))
    return findings


def replay(op: OpSpec, tensors: dict, values: dict):
    """The op's float64 result from its recorded inputs (its spec's replay, ops.py), or None
    when it has none or its arguments are not all known."""
    how = op.replay
    if how is None:
        return None
    with np.errstate(all="ignore"):
        try:
            return how(Replay(tensors, values))
        except NotReplayable:
            return None


def own_error(op: OpSpec, side: dict, output: np.ndarray) -> float | None:
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
