"""Error metrics of one aligned pair: full tensors, statistics only, checksums, or values.

Everything is computed in float64, with A as the reference (relative errors divide by A).
Full tensors are processed in fixed-size chunks so that converting a large tensor to
float64 never needs more than a few MB beyond the two arrays themselves, and each chunk
is read a handful of times while it is still in the CPU cache.

Statistics-only dumps cannot give ||a - b||, but they bound it from below: with d = a - b,
|mean_a - mean_b| * sqrt(n), |max_a - max_b|, |min_a - min_b| and | ||a|| - ||b|| | are
all <= ||d||. The largest of them is used as the error, so statistics can miss a
divergence (weaker evidence) but never invent one the tensors would not show.

The tensors a compare copies out of its files are read ahead (Prefetcher): the next pair is
read on a background thread while the current one is measured (a pair it maps from the files
costs too little to read ahead: Measurer.start_prefetch). At most ``depth`` pairs wait ready
(plus the one being measured), so memory stays within a few tensor pairs whatever the dump
size. Keys are taken in the planned order; a key asked for out of order (or twice) is not
served, and the caller reads it itself.
"""

from __future__ import annotations

import copy
import functools
import json
import math
import threading
from dataclasses import asdict, dataclass, field
from typing import Callable, Sequence

import numpy as np

from probe.comparison.tolerances import Tolerance

#: elements per chunk: three 512 KB float64 buffers stay in the CPU cache between passes.
CHUNK = 1 << 16

#: integer view with the same width as each dtype whose ULP distance we report
_ULP_VIEWS = {"float16": np.int16, "float32": np.int32, "float64": np.int64}
ULP_DTYPES = ("float16", "bfloat16", "float32", "float64")


@dataclass(slots=True)
class Metrics:
    """Errors of one aligned pair. Fields that a kind of evidence cannot give are None."""

    evidence: str  # "tensor" | "statistics" | "checksum" | "value"
    numel: int = 0
    err_l2: float = 0.0  # ||a - b|| (a lower bound for statistics evidence)
    ref_norm: float = 0.0  # ||a||
    other_norm: float = 0.0  # ||b||
    rel_l2: float = 0.0  # ||a - b|| / ||a||
    max_abs: float = 0.0
    max_rel: float | None = None  # max |a - b| / max(|a|, atol)
    cosine: float | None = None
    within: float | None = None  # share of elements with |a - b| <= atol + rtol * |a|
    nan_mismatch: int = 0  # positions NaN on one side only (count difference for statistics)
    inf_mismatch: int = 0
    ulp_max: int | None = None
    bit_equal: bool | None = None
    stat_rel: dict | None = None  # statistics evidence: relative change of norm/mean/min/max
    value_a: str | None = None  # non-tensor values
    value_b: str | None = None
    notes: list[str] = field(default_factory=list)
    # what the records' sketches measured (comparison/sketch.py SketchEstimate + lower_bound, text)
    sketch: dict | None = None

    def to_dict(self) -> dict:
        data = asdict(self)
        for name in ("value_a", "value_b", "stat_rel", "ulp_max", "bit_equal", "sketch"):
            if data[name] is None:
                del data[name]
        if not data["notes"]:
            del data["notes"]
        return data


# ---------------------------------------------------------------------------- full tensors


def _as_real(array: np.ndarray) -> np.ndarray:
    """Flat array of numbers float64 can hold: complex -> (re, im) pairs, bool -> uint8."""
    array = np.ascontiguousarray(array).reshape(-1)
    if np.iscomplexobj(array):
        return array.view(array.real.dtype)
    if array.dtype == np.bool_:
        return array.view(np.uint8)
    return array


#: bits of magnitude (below the sign bit) per dtype
_MAGNITUDE_BITS = {"float16": 15, "bfloat16": 15, "float32": 31, "float64": 63}


