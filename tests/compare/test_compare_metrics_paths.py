"""Every shortcut tensor_metrics takes per chunk gives what the plain float64 formulas give.

The shortcuts: a chunk with the same bits on both sides (sums taken from A), a chunk of equal
values, a chunk whose differences are all <= atol (all within), and the largest ratio searched
only where it can beat the largest so far. The maxima, counts and ULPs must be exact; the sums
(which depend on the order of the additions) are checked to 1e-12, and against the same tensor
measured with no dtype named (no ULP, so no same-bits shortcut) they must be bit for bit equal.
"""

import math

import numpy as np
import pytest

from probe.comparison.metrics import tensor_metrics
from probe.comparison.tolerances import Tolerance

TOL = Tolerance(rtol=2e-5, atol=1e-6)
CHUNK = 256


def _ulp_keys(values: np.ndarray, dtype: str) -> np.ndarray:
    """Ordered integers: adjacent floats are 1 apart, -0 and +0 are both 0."""
    if dtype == "bfloat16":
        bits = (values.view(np.int32) >> 16).astype(np.int64)
        magnitude = bits & 0x7FFF
    else:
        width = {"float16": np.int16, "float32": np.int32, "float64": np.int64}[dtype]
        bits = values.view(width).astype(np.int64)
        magnitude = bits & np.int64(np.iinfo(width).max)
    return np.where(bits < 0, -magnitude, magnitude)


def _plain(a: np.ndarray, b: np.ndarray, tol: Tolerance, dtype: str) -> dict:
    """The metrics over the whole tensor at once, straight from their definitions."""
    a64, b64 = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    both = np.isfinite(a64) & np.isfinite(b64)
    x, y = a64[both], b64[both]
    d = np.abs(x - y)
    ratio = d / np.maximum(np.abs(x), max(tol.atol, np.finfo(np.float64).tiny))
    keys_a, keys_b = _ulp_keys(a.ravel()[both], dtype), _ulp_keys(b.ravel()[both], dtype)
    return {
        "err_l2": math.sqrt(float(np.sum(d * d))), "ref_norm": float(np.linalg.norm(x)),
        "max_abs": float(d.max()) if d.size else 0.0, "max_rel": float(ratio.max()) if d.size else 0.0,
        "within": int(np.count_nonzero(d <= tol.atol + tol.rtol * np.abs(x))) / a64.size,
        "ulp_max": int(np.abs(keys_a - keys_b).max()) if d.size else 0,
        "nan_mismatch": int(np.count_nonzero(np.isnan(a64) != np.isnan(b64))),
    }


