"""Measure ||a - b|| / ||a|| of a record pair from the two runs' sketches (no tensors needed).

Each record of a schema-2 dump carries a sketch y = R x (probe/capture/numbers/sketch.py): k inner
products of the tensor's values with fixed +-1 vectors, the same in every run and on every
device. So y_a - y_b = R (a - b), and for each of the k rows E[(R d)_j^2] = ||d||^2:

    estimate  ||a - b||  ~  sqrt( mean_j (y_a[j] - y_b[j])^2 )         (Johnson-Lindenstrauss)

Confidence: k * estimate^2 / ||d||^2 follows (for differences spread over many elements, and
closely otherwise) a chi-square distribution with k degrees of freedom, so with probability
CONFIDENCE the true ||d|| lies in [estimate * low, estimate * high],
low = sqrt(k / q(1 - alpha/2)), high = sqrt(k / q(alpha/2)), q the chi-square quantiles.
For k = 16 at 95%: [0.75, 1.52] x the estimate; reports write the larger side, "+-52%".
(The quantiles are computed here, without scipy: ``chi2_quantile``.) A difference confined
to one element is measured exactly (every row sees it with weight +-1).

Floor: the sketch is itself computed with rounding (a float32 fold over n / (GROUPS *
BLOCK) super-rows and float32 inner products over BLOCK values for float32/16/bfloat16
tensors, float64 for float64 and integer tensors), about eps * (sqrt(BLOCK) +
sqrt(super-rows)) * ||x|| per number, and a little more where two devices or two BLAS
libraries order the sums differently. ``rounding_floor`` bounds it generously (FLOOR_FACTOR
times that, for both sides). An estimate at or below the floor says "no difference the
sketch can see": it counts as zero, so sketches never turn rounding into an error (two
identical runs, threads 1 vs 2, float32 vs float64 stay PASS). For float32 the floor is
1.5e-5 of the norm up to 4016 values and 3e-5 at 1M values (the float32 rtol is 2e-5).

How compare uses it (``refine``): for statistics and checksum evidence the error becomes the
larger of the statistics' lower bound and this estimate; the estimate (not the bound) is
what usually decides. Full tensors, when both sides have them, still decide exactly.
``raw_errors`` computes the estimates of many record pairs at once, and ``statistics_columns``
their statistics' lower bounds (metrics.statistics_metrics), column by column with numpy: a
statistics dump's compare measures a step file in a few array passes, not record by record.
This module never imports torch.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

from probe.comparison.metrics import Metrics

#: two-sided confidence of the band reports give
CONFIDENCE = 0.95
#: the capture's row length and rows per super-row (probe.capture.numbers.sketch; a test ties them)
BLOCK = 251
GROUPS = 16
#: the rounding floor in units of eps * sqrt(BLOCK) * norm, per side
FLOOR_FACTOR = 4.0
_EPS64 = 2.0 ** -52
_EPS32 = 2.0 ** -23


# ------------------------------------------------------------------ chi-square quantiles


def _lower_gamma_regularized(a: float, x: float) -> float:
    """P(a, x), the regularized lower incomplete gamma function (Numerical Recipes 6.2)."""
    if x <= 0:
        return 0.0
    log_prefix = a * math.log(x) - x - math.lgamma(a)
    if x < a + 1:  # series
        term = total = 1.0 / a
        denominator = a
        for _ in range(10_000):
            denominator += 1
            term *= x / denominator
            total += term
            if abs(term) < abs(total) * 1e-15:
                break
        return min(1.0, total * math.exp(log_prefix))
    # continued fraction for Q = 1 - P (modified Lentz)
    tiny = 1e-300
    b = x + 1 - a
    c = 1 / tiny
    d = 1 / b
    h = d
    for i in range(1, 10_000):
        an = -i * (i - a)
        b += 2
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1 / d
        delta = d * c
        h *= delta
        if abs(delta - 1) < 1e-15:
            break
    return max(0.0, 1.0 - math.exp(log_prefix) * h)


def chi2_cdf(x: float, k: int) -> float:
    return _lower_gamma_regularized(k / 2.0, x / 2.0)


def chi2_quantile(p: float, k: int) -> float:
    """x with chi2_cdf(x, k) = p, by bisection (to 1e-12 relative)."""
    if not 0 < p < 1 or k < 1:
        raise ValueError(f"chi2_quantile needs 0 < p < 1 and k >= 1, got p={p}, k={k}")
    low, high = 0.0, max(1.0, 2.0 * k)
    while chi2_cdf(high, k) < p:
        high *= 2
    for _ in range(200):
        middle = (low + high) / 2
        if chi2_cdf(middle, k) < p:
            low = middle
        else:
            high = middle
        if high - low <= 1e-12 * high:
            break
    return (low + high) / 2


_bands: dict[tuple[int, float], tuple[float, float]] = {}


def band(k: int, confidence: float = CONFIDENCE) -> tuple[float, float]:
    """(low, high): the true ||a - b|| lies in [low, high] x the estimate with this confidence."""
    key = (k, confidence)
    found = _bands.get(key)
    if found is None:
        alpha = 1 - confidence
        found = (math.sqrt(k / chi2_quantile(1 - alpha / 2, k)), math.sqrt(k / chi2_quantile(alpha / 2, k)))
        _bands[key] = found
    return found


def band_percent(k: int, confidence: float = CONFIDENCE) -> float:
    """The band as one "+-x%": the larger of its two sides (52 for k = 16)."""
    low, high = band(k, confidence)
    return 100 * max(1 - low, high - 1)


# ------------------------------------------------------------------ the estimate


def accumulation_eps(dtype: str) -> float:
    """Unit roundoff of the arithmetic the capture sketched a dtype in (capture/numbers/sketch.py):
    float64 for float64, complex128, integers and bool; float32 for every other float."""
    if dtype in ("float64", "complex128") or not (dtype.startswith("float") or dtype.startswith("complex")
                                                   or dtype in ("half", "bfloat16")):
        return _EPS64
    return _EPS32


def rounding_floor(dtype_a: str, norm_a: float, dtype_b: str, norm_b: float, numel: int = 0) -> float:
    """Largest ||y_a - y_b|| / sqrt(k) the sketches' own rounding can make (see module doc):
    the fold sums numel / (GROUPS * BLOCK) super-rows, the projection BLOCK values."""
    values = 2 * numel if dtype_a.startswith("complex") else numel  # (real, imag) pairs
    return _floor(values, accumulation_eps(dtype_a), norm_a, accumulation_eps(dtype_b), norm_b)


def _floor(values, eps_a, norm_a, eps_b, norm_b, sqrt=math.sqrt):
    """rounding_floor of numbers, or of numpy columns with sqrt=np.sqrt (refine_many): one
    formula, so both give the same bits."""
    supers = values / (GROUPS * BLOCK)
    scale = FLOOR_FACTOR * (math.sqrt(BLOCK) + sqrt(supers))
    return scale * (eps_a * abs(norm_a) + eps_b * abs(norm_b))


@dataclass
class SketchEstimate:
    """What two sketches say about ||a - b||. err_l2 is 0 when raw_err is within the floor."""

    k: int
    err_l2: float  # the estimate of ||a - b|| (0 within the floor)
    rel_l2: float  # err_l2 / ||a||
    raw_err: float  # sqrt(mean_j (y_a - y_b)_j^2) before the floor
    floor: float  # rounding_floor
    low: float  # the band: ||a - b|| in [low, high] with CONFIDENCE
    high: float
    confidence: float = CONFIDENCE

    @property
    def within_floor(self) -> bool:
        return self.raw_err <= self.floor

    def text(self) -> str:
        """How reports name this evidence: "estimated (sketch, k=16, +-52%)"."""
        if self.within_floor:
            return f"estimated (sketch, k={self.k}, no difference above the sketch's rounding floor)"
        return f"estimated (sketch, k={self.k}, \u00b1{band_percent(self.k, self.confidence):.0f}%)"

    def to_dict(self) -> dict:
        return _estimate_dict(self.k, self.err_l2, self.rel_l2, self.raw_err, self.floor, self.low, self.high,
                              self.within_floor, self.confidence)


def _estimate_dict(k, err_l2, rel_l2, raw_err, floor, low, high, within_floor, confidence=CONFIDENCE) -> dict:
    """SketchEstimate.to_dict, also for refine_many's columns. By hand: dataclasses.asdict
    deep-copies every float, a tenth of a statistics compare."""
    return {"k": k, "err_l2": err_l2, "rel_l2": rel_l2, "raw_err": raw_err, "floor": floor, "low": low,
            "high": high, "confidence": confidence, "within_floor": within_floor}


def estimate(sketch_a, sketch_b, norm_a: float, norm_b: float, dtype_a: str, dtype_b: str,
             numel: int = 0, measured=None) -> SketchEstimate | None:
    """The estimate from two sketches (sequences of floats), or None when either is missing,
    empty or not finite (a NaN/Inf in the tensor: the NaN/Inf counts speak then). Sketches
    of two sizes compare on their common prefix (capture/numbers/sketch.py keeps prefixes stable).
    measured: what raw_errors found for this pair ((k, raw error) or None), when it ran."""
    found = _raw_error(sketch_a, sketch_b) if measured is None else measured
    if not found:
        return None
    k, raw = found
    norm_a = norm_a if math.isfinite(norm_a) else 0.0
    norm_b = norm_b if math.isfinite(norm_b) else 0.0
    floor = rounding_floor(dtype_a, norm_a, dtype_b, norm_b, numel)
    err = 0.0 if raw <= floor else raw
    if norm_a > 0:
        rel = err / norm_a
    else:
        rel = 0.0 if err == 0 else math.inf
    low, high = band(k)
    return SketchEstimate(k=k, err_l2=err, rel_l2=rel, raw_err=raw, floor=floor, low=err * low, high=err * high)


def _raw_error(sketch_a, sketch_b) -> tuple[int, float] | bool:
    """(k, sqrt(mean_j (y_a - y_b)_j^2)) of two sketches; False when there is no estimate."""
    if sketch_a is None or sketch_b is None:
        return False
    k = min(len(sketch_a), len(sketch_b))
    if k == 0:
        return False
    total = 0.0
    # Python floats: a numpy row yields numpy scalars one at a time, several times slower
    for x, y in zip(_floats(sketch_a[:k]), _floats(sketch_b[:k])):
        x, y = float(x), float(y)
        if not (math.isfinite(x) and math.isfinite(y)):
            return False
        total += (x - y) * (x - y)
    return k, math.sqrt(total / k)


def _floats(values):
    return values.tolist() if hasattr(values, "tolist") else values


def refine(metrics, sketch_a, sketch_b, dtype_a: str, dtype_b: str, measured=None):
    """Statistics or checksum metrics -> the same metrics measured by the sketches.

    The error becomes max(statistics lower bound, sketch estimate), so a schema-1 dump (no
    sketches) keeps its lower bounds and a sketch never hides what the statistics prove.
    ``metrics.sketch`` records the estimate (JSON: metrics.sketch); bit-equal checksums
    stay exactly zero. measured: raw_errors' answer for this pair, when it ran. Returns metrics
    (changed in place)."""
    if metrics.evidence not in ("statistics", "checksum") or metrics.bit_equal:
        return metrics
    found = estimate(sketch_a, sketch_b, metrics.ref_norm, metrics.other_norm, dtype_a, dtype_b, metrics.numel,
                     measured)
    if found is None:
        return metrics
    data = found.to_dict()
    data["lower_bound"] = metrics.err_l2
    data["text"] = found.text()
    metrics.sketch = data
    if found.err_l2 > metrics.err_l2:
        metrics.err_l2 = found.err_l2
        if metrics.ref_norm > 0:
            metrics.rel_l2 = found.err_l2 / metrics.ref_norm
        else:
            metrics.rel_l2 = math.inf
    return metrics


def refine_many(found: list, dtypes_a: list, dtypes_b: list, raws: list) -> None:
    """refine() of many metrics at once, with raw_errors' answers (raws[i] for found[i]): the
    floors, errors and bands column by column with the same float64 operations as estimate(),
    and each report text made once per k."""
    todo = [number for number, (metrics, raw) in enumerate(zip(found, raws))
            if raw and metrics.evidence in ("statistics", "checksum") and not metrics.bit_equal]
    if not todo:
        return
    chosen = [found[number] for number in todo]
    numel = np.array([metrics.numel for metrics in chosen], dtype=np.float64)
    norm_a, norm_b = (np.array([getattr(metrics, name) for metrics in chosen], dtype=np.float64)
                      for name in ("ref_norm", "other_norm"))
    eps_a, eps_b = (np.array([accumulation_eps(dtypes[number]) for number in todo]) for dtypes in (dtypes_a, dtypes_b))
    complex_a = np.array([dtypes_a[number].startswith("complex") for number in todo])
    raw = np.array([raws[number][1] for number in todo], dtype=np.float64)
    ks = [raws[number][0] for number in todo]
    bands = np.array([band(k) for k in ks], dtype=np.float64).reshape(len(todo), 2)
    with np.errstate(all="ignore"):
        norm_a = np.where(np.isfinite(norm_a), norm_a, 0.0)
        norm_b = np.where(np.isfinite(norm_b), norm_b, 0.0)
        floor = _floor(np.where(complex_a, 2 * numel, numel), eps_a, norm_a, eps_b, norm_b, np.sqrt)
        within = raw <= floor
        err = np.where(within, 0.0, raw)
        rel = np.where(norm_a > 0, err / np.where(norm_a > 0, norm_a, 1.0), np.where(err == 0, 0.0, math.inf))
        low, high = err * bands[:, 0], err * bands[:, 1]
    columns = zip(chosen, ks, err.tolist(), rel.tolist(), raw.tolist(), floor.tolist(), low.tolist(), high.tolist(),
                  within.tolist())
    for metrics, k, err_l2, rel_l2, raw_err, floor_k, low_k, high_k, no_more in columns:
        data = metrics.sketch = _estimate_dict(k, err_l2, rel_l2, raw_err, floor_k, low_k, high_k, no_more)
        data["lower_bound"] = metrics.err_l2
        data["text"] = _estimate_text(k, no_more)
        if err_l2 > metrics.err_l2:
            metrics.err_l2 = err_l2
            metrics.rel_l2 = err_l2 / metrics.ref_norm if metrics.ref_norm > 0 else math.inf


@functools.lru_cache(maxsize=64)
def _estimate_text(k: int, within_floor: bool) -> str:
    """SketchEstimate.text of an estimate of k rows at CONFIDENCE."""
    return SketchEstimate(k, 0.0, 0.0, 0.0 if within_floor else 1.0, 0.0, 0.0, 0.0).text()


def sketch_note(with_tensors: bool) -> str:
    """The compare result's note when sketches measured some records."""
    head = ("where full tensors are missing" if with_tensors
            else "statistics only (no full tensors)")
    return (f"{head}: errors are estimated from each tensor's sketch (k=16: \u00b1"
            f"{band_percent(16):.0f}% at {CONFIDENCE:.0%} confidence), or the statistics' lower bound where "
            "that is larger; differences within the sketch's rounding floor count as none")