def _raw_bits(values: np.ndarray, dtype_name: str) -> np.ndarray | None:
    """The sign-magnitude bit patterns of a float array as signed integers (sign = int sign)."""
    if dtype_name == "bfloat16":
        # a decoded bf16 keeps its 16 bits in the top half of a float32
        return values.view(np.int32) >> 16 if values.dtype == np.float32 else None
    if dtype_name in _ULP_VIEWS and values.dtype == np.dtype(dtype_name):
        return values.view(_ULP_VIEWS[dtype_name])
    return None


def _ulp_chunk_max(bits_a: np.ndarray, bits_b: np.ndarray, magnitude_bits: int) -> tuple[int, bool]:
    """(largest ULP distance between paired floats given as raw bits, whether all bits are equal);
    -0 and +0 are 0 apart. With equal signs the distance is the difference of the raw integers
    (which cannot overflow); across zero it is the sum of the two magnitudes. Plain integer
    passes: several times faster than mapping every value to an ordered integer first."""
    if bits_a.size == 0:
        return 0, True
    diff = bits_a - bits_b
    signs = np.bitwise_xor(bits_a, bits_b)
    if int(signs.min()) >= 0:  # no pair across zero (a reduction, not a mask and a search)
        distance = max(int(diff.max()), -int(diff.min()))
        return distance, distance == 0
    cross = signs < 0
    kept = np.where(cross, 0, diff)  # a 0 among the same-sign distances changes no largest |distance|
    best = max(int(kept.max()), -int(kept.min()))
    mask = (1 << magnitude_bits) - 1
    mags = (bits_a[cross].astype(np.int64) & mask).astype(np.uint64) + (bits_b[cross].astype(np.int64) & mask).astype(np.uint64)
    return max(best, int(mags.max())), False


def _chunk_ulp(raw_a: np.ndarray, raw_b: np.ndarray, dtype: str) -> tuple[int | None, bool]:
    """(largest ULP distance, whether all bits are equal) of a chunk, (None, False) for arrays not
    floats stored as themselves. Equal bits are told of plain views only (a bfloat16 is shifted)."""
    bits_a, bits_b = _raw_bits(raw_a, dtype), _raw_bits(raw_b, dtype)
    if bits_a is None or bits_b is None:
        return None, False
    distance, same = _ulp_chunk_max(bits_a, bits_b, _MAGNITUDE_BITS[dtype])
    return distance, same and dtype in _ULP_VIEWS


def _max_ratio(d, x, floor, best, t, m) -> float:
    """max(best, largest d / max(x, floor)) with d, x >= 0. Only where d >= best * x can a
    ratio exceed best (rounding is monotone: d / m > best needs d > best * m >= best * x),
    so after the first chunks few ratios are divided out."""
    if best > 0:
        with np.errstate(over="ignore", invalid="ignore"):  # inf * x and inf * 0 (NaN) leave out no ratio > best
            np.multiply(x, best, out=t)
        hits = np.flatnonzero(np.greater_equal(d, t, out=m))
        if hits.size < d.size // 4:
            return max(best, float((d[hits] / np.maximum(x[hits], floor)).max())) if hits.size else best
    np.maximum(x, floor, out=x)
    np.divide(d, x, out=t)
    return max(best, float(t.max()))


def _dot(x: np.ndarray, y: np.ndarray) -> float:
    # einsum's single-threaded loop, not BLAS: OpenBLAS threads spin badly on a busy machine
    return float(np.einsum("i,i->", x, y))


class _Accumulator:
    __slots__ = ("saa", "sbb", "sab", "sdd", "max_abs", "max_rel", "within", "nan", "inf", "ulp")

    def __init__(self):
        self.saa = self.sbb = self.sab = self.sdd = self.max_abs = self.max_rel = 0.0
        self.within = self.nan = self.inf = self.ulp = 0


