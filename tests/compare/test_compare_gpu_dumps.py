"""Real dumps of one training step on an NVIDIA H100 and on its host CPU (tests/data/gpu_dumps,
copied byte for byte from the runs described in docs/compare-rules.md): what a user expects."""

import os

import pytest

from probe.comparison import result as R
from probe import compare

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "gpu_dumps")


def _dump(name: str) -> str:
    return os.path.join(DATA, name)


@pytest.mark.parametrize("model", ["conv", "gpt", "hf"])
def test_cpu_and_gpu_runs_of_one_model_pass_with_the_optimizer_step_compared(model):
    result = compare(_dump(f"{model}_cpu"), _dump(f"{model}_gpu"))
    counts = result.counts
    unpartnered = counts["only_a"] + counts["only_b"]
    total = counts["matched"] * 2 + unpartnered  # records of both dumps
    assert result.verdict == "pass", result.to_text()
    assert unpartnered <= 0.05 * total, counts
    # the optimizer step is compared: per-parameter ops of the CPU run paired with foreach elements
    optimizer = [row for row in result.rows if row.status in R.PAIRED and "_foreach_" in row.key_b]
    assert optimizer and all("_foreach_" not in row.key_a for row in optimizer)


def test_device_arguments_of_a_cpu_and_a_gpu_run_are_one_note():
    result = compare(_dump("hf_cpu"), _dump("hf_gpu"))
    assert not result.changes
    device_notes = [note for note in result.notes if "different devices" in note]
    assert len(device_notes) == 1 and "cpu in A, cuda:0 in B" in device_notes[0]


@pytest.mark.parametrize("reference", ["hf_gpu", "hf_cpu"])
def test_adam_amplifying_bf16_gradient_rounding_is_not_called_introduced(reference):
    result = compare(_dump(reference), _dump("hf_gpu_bf16"))
    introduced = [row for row in result.rows if row.status == R.DIVERGED and row.origin == R.INTRODUCED
                  and ("_foreach_" in row.key_b or "_foreach_" in row.key_a)]
    assert introduced == []
    addcdiv = [row for row in result.rows if row.divergence == R.OUTPUT and "_foreach_addcdiv_" in row.key]
    assert all(row.origin == R.AMPLIFIED for row in addcdiv)
