"""API level: what the TorchFunctionMode sees and how each call becomes records."""

import json
import math
import os

import pytest
import torch
import torch.nn.functional as F
from torch import relu

from probe.config import Config
from probe.debugger.debugger import PrecisionDebugger
from probe.dump.reader import load


def _capture(tmp_path, fn, **config):
    """Run fn() inside one captured step; return its records as {key: row}."""
    debugger = PrecisionDebugger(Config(dump_path=str(tmp_path), **config))
    with debugger.capture(config.pop("model", None)):
        fn()
    rows = load(tmp_path).records(step=0)
    by_key = {row["key"]: row for row in rows}
    assert len(by_key) == len(rows), "record keys must be unique"
    return by_key


def _ops(records):
    return {row["op"] for row in records.values()}


def test_api_level_sees_functional_torch_tensor_methods_operators_and_imported_names(tmp_path):
    x = torch.randn(3, 4)
    w = torch.randn(4, 2)

    def work():
        y = F.gelu(x)
        y = torch.tanh(y)
        y = relu(y)  # `from torch import relu`: no attribute of torch is involved
        y = y * 2 + x
        y = y @ w
        y.sum()

    ops = _ops(_capture(tmp_path, work))
    assert {"functional.gelu", "torch.tanh", "torch.relu", "Tensor.mul", "Tensor.add",
            "Tensor.matmul", "Tensor.sum"} <= ops


def test_metadata_and_value_reads_are_not_recorded(tmp_path):
    x = torch.randn(3, 4)

    def work():
        x.size(), x.shape, x.dim(), x.numel(), x.stride(), x.dtype, x.is_contiguous()
        len(x), x[0, 0].item(), x.requires_grad, x.grad, repr(x)

    ops = _ops(_capture(tmp_path, work))
    assert ops == {"Tensor.__getitem__"}  # x[0, 0] is an indexing op; nothing else is math


def test_a_call_records_exactly_its_inputs_and_outputs_not_probes_own_statistics(tmp_path):
    x = torch.randn(5)
    records = _capture(tmp_path, lambda: torch.relu(x))
    assert sorted(records) == ["/torch.relu#0/forward/input.0", "/torch.relu#0/forward/output.0"]


def test_statistics_of_inputs_and_outputs_match_the_tensors(tmp_path):
    x = torch.tensor([[-2.0, 1.0], [3.0, -0.5]])
    records = _capture(tmp_path, lambda: torch.relu(x))
    row = records["/torch.relu#0/forward/input.0"]
    assert (row["min"], row["max"], row["mean"]) == (-2.0, 3.0, 0.375)
    assert row["norm"] == pytest.approx(math.sqrt(4 + 1 + 9 + 0.25))
    assert (row["numel"], row["nan_count"], row["inf_count"]) == (4, 0, 0)
    assert (row["dtype"], row["shape"], row["device"], row["io"]) == ("float32", "[2, 2]", "cpu",
                                                                      "in")
    out = records["/torch.relu#0/forward/output.0"]
    assert (out["min"], out["max"], out["io"]) == (0.0, 3.0, "out")


def test_non_tensor_arguments_are_recorded_so_a_changed_eps_shows(tmp_path):
    x = torch.randn(2, 8)
    values = {}
    for eps in (1e-5, 1e-3):
        records = _capture(tmp_path / str(eps), lambda: F.layer_norm(x, (8,), eps=eps))
        values[eps] = records["/functional.layer_norm#0/forward/kwarg.eps"]["value"]
        assert records["/functional.layer_norm#0/forward/input.1"]["value"] == "[8]"
    assert json.loads(values[1e-5]) == 1e-5 and json.loads(values[1e-3]) == 1e-3


