"""probe.integrations.hf.ProbeCallback on a Trainer whose model FSDP2 shards over 2 ranks
(gloo, CPU; tests/integrations/sharded_trainer.py): every rank's steps are captured with
their shards, training is what it is without probe, and two identical runs pass.

The sharding is transformers' ``DistributedConfig(fsdp_size=2)`` at load time: accelerate's
FSDP2 plugin does not shard on the CPU (the Trainer falls back to DDP there, see
sharded_trainer.py and docs/trainers.md)."""

import pytest

from tests.torch_versions import fsdp2_on_cpu_gap, sharding_or_skip, transformers_or_skip

transformers_or_skip()
pytest.importorskip("accelerate", reason="the transformers Trainer needs accelerate: "
                    "pip install -e '.[hf]'")
pytest.importorskip("transformers.distributed", reason="FSDP2 at load time needs a "
                    "transformers with DistributedConfig (transformers.distributed): "
                    "pip install -U transformers")
if fsdp2_on_cpu_gap():
    pytest.skip(fsdp2_on_cpu_gap(), allow_module_level=True)

import probe  # noqa: E402
from tests.integrations import sharded_trainer  # noqa: E402

RUNS = ("plain", "a", "b")


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory):
    sharding_or_skip()
    root = tmp_path_factory.mktemp("hf_fsdp2")
    sharded_trainer.launch(root, RUNS)
    return root


def test_an_fsdp2_trainer_run_is_captured_on_every_rank_with_its_parameter_shards(out_dir):
    for rank in (0, 1):
        assert sharded_trainer.result(out_dir, "a", rank)["model_wrapped"].startswith("FSDP")
    dump = probe.load(str(out_dir / "a"))
    assert dump.steps == [0, 1] and dump.ranks == [0, 1]
    for rank in (0, 1):
        records = list(dump.records(step=1, rank=rank))
        inside = {record["module"] for record in records if record["kind"] == "api"}
        assert {"transformer.h.0.attn.c_attn", "transformer.h.1.mlp.c_fc"} <= inside
        layer = {record["slot"]: record for record in records
                 if record["module"] == "transformer.h.0.attn.c_attn"
                 and record["kind"] == "param"}
        # the forward runs on the all-gathered weight; its gradient is this rank's shard
        assert layer["param.weight"]["shape"] == "[32, 96]"
        shard = layer["param_grad.weight"]
        assert shard["shape"] == "[16, 96]"
        assert '"placements":["S(0)"]' in shard["placement"]
        assert f'"coord":[{rank}]' in shard["placement"]


def test_capturing_an_fsdp2_trainer_run_keeps_every_ranks_losses_bit_identical(out_dir):
    plain = [sharded_trainer.result(out_dir, "plain", rank)["losses"] for rank in (0, 1)]
    captured = [sharded_trainer.result(out_dir, "a", rank)["losses"] for rank in (0, 1)]
    assert len(plain[0]) == sharded_trainer.STEPS and plain[0] != plain[1]  # each its own data
    assert captured == plain


def test_two_identical_fsdp2_trainer_runs_compare_as_pass(out_dir):
    result = probe.compare(str(out_dir / "a"), str(out_dir / "b"))
    assert result.verdict == "pass" and result.counts["matched"] > 0
