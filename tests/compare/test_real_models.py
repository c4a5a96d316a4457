"""probe compare on tiny real models trained under the debugger: clean pairs pass, the
optimizer step pairs across implementations, amplified rounding is not called introduced."""

import pytest
import torch

from probe.comparison import result as R
from probe import compare
from real_models import TinyResNet, dump_run, resnet_batch


def _unpartnered_share(result) -> float:
    counts = result.counts
    lonely = counts["only_a"] + counts["only_b"]
    return lonely / (2 * counts["matched"] + lonely)


@pytest.mark.parametrize("make", [
    pytest.param(lambda foreach: torch.optim.AdamW, id="adamw"),
    pytest.param(lambda foreach: torch.optim.SGD, id="sgd-momentum"),
])
def test_foreach_and_per_parameter_optimizer_steps_pair_and_pass(tmp_path, make):
    def optimizer(foreach):
        kwargs = {"lr": 1e-3} if make(foreach) is torch.optim.AdamW else {"lr": 0.1, "momentum": 0.9}
        return lambda params: make(foreach)(params, foreach=foreach, **kwargs)

    a = dump_run(tmp_path / "loop", TinyResNet, resnet_batch, optimizer=optimizer(False), steps=2)
    b = dump_run(tmp_path / "foreach", TinyResNet, resnet_batch, optimizer=optimizer(True), steps=2)
    for first, second in ((a, b), (b, a)):
        result = compare(first, second)
        assert result.verdict == "pass", result.to_text()
        assert _unpartnered_share(result) <= 0.05, result.counts
        paired = [row for row in result.rows if row.paired_by == "foreach"]
        assert paired, "the optimizer step was not paired"
        # every optimizer record that updates a parameter is named by it, with that parameter's shape
        names = {row.target for row in paired if row.slot == "output.0"}
        assert {"stem.weight", "block.bn2.bias", "fc.weight"} <= names
        shapes = {f"{r.module}.{r.slot[6:]}": r.shape_a for r in result.rows if r.slot.startswith("param.")}
        assert all(row.shape_a == shapes[row.target] for row in paired
                   if row.slot == "output.0" and row.target in shapes and row.shape_a != "[]")


@pytest.mark.parametrize("task", ["statistics", "checksum", "tensor"])
@pytest.mark.parametrize("variant", ["threads", "float64"])
def test_conv_batchnorm_net_trained_with_adamw_passes_against_a_correct_variant(tmp_path, task, variant):
    """Conv biases before BatchNorm get a gradient that is pure rounding noise; AdamW turns it
    into an lr-sized update. Three steps, threads 1 vs 2 and float32 vs float64: PASS."""
    a = dump_run(tmp_path / "a", TinyResNet, resnet_batch, steps=3, task=task, n_threads=1)
    if variant == "threads":
        b = dump_run(tmp_path / "b", TinyResNet, resnet_batch, steps=3, task=task, n_threads=2)
    else:
        b = dump_run(tmp_path / "b", TinyResNet, resnet_batch, steps=3, task=task, n_threads=1,
                     dtype=torch.float64)
    result = compare(a, b)
    assert result.verdict == "pass", result.to_text()


def test_fused_and_unfused_adamw_pass_and_compare_every_updated_parameter(tmp_path):
    a = dump_run(tmp_path / "loop", TinyResNet, resnet_batch, steps=3,
                 optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3, foreach=False))
    b = dump_run(tmp_path / "fused", TinyResNet, resnet_batch, steps=3,
                 optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3, fused=True))
    result = compare(a, b)
    assert result.verdict == "pass", result.to_text()
    updated = {(row.step, row.target) for row in result.rows
               if row.paired_by == "fused" and row.slot == "output.0" and row.status in R.PAIRED}
    names = {name for name, p in TinyResNet().named_parameters()}
    assert updated == {(step, name) for step in range(3) for name in names}


