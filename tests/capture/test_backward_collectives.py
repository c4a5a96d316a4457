"""API level in backward: with a process group, a backward pass runs with the capture mode on
the mode stack, so the collectives its hooks launch (FSDP2's reduce-scatter, a user's gradient
all-reduce) are recorded, while every other call in backward passes through unrecorded and
the gradients stay bit-identical.

One process, a gloo group of world size 1 (the 2-rank FSDP2 runs are in test_sharded.py).
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from probe.capture.eager import backward_collectives
from probe.config import Config
from probe.debugger.debugger import PrecisionDebugger
from probe.dump.reader import load

pytestmark = pytest.mark.skipif(
    not dist.is_available() or not backward_collectives.available(),
    reason=f"torch {torch.__version__} lacks torch.distributed, or the autograd engine entry "
           "(torch.autograd.graph._engine_run_backward) probe starts a backward through; its "
           "backward collectives are then not recorded (docs/capture.md, Collectives)")


@pytest.fixture
def group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _loss(model, x):
    return model(x).square().mean()


BACKWARD_CALLS = {
    "tensor": lambda loss, params: loss.backward(),
    "tensor_gradient": lambda loss, params: (loss * 3).backward(torch.tensor(0.5)),
    "retain_twice": lambda loss, params: (loss.backward(retain_graph=True), loss.backward()),
    "autograd_list": lambda loss, params: torch.autograd.backward([loss, loss * 2], [None, None]),
    "autograd_inputs": lambda loss, params: torch.autograd.backward(loss, inputs=params[:2]),
    "generator": lambda loss, params: torch.autograd.backward(t for t in (loss,)),
}


@pytest.mark.parametrize("form", sorted(BACKWARD_CALLS))
def test_gradients_are_bit_identical_with_and_without_the_mode_in_backward(tmp_path, group, form):
    x = torch.randn(5, 6)
    plain = _model()
    BACKWARD_CALLS[form](_loss(plain, x), list(plain.parameters()))
    captured = _model()
    debugger = PrecisionDebugger(Config(dump_path=str(tmp_path / "dump"), level="api"))
    with debugger.capture(captured):
        BACKWARD_CALLS[form](_loss(captured, x), list(captured.parameters()))
    for mine, theirs in zip(captured.parameters(), plain.parameters()):
        assert (mine.grad is None) == (theirs.grad is None)
        if mine.grad is not None:
            assert torch.equal(mine.grad, theirs.grad)


def test_a_collective_in_a_gradient_hook_is_recorded_and_other_hook_code_is_not(tmp_path, group):
    from probe.compat import uncaptured_collectives

    if "all_reduce" in uncaptured_collectives():
        pytest.skip(f"torch {torch.__version__} runs dist.all_reduce without asking a TorchFunctionMode")
    model = _model()

    def reduce_gradient(grad):
        grad = grad.clone() * 1.0  # hook code: not recorded
        dist.all_reduce(grad)
        return grad

    debugger = PrecisionDebugger(Config(dump_path=str(tmp_path / "dump"), level="api"))
    with debugger.capture(model):
        hidden = model[0](torch.randn(5, 6))
        hidden.register_hook(reduce_gradient)
        model[2](model[1](hidden)).sum().backward()
    rows = load(tmp_path / "dump").records(step=0)
    ops = [row["op"] for row in rows if row["slot"] == "output.0"]
    assert "distributed.all_reduce" in ops
    assert "Tensor.clone" not in ops and "Tensor.mul" not in ops
    reduced = next(row for row in rows if row["op"] == "distributed.all_reduce" and row["slot"] == "output.0")
    forward_ends = max(row["seq"] for row in rows if row["op"] == "Tensor.sum")
    assert reduced["seq"] > forward_ends  # recorded where backward ran it


def test_checkpoint_recomputation_in_backward_records_nothing_more(tmp_path, group):
    def run(folder):
        model = _model()
        debugger = PrecisionDebugger(Config(dump_path=str(folder), level="api"))
        with debugger.capture(model):
            x = torch.randn(5, 6, requires_grad=True)
            checkpoint(model, x, use_reentrant=False).sum().backward()
        return sorted(row["key"] for row in load(folder).records(step=0))

    with_group = run(tmp_path / "with_group")
    dist.destroy_process_group()
    try:
        without_group = run(tmp_path / "without_group")
    finally:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store2'}", rank=0, world_size=1)
    assert with_group == without_group


def test_without_a_process_group_backward_is_left_to_torch(tmp_path):
    from probe.capture.eager.api_mode import ApiCaptureMode
    from probe.capture.recorder import Recorder

    assert not dist.is_initialized()
    assert ApiCaptureMode(Recorder(Config(dump_path=str(tmp_path)))).reenter_backward is False