def test_plain_values_are_json(tmp_path):
    x = torch.randn(2, 3)

    def work():
        x.to(torch.float64)
        x.sum(dim=1, keepdim=True)
        F.pad(x, (1, 1), mode="constant", value=None)

    records = _capture(tmp_path, work)
    assert records["/Tensor.to#0/forward/input.1"]["value"] == '"float64"'
    assert records["/Tensor.sum#0/forward/kwarg.dim"]["value"] == "1"
    assert records["/Tensor.sum#0/forward/kwarg.keepdim"]["value"] == "true"
    assert records["/functional.pad#0/forward/kwarg.mode"]["value"] == '"constant"'
    assert records["/functional.pad#0/forward/kwarg.value"]["value"] == "null"
    for row in records.values():
        if row["value"]:
            json.loads(row["value"])
            assert row["dtype"] == "" and row["numel"] == 0 and math.isnan(row["min"])


def test_nested_outputs_are_flattened_into_slots(tmp_path):
    x = torch.randn(4, 6)

    def work():
        torch.max(x, dim=1)  # torch.return_types.max(values, indices)
        torch.split(x, 2, dim=1)  # a tuple of three views
        torch.cat([x, x])  # a list input

    records = _capture(tmp_path, work)
    assert "/torch.max#0/forward/output.values" in records
    assert records["/torch.max#0/forward/output.indices"]["dtype"] == "int64"
    assert {f"/torch.split#0/forward/output.{i}" for i in range(3)} <= set(records)
    assert {"/torch.cat#0/forward/input.0.0", "/torch.cat#0/forward/input.0.1"} <= set(records)


def test_in_place_op_input_is_recorded_before_the_mutation(tmp_path):
    x = torch.zeros(4)

    def work():
        x.add_(5.0)
        x.mul_(2.0)

    records = _capture(tmp_path, work)
    assert records["/Tensor.add_#0/forward/input.0"]["max"] == 0.0
    assert records["/Tensor.add_#0/forward/output.0"]["max"] == 5.0
    assert records["/Tensor.mul_#0/forward/input.0"]["max"] == 5.0
    assert records["/Tensor.mul_#0/forward/output.0"]["max"] == 10.0


def test_setitem_records_the_written_tensor_as_output(tmp_path):
    x = torch.zeros(3)

    def work():
        x[1] = 7.0

    records = _capture(tmp_path, work)
    assert records["/Tensor.__setitem__#0/forward/input.0"]["max"] == 0.0
    assert records["/Tensor.__setitem__#0/forward/input.2"]["value"] == "7.0"
    assert records["/Tensor.__setitem__#0/forward/output.0"]["max"] == 7.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_float_dtypes_are_recorded_with_float64_statistics(tmp_path, dtype):
    x = torch.linspace(-3, 5, 17).to(dtype)
    records = _capture(tmp_path, lambda: torch.abs(x))
    row = records["/torch.abs#0/forward/input.0"]
    exact = x.double()
    assert row["dtype"] == str(dtype).removeprefix("torch.")
    assert (row["min"], row["max"]) == (exact.min().item(), exact.max().item())
    assert row["mean"] == pytest.approx(exact.mean().item(), rel=1e-6, abs=1e-7)
    assert row["norm"] == pytest.approx(exact.norm().item(), rel=1e-6)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint8, torch.bool])
def test_int_and_bool_tensors_get_statistics_of_their_values(tmp_path, dtype):
    x = torch.tensor([0, 1, 1, 0, 1]).to(dtype)
    records = _capture(tmp_path, lambda: torch.flip(x, (0,)))
    row = records["/torch.flip#0/forward/input.0"]
    assert row["dtype"] == str(dtype).removeprefix("torch.")
    assert (row["min"], row["max"], row["mean"]) == (0.0, 1.0, 0.6)
    assert row["norm"] == pytest.approx(math.sqrt(3))


def test_nan_and_inf_are_counted(tmp_path):
    x = torch.tensor([1.0, float("nan"), float("inf"), float("-inf"), 2.0])
    row = _capture(tmp_path, lambda: torch.neg(x))["/torch.neg#0/forward/input.0"]
    assert (row["nan_count"], row["inf_count"], row["numel"]) == (1, 2, 5)