def tensor_metrics(a: np.ndarray, b: np.ndarray, tol: Tolerance, dtype_a: str = "", dtype_b: str = "",
                   chunk: int = CHUNK) -> Metrics:
    """Metrics of two same-shape arrays (decoded values). A is the reference."""
    flat_a, flat_b = _as_real(a), _as_real(b)
    if dtype_a != dtype_b:
        flat_a, flat_b = _limits_as_inf(flat_a, dtype_a), _limits_as_inf(flat_b, dtype_b)
    if flat_a.size != flat_b.size:
        raise ValueError(f"tensor_metrics needs equal sizes, got {flat_a.size} and {flat_b.size}")
    numel = int(np.asarray(a).size)
    ulp_dtype = dtype_a if dtype_a == dtype_b and dtype_a in ULP_DTYPES else None
    # The ULP of a float32 that holds a decoded bf16 is the bf16 ULP; of an exactly
    # representable int, none: only floats stored as themselves get one.
    acc = _Accumulator()
    size = flat_a.size
    width = min(chunk, max(size, 1))
    buf_a, buf_b, buf_t = (np.empty(width, np.float64) for _ in range(3))
    buf_m = np.empty(width, np.bool_)
    floor = max(tol.atol, np.finfo(np.float64).tiny)
    ulp_ok = ulp_dtype is not None
    plain = tol.rtol >= 0 and tol.atol >= 0  # then a difference of 0 (or <= atol) is within
    for start in range(0, size, width):
        raw_a, raw_b = flat_a[start : start + width], flat_b[start : start + width]
        n = raw_a.size
        ulp, same = _chunk_ulp(raw_a, raw_b, ulp_dtype) if ulp_ok else (None, False)
        ulp_ok = ulp is not None
        ca, cb = buf_a[:n], buf_b[:n]
        ca[...] = raw_a  # each conversion is summed at once, while it is in the cache
        saa = _dot(ca, ca)
        if same and plain and math.isfinite(saa):
            # the same bits on both sides: B's sums are A's (einsum's sum depends on the values
            # alone), and every difference is 0, within tolerance and 0 ULP apart
            acc.saa, acc.sbb, acc.sab, acc.within = acc.saa + saa, acc.sbb + saa, acc.sab + saa, acc.within + n
            continue
        cb[...] = raw_b
        sbb = _dot(cb, cb)
        if not (math.isfinite(saa) and math.isfinite(sbb)):
            ca, cb, raw_a, raw_b = _drop_non_finite(ca, cb, raw_a, raw_b, acc)
            n = ca.size
            saa, sbb = _dot(ca, ca), _dot(cb, cb)
            ulp = _chunk_ulp(raw_a, raw_b, ulp_dtype)[0] if ulp_ok else None
        acc.ulp = max(acc.ulp, ulp) if ulp_ok else acc.ulp
        acc.saa, acc.sbb, acc.sab = acc.saa + saa, acc.sbb + sbb, acc.sab + _dot(ca, cb)
        if n == 0:
            continue
        d, t, m = np.subtract(ca, cb, out=cb), buf_t[:n], buf_m[:n]  # B's buffer: one less in the cache
        acc.sdd += _dot(d, d)
        np.abs(d, out=d)
        largest = float(d.max())
        acc.max_abs = max(acc.max_abs, largest)
        if largest == 0 and plain:  # equal values: every difference is within tolerance, every ratio 0
            acc.within += n
            continue
        np.abs(ca, out=ca)
        if plain and largest <= tol.atol:  # rtol * |a| + atol >= atol: all within
            acc.within += n
        else:
            np.multiply(ca, tol.rtol, out=t)
            t += tol.atol
            acc.within += int(np.count_nonzero(np.less_equal(d, t, out=m)))
        acc.max_rel = _max_ratio(d, ca, floor, acc.max_rel, t, m)
    return _finish(acc, numel, size, ulp_ok)


#: the largest finite value of each float dtype: masks are filled with -finfo(dtype).max
_DTYPE_MAX = {"float16": 65504.0, "bfloat16": 3.3895313892515355e38, "float32": 3.4028234663852886e38,
              "float64": 1.7976931348623157e308}


