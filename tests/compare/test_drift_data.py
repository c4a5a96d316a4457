"""Drift through data the model makes: PPO on CartPole (tests/ppo_runs.py) at lr 3e-2, every
update step dumped with statistics, against the same run with another device's rounding.
The drifted policy samples other actions, so the rollouts (the steps' inputs) part; every op
after that reads other data. That is drift that passes, with no likely cause; a changed
argument after the data parted is still named at its step."""

import pytest

import probe
from tests import ppo_runs

pytest.importorskip("gymnasium", reason="the PPO runs need gymnasium: pip install -e '.[examples]'")

#: one update step per rollout of 128 environment steps. The rollouts part at update 13 on
#: torch 2.4.1 and 19 on 2.13 and 2.15: at this lr the policy stays stochastic while the drift
#: grows, and 128 samples an update let it reach an action soon. (At lr 5e-2 with rollouts of
#: 32 the policy turned deterministic within 14 updates on 2.4.1, the drift stopped growing
#: at 1e-4 and no action ever differed.)
UPDATES = 24
LR = 3e-2
ROLLOUT = 128
FAULT_STEP = 22  # Adam's eps 1e-6 instead of 1e-8 from here on


def _train(path, **options):
    return ppo_runs.train(str(path), UPDATES, lr=LR, config={"task": "statistics", "level": "mix"},
                          rollout_steps=ROLLOUT, epochs=1, minibatch=ROLLOUT, **options)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("drift_data")
    returns = {"a": _train(folder / "a"), "b": _train(folder / "b", other=True),
               "fault": _train(folder / "fault", other=True, fault=("eps", FAULT_STEP))}
    assert returns["a"] != returns["b"], f"the rollouts did not part in {UPDATES} updates: the tests show nothing"
    return folder, returns


def test_rollouts_that_part_because_the_policy_drifted_are_drift_that_passes(runs):
    folder, _ = runs
    result = probe.compare(folder / "a", folder / "b")
    assert result.verdict == "pass", result.to_text()[:2000]
    assert result.likely_cause is None and result.first_divergence is None


def test_a_changed_eps_after_the_rollouts_parted_is_named_at_its_step(runs):
    folder, _ = runs
    result = probe.compare(folder / "a", folder / "fault")
    assert result.verdict == "diverged"
    assert result.first_divergence.step < FAULT_STEP, "the data had not parted before the fault"
    cause = result.likely_cause
    assert cause is not None and cause.step == FAULT_STEP, result.to_text()[:2000]
    # named at the Adam call it changed, or at the argument itself where every such call's
    # other input had already parted (torch 2.4.1: the data parted nine updates before)
    assert "1e-08 in A, 1e-06 in B" in " ".join([cause.cause, *cause.reasons]), result.to_text()[:2000]


def test_the_optimizer_updates_of_a_one_element_bias_are_named_by_it(runs):
    """The value head's [1] bias: its Adam calls link to it by their statistics, as a
    matrix's do (drift checks each parameter against what its last update wrote)."""
    folder, _ = runs
    result = probe.compare(folder / "a" / "step3", folder / "b" / "step3", keep_rows=100_000)
    named = {row.target for row in result.rows if row.op == "Tensor.addcdiv_"}
    assert "value.4.bias" in named and "" not in named
