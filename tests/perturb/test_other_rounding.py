"""probe.perturb.other_rounding: the same math, summed in another order."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from probe.config import Config
from probe.debugger import PrecisionDebugger
from probe.dump.reader import load
from probe.perturb import OtherRounding, other_rounding

torch.manual_seed(0)
X = torch.randn(4, 9, 96)
W = torch.randn(48, 96)
B = torch.randn(48)
IMAGES = torch.randn(2, 12, 7, 7)
KERNEL = torch.randn(5, 12, 3, 3)

CALLS = {
    "linear": lambda: F.linear(X, W, B),
    "matmul": lambda: torch.matmul(X, W.T),
    "operator @": lambda: X @ W.T,
    "vector @ matrix": lambda: W[0] @ X[0].T,
    "bmm": lambda: torch.bmm(X, X.transpose(1, 2)),
    "conv2d": lambda: F.conv2d(IMAGES, KERNEL, torch.randn(5), padding=1),
    "sum": lambda: X.sum(),
    "sum over a dim": lambda: torch.sum(X, 1),
    "mean keepdim": lambda: X.mean((0, 2), keepdim=True),
}


@pytest.mark.parametrize("name", list(CALLS))
def test_each_reduction_keeps_shape_and_dtype_and_differs_only_by_rounding(name):
    torch.manual_seed(1)
    plain = CALLS[name]()
    torch.manual_seed(1)
    with other_rounding():
        other = CALLS[name]()
    assert other.shape == plain.shape and other.dtype == plain.dtype
    scale = plain.abs().max().item()
    assert (other - plain).abs().max().item() <= 1e-5 * scale
    if name not in ("vector @ matrix",):  # some short dot products happen to round alike
        assert not torch.equal(other, plain), "the order of summation must change"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_products_are_rounded_once_like_a_tensor_core(dtype):
    x, w = X.to(dtype), W.to(dtype)
    plain = F.linear(x, w)
    with other_rounding():
        other = F.linear(x, w)
    assert other.dtype == dtype
    # accumulated in float32 and rounded once: at most one unit in the last place apart
    ulp = torch.finfo(dtype).eps * plain.float().abs()
    assert ((other.float() - plain.float()).abs() <= ulp + 1e-6).all()


def test_autocast_inputs_are_cast_as_autocast_casts_them():
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain = F.linear(X, W, B)
        with other_rounding():
            other = F.linear(X, W, B)
    assert other.dtype == plain.dtype == torch.bfloat16
    relative = ((other.float() - plain.float()).norm() / plain.float().norm()).item()
    assert relative < 2e-3


def test_gradients_differ_by_rounding_only():
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 10))
    batch = torch.randn(16, 64)
    model(batch).square().mean().backward()
    plain = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    with other_rounding():
        model(batch).square().mean().backward()
    moved = 0
    for param, before in zip(model.parameters(), plain):
        gap = (param.grad - before).norm().item()
        assert gap <= 1e-5 * before.norm().item()
        moved += gap > 0
    assert moved > 0


def test_integer_sums_and_out_arguments_pass_through_unchanged():
    counts = torch.arange(100)
    with other_rounding():
        assert torch.equal(counts.sum(), torch.arange(100).sum())
        out = torch.empty(9, 48)
        torch.matmul(X[0], W.T, out=out)
    assert torch.equal(out, torch.matmul(X[0], W.T))


def test_fewer_than_two_chunks_is_refused():
    with pytest.raises(ValueError, match="chunks"):
        OtherRounding(1)


def test_capture_entered_inside_it_records_the_same_keys_as_a_plain_run(tmp_path):
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
    batch = torch.randn(8, 32)

    def keys(path, perturbed):
        debugger = PrecisionDebugger(Config(dump_path=str(path), level="mix"))
        if perturbed:
            with other_rounding(), debugger.capture(model):
                model(batch).sum().backward()
        else:
            with debugger.capture(model):
                model(batch).sum().backward()
        return sorted(row["key"] for row in load(path).records(step=0))

    plain = keys(tmp_path / "plain", False)
    other = keys(tmp_path / "other", True)
    assert plain == other