def is_limit(value: float, dtype: str) -> bool:
    """value is +-finfo(dtype).max (a mask value that follows the dtype, not a number)."""
    limit = _DTYPE_MAX.get(dtype)
    return limit is not None and abs(value) == limit


def _limits_as_inf(flat: np.ndarray, dtype: str) -> np.ndarray:
    """Two runs in different dtypes fill masks with their own dtype's limit (float32's
    -3.4e38, float64's -1.8e308): both are "minus infinity" to the computation, so they
    compare as -inf (equal when in the same places)."""
    limit = _DTYPE_MAX.get(dtype)
    if limit is None or not np.issubdtype(flat.dtype, np.floating):
        return flat
    hits = np.abs(flat) == limit
    if not hits.any():
        return flat
    out = flat.astype(np.float64)
    out[hits] = np.copysign(np.inf, out[hits])
    return out


def _drop_non_finite(ca, cb, raw_a, raw_b, acc):
    """Count NaN/Inf disagreements and keep the positions finite on both sides."""
    nan_a, nan_b = np.isnan(ca), np.isnan(cb)
    acc.nan += int(np.count_nonzero(nan_a != nan_b))
    inf_a, inf_b = np.isinf(ca), np.isinf(cb)
    with np.errstate(invalid="ignore"):
        differs = ca != cb
    acc.inf += int(np.count_nonzero((inf_a | inf_b) & differs & ~(nan_a | nan_b)))
    keep = ~(nan_a | nan_b | inf_a | inf_b)
    return ca[keep], cb[keep], raw_a[keep], raw_b[keep]


def _finish(acc: _Accumulator, numel: int, size: int, ulp_ok: bool) -> Metrics:
    err = math.sqrt(acc.sdd)
    norm_a, norm_b = math.sqrt(acc.saa), math.sqrt(acc.sbb)
    rel = err / norm_a if norm_a > 0 else (0.0 if err == 0 else math.inf)
    if norm_a > 0 and norm_b > 0:
        cosine = max(-1.0, min(1.0, acc.sab / (norm_a * norm_b)))
    else:
        cosine = 1.0 if norm_a == norm_b else 0.0
    within = (acc.within / size) if size else 1.0
    return Metrics(
        evidence="tensor",
        numel=numel,
        err_l2=err,
        ref_norm=norm_a,
        other_norm=norm_b,
        rel_l2=rel,
        max_abs=acc.max_abs,
        max_rel=acc.max_rel,
        cosine=cosine,
        within=within,
        nan_mismatch=acc.nan,
        inf_mismatch=acc.inf,
        ulp_max=acc.ulp if ulp_ok else None,
        bit_equal=(acc.sdd == 0 and acc.nan == 0 and acc.inf == 0 and (not ulp_ok or acc.ulp == 0)),
    )


# ---------------------------------------------------------------------------- statistics


