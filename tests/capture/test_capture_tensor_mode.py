"""Task "tensor" stores each distinct tensor once per step; task "checksum" hashes bytes."""

import zlib

import numpy as np
import pytest
import torch
import torch.nn as nn

from probe.config import Config
from probe.debugger.debugger import PrecisionDebugger
from probe.dump.reader import load


def _capture(tmp_path, fn, model=None, **config):
    debugger = PrecisionDebugger(Config(dump_path=str(tmp_path), **config))
    with debugger.capture(model):
        fn()
    return load(tmp_path)


def test_an_output_reused_as_the_next_input_is_stored_once(tmp_path):
    x = torch.randn(4, 5)
    results = {}

    def work():
        results["a"] = torch.tanh(x)
        results["b"] = torch.sigmoid(results["a"])

    dump = _capture(tmp_path, work, task="tensor")
    with dump.open(0) as step:
        rows = {row["key"]: row for row in step.records}
        produced = rows["/torch.tanh#0/forward/output.0"]["tensor_id"]
        consumed = rows["/torch.sigmoid#0/forward/input.0"]["tensor_id"]
        assert produced == consumed >= 0
        assert step.tensor_count == 3  # x, tanh(x), sigmoid(tanh(x))
        assert np.array_equal(step.tensor(produced), results["a"].numpy())
        ids = {row["tensor_id"] for row in step.records}
        assert ids == set(range(3))


def test_a_tensor_modified_in_place_is_stored_again(tmp_path):
    x = torch.zeros(3)

    def work():
        x.add_(1.0)
        x.mul_(4.0)

    dump = _capture(tmp_path, work, task="tensor")
    with dump.open(0) as step:
        rows = {row["key"]: row for row in step.records}
        values = [step.tensor(rows[key]["tensor_id"]).tolist() for key in (
            "/Tensor.add_#0/forward/input.0", "/Tensor.add_#0/forward/output.0",
            "/Tensor.mul_#0/forward/output.0")]
        assert values == [[0.0] * 3, [1.0] * 3, [4.0] * 3]
        assert rows["/Tensor.mul_#0/forward/input.0"]["tensor_id"] == \
            rows["/Tensor.add_#0/forward/output.0"]["tensor_id"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64,
                                   torch.bool])
def test_stored_tensors_are_bit_exact(tmp_path, dtype):
    x = (torch.randn(2, 3) * 4).to(dtype)
    dump = _capture(tmp_path, lambda: torch.flip(x, (1,)), task="tensor")
    with dump.open(0) as step:
        row = next(r for r in step.records if r["key"] == "/torch.flip#0/forward/input.0")
        raw, dtype_name = step.stored_tensor(row["tensor_id"])
    assert dtype_name == str(dtype).removeprefix("torch.")
    expected = x.view(torch.int16) if dtype == torch.bfloat16 else x
    assert raw.tobytes() == expected.numpy().tobytes()


def test_tensor_mode_at_module_level_stores_parameters_and_gradients(tmp_path):
    model = nn.Linear(3, 2)
    dump = _capture(tmp_path, lambda: model(torch.randn(4, 3)).sum().backward(), model=model,
                    task="tensor", level="module")
    with dump.open(0) as step:
        rows = {row["key"]: row for row in step.records}
        grad_id = rows["/Linear#0/backward/param_grad.weight"]["tensor_id"]
        assert np.array_equal(step.tensor(grad_id), model.weight.grad.numpy())
        assert step.tensor_count == len({row["tensor_id"] for row in step.records
                                         if row["tensor_id"] >= 0})


def test_checksum_task_records_crc32_of_every_tensor(tmp_path):
    x = torch.randn(6)
    dump = _capture(tmp_path, lambda: torch.exp(x), task="checksum")
    rows = {row["key"]: row for row in dump.records(step=0)}
    assert rows["/torch.exp#0/forward/input.0"]["checksum"] == format(
        zlib.crc32(x.numpy().tobytes()), "08x")
    assert all(len(row["checksum"]) == 8 for row in rows.values())
    assert all(row["tensor_id"] == -1 for row in rows.values())


def test_statistics_task_stores_no_checksum_and_no_tensor(tmp_path):
    dump = _capture(tmp_path, lambda: torch.exp(torch.randn(3)))
    rows = dump.records(step=0)
    assert {row["checksum"] for row in rows} == {""}
    assert {row["tensor_id"] for row in rows} == {-1}


def test_tensor_mode_statistics_and_checksums_equal_the_statistics_and_checksum_tasks(tmp_path):
    # in tensor mode the writer thread computes them from the stored copy
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))
    x = torch.randn(4, 6)
    x[0, 0] = float("nan")
    columns = ("min", "max", "mean", "norm", "nan_count", "inf_count", "numel")
    found = {}
    for task in ("statistics", "checksum", "tensor"):
        folder = tmp_path / task
        model.zero_grad(set_to_none=True)
        dump = _capture(folder, lambda: model(x).sum().backward(), model=model, task=task, level="mix")
        with dump.open(0) as step:
            found[task] = {row["key"]: row for row in step.records}
    assert found["tensor"].keys() == found["statistics"].keys()
    stored = 0
    for key, row in found["tensor"].items():
        expected = found["statistics"][key]
        for column in columns:
            assert np.array_equal(row[column], expected[column], equal_nan=True), (key, column)
        assert row["checksum"] == found["checksum"][key]["checksum"], key
        stored += row["tensor_id"] >= 0
    assert stored > 10
