"""What compare makes in bulk or by a shortcut must equal what it made one at a time: a
tensor's print (its identity within one step file), made for a whole column at once, tells
tensors apart exactly as their statistics do and follows records added later; a row's copy
holds every field."""

from __future__ import annotations

import math

import pytest

from probe.comparison.records import Records, number_keys


def _tensor(key: str, low: float, high: float, mean: float, norm: float, shape: str = "[4]", numel: int = 4,
            tensor_id: int = -1) -> dict:
    return {"key": key, "slot": "output.0", "io": "out", "dtype": "float32", "shape": shape, "numel": numel,
            "min": low, "max": high, "mean": mean, "norm": norm, "tensor_id": tensor_id}


@pytest.mark.parametrize("first, second, same", [
    (1.5, 1.5, True),
    (math.nan, math.nan, True),  # NaN is the same statistic on both records
    (math.nan, -math.nan, True),
    (0.0, -0.0, False),  # equal numbers, different values
    (1.0, math.nextafter(1.0, 2.0), False),
    (math.inf, math.inf, True),
    (math.inf, -math.inf, False),
])
def test_number_keys_are_equal_exactly_for_the_same_number(first, second, same):
    key_a, key_b = number_keys([first, second])
    assert (key_a == key_b) is same


def test_number_keys_of_a_column_that_holds_no_numbers_fall_back_to_their_text():
    assert number_keys([None, "x"]) == ["None", "'x'"]


def test_prints_tell_tensors_apart_by_their_statistics_and_name_none_for_what_has_no_identity():
    records = Records.from_dicts([
        _tensor("a", -1.0, 2.0, 0.5, 3.0),
        _tensor("b", -1.0, 2.0, 0.5, 3.0),  # the same statistics: the same tensor as far as they tell
        _tensor("c", -1.0, 2.0, 0.5, 3.5),
        _tensor("d", math.nan, math.nan, math.nan, math.nan),  # nothing known
        _tensor("e", 1.0, 1.0, 1.0, 1.0, shape="[1]", numel=1),  # a one-element tensor: a [1] bias
        _tensor("f", 1.0, 1.0, 1.0, 1.0, shape="[]", numel=1),  # 0-dim: a step counter
        _tensor("g", 7.0, 8.0, 7.5, 9.0, tensor_id=12),  # a stored id decides
    ])
    prints = records.prints()
    assert prints[0] == prints[1] != prints[2]
    assert prints[3] is None and prints[4] is None and prints[5] is None
    assert prints[6] == ("id", 12)
    with_one_element = records.prints(one_element=True)
    assert with_one_element[4] is not None and with_one_element[5] is None


def test_prints_follow_records_appended_after_they_were_made():
    records = Records.from_dicts([_tensor("a", -1.0, 2.0, 0.5, 3.0)])
    assert len(records.prints()) == 1
    row = records.append_record(dict(records.row(0), key="a[0]"))
    prints = records.prints()
    assert len(prints) == 2 and prints[row] == prints[0]


def test_a_restated_row_holds_every_field_of_its_original_and_its_own_lists():
    import dataclasses

    from probe.comparison.metrics import Metrics
    from probe.comparison.story import restated
    from probe.comparison.structs import RecordRow

    values = {found.name: f"{found.name}!" for found in dataclasses.fields(RecordRow)}
    values.update(reasons=["beyond tolerance"], notes=["dtype differs"], input_errors=[{"slot": "input.0"}],
                  metrics=Metrics(evidence="tensor", numel=4), order=(3, 1, 0, 0), envelope={"verdict": "within"})
    row = RecordRow(**values)
    twin = restated(row)
    assert twin is not row and twin == row
    assert all(getattr(twin, name) is getattr(row, name) for name in values if name not in ("reasons", "notes"))
    twin.reasons.append("drift")
    twin.notes.append("settled")
    assert row.reasons == ["beyond tolerance"] and row.notes == ["dtype differs"]


def _sketch_metrics(norm_a: float, norm_b: float, err: float, numel: int, evidence: str = "statistics",
                    bit_equal=None):
    from probe.comparison.metrics import Metrics

    return Metrics(evidence=evidence, numel=numel, err_l2=err, ref_norm=norm_a, other_norm=norm_b,
                   rel_l2=err / norm_a if norm_a else 0.0, bit_equal=bit_equal)


