"""Fingerprints of a chaotic training: PPO on CartPole at lr 3e-2 (tests/ppo_runs.py), the plain
CPU run against the same run with another device's rounding. The two part by drift within
two or three updates; later a PPO ratio crosses its clip bound in one run and not the other, and the
policies sample other actions (new rollouts): gradients then grow hundreds of times in one
step. None of that is a jump; a weight changed by a bug after the runs drifted still is."""

import numpy as np
import pytest

from tests import ppo_runs as training
from probe.fingerprint import compare, file, report
from probe.fingerprint.live import LiveReference

pytest.importorskip("gymnasium", reason="the PPO runs need gymnasium: pip install -e '.[examples]'")

LR = 3e-2
STEPS_PER_UPDATE = 8  # a rollout of 128 environment steps, 4 epochs of 2 minibatches
UPDATES = 11  # 88 update steps: the rollouts part at update 10 (step 80) on torch 2.13
#: the weight bug comes this many steps after the runs part by drift (step 13 on torch 2.13, 18 on
#: 2.4.1): soon, for the drift grows about 1.2x a step, and by step 32 on 2.13 (28 on 2.4.1) it
#: is over a tenth of the 1e-3 the bug makes, which then hides in it
AFTER_PARTING = 2


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ppo")
    paths = {name: str(folder / name) for name in ("plain", "other", "weight", "eps")}
    training.train(paths["plain"], UPDATES, LR)
    training.train(paths["other"], UPDATES, LR, other=True)
    parting = compare.compare(_read(paths["plain"]), _read(paths["other"])).parting_step
    assert parting is not None, "the rounding-only pair never parted: the tests show nothing"
    paths["fault_step"] = fault = parting + AFTER_PARTING
    training.train(paths["weight"], fault // STEPS_PER_UPDATE + 1, LR, other=True, fault=("weight", fault))
    training.train(paths["eps"], 1, LR, fault=("eps", 0))
    return paths


def _read(path):
    return file.read(file.find_file(path))


def test_rounding_only_ppo_at_lr_3e_2_drifts_and_what_grows_fast_after_is_inherited_not_a_jump(runs):
    result = compare.compare(_read(runs["plain"]), _read(runs["other"]))
    assert result.parting_kind == "drift", "the pair never parted: the test shows nothing"
    assert result.jump_step is None and result.verdict == "pass", [(t.name, t.step) for t in result.jumped]
    assert result.inherited_step is not None, "nothing grew fast after parting: the test shows nothing"
    assert "Inherited, not a jump." in report.terminal(result)


def test_a_weight_scaled_by_1_001_after_the_runs_drifted_jumps_at_exactly_that_step(runs):
    result = compare.compare(_read(runs["plain"]), _read(runs["weight"]))
    assert result.parting_step < runs["fault_step"] and result.parting_kind == "drift"
    assert result.jump_step == runs["fault_step"] and result.verdict == "diverged"
    assert [t.name for t in result.jumped] == ["param/policy.2.weight"]


def test_an_adam_eps_bug_jumps_at_step_0(runs):
    result = compare.compare(_read(runs["plain"]), _read(runs["eps"]))
    assert result.jump_step == 0 and result.parting_kind == "jump"
    assert all(t.kind == "param" for t in result.jumped)


def _live_jumps(reference: str, candidate: str) -> list:
    """Replays the candidate's fingerprints through the live comparison, step by step."""
    prints = _read(candidate)
    described = {entry["name"]: entry for entry in prints.tensors}
    live = LiveReference(reference, 0, say=lambda text: None)
    jumps = []
    for row, step in enumerate(prints.steps):
        rows = [(entry["name"], prints.numbers[row, column], prints.sketch[row, column])
                for column, entry in enumerate(prints.tensors) if not np.isnan(prints.numbers[row, column, 4])]
        verdict = live.check(int(step), rows, described, float(prints.compute_unit[row]))
        jumps += [(int(step), name) for name, *_ in verdict.jumped]
    live.close()
    return jumps


def test_the_live_comparison_judges_inherited_growth_as_the_offline_compare_does(runs):
    assert _live_jumps(runs["plain"], runs["other"]) == []
    assert _live_jumps(runs["plain"], runs["weight"])[0] == (runs["fault_step"], "param/policy.2.weight")