def test_bf16_autocast_against_float32_passes_over_steps_with_its_differences_accepted(tmp_path):
    """The forward in bf16 under autocast: every difference is within bfloat16 tolerance where
    it is made, and the parameters AdamW updates from those gradients carry it into the next
    step, where they are float32 again: accepted there too, not a changed parameter."""
    def autocast_loss(model, x, y):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(x)
        return torch.nn.functional.cross_entropy(logits.float(), y)

    a = dump_run(tmp_path / "fp32", TinyResNet, resnet_batch, steps=2)
    b = dump_run(tmp_path / "bf16", TinyResNet, resnet_batch, steps=2, loss=autocast_loss)
    result = compare(a, b)
    assert result.verdict == "pass", result.to_text()
    assert not result.changes


def test_at_module_level_a_parameter_updated_from_an_accepted_noise_gradient_is_accepted(tmp_path):
    """Level "module" records no optimizer call: the next step's conv bias differs by AdamW's
    lr-sized update of a rounding-noise gradient; the gradient was accepted, so is the bias."""
    a = dump_run(tmp_path / "a", TinyResNet, resnet_batch, steps=3, level="module", n_threads=1)
    b = dump_run(tmp_path / "b", TinyResNet, resnet_batch, steps=3, level="module", n_threads=2)
    result = compare(a, b)
    assert result.verdict == "pass", result.to_text()
    bias = [row for row in result.rows if row.key == "stem/Conv2d#0/forward/param.bias" and row.step > 0]
    assert bias and all(row.status in (R.MATCH, R.EXPLAINED) for row in bias)


def test_two_parameter_groups_pair_and_name_each_parameter_both_ways(tmp_path):
    def optimizer(foreach):
        def make(params):
            params = list(params)
            return torch.optim.AdamW([{"params": [p for p in params if p.dim() > 1], "weight_decay": 0.1},
                                      {"params": [p for p in params if p.dim() <= 1], "weight_decay": 0.0}],
                                     lr=1e-3, foreach=foreach)
        return make

    a = dump_run(tmp_path / "loop", TinyResNet, resnet_batch, steps=2, optimizer=optimizer(False))
    b = dump_run(tmp_path / "foreach", TinyResNet, resnet_batch, steps=2, optimizer=optimizer(True))
    for first, second in ((a, b), (b, a)):
        result = compare(first, second)
        assert result.verdict == "pass" and _unpartnered_share(result) <= 0.05, result.counts
        shapes = {f"{r.module}.{r.slot[6:]}": r.shape_a for r in result.rows if r.slot.startswith("param.")}
        outputs = [r for r in result.rows if r.paired_by == "foreach" and r.slot == "output.0" and r.shape_a != "[]"]
        assert outputs and all(shapes[r.target] == r.shape_a for r in outputs)


class MaskedScores(torch.nn.Module):
    """Attention-style masking as transformers 4.x writes it: the masked scores are the
    smallest value of the run's dtype (finfo.min differs between a float32 and a float64 run)."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x):
        scores = self.proj(x) @ x.transpose(-1, -2)
        mask = torch.ones(scores.shape[-2:], dtype=torch.bool).tril()
        floor = torch.full([], torch.finfo(scores.dtype).min, dtype=scores.dtype)
        return torch.where(mask, scores, floor).softmax(-1) @ x


def masked_batch():
    g = torch.Generator().manual_seed(0)
    return torch.randn(4, 6, 8, generator=g), torch.randint(0, 8, (4,), generator=g)


def test_a_dtype_limit_mask_in_float32_and_float64_runs_is_not_a_divergence(tmp_path):
    def loss(model, x, y):
        return torch.nn.functional.cross_entropy(model(x).mean(1), y)

    a = dump_run(tmp_path / "fp32", MaskedScores, masked_batch, loss=loss)
    b = dump_run(tmp_path / "fp64", MaskedScores, masked_batch, loss=loss, dtype=torch.float64)
    result = compare(a, b)
    assert result.verdict == "pass", result.to_text()
    full = [row for row in result.rows if row.op == "torch.full" and row.io == "out"]
    assert full and all(row.status in R.WITHIN for row in full)
