"""Sketches of DTensor shards (probe/capture/numbers/shard_sketch.py, merged in
probe/comparison/shards.py): each shard is sketched with the projection entries of its
positions in the logical tensor, so the shards' sketches add up to the logical tensor's."""

import itertools
import json

import numpy as np
import pytest
import torch

from probe.capture.numbers.shard_sketch import Block, block_sketch, flat_offset, shard_layout, shard_sketch
from probe.capture.numbers.sketch import host_sketch, sketch_values, unpack
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
    from probe.capture.numbers.shard_sketch import sketch_at

    whole = _whole(torch.float64)
    for start, end in CUTS:
        offset = start * COLUMNS
        host = np.array(unpack(shard_sketch(whole[start:end], offset, 16)))
        device = sketch_at(whole[start:end].reshape(-1), offset, 16).numpy()
        assert np.allclose(host, device, rtol=1e-12, atol=1e-9)


def test_a_column_shard_is_a_block_of_runs_and_only_a_run_gets_a_flat_offset():
    column = json.dumps({"shape": [4, 16], "offset": [0, 8], "placements": ["S(1)"]})
    assert flat_offset(column, (4, 8)) is None
    assert shard_layout(column, (4, 8)) == Block(sizes=(4,), strides=(16,), start=8, length=8)
    single_row = json.dumps({"shape": [1, 16], "offset": [0, 8], "placements": ["S(1)"]})
    assert flat_offset(single_row, (1, 8)) == 8
    # a 2-D mesh's block at column 0 starts the flat index but is not one run of it
    corner = json.dumps({"shape": [4, 16], "offset": [0, 0], "placements": ["S(0)", "S(1)"]})
    assert flat_offset(corner, (2, 8)) is None
    assert shard_layout(corner, (2, 8)) == Block(sizes=(2,), strides=(16,), start=0, length=8)
    assert shard_layout(json.dumps({"shape": [4, 16], "offset": None}), (2, 16)) is None
    assert shard_layout(json.dumps({"shape": [4, 16], "offset": [0, 12]}), (4, 8)) is None


