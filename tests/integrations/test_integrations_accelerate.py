"""probe.integrations.accelerate.AcceleratorCapture: an accelerate loop with gradient
accumulation dumps one step file per optimizer step (examples/trainers/accelerate_loop.py)."""

import pytest

pytest.importorskip("accelerate", reason="accelerate is not installed: pip install -e '.[accelerate]'")

from examples.trainers import accelerate_loop  # noqa: E402
from tests.step_checks import assert_each_step_holds_micro_batches  # noqa: E402


def test_an_accelerate_loop_dumps_each_optimizer_step_with_its_micro_batches(tmp_path):
    accelerate_loop.train(str(tmp_path / "dump"), steps=3, accumulation=2, level="module")
    assert_each_step_holds_micro_batches(tmp_path / "dump", 3, "0", 2)
