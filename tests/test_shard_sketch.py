"""Sketches of DTensor shards (probe/capture/shard_sketch.py, merged in
probe/comparison/shards.py): each shard is sketched with the projection entries of its
positions in the logical tensor, so the shards' sketches add up to the logical tensor's."""

import json

import numpy as np
import pytest
import torch

from probe.capture.shard_sketch import flat_offset, shard_sketch
from probe.capture.sketch import host_sketch, unpack
from probe.comparison.records import Records
from probe.comparison.shards import merge_ranks

#: 40 x 300 = 12000 values: three super-rows of the fold, crossed by uneven row shards
ROWS, COLUMNS = 40, 300
CUTS = [(0, 13), (13, 27), (27, 40)]


def _placement(start):
    return json.dumps({"mesh": [3], "dims": None, "placements": ["S(0)"], "coord": [0],
                       "shape": [ROWS, COLUMNS], "offset": [start, 0]})


def _whole(dtype):
    return torch.randn(ROWS, COLUMNS, generator=torch.Generator().manual_seed(0), dtype=dtype)


@pytest.mark.parametrize("dtype, rtol", [(torch.float32, 1e-5), (torch.float64, 1e-12)])
def test_row_shards_sketched_at_their_offsets_add_up_to_the_whole_tensors_sketch(dtype, rtol):
    whole = _whole(dtype)
    expected = np.array(unpack(host_sketch(whole, 16)))
    total = np.zeros(16)
    for start, end in CUTS:
        offset = flat_offset(_placement(start), (end - start, COLUMNS))
        assert offset == start * COLUMNS
        total += np.array(unpack(shard_sketch(whole[start:end], offset, 16)))
    assert np.allclose(total, expected, rtol=rtol, atol=rtol * np.abs(expected).max())
    # the shard's own sketch (positions from 0) is not its part of the whole's
    own = sum(np.array(unpack(host_sketch(whole[start:end], 16))) for start, end in CUTS)
    assert not np.allclose(own, expected, rtol=1e-3)


def test_the_device_path_gives_the_same_shard_sketch_as_the_host_path():
    """On a GPU a shard is sketched by torch and resolved later; on CPU the same code runs."""
    from probe.capture.shard_sketch import _torch_sketch_at

    whole = _whole(torch.float64)
    for start, end in CUTS:
        offset = start * COLUMNS
        host = np.array(unpack(shard_sketch(whole[start:end], offset, 16)))
        device = _torch_sketch_at(whole[start:end].reshape(-1), offset, 16).numpy()
        assert np.allclose(host, device, rtol=1e-12, atol=1e-9)


def test_a_column_shard_is_not_one_run_of_the_flat_index_and_gets_no_offset():
    column = json.dumps({"shape": [4, 16], "offset": [0, 8], "placements": ["S(1)"]})
    assert flat_offset(column, (4, 8)) is None
    single_row = json.dumps({"shape": [1, 16], "offset": [0, 8], "placements": ["S(1)"]})
    assert flat_offset(single_row, (1, 8)) == 8
    assert flat_offset(json.dumps({"shape": [4, 16], "offset": None}), (2, 16)) is None


def _record(whole, start, end, sketched):
    shard = whole[start:end]
    return {"key": "fc/Linear#0/forward/param.weight", "module": "fc", "op": "Linear",
            "slot": "param.weight", "dtype": "torch.float32", "shape": f"[{end - start}, {COLUMNS}]",
            "numel": shard.numel(), "min": shard.min().item(), "max": shard.max().item(),
            "mean": shard.mean().item(), "norm": shard.norm().item(), "nan_count": 0,
            "inf_count": 0, "tensor_id": -1, "checksum": "", "placement": _placement(start),
            "sketch": sketched}


def test_compare_sums_the_shard_sketches_into_the_logical_tensors_sketch():
    whole = _whole(torch.float32)
    by_rank = {rank: Records.from_dicts([_record(whole, start, end, unpack(
        shard_sketch(whole[start:end], start * COLUMNS, 16)))])
        for rank, (start, end) in enumerate(CUTS)}
    merged = merge_ranks(by_rank)
    expected = np.array(unpack(host_sketch(whole, 16)))
    for rank in by_rank:
        found = merged.views[rank].row(0)["sketch"]
        assert np.allclose(found, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())
    # one shard without a sketch: the logical record has none (not a wrong one)
    by_rank[1] = Records.from_dicts([_record(whole, *CUTS[1], None)])
    assert merge_ranks(by_rank).views[0].row(0)["sketch"] is None