def _chunks(size, parts):
    """[(start, end)] of torch's Shard over `parts` ranks: chunks of ceil(size / parts), the
    last ones smaller or empty."""
    step = -(-size // parts)
    return [(min(rank * step, size), min(rank * step + step, size)) for rank in range(parts)]


def _blocks(shape, parts):
    """Every shard of a tensor of `shape` split into parts[d] along dim d (a mesh with one
    dimension per split dim): [(placement JSON, index of the block)]."""
    split = [d for d in range(len(shape)) if parts[d] > 1]
    found = []
    for box in itertools.product(*[_chunks(size, count) for size, count in zip(shape, parts)]):
        placement = json.dumps({"mesh": [parts[d] for d in split], "dims": None,
                                "placements": [f"S({d})" for d in split], "coord": None,
                                "shape": list(shape), "offset": [start for start, _ in box]})
        found.append((placement, tuple(slice(start, end) for start, end in box)))
    return found


#: (logical shape, parts per dim): column blocks (RowwiseParallel's weight), uneven and empty
#: shards, a 2-D mesh's blocks, 3-D tensors with few long runs and with many short ones, runs
#: longer than a super-row cut into pieces, and row shards too large for the numpy fold
LAYOUTS = {
    "columns of 16x8": ((16, 8), (1, 2)),
    "uneven columns of 16x8": ((16, 8), (1, 3)),
    "2-D mesh blocks": ((40, 300), (3, 4)),
    "Shard(1) of 3-D, long runs": ((3, 64, 300), (1, 2, 1)),
    "Shard(1) of 3-D, short runs": ((5, 7, 300), (1, 3, 1)),
    "last dim split, two shards empty": ((3, 8, 5), (1, 1, 7)),
    "runs longer than a super-row": ((10, 10000), (1, 2)),
    "rows sharing their leads": ((600, 256), (1, 2)),
    "wide rows sharing some leads": ((1200, 512), (1, 2)),
    "row halves folded by torch": ((700, 1000), (2, 1)),
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("dtype, rtol", [(torch.float32, 1e-5), (torch.float64, 1e-12),
                                         (torch.bfloat16, 1e-5)])
def test_block_shards_sketched_at_their_logical_positions_add_up_to_the_whole_sketch(layout, dtype, rtol):
    shape, parts = LAYOUTS[layout]
    whole = torch.randn(*shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    expected = np.array(unpack(host_sketch(whole, 16)))
    total, own = np.zeros(16), np.zeros(16)
    for placement, index in _blocks(shape, parts):
        local = whole[index].contiguous()
        found = shard_sketch(local, shard_layout(placement, local.shape), 16)
        assert type(found) is bytes  # a CPU shard: packed, as every CPU record's sketch
        total += np.array(unpack(found))
        if local.numel():
            own += np.array(unpack(host_sketch(local, 16)))
    assert np.allclose(total, expected, rtol=rtol, atol=rtol * np.abs(expected).max())
    # the shards' own sketches (positions from 0) are not their parts of the whole's
    assert not np.allclose(own, expected, rtol=1e-3)


def test_runs_that_share_a_place_in_the_fold_are_summed_before_they_are_placed():
    from probe.capture.numbers.shard_sketch import _short_run_plan

    def plans(shape):
        placement, index = _blocks(shape, (1, 2))[1]
        layout = shard_layout(placement, torch.empty(shape)[index].shape)
        return [plan for _, _, _, plan in _short_run_plan(layout, torch.device("cpu"))]

    # 256 values a row: every 251st row starts at the same place of a super-row
    (plan,) = plans((600, 256))
    assert plan.group is not None and len(plan.places) < 600
    (plan,) = plans((16, 8))  # one super-row: every run its own place
    assert plan.group is None and len(plan.places) == 16


def test_the_short_run_path_in_chunks_gives_the_sketch_in_one(monkeypatch):
    from probe.capture.numbers import shard_sketch as module

    whole = torch.randn(300, 60, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    expected = np.array(unpack(host_sketch(whole, 16)))
    monkeypatch.setattr(module, "_CHUNK", 100)  # 30 values a run: 3 runs a pass
    total = np.zeros(16)
    for placement, index in _blocks(whole.shape, (1, 2)):
        layout = shard_layout(placement, whole[index].shape)
        assert len(module._short_run_plan(layout, torch.device("cpu"))) == 100
        total += np.array(unpack(shard_sketch(whole[index].contiguous(), layout, 16)))
    assert np.allclose(total, expected, rtol=1e-12, atol=1e-12 * np.abs(expected).max())


@pytest.mark.parametrize("layout", ["2-D mesh blocks", "Shard(1) of 3-D, long runs",
                                    "rows sharing their leads"])
def test_the_device_path_sketches_a_block_into_the_same_sum(layout):
    """On a GPU a block is sketched by torch into a (k,) float64 tensor, resolved later with
    the deferred statistics; on CPU the same code runs."""
    shape, parts = LAYOUTS[layout]
    whole = torch.randn(*shape, generator=torch.Generator().manual_seed(3))
    expected = np.array(unpack(host_sketch(whole, 16)))
    total = torch.zeros(16, dtype=torch.float64)
    for placement, index in _blocks(shape, parts):
        local = whole[index].contiguous()
        found = block_sketch(sketch_values(local), shard_layout(placement, local.shape), 16,
                             host=False)
        assert found.dtype == torch.float64 and found.shape == (16,)
        total += found
    assert np.allclose(total.numpy(), expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())


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


def _block_record(local, placement):
    return {"key": "fc/Linear#0/forward/param.weight", "module": "fc", "op": "Linear",
            "slot": "param.weight", "dtype": "torch.float32",
            "shape": "[" + ", ".join(str(size) for size in local.shape) + "]",
            "numel": local.numel(), "min": local.min().item(), "max": local.max().item(),
            "mean": local.mean().item(), "norm": local.norm().item(), "nan_count": 0,
            "inf_count": 0, "tensor_id": -1, "checksum": "", "placement": placement,
            "sketch": unpack(shard_sketch(local, shard_layout(placement, local.shape), 16))}


@pytest.mark.parametrize("placements", [["R", "S(1)"], ["S(0)", "S(1)"]])
def test_compare_sums_the_blocks_of_a_2d_mesh_once_each_into_the_whole_sketch(placements):
    """A 2 x 2 mesh: column shards replicated on the first mesh dimension (each copy sketched
    alike, counted once), or a block per rank."""
    whole = _whole(torch.float32)
    by_rank = {}
    for rank, (row, column) in enumerate(itertools.product(range(2), range(2))):
        rows = (0, ROWS) if placements[0] == "R" else (row * ROWS // 2, (row + 1) * ROWS // 2)
        columns = (column * COLUMNS // 2, (column + 1) * COLUMNS // 2)
        placement = json.dumps({"mesh": [2, 2], "dims": None, "placements": placements,
                                "coord": [row, column], "shape": [ROWS, COLUMNS],
                                "offset": [rows[0], columns[0]]})
        local = whole[rows[0]:rows[1], columns[0]:columns[1]].contiguous()
        by_rank[rank] = Records.from_dicts([_block_record(local, placement)])
    merged = merge_ranks(by_rank)
    expected = np.array(unpack(host_sketch(whole, 16)))
    assert merged.shards == {"fc/Linear#0/forward/param.weight": 2 if placements[0] == "R" else 4}
    for rank in by_rank:
        found = merged.views[rank].row(0)["sketch"]
        assert np.allclose(found, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())