def test_empty_tensor_has_counts_and_nan_statistics(tmp_path):
    row = _capture(tmp_path, lambda: torch.neg(torch.ones(0, 3)))["/torch.neg#0/forward/input.0"]
    assert (row["numel"], row["nan_count"], row["shape"]) == (0, 0, "[0, 3]")
    assert all(math.isnan(row[name]) for name in ("min", "max", "mean", "norm"))


def test_source_location_points_at_the_calling_line(tmp_path):
    x = torch.randn(3)

    def work():
        torch.sigmoid(x)  # the line recorded below
    line = work.__code__.co_firstlineno + 1
    row = _capture(tmp_path, work)["/torch.sigmoid#0/forward/output.0"]
    path, _, number = row["source"].rpartition(":")
    assert os.path.abspath(path) == os.path.abspath(__file__)
    assert int(number) == line


def test_backward_records_grad_output_and_single_node_grad_input(tmp_path):
    x = torch.tensor([0.5, -1.0, 2.0], requires_grad=True)

    def work():
        y = torch.tanh(x)
        (y * torch.tensor([1.0, 2.0, 3.0])).sum().backward()

    records = _capture(tmp_path, work)
    grad_out = records["/torch.tanh#0/backward/grad_output.0"]
    assert (grad_out["min"], grad_out["max"]) == (1.0, 3.0)
    grad_in = records["/torch.tanh#0/backward/grad_input.0"]
    expected = torch.tensor([1.0, 2.0, 3.0]) * (1 - torch.tanh(x.detach()) ** 2)
    assert grad_in["norm"] == pytest.approx(expected.norm().item(), rel=1e-6)
    assert grad_in["io"] == "out" and grad_out["io"] == "in"
    assert grad_in["seq"] == grad_out["seq"] > records["/torch.tanh#0/forward/output.0"]["seq"]


@pytest.fixture
def composite_grad_input(monkeypatch):
    """Per-call grad_input of composite calls (on by default; api_mode's escape hatch can turn it off)."""
    from probe.capture.eager import api_mode

    monkeypatch.setattr(api_mode, "COMPOSITE_GRAD_INPUT", True)


def _capture_tensors(tmp_path, fn):
    """Run fn() in one captured step with task "tensor"; return {key: stored tensor}."""
    debugger = PrecisionDebugger(Config(dump_path=str(tmp_path), task="tensor"))
    with debugger.capture():
        fn()
    dump = load(tmp_path)
    with dump.open(step=0, rank=dump.ranks[0]) as step:
        return {row["key"]: torch.from_numpy(step.tensor(int(row["tensor_id"])).copy())
                for row in step.records.to_dicts() if row["tensor_id"] >= 0}


def test_composite_linear_on_3d_input_records_true_per_call_grad_inputs(tmp_path,
        composite_grad_input):
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(5, 4, dtype=torch.float64))
    bias = torch.nn.Parameter(torch.randn(5, dtype=torch.float64))
    source = torch.randn(2, 3, 4, dtype=torch.float64, requires_grad=True)
    upstream = torch.randn(2, 3, 5, dtype=torch.float64)

    def work():
        x = source * 1.5  # a non-leaf input: its grad_fn marks where the call starts
        y = F.linear(x, weight, bias)  # ViewBackward0 -> AddmmBackward0, weight via TBackward0
        # x is used again after the call: its accumulated gradient is not the per-call one
        (y * upstream).sum().add(x.sum()).backward()

    tensors = _capture_tensors(tmp_path, work)
    x = (source.detach() * 1.5).requires_grad_()
    w, b = weight.detach().clone().requires_grad_(), bias.detach().clone().requires_grad_()
    expected = torch.autograd.grad(F.linear(x, w, b), (x, w, b), upstream)
    prefix = "/functional.linear#0/backward/"
    for slot, want in zip(("grad_input.0", "grad_input.1", "grad_input.2"), expected):
        assert torch.allclose(tensors[prefix + slot], want, rtol=1e-12, atol=1e-12), slot
    assert torch.equal(tensors[prefix + "grad_output.0"], upstream)


