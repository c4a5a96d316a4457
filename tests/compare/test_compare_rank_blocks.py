"""Rank blocks (probe/comparison/shards.py, merge_rank_blocks) on hand-made records: plain records that are
each tensor-parallel rank's block of a tensor one device holds whole become that tensor's
record; anything else stays rank-local."""

import math

import numpy as np

from probe.comparison.records import Records
from probe.comparison.shards import merge_rank_blocks
from probe.comparison.shards import merge_ranks

KEY = "attn/Tensor.transpose#0/forward/output.0"


def _tensor(array, key=KEY, tensor_id=-1):
    array = np.asarray(array, dtype=np.float64)
    return {"key": key, "slot": key.rsplit("/", 1)[1], "shape": str(list(array.shape)),
            "numel": array.size, "min": float(array.min()), "max": float(array.max()),
            "mean": float(array.mean()), "norm": float(np.linalg.norm(array)),
            "nan_count": 0, "inf_count": 0, "tensor_id": tensor_id}


def _number(value, key):
    return {"key": key, "slot": key.rsplit("/", 1)[1], "value": str(value)}


def _merged(rows_by_rank):
    return merge_ranks({rank: Records.from_dicts(rows) for rank, rows in rows_by_rank.items()})


def _row(records, key):
    return records.row(records.columns["key"].index(key))


WHOLE = np.arange(16.0).reshape(2, 4, 2) - 5  # (batch, heads, features): rank r holds heads 2r, 2r+1


def test_blocks_of_one_dimension_merge_into_the_whole_tensors_statistics():
    # each rank sketched its block as a whole tensor: those sketches do not add up to the whole's
    merged = _merged({rank: [dict(_tensor(WHOLE[:, 2 * rank:2 * rank + 2]), sketch=[1.0, 2.0])]
                      for rank in (0, 1)})
    assert merge_rank_blocks(merged, Records.from_dicts([_tensor(WHOLE)])) == 1
    assert KEY in merged.logical
    for rank in (0, 1):
        row = _row(merged.views[rank], KEY)
        assert (row["shape"], row["numel"], row["min"], row["max"]) == ("[2, 4, 2]", 16, -5.0, 10.0)
        assert math.isclose(row["mean"], WHOLE.mean()) and math.isclose(row["norm"], np.linalg.norm(WHOLE))
        assert row["sketch"] is None


def test_dumped_blocks_of_a_head_dimension_are_reassembled_in_rank_order():
    stored = {0: {3: WHOLE[:, :2]}, 1: {7: WHOLE[:, 2:]}}
    merged = _merged({0: [_tensor(stored[0][3], tensor_id=3)], 1: [_tensor(stored[1][7], tensor_id=7)]})
    merge_rank_blocks(merged, Records.from_dicts([_tensor(WHOLE, tensor_id=1)]))
    row = _row(merged.views[0], KEY)
    fetch = merged.fetch({rank: stored[rank].__getitem__ for rank in stored}, stored[0].__getitem__)
    assert np.array_equal(fetch(row["tensor_id"]), WHOLE)


def test_blocks_of_the_first_dimension_keep_no_reassembled_tensor():
    """A split of dimension 0 can be a data-parallel batch, which a sampler deals out strided."""
    merged = _merged({rank: [_tensor(WHOLE[rank:rank + 1], tensor_id=rank)] for rank in (0, 1)})
    merge_rank_blocks(merged, Records.from_dicts([_tensor(WHOLE, tensor_id=1)]))
    row = _row(merged.views[0], KEY)
    assert row["shape"] == "[2, 4, 2]" and row["tensor_id"] == -1 and not merged.assembled


def test_shapes_that_do_not_split_one_dimension_by_the_rank_count_stay_rank_local():
    for blocks in ([WHOLE[:, :1], WHOLE[:, 1:2]],            # a quarter each: not split two ways
                   [WHOLE[:1, :2], WHOLE[1:, 2:]],            # two dimensions differ
                   [WHOLE[:, :2], WHOLE[:, 2:3]]):            # the ranks' shapes differ
        merged = _merged({rank: [_tensor(block)] for rank, block in enumerate(blocks)})
        assert merge_rank_blocks(merged, Records.from_dicts([_tensor(WHOLE)])) == 0
        assert KEY not in merged.logical and _row(merged.views[0], KEY)["shape"] == str(list(blocks[0].shape))


def test_a_head_count_argument_stands_for_the_whole_count_only_where_its_output_was_merged():
    call = "attn/Tensor.expand#0/forward/"
    other = "attn/Tensor.repeat#0/forward/"
    whole = Records.from_dicts([_tensor(WHOLE, call + "output.0"), _number(4, call + "input.2"),
                                _number(2, call + "input.3"), _number(4, other + "input.1")])
    merged = _merged({rank: [_tensor(WHOLE[:, 2 * rank:2 * rank + 2], call + "output.0"),
                             _number(2, call + "input.2"),   # the rank's head count: 2 of 4
                             _number(2, call + "input.3"),   # the features, whole on both
                             _number(2, other + "input.1")]  # no merged output in its call
                      for rank in (0, 1)})
    merge_rank_blocks(merged, whole)
    view = merged.views[1]
    assert _row(view, call + "input.2")["value"] == "4"
    assert _row(view, call + "input.3")["value"] == "2"
    assert _row(view, other + "input.1")["value"] == "2" and other + "input.1" not in merged.logical
