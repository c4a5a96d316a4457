"""Fingerprints of a chaotic training: PPO on CartPole at lr 3e-2 (tests/ppo_runs.py), the plain
CPU run against the same run with another device's rounding. The two part by drift within a
few steps; later a PPO ratio crosses its clip bound in one run and not the other, and the
policies sample other actions (new rollouts): gradients then grow hundreds of times in one
step. None of that is a jump; a weight changed by a bug after the runs drifted still is."""

import numpy as np
import pytest

from tests import ppo_runs as training
from tests.torch_versions import ppo_rounding_parts_by_a_jump
from probe.fingerprint import compare, file, report
from probe.fingerprint.live import LiveReference

pytest.importorskip("gymnasium", reason="the PPO runs need gymnasium: pip install -e '.[examples]'")

#: where fingerprints still false-alarm: strict, so the test fails once they no longer do
KNOWN_JUMP = pytest.mark.xfail(ppo_rounding_parts_by_a_jump() is not None, reason=str(ppo_rounding_parts_by_a_jump()),
                               strict=True)

LR = 3e-2
UPDATES = 11  # 88 update steps: the rollouts part at update 10 (step 80) on torch 2.13
FAULT_STEP = 10


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ppo")
    variants = {"plain": (UPDATES, {}), "other": (UPDATES, {"other": True}),  # the faults: as long as needed
                "weight": (2, {"other": True, "fault": ("weight", FAULT_STEP)}), "eps": (1, {"fault": ("eps", 0)})}
    paths = {}
    for name, (updates, options) in variants.items():
        paths[name] = str(folder / name)
        training.train(paths[name], updates, LR, **options)
    return paths


def _read(path):
    return file.read(file.find_file(path))


@KNOWN_JUMP
def test_rounding_only_ppo_at_lr_3e_2_drifts_and_what_grows_fast_after_is_inherited_not_a_jump(runs):
    result = compare.compare(_read(runs["plain"]), _read(runs["other"]))
    assert result.parting_kind == "drift", "the pair never parted: the test shows nothing"
    assert result.jump_step is None and result.verdict == "pass", [(t.name, t.step) for t in result.jumped]
    assert result.inherited_step is not None, "nothing grew fast after parting: the test shows nothing"
    assert "Inherited, not a jump." in report.terminal(result)


@KNOWN_JUMP
def test_a_weight_scaled_by_1_001_after_the_runs_drifted_jumps_at_exactly_that_step(runs):
    result = compare.compare(_read(runs["plain"]), _read(runs["weight"]))
    assert result.parting_step < FAULT_STEP and result.parting_kind == "drift"
    assert result.jump_step == FAULT_STEP and result.verdict == "diverged"
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


@KNOWN_JUMP
def test_the_live_comparison_judges_inherited_growth_as_the_offline_compare_does(runs):
    assert _live_jumps(runs["plain"], runs["other"]) == []
    assert _live_jumps(runs["plain"], runs["weight"])[0] == (FAULT_STEP, "param/policy.2.weight")
