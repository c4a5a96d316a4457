"""The rounding envelope of each op family: op_envelope, and judged (an output's envelope and
what its row reports of it).

What an envelope is, and the model behind the bounds, is envelope.py; which family and form
an op takes is its spec (ops.py). A new family or form is a branch of op_envelope (forward)
or _backward here. Torch-free and numpy-free.
"""

from __future__ import annotations

import math

from probe.comparison.envelope import ELEMENTWISE_ULPS, LAMBDA, RUNS, Envelope, Operand, with_baseline
from probe.comparison.ops import (
    ADDCDIV, ADDCMUL, ATTENTION, BROADCAST, CAST, CHANNELS, CONCAT, CONV, COPY, DIVIDE, DOT, ELEMENTWISE, EXP,
    GATHER, LERP, LOG, LOG1P, LOSS, MEANS, NORM, OPTIMIZER, POW, PRODUCT, QUOTIENT, RECIPROCAL, RSQRT, SAMPLES,
    SHIFT, SOFTMAX, SQRT, SQUARE, SUM, OpSpec,
)


#: unit roundoff (half an ulp at 1) of each floating dtype
UNIT_ROUNDOFF = {
    "float64": 2.0 ** -53, "complex128": 2.0 ** -53,
    "float32": 2.0 ** -24, "complex64": 2.0 ** -24,
    "float16": 2.0 ** -11, "complex32": 2.0 ** -11,
    "bfloat16": 2.0 ** -8,
    "float8_e4m3fn": 2.0 ** -4, "float8_e4m3fnuz": 2.0 ** -4,
    "float8_e5m2": 2.0 ** -3, "float8_e5m2fnuz": 2.0 ** -3,
}

#: the 16-bit and 8-bit floating dtypes: where two kernels of one computation round apart
LOW_PRECISION = ("bfloat16", "float16", "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz")


def unit_roundoff(dtype: str) -> float | None:
    return UNIT_ROUNDOFF.get(dtype.removeprefix("torch."))


def accumulation_roundoff(dtype: str) -> float | None:
    """16-bit and 8-bit ops accumulate in float32 on every device probe knows (cuBLAS, oneDNN,
    CPU fallbacks); float32 and float64 in their own dtype (TF32 off, torch's default)."""
    u = unit_roundoff(dtype)
    if u is None:
        return None
    return min(u, UNIT_ROUNDOFF["float32"])


def judged(op_spec: OpSpec, phase: str, slot: str, out: Operand, inputs: dict, forward: dict, values: dict,
           band: tuple, divergent, measured: float | None = None) -> tuple[Envelope | None, dict | None]:
    """(the envelope of one output, what its row reports of it), (None, None) where the model
    does not know the op; measured: what a trusted second run differs from A by there (with_baseline)."""
    env = op_envelope(op_spec, phase, slot, out, inputs, forward, values)
    if measured is not None:
        env = with_baseline(env, measured)
    return (env, env.report(band, divergent)) if env is not None else (None, None)


def _prod(values) -> int:
    total = 1
    for v in values:
        total *= int(v)
    return total


def _sensitivity(parts: list, slot: str, operand: Operand | None, factor: float) -> float:
    if operand is None or operand.err == 0:
        return 0.0
    share = factor * operand.err
    parts.append((slot, share))
    return share


