"""A bfloat16 model: the likely cause is where the error entered, even within tolerance, not the
first op beyond tolerance downstream; lower precision inside a norm or a rotary embedding is a
precision finding at its first op."""

import pytest
import torch

import probe
from tests.verdict_models import TinyAttention, tokens, train

OPTIONS = dict(steps=1, data=tokens, task="statistics", lr=1e-3, dtype=torch.bfloat16)


def _scale_qkv(model):
    with torch.no_grad():
        model.qkv.weight.mul_(1.005)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return train(tmp_path_factory.mktemp("bf16") / "a", lambda: TinyAttention(sharpness=8.0), **OPTIONS)


def test_a_weight_off_by_half_a_percent_in_bf16_is_the_likely_cause_not_the_op_beyond_tolerance(reference, tmp_path):
    b = train(tmp_path / "b", lambda: TinyAttention(sharpness=8.0), fault=_scale_qkv, **OPTIONS)
    result = probe.compare(reference, b)
    assert result.verdict == "diverged"
    cause = result.likely_cause
    assert (cause.module, cause.op, cause.phase, cause.origin) == ("qkv", "functional.linear", "forward", "introduced")
    assert cause.status != "diverged"  # within (or at) tolerance where it entered
    assert "enters here within tolerance" in cause.cause and "units of bfloat16 roundoff" in cause.cause
    text = result.to_text()
    assert "no single op introduced" not in text


def test_a_norm_without_its_float32_upcast_is_a_precision_finding_at_its_first_op(reference, tmp_path):
    """Its values stay within bfloat16's rounding envelope: a finding in the headline, exit 0."""
    b = train(tmp_path / "b", lambda: TinyAttention(sharpness=8.0, upcast_norm=False), **OPTIONS)
    result = probe.compare(reference, b)
    headline = result.to_text().splitlines()[0]
    assert result.verdict == "pass", headline
    assert "precision finding: B computes <root> Tensor.pow in bfloat16 where A uses float32" in headline


def test_the_same_bf16_model_twice_passes_with_no_likely_cause(reference, tmp_path):
    result = probe.compare(reference, train(tmp_path / "b", lambda: TinyAttention(sharpness=8.0), **OPTIONS))
    assert result.verdict == "pass" and result.likely_cause is None