#: (norms, statistics' bound, numel, dtypes, raw_errors' answer): each a branch of estimate()
SKETCH_CASES = [
    (3.0, 3.1, 1e-3, 4096, ("float32", "float32"), (16, 2e-2)),  # the estimate decides
    (3.0, 3.1, 5e-2, 4096, ("float32", "float32"), (16, 2e-2)),  # the statistics' bound is larger
    (3.0, 3.0, 0.0, 4096, ("float32", "float32"), (16, 1e-9)),  # within the sketch's rounding floor
    (0.0, 1.0, 1.0, 10, ("float32", "float32"), (16, 0.5)),  # A is zero: an infinite relative error
    (0.0, 0.0, 0.0, 10, ("float32", "float32"), (16, 0.0)),
    (2.0, 2.5, 1e-4, 1 << 20, ("complex64", "complex64"), (8, 1e-2)),  # another k; complex counts twice
    (2.0, 5.0, 1e-4, 300, ("float64", "bfloat16"), (16, 1e-3)),  # another accumulation on each side
    (math.inf, 2.0, 1e-4, 300, ("float32", "float32"), (16, 1e-3)),  # a norm that overflowed
    (2.0, 2.0, 1e-4, 300, ("float32", "float32"), False),  # no estimate: left as it was
]


@pytest.mark.parametrize("norm_a, norm_b, bound, numel, dtypes, raw", SKETCH_CASES)
def test_sketch_estimates_made_by_column_equal_those_made_one_at_a_time(norm_a, norm_b, bound, numel, dtypes, raw):
    from probe.comparison.sketch import refine, refine_many

    one, many = (_sketch_metrics(norm_a, norm_b, bound, numel) for _ in range(2))
    refine(one, None, None, dtypes[0], dtypes[1], raw)
    refine_many([many], [dtypes[0]], [dtypes[1]], [raw])
    assert (many.err_l2, many.rel_l2) == (one.err_l2, one.rel_l2)
    assert repr(many.sketch) == repr(one.sketch)  # every float to the bit, the keys in the same order


def test_sketch_estimates_by_column_leave_bit_equal_and_value_metrics_alone():
    from probe.comparison.sketch import refine_many

    equal = _sketch_metrics(3.0, 3.0, 0.0, 10, evidence="checksum", bit_equal=True)
    value = _sketch_metrics(1.0, 1.0, 0.0, 1, evidence="value")
    refine_many([equal, value], ["float32"] * 2, ["float32"] * 2, [(16, 1.0), (16, 1.0)])
    assert equal.sketch is None and value.sketch is None and equal.err_l2 == 0.0


def test_an_op_summary_holds_every_field_in_order_and_stays_frozen():
    import dataclasses

    from probe.comparison.result import OpSummary

    summary = OpSummary(1, 2, "fc1", "linear", 0, "forward", "fc1/linear#0", "api", 0.5, 1e-3, 1e-4, 10.0, True,
                        "introduced")
    assert list(vars(summary)) == [found.name for found in dataclasses.fields(OpSummary)]
    assert summary.where == [] and summary.where is not OpSummary(*list(vars(summary).values())[:14]).where
    with pytest.raises(dataclasses.FrozenInstanceError):
        summary.introduced = 0.0
    moved = dataclasses.replace(summary, where=[(1, 2)], diverged_in=1)
    assert (moved.where, moved.diverged_in, moved.key) == ([(1, 2)], 1, summary.key)


@pytest.mark.parametrize("lengths", [(16, 16), (16, 8), (8, 16)])
def test_sketch_differences_made_in_bulk_equal_those_made_pair_by_pair(lengths):
    import numpy as np

    from probe.comparison.sketch import _raw_error, raw_errors

    rng = np.random.default_rng(3)
    sketches_a = [rng.standard_normal(lengths[0]) for _ in range(5)] + [[1.0, 2.0] * (lengths[0] // 2), None]
    sketches_b = [rng.standard_normal(lengths[1]) for _ in range(5)] + [[1.5, 2.0] * (lengths[1] // 2), [1.0]]
    sketches_b[2][0] = np.nan  # no estimate where a sketch is not finite
    expected = [_raw_error(x, y) for x, y in zip(sketches_a, sketches_b)]
    assert raw_errors(sketches_a, sketches_b) == expected
    assert expected[2] is False and expected[6] is False and expected[0][0] == min(lengths)