def test_composite_call_input_feeding_several_nodes_records_the_summed_gradient(tmp_path,
        composite_grad_input):
    torch.manual_seed(0)
    source = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    upstream = torch.randn(3, 4, dtype=torch.float64)

    def work():
        x = source * 2.0
        y = F.normalize(x, dim=1)  # x / norm(x): x reaches the division and the norm
        (y * upstream).sum().backward()

    tensors = _capture_tensors(tmp_path, work)
    x = (source.detach() * 2.0).requires_grad_()
    (expected,) = torch.autograd.grad(F.normalize(x, dim=1), x, upstream)
    got = tensors["/functional.normalize#0/backward/grad_input.0"]
    assert torch.allclose(got, expected, rtol=1e-12, atol=1e-12)
    # one of the two edges alone is not the per-call gradient
    (through_division,) = torch.autograd.grad(x / x.norm(dim=1, keepdim=True).detach(), x,
                                              upstream)
    assert not torch.allclose(got, through_division)


def test_composite_cross_entropy_records_grad_input_of_the_logits(tmp_path,
        composite_grad_input):
    logits = torch.randn(4, 3, requires_grad=True)
    target = torch.tensor([0, 2, 1, 0])
    records = _capture(tmp_path, lambda: F.cross_entropy(logits, target).backward())
    assert "/functional.cross_entropy#0/backward/grad_output.0" in records
    grad_in = records["/functional.cross_entropy#0/backward/grad_input.0"]
    assert grad_in["norm"] == pytest.approx(logits.grad.norm().item(), rel=1e-6)
    # recorded when the node that sends it runs, after the call's grad_output arrived
    assert grad_in["seq"] > records["/functional.cross_entropy#0/backward/grad_output.0"]["seq"]
    assert not any("cross_entropy#0/backward/grad_input.1" in key for key in records)


