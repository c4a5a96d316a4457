"""probe.integrations.hf.ProbeCallback: a transformers Trainer dumps one step file per
optimizer step (examples/trainers/hf_trainer.py: a tiny GPT-2 from a config, 3 steps)."""

import pytest

from tests.torch_versions import transformers_or_skip

transformers_or_skip()
pytest.importorskip("accelerate", reason="the transformers Trainer needs accelerate: "
                    "pip install -e '.[hf]'")

import probe  # noqa: E402
from examples.trainers import hf_trainer  # noqa: E402
from tests.step_checks import assert_each_step_holds_micro_batches  # noqa: E402


@pytest.fixture(scope="module")
def reference_dump(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    hf_trainer.train(str(root / "a"), str(root / "trainer"))
    return str(root / "a")


def test_every_optimizer_step_of_the_trainer_is_one_step_file_with_module_names(reference_dump):
    dump = assert_each_step_holds_micro_batches(reference_dump, 3, "", 1)
    assert dump.ranks == [0]
    modules = {record["module"] for record in dump.records(step=2)}
    assert {"transformer.h.0.attn", "transformer.h.1.mlp.c_fc", "transformer.ln_f"} <= modules


def test_two_identical_trainer_runs_compare_as_pass(reference_dump, tmp_path):
    hf_trainer.train(str(tmp_path / "b"), str(tmp_path / "trainer"))
    result = probe.compare(reference_dump, str(tmp_path / "b"))
    assert result.verdict == "pass" and result.counts["matched"] > 0


def test_a_layer_norm_epsilon_change_is_named_at_a_layer_norm(reference_dump, tmp_path):
    hf_trainer.train(str(tmp_path / "eps"), str(tmp_path / "trainer"), layer_norm_epsilon=1e-2)
    result = probe.compare(reference_dump, str(tmp_path / "eps"))
    assert result.verdict == "diverged"
    assert "ln_" in result.first_divergence.module, result.first_divergence


def test_gradient_accumulation_puts_every_micro_batch_in_its_optimizer_steps_file(tmp_path):
    hf_trainer.train(str(tmp_path / "acc"), str(tmp_path / "trainer"), accumulation=4,
                     steps=2, level="module")
    assert_each_step_holds_micro_batches(tmp_path / "acc", 2, "", 4)


def test_the_step_files_carry_the_trainers_process_index_as_rank(tmp_path, monkeypatch):
    # $RANK is what a debugger reads outside torch.distributed; the Trainer's process index
    # (0 here: one process) must win
    monkeypatch.setenv("RANK", "3")
    trainer = hf_trainer.train(str(tmp_path / "d"), str(tmp_path / "trainer"), steps=1,
                               level="module")
    assert trainer.args.process_index == 0
    assert probe.load(str(tmp_path / "d")).ranks == [0]
