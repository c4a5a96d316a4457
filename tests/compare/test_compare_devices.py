"""Where a tensor lives is not a numerical difference: device arguments across runs."""

import numpy as np
import pytest

from probe.comparison import result as R
from probe.comparison import story
from probe.comparison.api import compare
from probe.comparison.api import compare_step
from probe.comparison.structs import StepInput
from probe.comparison.tolerances import Tolerances
from test_compare_support import SyntheticRun, write_step


def _placement_runs():
    runs = []
    for device in ("cpu", "cuda:0"):
        run = SyntheticRun(task="statistics")
        positions = np.arange(8)
        x = np.linspace(-1, 1, 8).astype(np.float32)
        run.call("", "torch.arange", {"input.0": 8, "kwarg.device": device, "output.0": positions})
        run.call("", "Tensor.to", {"input.0": x, "input.1": device, "kwarg.non_blocking": device != "cpu",
                                   "output.0": x})
        run.call("", "torch.tensor", {"input.0": 1.0, "kwarg.device": f"device(type='{device.split(':')[0]}')",
                                      "kwarg.pin_memory": device != "cpu", "output.0": np.ones(1, np.float32)})
        if device != "cpu":
            run.call("", "Tensor.cuda", {"input.0": x, "output.0": x})
        run.call("", "torch.relu", {"input.0": x, "output.0": np.maximum(x, 0)})
        runs.append(run)
    return runs


def test_device_arguments_are_never_a_changed_argument_or_a_divergence():
    a, b = _placement_runs()
    outcome = compare_step(StepInput(a.records(), b.records(), None, None), Tolerances())
    assert not outcome.diverged and story.first_divergence(outcome.rows) is None
    placement = [row for row in outcome.rows if any(n.startswith(R.PLACEMENT_NOTE) for n in row.notes)]
    assert {row.slot for row in placement} == {"kwarg.device", "input.1", "kwarg.non_blocking", "kwarg.pin_memory"}
    assert all(row.status == R.MATCH for row in placement)


def test_a_changed_string_that_is_no_device_still_diverges():
    a, b = SyntheticRun(task="statistics"), SyntheticRun(task="statistics")
    x = np.linspace(-1, 1, 8).astype(np.float32)
    a.call("", "functional.gelu", {"input.0": x, "kwarg.approximate": "none", "output.0": x})
    b.call("", "functional.gelu", {"input.0": x, "kwarg.approximate": "cpu", "output.0": (x * 1.001).astype(np.float32)})
    outcome = compare_step(StepInput(a.records(), b.records(), None, None), Tolerances())
    first = story.first_divergence(outcome.rows)
    assert outcome.diverged and "kwarg.approximate changed" in first.cause


def test_runs_on_two_devices_get_one_device_note(tmp_path):
    a, b = _placement_runs()
    write_step(a, tmp_path / "a", device="cpu")
    write_step(b, tmp_path / "b", device="cuda:0")
    result = compare(tmp_path / "a", tmp_path / "b")
    assert result.verdict == "pass" and not result.changes
    device_notes = [note for note in result.notes if "device" in note]
    assert len(device_notes) == 1
    assert "cpu in A, cuda:0 in B" in device_notes[0] and "5 placement arguments" in device_notes[0]
    assert "1 device move (Tensor.cuda" in device_notes[0] and result.counts["only_b"] == 2


def test_tensors_on_other_devices_per_record_are_the_same_one_note(tmp_path):
    """The root attributes agree (the first device seen), the records do not: still one note."""
    a, b = _placement_runs()
    for row in b.rows:
        if row["dtype"]:
            row["device"] = "cuda:0"
    write_step(a, tmp_path / "a", device="cpu")
    write_step(b, tmp_path / "b", device="cpu")
    result = compare(tmp_path / "a", tmp_path / "b")
    assert result.verdict == "pass"
    device_notes = [note for note in result.notes if "different devices" in note]
    assert len(device_notes) == 1 and "cpu in A, cuda:0 in B" in device_notes[0]
