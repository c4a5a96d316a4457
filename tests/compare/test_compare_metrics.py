"""Metrics of one aligned pair: exact values against direct float64 numpy, ULPs, NaN/Inf."""

import math

import numpy as np
import pytest

from probe.comparison.metrics import statistics_metrics, tensor_metrics, value_metrics
from probe.comparison.tolerances import Tolerance
from test_compare_support import _stats

TOL = Tolerance(rtol=1e-3, atol=1e-6)


def _bf16(values: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even float32 -> bfloat16, returned decoded as float32 (like the reader)."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    return rounded.astype(np.uint32).view(np.float32)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_tensor_metrics_equal_direct_float64_formulas(dtype):
    rng = np.random.default_rng(1)
    a = rng.standard_normal((37, 53)).astype(dtype)
    b = (a + rng.standard_normal(a.shape) * 1e-3).astype(dtype)
    m = tensor_metrics(a, b, TOL, a.dtype.name, b.dtype.name, chunk=256)
    a64, b64 = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    d = a64 - b64
    assert m.err_l2 == pytest.approx(np.linalg.norm(d), rel=1e-12)
    assert m.rel_l2 == pytest.approx(np.linalg.norm(d) / np.linalg.norm(a64), rel=1e-12)
    assert m.max_abs == np.abs(d).max()
    assert m.max_rel == pytest.approx((np.abs(d) / np.maximum(np.abs(a64), TOL.atol)).max(), rel=1e-12)
    assert m.cosine == pytest.approx(a64 @ b64 / np.linalg.norm(a64) / np.linalg.norm(b64), rel=1e-12)
    assert m.within == pytest.approx(np.mean(np.abs(d) <= TOL.atol + TOL.rtol * np.abs(a64)))
    assert m.numel == a.size and m.nan_mismatch == 0 and m.inf_mismatch == 0


def test_chunk_size_does_not_change_the_metrics():
    rng = np.random.default_rng(2)
    a = rng.standard_normal(10_007).astype(np.float32)
    b = a * np.float32(1.0001)
    small = tensor_metrics(a, b, TOL, "float32", "float32", chunk=13)
    large = tensor_metrics(a, b, TOL, "float32", "float32", chunk=1 << 20)
    assert small.max_abs == large.max_abs and small.ulp_max == large.ulp_max
    assert small.rel_l2 == pytest.approx(large.rel_l2, rel=1e-12)
    assert small.within == large.within


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_ulp_distance_counts_representable_steps(dtype):
    a = np.array([1.0, -2.5, 0.0, 3.0], dtype=dtype)
    b = a.copy()
    b[0] = np.nextafter(a[0], dtype(2))
    b[1] = np.nextafter(np.nextafter(a[1], dtype(-3)), dtype(-3))
    m = tensor_metrics(a, b, TOL, a.dtype.name, a.dtype.name)
    assert m.ulp_max == 2
    zero = tensor_metrics(np.array([0.0], dtype), np.array([-0.0], dtype), TOL, a.dtype.name, a.dtype.name)
    assert zero.ulp_max == 0
    tiny = np.finfo(dtype).smallest_subnormal
    cross = tensor_metrics(np.array([tiny], dtype), np.array([-tiny], dtype), TOL, a.dtype.name, a.dtype.name)
    assert cross.ulp_max == 2


def test_ulp_across_zero_in_float64_is_exact_for_large_values():
    a, b = np.array([-1.0]), np.array([1.0])
    one_bits = int(np.array([1.0]).view(np.int64)[0])
    assert tensor_metrics(a, b, TOL, "float64", "float64").ulp_max == 2 * one_bits


def test_bfloat16_ulp_uses_the_16_bit_grid():
    rng = np.random.default_rng(3)
    a = _bf16(rng.standard_normal(1000).astype(np.float32))
    step = (a.view(np.uint32) + (1 << 16)).view(np.float32)  # next bf16 away from zero
    m = tensor_metrics(a, step, TOL, "bfloat16", "bfloat16")
    assert m.ulp_max == 1


def test_ulp_is_not_reported_when_dtypes_differ():
    a = np.ones(4, np.float32)
    assert tensor_metrics(a, a.astype(np.float64), TOL, "float32", "float64").ulp_max is None


def test_nan_on_one_side_is_counted_and_excluded_from_the_error():
    a = np.array([1.0, 2.0, np.nan, 4.0], np.float32)
    b = np.array([1.0, np.nan, np.nan, 4.0], np.float32)
    m = tensor_metrics(a, b, TOL, "float32", "float32")
    assert m.nan_mismatch == 1
    assert m.err_l2 == 0.0 and m.max_abs == 0.0
    same = tensor_metrics(a, a.copy(), TOL, "float32", "float32")
    assert same.nan_mismatch == 0 and same.bit_equal


def test_inf_with_different_sign_is_a_mismatch_and_equal_inf_is_not():
    a = np.array([np.inf, -np.inf, 1.0], np.float64)
    b = np.array([np.inf, np.inf, 1.0], np.float64)
    m = tensor_metrics(a, b, TOL, "float64", "float64")
    assert m.inf_mismatch == 1 and m.nan_mismatch == 0


def test_zero_reference_gives_infinite_relative_error_unless_both_are_zero():
    zeros = np.zeros(8, np.float32)
    assert tensor_metrics(zeros, zeros.copy(), TOL, "float32", "float32").rel_l2 == 0.0
    assert math.isinf(tensor_metrics(zeros, zeros + 1, TOL, "float32", "float32").rel_l2)


def test_complex_and_integer_tensors_compare_componentwise():
    a = np.array([1 + 2j, 3 - 1j], np.complex64)
    b = np.array([1 + 2j, 3 - 2j], np.complex64)
    m = tensor_metrics(a, b, TOL, "complex64", "complex64")
    assert m.max_abs == 1.0 and m.numel == 2
    ints = tensor_metrics(np.array([1, 2, 3]), np.array([1, 2, 4]), TOL, "int64", "int64")
    assert ints.max_abs == 1.0 and ints.ulp_max is None


def test_statistics_give_a_lower_bound_of_the_true_error():
    rng = np.random.default_rng(4)
    for trial in range(20):
        a = rng.standard_normal(500)
        b = a + rng.standard_normal(500) * 10.0 ** rng.uniform(-6, 0) + rng.uniform(-1e-3, 1e-3)
        true = np.linalg.norm(a - b)
        stats = statistics_metrics({**_stats(a), "checksum": "", "dtype": "float64"},
                                   {**_stats(b), "checksum": "", "dtype": "float64"})
        assert 0 < stats.err_l2 <= true * (1 + 1e-12)
        assert stats.max_abs <= np.abs(a - b).max() * (1 + 1e-12)
        assert stats.evidence == "statistics"


def test_statistics_report_nan_count_differences():
    a = np.array([1.0, np.nan, 3.0])
    b = np.array([1.0, 2.0, 3.0])
    m = statistics_metrics({**_stats(a), "checksum": "", "dtype": "float64"},
                           {**_stats(b), "checksum": "", "dtype": "float64"})
    assert m.nan_mismatch == 1


def test_equal_checksums_mean_exactly_zero_error():
    stats = {**_stats(np.arange(4.0)), "checksum": "abc", "dtype": "float32"}
    other = {**stats, "mean": stats["mean"] + 1}  # impossible with equal bytes: checksum wins
    m = statistics_metrics(stats, other, "checksum")
    assert m.bit_equal and m.err_l2 == 0.0
    changed = statistics_metrics(stats, {**other, "checksum": "abd"}, "checksum")
    assert changed.bit_equal is False and changed.err_l2 > 0


def test_values_compare_exactly():
    assert value_metrics("1e-05", "1e-05").bit_equal
    assert value_metrics("1", "1.0").bit_equal
    assert not value_metrics("1e-05", "0.001").bit_equal
    assert not value_metrics("true", "1").bit_equal
    assert value_metrics('[2, 3]', '[2, 3]').bit_equal and not value_metrics('[2, 3]', '[3, 2]').bit_equal


def test_checksums_of_different_dtypes_say_nothing_about_bit_equality():
    stats = {**_stats(np.arange(4.0)), "checksum": "abc", "dtype": "float32"}
    m = statistics_metrics(stats, {**stats, "checksum": "abd", "dtype": "float64"}, "checksum")
    assert m.bit_equal is None and m.err_l2 == 0.0


def _columns(rng, count: int, sketch_values) -> dict:
    """Record columns of `count` float32 tensors: random statistics and sketches, with NaN,
    infinity, empty tensors and checksums among them."""
    norm = np.abs(rng.standard_normal(count)) * 10
    columns = {"min": (-np.abs(rng.standard_normal(count))).tolist(), "max": np.abs(rng.standard_normal(count)).tolist(),
               "mean": (rng.standard_normal(count) * 1e-2).tolist(), "norm": norm.tolist(),
               "nan_count": [0] * count, "inf_count": [0] * count, "numel": rng.integers(0, 5000, count).tolist(),
               "checksum": [""] * count, "dtype": ["float32"] * count, "sketch": list(sketch_values)}
    columns["mean"][1] = columns["norm"][2] = math.nan  # statistics a NaN spoilt
    columns["max"][3], columns["inf_count"][3] = math.inf, 2  # an infinity: measured alone
    columns["numel"][4] = 0
    columns["checksum"][5] = columns["checksum"][6] = "c5"
    columns["dtype"][7] = "bfloat16"  # two dtypes (B's is float32): measured alone
    columns["sketch"][8] = None
    columns["nan_count"][9] = 1
    return columns


def test_column_wise_statistics_metrics_equal_the_per_record_ones_bit_for_bit():
    from probe.comparison.measure import STAT_COLUMNS
    from probe.comparison.sketch import raw_errors, refine, statistics_columns

    rng = np.random.default_rng(5)
    count = 64
    sketches = rng.standard_normal((count, 16))
    a = _columns(rng, count, sketches)
    b = _columns(np.random.default_rng(5), count, sketches + rng.standard_normal((count, 16)) * 1e-3)
    b["checksum"][6] = "c6"  # 5: the same bytes; 6: other bytes
    b["dtype"][7] = "float32"
    b["sketch"][10] = np.full(16, np.nan)
    rows_a, rows_b = list(range(count)), list(rng.permutation(count))
    rows_b[:11] = range(11)  # the edge cases paired with themselves
    found = statistics_columns(a, rows_a, b, rows_b)
    raws = raw_errors([a["sketch"][r] for r in rows_a], [b["sketch"][r] for r in rows_b])
    for row_a, row_b, metrics, raw in zip(rows_a, rows_b, found, raws):
        stats_a, stats_b = ({name: cols[name][row] for name in STAT_COLUMNS} for cols, row in ((a, row_a), (b, row_b)))
        expected = statistics_metrics(stats_a, stats_b, "checksum" if stats_a["checksum"] and stats_b["checksum"]
                                      else "statistics")
        if row_a in (3, 7):
            assert metrics is None
            continue
        assert metrics.to_dict() == expected.to_dict(), row_a
        refine(expected, a["sketch"][row_a], b["sketch"][row_b], "float32", "float32")
        refine(metrics, None, None, "float32", "float32", raw)
        assert repr(metrics.to_dict()) == repr(expected.to_dict()), row_a
