"""probe.integrations.lightning.ProbeCallback: a Lightning Trainer dumps one step file per
optimizer step (examples/trainers/lightning_trainer.py: a small MLP, 3 steps, CPU)."""

import pytest

pytest.importorskip("lightning", reason="Lightning is not installed: pip install -e '.[lightning]'")

from tests.step_checks import assert_each_step_holds_micro_batches  # noqa: E402
from examples.trainers import lightning_trainer  # noqa: E402


def test_every_optimizer_step_of_the_lightning_trainer_is_one_step_file(tmp_path):
    lightning_trainer.train(str(tmp_path / "a"), str(tmp_path / "trainer"))
    dump = assert_each_step_holds_micro_batches(tmp_path / "a", 3, "net", 1)
    assert dump.ranks == [0]
    assert {"net.0", "net.1", "net.3"} <= {record["module"] for record in dump.records(step=1)}


def test_lightning_accumulation_puts_every_micro_batch_in_its_optimizer_steps_file(tmp_path):
    lightning_trainer.train(str(tmp_path / "acc"), str(tmp_path / "trainer"), steps=2,
                            accumulation=3, level="module")
    assert_each_step_holds_micro_batches(tmp_path / "acc", 2, "net", 3)
