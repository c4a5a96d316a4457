"""Drift through data the model makes: PPO on CartPole (tests/ppo_runs.py) at lr 5e-2, every
update step dumped with statistics, against the same run with another device's rounding.
The drifted policy samples other actions, so the rollouts (the steps' inputs) part; every op
after that reads other data. That is drift that passes, with no likely cause; a changed
argument after the data parted is still named at its step."""

import pytest
import torch

import probe
from tests import ppo_runs

pytest.importorskip("gymnasium", reason="the PPO runs need gymnasium: pip install -e '.[examples]'")

UPDATES = 30  # one update step per rollout of 32 environment steps
LR = 5e-2
FAULT_STEP = 27  # Adam's eps 1e-6 instead of 1e-8 from here on


def _train(path, **options):
    return ppo_runs.train(str(path), UPDATES, lr=LR, config={"task": "statistics", "level": "mix"},
                          rollout_steps=32, epochs=1, minibatch=32, **options)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("drift_data")
    returns = {"a": _train(folder / "a"), "b": _train(folder / "b", other=True),
               "fault": _train(folder / "fault", other=True, fault=("eps", FAULT_STEP))}
    return folder, returns


def _parted_or_skip(returns) -> None:
    if returns["a"] == returns["b"]:  # measured on torch 2.4.1: this torch's kernels drift less
        pytest.skip(f"on torch {torch.__version__} the rollouts did not part in {UPDATES} updates: "
                    "no data made by a drifted policy to judge")


def test_rollouts_that_part_because_the_policy_drifted_are_drift_that_passes(runs):
    folder, returns = runs
    _parted_or_skip(returns)
    result = probe.compare(folder / "a", folder / "b")
    assert result.verdict == "pass", result.to_text()[:2000]
    assert result.likely_cause is None and result.first_divergence is None


def test_a_changed_eps_after_the_rollouts_parted_is_named_at_its_step(runs):
    folder, returns = runs
    _parted_or_skip(returns)
    result = probe.compare(folder / "a", folder / "fault")
    assert result.verdict == "diverged"
    assert result.first_divergence.step < FAULT_STEP, "the data had not parted before the fault"
    cause = result.likely_cause
    assert cause is not None and cause.step == FAULT_STEP, result.to_text()[:2000]
    assert "changed: 1e-08 in A, 1e-06 in B" in cause.cause


def test_the_optimizer_updates_of_a_one_element_bias_are_named_by_it(runs):
    """The value head's [1] bias: its Adam calls link to it by their statistics, as a
    matrix's do (drift checks each parameter against what its last update wrote)."""
    folder, _ = runs
    result = probe.compare(folder / "a" / "step3", folder / "b" / "step3", keep_rows=100_000)
    named = {row.target for row in result.rows if row.op == "Tensor.addcdiv_"}
    assert "value.4.bias" in named and "" not in named