# ------------------------------------------------------------------ many record pairs at once


def raw_errors(sketches_a: list, sketches_b: list) -> list:
    """_raw_error of many sketch pairs: the pairs of one k in one numpy pass, summed over j in
    the order _raw_error sums (the same bits)."""
    found: list = [False] * len(sketches_a)
    groups: dict[int, list[int]] = {}
    for number, (x, y) in enumerate(zip(sketches_a, sketches_b)):
        if x is not None and y is not None and min(len(x), len(y)):
            groups.setdefault(min(len(x), len(y)), []).append(number)
    for k, members in groups.items():
        a, b = _stacked(sketches_a, members, k), _stacked(sketches_b, members, k)
        total = np.zeros(len(members))
        with np.errstate(all="ignore"):
            for j in range(k):
                step = a[:, j] - b[:, j]
                total += step * step
            raw = np.sqrt(total / k)
        finite = (np.isfinite(a).all(axis=1) & np.isfinite(b).all(axis=1)).tolist()
        for number, ok, value in zip(members, finite, raw.tolist()):
            if ok:
                found[number] = (k, value)
    return found


def _stacked(sketches: list, members: list, k: int) -> np.ndarray:
    """The first k values of the members' sketches as one (members, k) float64 array: stacked
    whole when they have one length (a step file's rows: a third of the time of row by row)."""
    try:
        stacked = np.array([sketches[i] for i in members], dtype=np.float64)
    except ValueError:  # sketches of several lengths
        stacked = None
    if stacked is not None and stacked.ndim == 2 and stacked.shape[1] >= k:
        return stacked[:, :k]
    return np.array([np.asarray(sketches[i][:k], dtype=np.float64) for i in members]).reshape(len(members), k)