def test_composite_grad_input_does_not_change_gradients(tmp_path,
        composite_grad_input):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 5)
    reference = torch.nn.Linear(4, 5)
    reference.load_state_dict(model.state_dict())
    x = torch.randn(2, 3, 4, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()

    def work():
        F.normalize(model(x), dim=-1).pow(2).sum().backward()

    records = _capture(tmp_path, work)
    F.normalize(reference(x_ref), dim=-1).pow(2).sum().backward()
    assert "/functional.linear#0/backward/grad_input.1" in records
    assert torch.equal(model.weight.grad, reference.weight.grad)
    assert torch.equal(model.bias.grad, reference.bias.grad)
    assert torch.equal(x.grad, x_ref.grad)


@pytest.mark.parametrize("composite", [True, False])
def test_composite_grad_input_is_on_by_default_and_the_flag_turns_it_off(tmp_path, monkeypatch, composite):
    from probe.capture.eager import api_mode

    if not composite:
        monkeypatch.setattr(api_mode, "COMPOSITE_GRAD_INPUT", False)
    logits = torch.randn(4, 3, requires_grad=True)
    target = torch.tensor([0, 2, 1, 0])
    records = _capture(tmp_path, lambda: F.cross_entropy(logits, target).backward())
    assert "/functional.cross_entropy#0/backward/grad_output.0" in records
    assert ("/functional.cross_entropy#0/backward/grad_input.0" in records) == composite


def test_in_place_ops_keep_working_with_backward_hooks(tmp_path):
    w = torch.randn(3, 3, requires_grad=True)
    x = torch.randn(2, 3)

    def work():
        h = torch.matmul(x, w)
        h.mul_(2.0)
        h.relu_()
        h.sum().backward()

    reference_w = w.detach().clone().requires_grad_()
    h = torch.matmul(x, reference_w)
    h.mul_(2.0)
    h.relu_()
    h.sum().backward()
    records = _capture(tmp_path, work)
    assert torch.equal(w.grad, reference_w.grad)
    assert "/Tensor.mul_#0/backward/grad_output.0" in records
    assert "/Tensor.relu_#0/backward/grad_output.0" in records


@pytest.mark.filterwarnings("ignore:.*is deprecated:FutureWarning")  # 2.13's old names
def test_collectives_are_captured_through_the_mode_or_warned_about_once(tmp_path):
    import warnings

    import torch.distributed as dist

    from probe import compat

    from probe.compat import version_gaps

    from torch_versions import ALL_COLLECTIVES, collectives_this_torch_hides

    hidden = collectives_this_torch_hides()
    assert set(compat.uncaptured_collectives()) == hidden
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        tensor = torch.full((3,), 2.0)
        gathered = torch.zeros(3)
        scattered = torch.zeros(3)

        def work():
            dist.all_reduce(tensor)
            dist.broadcast(tensor, src=0)
            tensor.add_(1.0)
            listed = [torch.zeros(3)]
            dist.all_gather(listed, tensor)
            dist.all_gather_into_tensor(gathered, tensor * 2)  # FSDP's two collectives
            dist.reduce_scatter_tensor(scattered, tensor * 3)

        debugger = PrecisionDebugger(Config(dump_path=str(tmp_path / "dump")))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(2):  # two steps: the warning comes once
                with debugger.capture():
                    work()
    finally:
        dist.destroy_process_group()
    records = {row["key"]: row for row in load(tmp_path / "dump").records(step=0)}
    told = [str(w.message) for w in caught if issubclass(w.category, version_gaps.TorchVersionWarning)]
    if hidden:
        assert len(told) == 1, told
        listed = "any collective" if hidden == ALL_COLLECTIVES else ", ".join(
            name for name in compat.COLLECTIVES if name in hidden)
        assert f"does not pass {listed} through __torch_function__" in told[0]
    else:
        assert told == []
    # one name per collective on every version: 2.13 calls these all_gather_single and
    # reduce_scatter_single, older versions all_gather_into_tensor and reduce_scatter_tensor
    expected = {"all_reduce": 2.0, "broadcast": 2.0, "all_gather": 3.0,
                "all_gather_into_tensor": ("all_gather_single", 6.0),
                "reduce_scatter_tensor": ("reduce_scatter_single", 9.0)}
    for called, want in expected.items():
        op, value = want if isinstance(want, tuple) else (called, want)
        key = f"/distributed.{op}#0/forward/output.0"
        if called in hidden:
            assert key not in records
        else:
            assert records[key]["max"] == value, called
    assert not any("all_gather_into_tensor" in key or "reduce_scatter_tensor" in key
                   for key in records)


def test_foreach_in_place_ops_record_the_updated_list_as_output(tmp_path):
    params = [torch.zeros(2), torch.ones(3)]
    records = _capture(tmp_path, lambda: torch._foreach_add_(params, 1.0))
    assert records["/torch._foreach_add_#0/forward/input.0.1"]["max"] == 1.0
    assert records["/torch._foreach_add_#0/forward/output.0"]["max"] == 1.0
    assert records["/torch._foreach_add_#0/forward/output.1"]["max"] == 2.0


def test_a_call_from_code_with_an_unhashable_constant_is_recorded(tmp_path):
    """Before Python 3.12 a slice is unhashable, and dynamo's resume functions can hold one
    among their constants: the mode's lookups by code object must not fail on them."""
    import types

    def caller(x):
        return torch.tanh(x)

    code = caller.__code__
    code = code.replace(co_consts=code.co_consts + (slice(1, 2),))
    with_slice = types.FunctionType(code, caller.__globals__)
    x = torch.randn(3)
    ops = _ops(_capture(tmp_path, lambda: with_slice(x)))
    assert "torch.tanh" in ops
