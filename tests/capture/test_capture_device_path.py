"""The accelerator's capture path, held on the CPU with PROBE_DEVICE_PATH=1 (device_bucket.py):
the same numbers as the host path, a fixed number of calls per bucket, no host read inside the
step, and values kept as recorded when a call writes them in place."""

import json
import math
import os
import subprocess
import sys
import tempfile

import numpy as np
import pytest
import torch
import torch.nn as nn

from bench import launch_count
from examples import models
from probe.capture.numbers import stats
from probe.capture.numbers import device_bucket
from probe.capture.numbers.device_bucket import DeviceBucket
from probe.config import Config
from probe.debugger import PrecisionDebugger
from probe.dump.reader import load

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def device_path(monkeypatch):
    monkeypatch.setenv("PROBE_DEVICE_PATH", "1")


def _tensors():
    g = torch.Generator().manual_seed(4)
    return [torch.randn(3, generator=g), torch.randn(256, 256, generator=g),
            torch.randn(4, 64, 256, generator=g) + 1.0, torch.rand(5000, generator=g) + 0.5,
            -torch.rand(4016, generator=g), torch.randn(4017, generator=g, dtype=torch.float64),
            torch.randn(100, generator=g).to(torch.bfloat16), torch.randint(-5, 5, (300,), generator=g),
            torch.ones(7, dtype=torch.bool), torch.randn(64, 48, generator=g).t()]


@pytest.mark.parametrize("sketch_size", [0, 16])
def test_bucket_numbers_equal_float64_statistics_and_the_host_sketch(sketch_size):
    tensors = _tensors()
    bucket = DeviceBucket(sketch_size)
    slots = [bucket.add(t) for t in tensors]
    bucket.resolve()
    assert bucket.host_transfers == 1
    for tensor, slot in zip(tensors, slots):
        (low, high, mean, norm, nans, infs), sketched = slot.result
        exact = tensor.to(torch.float64)
        assert (low, high) == (exact.min().item(), exact.max().item())
        assert mean == pytest.approx(exact.mean().item(), rel=1e-6, abs=1e-9)
        assert norm == pytest.approx(exact.norm().item(), rel=1e-6)
        assert (nans, infs) == (0, 0)
        if sketch_size == 0:
            assert sketched is None
            continue
        _, host = stats.host_stats_and_sketch(tensor, sketch_size)
        got, want = np.frombuffer(sketched), np.frombuffer(host)
        floor = 1e-6 * float(exact.norm()) * math.sqrt(sketch_size)  # float32 rounding floor
        assert np.abs(got - want).max() <= floor


def test_nan_and_inf_are_counted_and_do_not_spill_into_other_tensors_of_the_bucket():
    with_nan = torch.tensor([1.0, float("nan"), 2.0])
    with_infs = torch.tensor([1.0, float("inf"), -3.0, float("-inf")])
    only_high = torch.tensor([float("inf"), 2.0])
    clean = torch.randn(50, generator=torch.Generator().manual_seed(0))
    bucket = DeviceBucket(16)
    slots = [bucket.add(t) for t in (with_nan, with_infs, only_high, clean)]
    bucket.resolve()
    nan_row, inf_row, high_row, clean_row = (slot.result for slot in slots)
    assert math.isnan(nan_row[0][0]) and nan_row[0][4:] == (1, 0)
    assert inf_row[0][:2] == (-math.inf, math.inf) and inf_row[0][4:] == (0, 2)
    assert math.isnan(inf_row[0][2])  # inf - inf
    assert high_row[0][2] == math.inf and high_row[0][3] == math.inf
    assert clean_row[0][2] == pytest.approx(clean.double().mean().item(), rel=1e-6, abs=1e-7)
    assert np.isfinite(np.frombuffer(clean_row[1])).all()


def test_a_tensor_written_in_place_after_before_write_keeps_its_recorded_values():
    tensor = torch.arange(6.0)
    bucket = DeviceBucket(0)
    slot = bucket.add(tensor)
    bucket.before_write([tensor])  # what the API mode does before ``tensor.mul_(10)``
    tensor.mul_(10)
    later = bucket.add(tensor)
    bucket.resolve()
    assert slot.result[0][:3] == (0.0, 5.0, 2.5)
    assert later.result[0][:3] == (0.0, 50.0, 25.0)
    assert bucket.stale == 0