def _bf16(values: np.ndarray) -> np.ndarray:
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    return (((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16).astype(np.uint32).view(np.float32)


def _check(a: np.ndarray, b: np.ndarray, dtype: str, tol: Tolerance = TOL) -> None:
    found = tensor_metrics(a, b, tol, dtype, dtype, chunk=CHUNK)
    plain = _plain(a, b, tol, dtype)
    for name in ("max_abs", "max_rel", "within", "ulp_max", "nan_mismatch"):
        assert getattr(found, name) == plain[name], (name, getattr(found, name), plain[name])
    assert found.err_l2 == pytest.approx(plain["err_l2"], rel=1e-12, abs=1e-300)
    assert found.ref_norm == pytest.approx(plain["ref_norm"], rel=1e-12)
    # no dtype named: no ULP and no same-bits shortcut, the same chunks summed the long way
    unnamed = tensor_metrics(a, b, tol, "", "", chunk=CHUNK).to_dict()
    named = found.to_dict()
    for name in ("ulp_max", "bit_equal"):
        named.pop(name, None), unnamed.pop(name, None)
    assert named == unnamed


def _mixed(dtype, rng) -> tuple[np.ndarray, np.ndarray]:
    """Chunks that are bit-equal, equal in value only (-0 vs +0), below atol, and far apart."""
    a = rng.standard_normal(CHUNK * 8)
    b = a.copy()
    b[CHUNK : 2 * CHUNK] *= 1 + 1e-3 * rng.standard_normal(CHUNK)  # beyond tolerance
    a[2 * CHUNK : 2 * CHUNK + 5] = 0.0
    b[2 * CHUNK : 2 * CHUNK + 5] = -0.0  # the rest of that chunk bit-equal
    b[4 * CHUNK : 5 * CHUNK] += 1e-8 * rng.standard_normal(CHUNK)  # all within atol
    a[5 * CHUNK : 6 * CHUNK] *= 1e-3
    b[5 * CHUNK : 6 * CHUNK] = a[5 * CHUNK : 6 * CHUNK]
    b[5 * CHUNK : 5 * CHUNK + 9] += 1.5e-6  # a little beyond atol: some outside rtol * |a| + atol
    b[6 * CHUNK : 8 * CHUNK] *= 1 + 1e-6 * rng.standard_normal(2 * CHUNK)  # ratios to search
    if dtype == "bfloat16":
        return _bf16(a), _bf16(b)
    return a.astype(dtype), b.astype(dtype)


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64", "bfloat16"])
def test_each_chunk_shortcut_gives_the_plain_metrics(dtype):
    a, b = _mixed(dtype, np.random.default_rng(0))
    _check(a, b, dtype)
    _check(a, b, dtype, Tolerance(rtol=0.0, atol=0.0))


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_bit_equal_tensors_have_equal_norms_and_zero_error(dtype):
    a = np.random.default_rng(1).standard_normal(CHUNK * 3 + 7).astype(dtype)
    found = tensor_metrics(a, a.copy(), TOL, dtype, dtype, chunk=CHUNK)
    assert found.ref_norm == found.other_norm
    assert (found.err_l2, found.max_abs, found.max_rel, found.within, found.cosine, found.ulp_max, found.bit_equal) == \
        (0.0, 0.0, 0.0, 1.0, 1.0, 0, True)
    _check(a, a.copy(), dtype)


def test_bit_equal_chunk_with_nan_or_inf_counts_them_as_the_plain_path_does():
    a = np.random.default_rng(2).standard_normal(CHUNK * 3).astype(np.float32)
    a[CHUNK + 3], a[2 * CHUNK + 9] = np.nan, np.inf
    b = a.copy()
    b[5] = np.nan  # one side only
    b[2 * CHUNK + 10] = np.nextafter(b[2 * CHUNK + 10], np.float32(9))
    _check(a, b, "float32")
    assert tensor_metrics(a, a.copy(), TOL, "float32", "float32", chunk=CHUNK).nan_mismatch == 0


def test_ulp_leaves_out_pairs_with_nan_even_when_their_bits_are_far_apart():
    a = np.ones(CHUNK * 2, np.float32)
    b = a.copy()
    b[3] = np.nextafter(np.float32(1), np.float32(2))
    a[CHUNK + 1] = np.nan  # NaN's bits are ~2**31 ULPs from 1.0: not a distance
    b[CHUNK + 2] = -np.inf
    found = tensor_metrics(a, b, TOL, "float32", "float32", chunk=CHUNK)
    assert found.ulp_max == 1 and found.nan_mismatch == 1 and found.inf_mismatch == 1
    _check(a, b, "float32")


@pytest.mark.parametrize("order", ["rising", "falling", "one_late", "just_above", "below_floor"])
def test_largest_ratio_is_found_wherever_it_lies(order):
    """The ratio search divides only where d >= best * |a|: the largest must still be exact,
    whether each chunk beats the last (all candidates), none does, or one element late does."""
    rng = np.random.default_rng(3)
    n = CHUNK * 10
    scale = {"rising": np.geomspace(1, 1e-3, n), "falling": np.geomspace(1e-3, 1, n)}.get(order, np.ones(n))
    a = (scale * (1 + rng.random(n))).astype(np.float32)
    b = (a.astype(np.float64) + 1e-5 * rng.standard_normal(n)).astype(np.float32)
    if order == "one_late":
        b[n - 3] = a[n - 3] * np.float32(1.5)
    if order == "just_above":  # 0.5 early; one step of float32 more late, and a tie after it
        a[[5, CHUNK * 7 + 1, CHUNK * 8]] = 1.0
        b[[5, CHUNK * 7 + 1, CHUNK * 8]] = [1.5, np.nextafter(np.float32(1.5), np.float32(2)), 1.5]
    if order == "below_floor":  # |a| under atol divides by atol; a = 0 too
        a[CHUNK * 7 : CHUNK * 7 + 4] = [0.0, 1e-9, -1e-7, 5e-7]
    _check(a, b, "float32")


def test_negative_tolerance_takes_no_shortcut():
    """A difference of 0 is within only if rtol * |a| + atol >= 0: not assumed when negative."""
    a = np.random.default_rng(4).standard_normal(CHUNK * 2).astype(np.float32)
    a[:3] = 0.0
    _check(a, a.copy(), "float32", Tolerance(rtol=-1e-3, atol=0.0))


def test_a_float32_labelled_bfloat16_is_not_taken_for_equal_by_its_top_half():
    """Only a plain view of the bits tells equal values; a bfloat16's ULPs read the top half."""
    a = np.random.default_rng(5).standard_normal(CHUNK).astype(np.float32)
    b = (a.view(np.uint32) ^ np.uint32(1)).view(np.float32)  # the low bits differ
    found = tensor_metrics(a, b, TOL, "bfloat16", "bfloat16", chunk=CHUNK)
    assert found.ulp_max == 0 and found.err_l2 > 0 and not found.bit_equal
    _check(a, b, "bfloat16")
