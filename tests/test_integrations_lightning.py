"""probe.integrations.lightning.ProbeCallback: a Lightning Trainer dumps one step file per
optimizer step (examples/trainers/lightning_trainer.py: a small MLP, 3 steps, CPU)."""

import collections

import pytest

pytest.importorskip("lightning", reason="Lightning is not installed: pip install -e '.[lightning]'")

import probe  # noqa: E402
from examples.trainers import lightning_trainer  # noqa: E402


def test_every_optimizer_step_of_the_lightning_trainer_is_one_step_file(tmp_path):
    lightning_trainer.train(str(tmp_path / "a"), str(tmp_path / "trainer"))
    dump = probe.load(str(tmp_path / "a"))
    assert dump.steps == [0, 1, 2] and dump.ranks == [0]
    assert {"net.0", "net.1", "net.3"} <= {record["module"] for record in dump.records(step=1)}


def test_lightning_accumulation_puts_every_micro_batch_in_its_optimizer_steps_file(tmp_path):
    lightning_trainer.train(str(tmp_path / "acc"), str(tmp_path / "trainer"), steps=2,
                            accumulation=3, level="module")
    dump = probe.load(str(tmp_path / "acc"))
    assert dump.steps == [0, 1]
    for step in dump.steps:
        calls = collections.Counter(record["index"] for record in dump.records(step=step)
                                    if record["module"] == "net" and record["phase"] == "forward")
        assert sorted(calls) == [0, 1, 2], (step, calls)