def test_a_foreach_write_of_held_tensors_flushes_the_bucket_once_and_keeps_the_recorded_values():
    params = [torch.arange(4.0), torch.full((3,), -2.0), torch.ones(2, 2)]
    bucket = DeviceBucket(0)
    slots = [bucket.add(p) for p in params]
    bucket.before_write(params)  # what the API mode does before torch._foreach_mul_(params, 3)
    assert len(bucket) == 0 and bucket.flushes == 1  # one batch, nothing copied
    torch._foreach_mul_(params, 3.0)
    bucket.resolve()
    assert [slot.result[0][:2] for slot in slots] == [(0.0, 3.0), (-2.0, -2.0), (1.0, 1.0)]
    assert bucket.stale == 0


def test_a_write_through_another_view_of_a_held_storage_flushes_first():
    base = torch.arange(6.0)
    bucket = DeviceBucket(0)
    slot = bucket.add(base)
    bucket.before_write([base[2:4]])
    assert len(bucket) == 0
    base[2:4].zero_()
    bucket.resolve()
    assert slot.result[0][:3] == (0.0, 5.0, 2.5)


def test_a_write_nobody_announced_is_reported_unknown_not_wrong():
    tensor = torch.arange(6.0)
    bucket = DeviceBucket(0)
    slot = bucket.add(tensor)
    tensor.add_(1.0)  # unseen: the autograd engine, a C++ reducer
    bucket.resolve()
    assert math.isnan(slot.result[0][0]) and slot.result[0][4] == -1
    assert bucket.stale == 1


def test_a_write_through_a_view_nobody_announced_is_caught_by_the_shared_version():
    base = torch.arange(6.0)
    bucket = DeviceBucket(0)
    slot = bucket.add(base)
    base[2:4].add_(1.0)  # a view shares its base's version counter
    bucket.resolve()
    assert slot.result[0][4] == -1 and bucket.stale == 1


def test_a_write_through_data_under_the_capture_is_read_after_the_recorded_values(
        tmp_path, device_path):
    model = nn.Linear(4, 3)
    before = model.weight.detach().clone()
    debugger = PrecisionDebugger(Config(dump_path=str(tmp_path), level="api"))
    with debugger.capture(model):
        model(torch.randn(2, 4))
        model.weight.data.mul_(10)  # .data has its own version counter: seen by its memory
    debugger.close()
    rows = {row["key"]: row for row in load(tmp_path).records(step=0)}
    weight = rows["/functional.linear#0/forward/input.1"]
    assert (weight["min"], weight["max"]) == (before.min().item(), before.max().item())
    assert weight["nan_count"] == 0


def test_the_bucket_is_flushed_when_backward_starts_when_it_ends_and_after_the_optimizer_step():
    from probe.capture import ApiCaptureMode, Recorder

    bucket = DeviceBucket(16)
    recorder = Recorder(Config(level="api"), defer_stats=True, device_bucket=bucket)
    recorder.active = True
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = {}
    with ApiCaptureMode(recorder):
        hidden = model[1](model[0](torch.randn(4, 8)))
        hidden.register_hook(lambda grad: seen.setdefault("mid-backward", len(bucket)) and None)
        loss = model[2](hidden).square().mean()
        seen["forward"] = len(bucket)
        loss.backward()
        seen["after backward"] = len(bucket)
        optimizer.step()
        seen["after step"] = len(bucket)
    # mid-backward the bucket holds only the gradients recorded so far (the forward's
    # tensors went in one flush when backward started)
    assert seen["forward"] > 8 and 0 < seen["mid-backward"] < 8
    assert seen["after backward"] == 0 and seen["after step"] == 0
    assert bucket.flushes == 3 and bucket.stale == 0


def _step_rows(tmp_path, level, model, batch, optimizer_factory):
    optimizer = optimizer_factory(model.parameters())
    debugger = PrecisionDebugger(Config(dump_path=str(tmp_path), level=level))
    with debugger.capture(model):
        model(batch).square().mean().backward()
        optimizer.step()
    debugger.close()
    return {row["key"]: row for row in load(tmp_path).records(step=0)}