def statistics_metrics(ra: dict, rb: dict, evidence: str = "statistics") -> Metrics:
    """Lower bounds of the error from the recorded min/max/mean/norm/NaN/Inf counts."""
    numel = int(ra["numel"])
    masked = limit_masked(ra, rb) + same_infinities(ra, rb)
    if masked:
        # both hold their dtype's limit as a mask value: the sums (mean, norm) are the mask's
        ra = dict(ra, **{name: math.nan for name in ("mean", "norm", *masked)})
        rb = dict(rb, **{name: math.nan for name in ("mean", "norm", *masked)})
    rms_a = ra["norm"] / math.sqrt(numel) if numel > 0 and math.isfinite(ra["norm"]) else math.nan
    diffs = {}
    for name in ("norm", "mean", "min", "max"):
        va, vb = float(ra[name]), float(rb[name])
        diffs[name] = abs(va - vb) if math.isfinite(va) and math.isfinite(vb) else math.nan
    bounds = [
        diffs["norm"],
        diffs["mean"] * math.sqrt(numel) if numel > 0 else math.nan,
        diffs["max"],
        diffs["min"],
    ]
    known = [value for value in bounds if math.isfinite(value)]
    err = max(known) if known else 0.0
    norm_a = float(ra["norm"]) if math.isfinite(ra["norm"]) else 0.0
    if masked:  # the scale of the values that are not the mask: the unmasked extreme
        unmasked = [abs(float(ra[name])) for name in ("min", "max") if math.isfinite(ra[name])]
        norm_a = max(unmasked, default=0.0) * math.sqrt(max(numel, 1))
    if norm_a > 0:
        rel = err / norm_a
    else:
        rel = 0.0 if err == 0 else math.inf
    stat_rel = {}
    for name, diff in diffs.items():
        scale = norm_a if name == "norm" else rms_a
        if not math.isfinite(diff):
            stat_rel[name] = None
        elif diff == 0:
            stat_rel[name] = 0.0
        else:
            stat_rel[name] = diff / scale if scale and math.isfinite(scale) else math.inf
    abs_known = [diffs[name] for name in ("max", "min", "mean") if math.isfinite(diffs[name])]
    metrics = Metrics(
        evidence=evidence,
        numel=numel,
        err_l2=err,
        ref_norm=norm_a,
        other_norm=float(rb["norm"]) if math.isfinite(rb["norm"]) else 0.0,
        rel_l2=rel,
        max_abs=max(abs_known) if abs_known else 0.0,
        nan_mismatch=abs(int(ra["nan_count"]) - int(rb["nan_count"])),
        inf_mismatch=abs(int(ra["inf_count"]) - int(rb["inf_count"])),
        stat_rel=stat_rel,
    )
    if evidence == "checksum" and ra["dtype"] == rb["dtype"]:
        # checksums of two dtypes never match and say nothing: bit_equal stays unknown (None)
        same = bool(ra["checksum"]) and ra["checksum"] == rb["checksum"]
        metrics.bit_equal = same
        if same:  # identical bytes: the statistics cannot disagree, the error is exactly zero
            metrics.err_l2 = metrics.rel_l2 = metrics.max_abs = 0.0
    return metrics


def same_infinities(ra: dict, rb: dict) -> list[str]:
    """The extremes that are the same infinity on both sides, with as many Inf values on each
    (a causal mask filled with -inf in a float32 and a bfloat16 run): equal in place and sign
    as far as statistics tell, they match; the sums they dominate (mean, norm) say nothing."""
    if int(ra["inf_count"]) == 0 or int(ra["inf_count"]) != int(rb["inf_count"]):
        return []
    return [name for name in ("min", "max")
            if math.isinf(float(ra[name])) and float(ra[name]) == float(rb[name])]


def limit_masked(ra: dict, rb: dict) -> list[str]:
    """The extremes (min/max) that are the two dtypes' limits on both sides (dtypes differ)."""
    if ra.get("dtype") == rb.get("dtype"):
        return []
    return [name for name in ("min", "max")
            if is_limit(float(ra[name]), ra.get("dtype", "")) and is_limit(float(rb[name]), rb.get("dtype", ""))
            and (ra[name] > 0) == (rb[name] > 0)]


# ---------------------------------------------------------------------------- values


def parse_value(text: str):
    """The Python value of a record's JSON value column ("" -> None). A statistics dump
    repeats the same few argument texts thousands of times: each is parsed once, and a list or
    dict handed out as a copy of its own."""
    value = _parsed(text)
    return copy.deepcopy(value) if isinstance(value, (list, dict)) else value


@functools.lru_cache(maxsize=4096)
def _parsed(text: str):
    if text == "":
        return None
    try:
        return json.loads(text)
    except ValueError:
        return text


def value_metrics(text_a: str, text_b: str) -> Metrics:
    """Non-tensor values compare exactly (1 and 1.0 are equal; NaN equals NaN)."""
    equal = _values_equal(parse_value(text_a), parse_value(text_b))
    return Metrics(
        evidence="value",
        numel=1,
        err_l2=0.0 if equal else math.inf,
        rel_l2=0.0 if equal else math.inf,
        max_abs=0.0 if equal else math.inf,
        bit_equal=equal,
        value_a=text_a,
        value_b=text_b,
    )