def op_envelope(op_spec: OpSpec, phase: str, slot: str, out: Operand, inputs: dict, forward: dict | None = None,
                values: dict | None = None, dtype: str | None = None) -> Envelope | None:
    """The envelope of output ``slot`` of one call of an op (its spec: ops.spec(op)).

    inputs: slot -> Operand of the call's tensor inputs ("input.0", "input.1", "kwarg.bias",
    "param.weight", "grad_output.0"); forward: the same for the forward call of a backward one;
    values: slot -> plain value (scalars such as addcdiv's value); dtype: the dtype its rounding
    is judged in (the lower-precision side, autocast included; default the output's).
    None where the model does not know the op (the fixed tolerance judges alone)."""
    fam = op_spec.family
    dtype = dtype or out.dtype
    u = unit_roundoff(dtype)
    if fam is None or u is None or out.numel <= 0:
        return None
    u_acc = accumulation_roundoff(dtype)
    values = values or {}
    forward = forward or {}
    # operands cast to a lower dtype on one side (autocast) round once more, at the judged dtype
    u_cast = u if any(o.dtype and o.dtype != dtype and unit_roundoff(o.dtype) is not None
                      and unit_roundoff(o.dtype) < u for o in inputs.values()) else 0.0
    tensors = [(s, o) for s, o in inputs.items() if o.numel > 0]
    parts: list = []
    if phase == "backward":
        return _backward(op_spec, out, inputs, forward, u, u_acc, u_cast, parts)
    if fam == DOT:
        return _dot(out, tensors, u, u_acc, u_cast, parts, window=1)
    if fam == CONV:
        weight = _weight(tensors)
        window = _prod(weight.shape[2:]) if weight is not None and len(weight.shape) > 2 else 1
        return _dot(out, tensors, u, u_acc, u_cast, parts, window=window, conv=True)
    if fam == NORM:
        return _norm(op_spec.form, out, tensors, u, u_acc, parts)
    if fam == SOFTMAX:
        x = _first(tensors)
        k = x.shape[_dim(values, len(x.shape))] if x is not None and x.shape else (x.numel if x else 1)
        spread = _spread(x)
        rounding = RUNS * (LAMBDA * math.sqrt(k) * u_acc + (ELEMENTWISE_ULPS + spread) * u) * max(out.norm, 1e-300)
        prop = _sensitivity(parts, "input.0", x, 1.0)
        return Envelope(SOFTMAX, k, u, 1.0 + spread, rounding, prop, parts)
    if fam in (SUM, LOSS):
        return _sum(op_spec, out, tensors, u, u_acc, parts)
    if fam == ATTENTION:
        return _attention(out, inputs, u, u_acc, u_cast, parts)
    if fam in (DIVIDE, ELEMENTWISE, OPTIMIZER):
        return _elementwise(op_spec, out, inputs, values, u, parts)
    if fam == COPY:
        # a gather (embedding, index_select) reads a row once per index: a repeated index
        # repeats its difference, up to every output row on one input row
        rows = out.numel // max(out.shape[-1] if out.shape else 1, 1)

        def repeats(operand) -> float:
            if op_spec.form == GATHER:
                return math.sqrt(max(rows, 1))
            if op_spec.form == BROADCAST:  # a broadcast copy (expand, repeat): each value k times
                return math.sqrt(max(out.numel // max(operand.numel, 1), 1))
            return 1.0

        prop = sum(_sensitivity(parts, s, o, repeats(o)) for s, o in tensors)
        if op_spec.form == CONCAT or not tensors:
            prop = math.sqrt(sum(o.err ** 2 for _, o in tensors))
        return Envelope(COPY, 1, u, 1.0, 0.0, prop, parts)
    if fam == CAST:
        x = _first(tensors)
        prop = _sensitivity(parts, "input.0", x, 1.0)
        return Envelope(CAST, 1, u, 1.0, RUNS * u * out.norm, prop, parts)
    return None


def _first(tensors) -> Operand | None:
    return tensors[0][1] if tensors else None


def _weight(tensors) -> Operand | None:
    for slot, operand in tensors:
        if slot in ("input.1", "param.weight", "kwarg.weight"):
            return operand
    return None


def _dim(values: dict, ndim: int) -> int:
    for slot in ("kwarg.dim", "input.1", "default.dim"):
        value = values.get(slot)
        if isinstance(value, int) and not isinstance(value, bool) and ndim:
            return value % ndim
    return ndim - 1 if ndim else 0


def _spread(x: Operand | None) -> float:
    """exp's conditioning: |x| at the extremes (softmax subtracts the max: the range matters)."""
    if x is None or not (math.isfinite(x.min) and math.isfinite(x.max)):
        return 0.0
    return min(x.max - x.min, 1e6)


def _dot(out, tensors, u, u_acc, u_cast, parts, window, conv=False) -> Envelope:
    """y = x W (+ b): rounding lambda sqrt(K) u ||x|| ||W||, K the inner length."""
    ordered = [o for s, o in tensors if s.startswith(("input.", "param.", "kwarg."))]
    x = next((o for s, o in tensors if s in ("input.0", "kwarg.input")), ordered[0] if ordered else None)
    w = _weight(tensors) or next((o for o in ordered if o is not x), None)
    if x is None or w is None:
        return None
    if conv:
        k = _prod(w.shape[1:]) if len(w.shape) > 1 else w.numel
    else:
        k = x.shape[-1] if x.shape else x.numel
    k = max(int(k), 1)
    # the L2 norm over outputs of sum|x_i w_i|: <= ||x|| ||W||, and a conv reads each value in
    # up to `window` products
    scale = x.norm * w.norm * math.sqrt(window)
    conditioning = scale / out.norm if out.norm > 0 else math.inf
    rounding = RUNS * ((LAMBDA * math.sqrt(k) * u_acc + 2 * u_cast) * scale + u * out.norm)
    prop = _sensitivity(parts, "input.0", x, w.norm * math.sqrt(window))
    prop += _sensitivity(parts, "input.1", w, x.norm * math.sqrt(window))
    prop += x.err * w.err * math.sqrt(window)
    for slot, operand in tensors:
        if operand is not x and operand is not w:  # a bias, broadcast over the rows
            rows = max(out.numel // max(operand.numel, 1), 1)
            prop += _sensitivity(parts, slot, operand, math.sqrt(rows))
    return Envelope(CONV if conv else DOT, k, u, conditioning, rounding, prop, parts)


def _norm(form, out, tensors, u, u_acc, parts) -> Envelope:
    """(x - mean) / sqrt(var + eps) * w + b over rows of width K: two K-long sums, and the
    variance's cancellation when the mean is large against the spread."""
    x = _first(tensors)
    if x is None:
        return None
    if form == CHANNELS:
        k = x.numel // x.shape[1] if len(x.shape) > 1 and x.shape[1] else x.numel
    elif form == SAMPLES:
        k = x.numel // x.shape[0] if x.shape else x.numel
    else:
        k = x.shape[-1] if x.shape else x.numel
    k = max(int(k), 1)
    rms2 = (x.norm ** 2) / max(x.numel, 1)
    mean2 = x.mean ** 2 if math.isfinite(x.mean) else 0.0
    var = rms2 - mean2
    conditioning = rms2 / var if var > rms2 * 1e-6 else 1e6
    affine = [o for s, o in tensors if o is not x]
    bias_norm = max((o.norm * math.sqrt(max(out.numel // max(o.numel, 1), 1)) for o in affine), default=0.0)
    scale = out.norm + bias_norm
    rounding = RUNS * (LAMBDA * math.sqrt(k) * u_acc * conditioning + ELEMENTWISE_ULPS * u) * scale
    # ||dx|| over the input's centred size, through the output's size; the affine weight and
    # bias at most their own relative difference times the output
    centred = math.sqrt(max(var, 0.0) * x.numel)
    prop = _sensitivity(parts, "input.0", x, 2.0 * scale / centred if centred > 0 else math.inf)
    for slot, operand in [(s, o) for s, o in tensors if o is not x]:
        if operand.err and operand.norm > 0:
            prop += _sensitivity(parts, slot, operand, scale / operand.norm)
        elif operand.err:
            prop = math.inf
    return Envelope(NORM, k, u, conditioning, rounding, prop, parts)


def _sum(op_spec: OpSpec, out, tensors, u, u_acc, parts) -> Envelope:
    """A sum of K values errs by lambda sqrt(K) u sum|x|; sum|x| = |sum x| when every value has
    one sign (well conditioned), else at most sqrt(K) ||x|| per output."""
    x = _first(tensors)
    if x is None:
        return None
    k = max(x.numel // max(out.numel, 1), 1)
    fam = op_spec.family
    if op_spec.sums == MEANS or fam == LOSS:
        per = 1.0 / k
    else:
        per = 1.0
    if x.one_sign:
        absolute = x.norm * math.sqrt(k) * per if fam != LOSS else max(out.norm, 1e-300)
        absolute = min(absolute, abs(x.mean) * x.numel * per if math.isfinite(x.mean) else absolute)
        absolute = max(absolute, out.norm)
    else:
        absolute = x.norm * math.sqrt(k) * per
    if fam == LOSS:
        # the loss of each sample (a logsumexp over the classes for cross entropy) then their mean
        classes = x.shape[-1] if len(x.shape) > 1 else 1
        absolute = max(absolute, out.norm) * (1.0 + _spread(x))
        k = max(k, classes)
    conditioning = absolute / out.norm if out.norm > 0 else math.inf
    rounding = RUNS * (LAMBDA * math.sqrt(k) * u_acc * absolute + u * out.norm)
    prop = _sensitivity(parts, "input.0", x, math.sqrt(k) * per if fam != LOSS else 2.0 / math.sqrt(max(x.numel // max(x.shape[-1] if x.shape else 1, 1), 1)))
    for slot, operand in tensors[1:]:
        if operand.err and operand.dtype and not operand.dtype.startswith(("int", "uint", "bool")):
            prop += _sensitivity(parts, slot, operand, 1.0)
    return Envelope(fam, k, u, conditioning, rounding, prop, parts)


def _attention(out, inputs, u, u_acc, u_cast, parts) -> Envelope:
    """softmax(q k^T / sqrt(E)) v: two dot products (E and S long) and a softmax whose
    conditioning is the scores' range, bounded by max|q| max|k| sqrt(E)."""
    q, k_, v = (inputs.get(f"input.{i}") or inputs.get(name) for i, name in
                enumerate(("kwarg.query", "kwarg.key", "kwarg.value")))
    if q is None or k_ is None or v is None or not q.shape or len(k_.shape) < 2:
        return None
    e, s = q.shape[-1], k_.shape[-2]
    spread = min(2 * q.amax * k_.amax * math.sqrt(e), 1e6)
    scale = max(out.norm, v.norm * math.sqrt(max(q.numel // max(q.shape[-1], 1), 1) / max(s, 1)))
    rounding = RUNS * ((LAMBDA * (math.sqrt(e) + math.sqrt(s)) * u_acc + 2 * u_cast) * (1 + spread)
                       + ELEMENTWISE_ULPS * u) * scale
    prop = _sensitivity(parts, "input.2", v, 1.0)
    score_sens = scale * max(k_.amax, q.amax) * math.sqrt(e) / math.sqrt(e)
    prop += _sensitivity(parts, "input.0", q, score_sens / max(q.norm, 1e-300) * q.norm / max(math.sqrt(q.numel), 1e-300) * math.sqrt(s))
    prop += _sensitivity(parts, "input.1", k_, score_sens / max(math.sqrt(k_.numel), 1e-300) * math.sqrt(s))
    return Envelope(ATTENTION, e + s, u, 1 + spread, rounding, prop, parts)


def _number(value) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def _elementwise(op_spec: OpSpec, out, inputs, values, u, parts) -> Envelope:
    """A few ulps of rounding per element; the inputs' differences through the op's
    derivative, bounded with the recorded extremes (a division by the smallest |denominator|)."""
    fam, form = op_spec.family, op_spec.form
    tensors = {s: o for s, o in inputs.items() if o.numel > 0}
    ordered = [tensors[s] for s in sorted(tensors, key=_slot_order)]
    rounding = RUNS * ELEMENTWISE_ULPS * u * out.norm
    a = ordered[0] if ordered else None
    b = ordered[1] if len(ordered) > 1 else None
    c = ordered[2] if len(ordered) > 2 else None
    if a is None:
        return None  # no recorded tensor input: nothing to tell its own error from
    scalar = next((_number(values[s]) for s in ("kwarg.value", "kwarg.alpha", "kwarg.weight", "input.2", "input.1",
                                                "kwarg.other") if s in values and _number(values[s]) is not None),
                  None) if values else None
    scalar = abs(scalar) if scalar is not None else 1.0
    prop = 0.0
    conditioning = 1.0
    slots = {id(o): s for s, o in tensors.items()}

    def sens(operand, factor):
        return _sensitivity(parts, slots.get(id(operand), "input"), operand, factor)

    def broadcast(operand):
        return math.sqrt(max(out.numel // max(operand.numel, 1), 1)) if operand is not None else 1.0

    if form == QUOTIENT:
        if b is None:  # by a number
            prop = sens(a, 1.0 / scalar if scalar else math.inf)
        else:
            den = b.amin
            conditioning = b.amax / den if den > 0 else math.inf
            prop = sens(a, broadcast(a) / den if den > 0 else math.inf) + sens(
                b, broadcast(b) * a.amax / den ** 2 if den > 0 else math.inf)
            rounding = RUNS * ELEMENTWISE_ULPS * u * out.norm
    elif form == ADDCDIV:  # a + value * t1 / t2
        if b is None or c is None:
            return None
        den = c.amin
        conditioning = c.amax / den if den > 0 else math.inf
        update = scalar * (b.norm / den if den > 0 else math.inf)
        rounding = RUNS * ELEMENTWISE_ULPS * u * (out.norm + update)
        prop = sens(a, broadcast(a)) + sens(b, broadcast(b) * scalar / den if den > 0 else math.inf) + sens(
            c, broadcast(c) * scalar * b.amax / den ** 2 if den > 0 else math.inf)
    elif form in (SQRT, RSQRT, RECIPROCAL, LOG, LOG1P):
        den = a.amin + (1.0 if form == LOG1P else 0.0)
        # B's values lie within ||a - b|| of A's: the secant between the two runs' values, not
        # the slope at A's alone (Adam's sqrt(v) of a noise gradient differs by more than v)
        factor = _inverse_slope(form, den, den - a.err if math.isfinite(a.err) else 0.0)
        conditioning = a.amax / den if den > 0 else math.inf
        prop = sens(a, factor)
    elif form in (PRODUCT, ADDCMUL, SQUARE, POW):
        if form == ADDCMUL and c is not None:  # a + value * t1 * t2
            prop = sens(a, broadcast(a)) + sens(b, broadcast(b) * scalar * c.amax) + sens(
                c, broadcast(c) * scalar * b.amax) + scalar * b.err * c.err
            rounding = RUNS * ELEMENTWISE_ULPS * u * (out.norm + scalar * b.amax * c.norm)
        elif form in (SQUARE, POW) and b is None:
            exponent = scalar if form == POW else 2.0
            prop = sens(a, abs(exponent) * a.amax ** max(exponent - 1, 0)) if a is not None else 0.0
        elif b is None:
            prop = sens(a, scalar)
        else:
            prop = sens(a, broadcast(a) * b.amax) + sens(b, broadcast(b) * a.amax) + a.err * b.err
    elif form == EXP:
        prop = sens(a, out.amax)
        conditioning = 1.0 + _spread(a)
    elif form == LERP:  # a + w (b - a)
        weight = scalar if c is None else c.amax
        prop = sens(a, broadcast(a) * (1 + weight)) + sens(b, broadcast(b) * weight)
    elif fam == OPTIMIZER:
        # a fused update divides by sqrt(v) + eps: bounded only where no input differs
        prop = 0.0 if all(o.err == 0 for o in ordered) else math.inf
    else:
        lipschitz = op_spec.lipschitz * (scalar if form == SHIFT and b is not None else 1.0)
        prop = sum(sens(o, broadcast(o) * (1.0 if o is a else lipschitz)) for o in ordered)
    return Envelope(fam, 1, u, conditioning, rounding, prop, parts)


def _slot_order(slot: str):
    head, _, index = slot.partition(".")
    rank = {"input": 0, "param": 1, "kwarg": 2}.get(head, 3)
    return (rank, int(index) if index.isdigit() else 0, slot)


def _backward(op_spec: OpSpec, out, inputs, forward, u, u_acc, u_cast, parts) -> Envelope | None:
    """The gradient an op's backward makes: its grad_output through the op's derivative at the
    forward's values. Products again for matmuls and convolutions (dx = dy W^T, K the output
    width; dW = dy^T x, K the rows), reductions of width K for normalizations and softmax;
    elementwise: a few ulps. Bounded from above, conservatively, by the larger K."""
    fam = op_spec.family
    gy = inputs.get("grad_output.0")
    if gy is None:
        return None
    fx = [o for s, o in sorted(forward.items(), key=lambda item: _slot_order(item[0]))
          if s.startswith(("input.", "param.", "kwarg.")) and o.numel > 0]
    x = fx[0] if fx else None
    if fam in (DOT, CONV):
        w = fx[1] if len(fx) > 1 else None
        if x is None or w is None:
            return None
        rows = max(x.numel // max(x.shape[-1] if x.shape else 1, 1), 1)
        k = max(gy.shape[-1] if gy.shape else 1, rows, _prod(w.shape[1:]) if len(w.shape) > 1 else 1,
                gy.numel // max(gy.shape[1] if len(gy.shape) > 1 else 1, 1) if fam == CONV else 1)
        window = _prod(w.shape[2:]) if fam == CONV and len(w.shape) > 2 else 1
        scale = gy.norm * max(x.norm, w.norm, out.norm / max(gy.norm, 1e-300)) * math.sqrt(window)
        rounding = RUNS * ((LAMBDA * math.sqrt(k) * u_acc + 2 * u_cast) * scale + u * out.norm)
        big = max(x.norm, w.norm) * math.sqrt(max(window, rows if out.numel <= gy.shape[-1] else 1))
        prop = _sensitivity(parts, "grad_output.0", gy, big)
        prop += sum(_sensitivity(parts, f"forward.input.{i}", o, gy.norm * math.sqrt(window)) for i, o in enumerate((x, w)))
        return Envelope(fam, k, u, scale / out.norm if out.norm > 0 else math.inf, rounding, prop, parts)
    if fam in (NORM, SOFTMAX, SUM, LOSS, ATTENTION):
        k = max((o.shape[-1] for o in fx if o.shape), default=1)
        if fam == NORM:
            k = max(k, max(x.numel // max(k, 1), 1) if x is not None else 1)
        if fam == ATTENTION and len(fx) > 1 and len(fx[1].shape) > 1:
            k = fx[0].shape[-1] + fx[1].shape[-2]
        spread = _spread(x) if fam in (SOFTMAX, LOSS) else 0.0
        scale = max(out.norm, gy.norm)
        rounding = RUNS * (LAMBDA * math.sqrt(k) * u_acc * (3.0 + spread) + ELEMENTWISE_ULPS * u) * scale
        return Envelope(fam, k, u, 3.0 + spread, rounding, math.inf if _any_err(gy, fx) else 0.0, parts)
    if fam == COPY and op_spec.form in (GATHER, BROADCAST):
        # the gradient rows of repeated indices (broadcast copies) are summed, in an order
        # that differs by device (atomics on a GPU): a sum of up to K rows, rounded once to
        # the gradient's dtype. Over the outputs, sum|g| is at most sqrt(K) ||dy||.
        rows = gy.numel // max(gy.shape[-1] if gy.shape else 1, 1)
        k = max(gy.numel // max(out.numel, 1), 1) if op_spec.form != GATHER else max(rows, 1)
        rounding = RUNS * (LAMBDA * k * u_acc * gy.norm + u * out.norm)
        prop = math.inf if any(o.err for o in fx) else _sensitivity(parts, "grad_output.0", gy, math.sqrt(k))
        return Envelope(SUM, k, u, 1.0, rounding, prop, parts)
    if fam in (ELEMENTWISE, DIVIDE, COPY, CAST):
        rounding = RUNS * ELEMENTWISE_ULPS * u * out.norm if fam != COPY else 0.0
        prop = math.inf if any(o.err for o in fx) else _sensitivity(parts, "grad_output.0", gy,
                                                                     _derivative_bound(op_spec, fx, out, gy))
        if fam == COPY and not any(o.err for o in fx):
            prop = gy.err
        return Envelope(fam, 1, u, 1.0, rounding, prop, parts)
    return None


def _inverse_slope(form: str, den: float, low: float) -> float:
    """The largest |f'| of sqrt, rsqrt, reciprocal or log (log1p: den and low shifted by 1)
    between values of at least ``low`` (den: A's smallest, at least low); for sqrt the secant
    from A's values to B's, finite even where B's may reach 0."""
    if den <= 0:
        return math.inf
    if form == SQRT:
        return 1.0 / (math.sqrt(den) + math.sqrt(max(low, 0.0)))
    if low <= 0:
        return math.inf
    if form == RSQRT:
        return 0.5 / low ** 1.5
    if form == RECIPROCAL:
        return 1.0 / (den * low)
    return 1.0 / low


def _derivative_bound(op_spec: OpSpec, fx: list, out: Operand, gy: Operand) -> float:
    """How much an elementwise op's backward scales its grad_output's difference: the largest
    |f'| over the forward's values, from their recorded extremes (a product's gradient is the
    other factor: max|b|; rsqrt's 0.5 min|x|^-1.5, _inverse_slope). At least the ratio of the gradients' norms in
    A, which is exact for a product by a number the record does not hold."""
    ratio = out.norm / gy.norm if gy.norm > 0 and math.isfinite(out.norm) else 0.0
    x = fx[0] if fx else None

    def inverse(value: float, power: float) -> float:
        return value ** -power if value > 0 else math.inf

    form = op_spec.form
    if form in (PRODUCT, ADDCMUL):
        bound = max((o.amax for o in fx), default=0.0)
    elif form == QUOTIENT:
        den = fx[1].amin if len(fx) > 1 else 0.0
        bound = max(inverse(den, 1), fx[0].amax * inverse(den, 2)) if len(fx) > 1 else 0.0
    elif form in (RSQRT, SQRT, RECIPROCAL, LOG) and x is not None:
        bound = _inverse_slope(form, x.amin, x.amin)
    elif form == EXP and x is not None:
        bound = math.exp(min(x.max, 700.0)) if math.isfinite(x.max) else math.inf
    else:
        bound = op_spec.lipschitz
    return max(bound, ratio)


def _any_err(gy, fx) -> bool:
    return bool(gy.err) or any(o.err for o in fx)