@pytest.mark.parametrize("level", ["api", "module", "mix"])
@pytest.mark.parametrize("optimizer", ["sgd-loop", "adamw-foreach"])
def test_device_path_rows_equal_host_path_rows_through_in_place_optimizer_steps(
        tmp_path, monkeypatch, level, optimizer):
    factories = {"sgd-loop": lambda p: torch.optim.SGD(p, lr=0.1, foreach=False),
                 "adamw-foreach": lambda p: torch.optim.AdamW(p, lr=0.1, foreach=True)}

    def rows(folder, device_path):
        monkeypatch.setenv("PROBE_DEVICE_PATH", "1" if device_path else "0")
        torch.manual_seed(5)
        model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(inplace=True), nn.LayerNorm(32),
                              nn.Linear(32, 4))
        return _step_rows(folder, level, model, torch.randn(8, 16), factories[optimizer])

    host = rows(tmp_path / "host", False)
    device = rows(tmp_path / "device", True)
    assert host.keys() == device.keys()
    for key, want in host.items():
        got = device[key]
        assert (got["min"], got["max"], got["nan_count"]) == pytest.approx(
            (want["min"], want["max"], want["nan_count"]), nan_ok=True), key
        assert (got["mean"], got["norm"]) == pytest.approx((want["mean"], want["norm"]),
                                                           rel=1e-5, abs=1e-6, nan_ok=True), key


@pytest.fixture(scope="module")
def gpt_launches():
    """Kernel-launching ops of a plain and of a captured step of the project's GPT's structure
    (4 blocks; narrow, so the CPU runs it fast: the op count does not depend on the width),
    on the device path, at levels api and mix."""
    os.environ["PROBE_DEVICE_PATH"] = "1"
    try:
        torch.manual_seed(0)
        model = models.TinyGPT(d_model=64, n_layers=4, max_len=32)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        x, y = models.make_batch("gpt", 1, max_len=32)

        def plain():
            models.train_step(model, optimizer, x, y)

        plain()
        counted = {"plain": launch_count.count(plain)}
        for level in ("api", "mix"):
            with tempfile.TemporaryDirectory() as folder:
                debugger = PrecisionDebugger(Config(dump_path=folder, level=level))
                step = launch_count.captured_step(debugger, model, plain)
                step()
                counted[level] = launch_count.count(step)
                debugger.close()
        return counted
    finally:
        del os.environ["PROBE_DEVICE_PATH"]


@pytest.mark.parametrize("level", ["api", "mix"])
def test_a_captured_gpt_step_launches_at_most_a_quarter_more_kernels_than_the_plain_step_plus_30(
        gpt_launches, level):
    plain, captured = gpt_launches["plain"].total, gpt_launches[level].total
    assert captured <= 1.25 * plain + 30, (plain, captured, gpt_launches[level].launches)


@pytest.mark.parametrize("level", ["api", "mix"])
def test_a_captured_step_copies_no_record_and_reads_no_number_on_the_host(gpt_launches, level):
    plain, captured = gpt_launches["plain"], gpt_launches[level]
    for op in ("clone", "copy_", "_to_copy", "_foreach_mul"):
        assert captured.launches[op] == plain.launches[op], op
    # the tensors that are not contiguous (attention's q, k, v views): one multi-tensor copy
    # into the arena per flush, at most
    flushes = captured.launches["segment_reduce"] // 3
    assert captured.launches["_foreach_copy_"] <= flushes <= 3
    assert captured.host_reads == plain.host_reads == 0


@pytest.mark.parametrize("blocks, bucket_tensors", [(2, 256), (12, 8)])  # 8: many flushes
def test_every_step_file_costs_one_host_transfer_whatever_the_model_size(
        tmp_path, device_path, monkeypatch, blocks, bucket_tensors):
    monkeypatch.setattr(device_bucket, "BUCKET_TENSORS", bucket_tensors)
    torch.manual_seed(1)
    model = models.DeepMLP(depth=blocks)
    x, y = models.make_batch("deepmlp", 16)
    optimizer = torch.optim.AdamW(model.parameters())
    debugger = PrecisionDebugger(Config(dump_path=str(tmp_path), level="mix"))
    for _ in range(2):
        with debugger.capture(model):
            models.train_step(model, optimizer, x, y)
    debugger.close()
    shown = subprocess.run([sys.executable, "-m", "probe", "inspect", str(tmp_path), "--json",
                            "--limit", "0"], capture_output=True, text=True, cwd=REPO_ROOT, check=True)
    files = json.loads(shown.stdout)["files"]
    assert len(files) == 2
    for entry in files:
        cost = entry["cost"]
        assert cost["host_transfers"] == 1
        assert cost["stale_records"] == 0
        assert cost["capture_ms"] > 0 and cost["bytes"] > 0
