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