_BOUNDS = ("norm", "mean", "min", "max")


def statistics_columns(a: dict, rows_a: list, b: dict, rows_b: list) -> list:
    """metrics.statistics_metrics of many record pairs (a, b: the runs' record columns; rows_a[i]
    pairs with rows_b[i]), computed column by column with the same float64 operations. A pair
    of two dtypes or with an infinity in A (a mask value the scalar rules set apart) is None:
    the caller measures it alone."""
    def column(cols, rows, name):
        return np.asarray(cols[name], dtype=np.float64)[np.asarray(rows, dtype=np.int64)]

    va, vb = ({name: column(cols, rows, name) for name in _BOUNDS} for cols, rows in ((a, rows_a), (b, rows_b)))
    numel = column(a, rows_a, "numel")
    with np.errstate(all="ignore"):
        diffs = {name: np.where(np.isfinite(va[name]) & np.isfinite(vb[name]), np.abs(va[name] - vb[name]), np.nan)
                 for name in _BOUNDS}
        norm_known = np.isfinite(va["norm"])
        rms = np.where((numel > 0) & norm_known, va["norm"] / np.sqrt(numel), np.nan)
        mean_bound = np.where(numel > 0, diffs["mean"] * np.sqrt(numel), np.nan)
        err = _largest_finite([diffs["norm"], mean_bound, diffs["max"], diffs["min"]])
        norm_a = np.where(norm_known, va["norm"], 0.0)
        rel = np.where(norm_a > 0, err / norm_a, np.where(err == 0, 0.0, np.inf))
        stat_rel = {}
        for name, diff in diffs.items():
            scale = norm_a if name == "norm" else rms
            value = np.where(diff == 0, 0.0, np.where((scale != 0) & np.isfinite(scale), diff / scale, np.inf))
            stat_rel[name] = [v if ok else None for v, ok in zip(value.tolist(), np.isfinite(diff).tolist())]
        max_abs = _largest_finite([diffs["max"], diffs["min"], diffs["mean"]])
    other_norm = np.where(np.isfinite(vb["norm"]), vb["norm"], 0.0).tolist()
    found: list = []
    columns = zip(rows_a, rows_b, err.tolist(), norm_a.tolist(), other_norm, rel.tolist(), max_abs.tolist())
    for number, (row_a, row_b, err_l2, ref_norm, other, rel_l2, largest) in enumerate(columns):
        if a["dtype"][row_a] != b["dtype"][row_b] or int(a["inf_count"][row_a]):
            found.append(None)
            continue
        checksum_a, checksum_b = a["checksum"][row_a], b["checksum"][row_b]
        metrics = Metrics(
            evidence="checksum" if checksum_a and checksum_b else "statistics", numel=int(a["numel"][row_a]),
            err_l2=err_l2, ref_norm=ref_norm, other_norm=other, rel_l2=rel_l2, max_abs=largest,
            nan_mismatch=abs(int(a["nan_count"][row_a]) - int(b["nan_count"][row_b])),
            inf_mismatch=abs(int(a["inf_count"][row_a]) - int(b["inf_count"][row_b])),
            stat_rel={name: stat_rel[name][number] for name in _BOUNDS})
        if metrics.evidence == "checksum":
            metrics.bit_equal = checksum_a == checksum_b
            if metrics.bit_equal:  # identical bytes: the error is exactly zero
                metrics.err_l2 = metrics.rel_l2 = metrics.max_abs = 0.0
        found.append(metrics)
    return found


def _largest_finite(columns: list) -> np.ndarray:
    """Per position, the largest finite value of the columns (0.0 where none is finite)."""
    stacked = np.array(columns, dtype=np.float64).reshape(len(columns), -1)
    stacked[~np.isfinite(stacked)] = np.nan
    with np.errstate(all="ignore"):
        return np.nan_to_num(np.fmax.reduce(stacked, axis=0), nan=0.0)