def _values_equal(x, y) -> bool:
    if isinstance(x, float) and isinstance(y, float) and math.isnan(x) and math.isnan(y):
        return True
    if isinstance(x, (list, tuple)) and isinstance(y, (list, tuple)):
        return len(x) == len(y) and all(_values_equal(p, q) for p, q in zip(x, y))
    if isinstance(x, dict) and isinstance(y, dict):
        return x.keys() == y.keys() and all(_values_equal(x[k], y[k]) for k in x)
    if isinstance(x, bool) or isinstance(y, bool):
        return type(x) is type(y) and x == y
    return x == y


Fetch = Callable[[int], np.ndarray]


class Prefetcher:
    def __init__(self, keys: Sequence[tuple[int, int]], fetch_a: Fetch, fetch_b: Fetch, depth: int = 1):
        self._keys = list(keys)
        self._position = {key: index for index, key in enumerate(self._keys)}
        self._fetch_a, self._fetch_b = fetch_a, fetch_b
        self._depth = depth
        self._cond = threading.Condition()
        self._ready: dict = {}
        self._skip_below = 0  # keys planned before this index will not be asked for
        self._error: BaseException | None = None
        self._stopped = False
        self._done = False
        self._thread = threading.Thread(target=self._run, name="probe-compare-prefetch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for index, (id_a, id_b) in enumerate(self._keys):
                with self._cond:
                    while len(self._ready) >= self._depth and not self._stopped:
                        self._cond.wait()
                    if self._stopped:
                        return
                    if index < self._skip_below:
                        continue
                pair = (self._fetch_a(id_a), self._fetch_b(id_b))
                with self._cond:
                    if index >= self._skip_below:
                        self._ready[index] = pair
                    self._cond.notify_all()
                del pair
        except BaseException as error:  # handed to the measuring thread by take()
            with self._cond:
                self._error = error
                self._cond.notify_all()
        finally:
            with self._cond:
                self._done = True
                self._cond.notify_all()

    def take(self, key: tuple[int, int]):
        """(array_a, array_b) for key, or None when the caller must read it itself."""
        index = self._position.get(key)
        with self._cond:
            if index is None or index < self._skip_below:
                return None
            # everything planned before this key will not be asked for any more
            for stale in [i for i in self._ready if i < index]:
                del self._ready[stale]
            self._skip_below = index
            self._cond.notify_all()
            while index not in self._ready and self._error is None and not self._done:
                self._cond.wait()
            self._skip_below = index + 1
            self._cond.notify_all()
            if index in self._ready:
                return self._ready.pop(index)
            if self._error is not None:
                error, self._error = self._error, None
                raise error
            return None

    def close(self) -> None:
        with self._cond:
            self._stopped = True
            self._ready.clear()
            self._cond.notify_all()
        self._thread.join()


@dataclass
class Best:
    """``max(items, key=...)`` over items met in ordinal order, taken in any order and merged:
    the earliest item with the largest key; an item whose key is NaN wins only when it comes
    first, as it does for max()."""

    first: tuple | None = None  # (ordinal, key, item) with the smallest ordinal
    best: tuple | None = None  # (ordinal, key, item) with the largest key that is a number

    def offer(self, key, ordinal, item) -> None:
        if self.first is None or ordinal < self.first[0]:
            self.first = (ordinal, key, item)
        if key == key and (self.best is None or key > self.best[1]
                           or (key == self.best[1] and ordinal < self.best[0])):
            self.best = (ordinal, key, item)

    def merge(self, other: "Best") -> None:
        for entry in (other.first, other.best):
            if entry is not None:
                self.offer(entry[1], entry[0], entry[2])

    @property
    def item(self):
        if self.first is None:
            return None
        key = self.first[1]
        return self.first[2] if key != key else self.best[2]
