"""Replay keeps "introduced" where the error enters through a parameter, a buffer, the data or
an unpartnered producer, and calls an argument change what it is (tiny task-"tensor" dumps)."""

import json

import pytest
import torch
import torch.nn.functional as F

import probe
from probe.dump.reader import open_step_file
from tests.verdict_models import SmallNet, scale_fc1_weight, train


def _compare(tmp_path, build_b=SmallNet, **options):
    a = train(tmp_path / "a", **{k: v for k, v in options.items() if k == "steps"})
    b = train(tmp_path / "b", build_b, **options)
    return probe.compare(a, b, replay=5)


def test_a_scaled_weight_stays_introduced_at_its_linear_after_replay_and_json_agrees_with_the_text(tmp_path):
    result = _compare(tmp_path, fault=scale_fc1_weight)
    first = result.first_divergence
    assert (first.module, first.op, first.origin) == ("fc1", "functional.linear", "introduced")
    verdict = result.replay.verdict_for(first.step, first.rank, first.key_a)
    assert verdict["verdict"] == "rounding" and verdict["rounding"] == "enters"
    assert verdict["enters_through"]["source"] == "param"
    text = result.to_text()
    assert "no single op introduced" not in text
    assert "enters here through parameter input.1" in text
    data = json.loads(result.to_json())
    assert data["likely_cause"]["origin"] == "introduced" and data["likely_cause"]["module"] == "fc1"


def test_a_weight_bug_from_step_3_of_5_is_introduced_at_its_linear_in_step_3(tmp_path):
    result = _compare(tmp_path, steps=5, fault=scale_fc1_weight, fault_step=3)
    cause = result.likely_cause
    assert (cause.step, cause.module, cause.op, cause.origin) == (3, "fc1", "functional.linear", "introduced")
    assert "no single op introduced" not in result.to_text()


def test_an_activation_the_other_run_does_not_have_makes_the_next_op_where_the_error_enters(tmp_path):
    result = _compare(tmp_path, lambda: SmallNet(act=F.silu))
    first = result.first_divergence
    assert (first.op, first.origin) == ("functional.layer_norm", "introduced")
    verdict = result.replay.verdict_for(first.step, first.rank, first.key_a)
    assert verdict["rounding"] == "enters" and verdict["enters_through"]["source"] == "unpaired"


def test_a_changed_eps_replays_as_arguments_differ_with_both_values_never_rounding(tmp_path):
    result = _compare(tmp_path, lambda: SmallNet(eps=1e-3))
    first = result.first_divergence
    verdict = result.replay.verdict_for(first.step, first.rank, first.key_a)
    assert verdict["verdict"] == "arguments differ"
    assert "arguments differ: eps 1e-05 vs 0.001" in verdict["summary"]
    assert first.origin == "introduced"


def test_a_gelu_left_at_its_default_is_recorded_and_compared_with_the_other_runs_approximate(tmp_path):
    result = _compare(tmp_path, lambda: SmallNet(approximate="tanh"))
    first = result.first_divergence
    assert first.op == "functional.gelu" and first.origin == "introduced"
    assert first.cause == 'argument kwarg.approximate changed: "none" in A, "tanh" in B'
    verdict = result.replay.verdict_for(first.step, first.rank, first.key_a)
    assert verdict["verdict"] == "arguments differ"
    assert "approximate 'none' vs 'tanh'" in verdict["summary"]
    with open_step_file(str(tmp_path / "a" / "step0" / "rank0.h5")) as handle:
        rows = handle.records.to_dicts()
    defaults = {row["slot"]: row["value"] for row in rows if row["op"] == "functional.gelu"
                and row["slot"].startswith("default.")}
    assert defaults == {"default.approximate": '"none"'}
    # a default both runs left alone is not a record without partner
    assert result.counts["only_a"] == 0 and result.counts["only_b"] == 0


def test_same_function_on_both_sides_still_replays_as_rounding_own(tmp_path):
    a = train(tmp_path / "a")
    b = train(tmp_path / "b")
    result = probe.compare(a, b, replay=3)
    assert result.verdict == "pass"
    assert all(call["replay"]["verdict"] not in ("arguments differ",) for call in result.replay.calls)


class _Rotary(torch.nn.Module):
    """Rotary-style frequencies held in a buffer made from theta (Llama's inv_freq)."""

    def __init__(self, theta):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / theta ** (torch.arange(0, 16, 2).float() / 16))
        self.fc = torch.nn.Linear(16, 4)

    def forward(self, x):
        angles = torch.outer(torch.arange(x.shape[0]).float(), self.inv_freq)
        return self.fc(x * torch.cat((angles, angles), dim=-1).cos())


def test_a_changed_theta_buffer_is_where_the_error_enters_in_replay_too(tmp_path):
    a = train(tmp_path / "a", lambda: _Rotary(10000.0))
    b = train(tmp_path / "b", lambda: _Rotary(500000.0))
    result = probe.compare(a, b, replay=5)
    first = result.first_divergence
    assert (first.op, first.origin) == ("torch.outer", "introduced")
    verdict = result.replay.verdict_for(first.step, first.rank, first.key_a)
    assert verdict["rounding"] == "enters" and verdict["enters_through"]["source"] == "external"
    assert "no single op introduced" not in result.to_text()
