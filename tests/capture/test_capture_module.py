"""Module level: inputs/outputs of every module, parameters, gradients, nested outputs."""

import collections

import pytest
import torch
import torch.nn as nn

from probe.config import Config
from probe.debugger.debugger import PrecisionDebugger
from probe.dump.reader import load


def _records(tmp_path, model, run, level="module", **config):
    debugger = PrecisionDebugger(Config(dump_path=str(tmp_path), level=level, **config))
    with debugger.capture(model):
        run()
    return {row["key"]: row for row in load(tmp_path).records(step=0)}


def test_module_level_records_every_module_its_parameters_and_their_gradients(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(inplace=True), nn.Linear(3, 2))
    x = torch.randn(5, 4)
    records = _records(tmp_path, model, lambda: model(x).square().sum().backward())
    for path, kind in (("", "Sequential"), ("0", "Linear"), ("1", "ReLU"), ("2", "Linear")):
        assert f"{path}/{kind}#0/forward/input.0" in records
        assert f"{path}/{kind}#0/forward/output.0" in records
    weight = records["0/Linear#0/forward/param.weight"]
    assert weight["kind"] == "param" and weight["io"] == "in"
    assert weight["norm"] == pytest.approx(model[0].weight.detach().norm().item(), rel=1e-6)
    for path in ("0", "2"):
        for name in ("weight", "bias"):
            row = records[f"{path}/Linear#0/backward/param_grad.{name}"]
            grad = getattr(model[int(path)], name).grad
            assert (row["kind"], row["phase"], row["io"]) == ("param", "backward", "out")
            assert row["norm"] == pytest.approx(grad.norm().item(), rel=1e-6)
            assert (row["min"], row["max"]) == (grad.min().item(), grad.max().item())
    # parameter gradients land in backward order: the last layer's first
    assert records["2/Linear#0/backward/param_grad.weight"]["seq"] < \
        records["0/Linear#0/backward/param_grad.weight"]["seq"]
    assert not any(row["kind"] == "api" for row in records.values())


def test_module_backward_records_grad_output_and_grad_input(tmp_path):
    model = nn.Sequential(nn.Linear(3, 3), nn.Tanh())
    x = torch.randn(2, 3, requires_grad=True)
    captured = {}
    model[1].register_full_backward_hook(lambda m, gi, go: captured.update(gi=gi[0], go=go[0]))
    # the reference hook above is the user's own; probe must coexist with it
    records = _records(tmp_path, model, lambda: model(x).mul(3.0).sum().backward())
    grad_output = records["1/Tanh#0/backward/grad_output.0"]
    assert grad_output["min"] == grad_output["max"] == 3.0
    grad_input = records["1/Tanh#0/backward/grad_input.0"]
    assert grad_input["norm"] == pytest.approx(captured["gi"].norm().item(), rel=1e-6)
    assert records["/Sequential#0/backward/grad_input.0"]["norm"] == pytest.approx(
        x.grad.norm().item(), rel=1e-6)
    assert grad_output["seq"] < grad_input["seq"]


def test_in_place_relu_module_still_trains_at_module_level(tmp_path):
    """torch's full backward hooks would raise here; probe's tensor hooks must not."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(inplace=True), nn.Linear(4, 1))
    x = torch.randn(3, 4)
    reference = nn.Sequential(nn.Linear(4, 4), nn.ReLU(inplace=True), nn.Linear(4, 1))
    reference.load_state_dict(model.state_dict())
    reference(x).sum().backward()
    records = _records(tmp_path, model, lambda: model(x).sum().backward(), level="mix")
    assert torch.equal(model[0].weight.grad, reference[0].weight.grad)
    assert "1/ReLU#0/backward/grad_output.0" in records


Pair = collections.namedtuple("Pair", "logits aux")


class Structured(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 3)

    def forward(self, x, scale=1.0, mask=None):
        y = self.fc(x) * scale
        return {"pair": Pair(y, y.sum()), "list": [y, None], "flag": True}


def test_nested_module_inputs_and_outputs_are_flattened(tmp_path):
    model = Structured()
    records = _records(tmp_path, model, lambda: model(torch.randn(2, 3), scale=0.5))
    assert records["/Structured#0/forward/kwarg.scale"]["value"] == "0.5"
    assert "/Structured#0/forward/output.pair.logits" in records
    assert records["/Structured#0/forward/output.pair.aux"]["shape"] == "[]"
    assert "/Structured#0/forward/output.list.0" in records
    assert records["/Structured#0/forward/output.list.1"]["value"] == "null"
    assert records["/Structured#0/forward/output.flag"]["value"] == "true"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_module_parameters_of_every_float_dtype_are_recorded(tmp_path, dtype):
    torch.manual_seed(0)
    model = nn.Linear(4, 2).to(dtype)
    x = torch.randn(3, 4).to(dtype)
    records = _records(tmp_path, model, lambda: model(x).float().sum().backward())
    weight = records["/Linear#0/forward/param.weight"]
    exact = model.weight.detach().double()
    assert weight["dtype"] == str(dtype).removeprefix("torch.")
    assert (weight["min"], weight["max"]) == (exact.min().item(), exact.max().item())
    grad = records["/Linear#0/backward/param_grad.weight"]
    assert grad["norm"] == pytest.approx(model.weight.grad.double().norm().item(), rel=1e-3)
