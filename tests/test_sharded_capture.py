"""Capture of sharded training (FSDP2, DDP, tensor parallel) on CPU with gloo, 2 ranks.

One torchrun job (tests/scripts/sharded_train.py) trains the same tiny model once per
scenario, without capture and under capture, and writes each rank's losses; the tests read
them. FSDP2 frees and re-allocates the memory of its unsharded parameters every step, and
every DTensor is a wrapper without memory of its own: capture must read both without
changing what training computes.
"""

import math
import os
import sys

import pytest
import torch

from torch_versions import sharding_or_skip

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts"))
import sharded_train  # noqa: E402

CAPTURES = [f"{level}.{task}" for level in ("module", "api", "mix")
            for task in ("statistics", "tensor", "checksum")]
#: (baseline, captured) pairs beyond FSDP2 under every level x task
OTHERS = [
    ("fsdp-none-keep", "fsdp-mix.tensor-keep"),
    ("fsdp-none-bf16", "fsdp-mix.statistics-bf16"),
    ("ddp-none", "ddp-mix.statistics"),
    ("tp-none", "tp-mix.statistics"),
    ("tp-none", "tp-api.tensor"),
]


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    sharding_or_skip()
    out = tmp_path_factory.mktemp("sharded")
    scenarios = ["fsdp-none"] + [f"fsdp-{capture}" for capture in CAPTURES]
    scenarios += sorted({name for pair in OTHERS for name in pair})
    sharded_train.launch(out, scenarios)
    return out


def test_fsdp2_trains_bit_identically_under_every_level_and_task(job):
    baseline = [sharded_train.losses(job, "fsdp-none", rank) for rank in (0, 1)]
    assert baseline[0] != baseline[1]  # each rank trains on its own data
    for capture in CAPTURES:
        for rank in (0, 1):
            assert sharded_train.losses(job, f"fsdp-{capture}", rank) == baseline[rank], capture


@pytest.mark.parametrize("baseline, captured", OTHERS)
def test_reshard_keep_mixed_precision_ddp_and_tensor_parallel_train_bit_identically(
        job, baseline, captured):
    for rank in (0, 1):
        assert sharded_train.losses(job, captured, rank) == sharded_train.losses(job, baseline, rank)


def test_a_dtensor_is_recorded_as_its_local_shard_with_its_placement(job):
    """Tensor parallel: the first Linear's weight (16 x 8) is split by rows; each rank records
    its 8 x 8 shard's statistics (no NaN, no -1 counts) and where the shard sits."""
    import json

    from probe.dump.reader import load

    dump = load(job / "tp-mix.statistics")
    weight = sharded_train.build()[0].weight.detach()
    for rank in (0, 1):
        rows = list(dump.records(step=0, rank=rank))
        tensors = [row for row in rows if row["dtype"] and row["numel"] > 0]
        assert tensors and not any(math.isnan(row["mean"]) or row["nan_count"] < 0
                                   for row in tensors)
        (row,) = [row for row in rows if row["key"] == "0/Linear#0/forward/param.weight"]
        place = json.loads(row["placement"])
        assert place == {"mesh": [2], "dims": ["tp"], "placements": ["S(0)"], "coord": [rank],
                         "shape": [16, 8], "offset": [8 * rank, 0]}
        shard = weight[8 * rank:8 * rank + 8]
        assert row["shape"] == "[8, 8]" and row["numel"] == 64
        assert (row["min"], row["max"]) == (shard.min().item(), shard.max().item())
        assert not any(row["placement"] for row in rows if row["module"] == "1")  # GELU's input is plain


@pytest.mark.parametrize("task", ["statistics", "checksum"])
@pytest.mark.parametrize("size", [8, 100_000])  # batched on the host, and computed alone
def test_capture_leaves_every_storage_it_reads_resizable(task, size):
    """Tensor.numpy() marks a storage as not resizable for good; FSDP2 then cannot free its
    unsharded parameters ("Trying to resize storage that is not resizable")."""
    from probe.capture.recorder import Recorder
    from probe.config import Config

    tensors = [torch.randn(size), torch.randn(size, dtype=torch.float64),
               torch.randn(2, size)[:, ::2], torch.arange(size)]
    recorder = Recorder(Config(task=task))
    call = recorder.call("api", "", "torch.neg", 0, "forward", "", 1)
    for position, tensor in enumerate(tensors):
        recorder.add(call, f"input.{position}", "in", tensor)
    recorder.resolve()
    assert all(row[13] == row[13] for row in recorder.rows)  # statistics were computed
    for tensor in tensors:
        tensor.untyped_storage().resize_(0)  # what FSDP2 does after forward
