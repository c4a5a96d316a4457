"""The device bucket's Triton kernel (capture/numbers/bucket_kernel.py), held on the CPU by
Triton's interpreter (TRITON_INTERPRET=1, PROBE_TRITON=1): the torch path's numbers from one
read of each tensor, through a bucket and through a whole captured step, and the torch path
back, with one warning, when the kernel cannot run."""

import math
import warnings

import numpy as np
import pytest
import torch
import torch.nn as nn

from probe.capture.numbers import bucket_kernel
from probe.capture.numbers.device_bucket import DeviceBucket
from probe.capture.numbers.sketch import unpack
from probe.config import Config
from probe.debugger import PrecisionDebugger
from probe.dump.reader import load

if bucket_kernel.triton_version() < bucket_kernel.MIN_TRITON:
    pytest.skip(f"the bucket kernel needs Triton >= {'.'.join(map(str, bucket_kernel.MIN_TRITON))}: "
                "pip install triton (CUDA builds of torch from 2.6 bring it)", allow_module_level=True)


@pytest.fixture
def kernel_path(monkeypatch):
    """The kernel in Triton's interpreter, made afresh for the test (nothing given up)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("PROBE_TRITON", "1")
    monkeypatch.setenv("PROBE_DEVICE_PATH", "1")
    monkeypatch.setattr(bucket_kernel, "_state", {"kernels": {}, "failed": None})


def _tensors(dtype):
    g = torch.Generator().manual_seed(7)
    nonfinite = torch.randn(9000, generator=g) * 100  # three super-rows: NaN-free, Inf in two
    nonfinite[5], nonfinite[4100], nonfinite[8999] = math.inf, -math.inf, math.inf
    with_nan = torch.randn(3, 7, generator=g)
    with_nan[1, 2] = math.nan
    tensors = [torch.randn(5000, generator=g), with_nan, torch.randn(300, 70, generator=g).t(),
               nonfinite, torch.randn(1, generator=g), torch.randn(4016 * 3, generator=g) + 1,
               torch.full((40,), -2.5)]
    return [t.to(dtype) for t in tensors]


def _bucket_numbers(tensors, sketch_size, kernel, monkeypatch):
    monkeypatch.setenv("PROBE_TRITON", "1" if kernel else "0")
    bucket = DeviceBucket(sketch_size)
    slots = [bucket.add(t) for t in tensors]
    bucket.resolve()
    assert bucket.host_transfers == 1
    return [slot.result for slot in slots]


def _assert_same_numbers(got, want, where):
    (numbers, sketched), (expected, expected_sketch) = got, want
    low, high, mean, norm, nans, infs = numbers
    assert (nans, infs) == expected[4:], where
    np.testing.assert_equal((low, high), expected[:2], err_msg=where)  # NaN == NaN here
    np.testing.assert_allclose((mean, norm), expected[2:4], rtol=1e-12, err_msg=where)
    if expected_sketch is None:
        assert sketched is None, where
        return
    ours, theirs = np.array(unpack(sketched)), np.array(unpack(expected_sketch))
    if np.isfinite(theirs).all():
        # float32 products against the torch path's float64: the sketch's own rounding floor
        assert np.abs(ours - theirs).max() <= 1e-5 * np.abs(theirs).max(), where
    else:
        assert not np.isfinite(ours).all(), where


@pytest.mark.parametrize("sketch_size", [0, 16, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_kernel_gives_the_torch_paths_numbers_in_one_launch_per_dtype(
        kernel_path, monkeypatch, dtype, sketch_size):
    tensors = _tensors(dtype)
    want = _bucket_numbers(tensors, sketch_size, False, monkeypatch)
    before = bucket_kernel.launches
    got = _bucket_numbers(tensors, sketch_size, True, monkeypatch)
    assert bucket_kernel.launches == before + 1
    for index, (ours, theirs) in enumerate(zip(got, want)):
        _assert_same_numbers(ours, theirs, f"tensor {index}")


def test_a_bucket_of_mixed_dtypes_launches_the_kernel_per_float_dtype_and_torch_for_the_rest(
        kernel_path, monkeypatch):
    g = torch.Generator().manual_seed(3)
    tensors = [torch.randn(500, generator=g), torch.randn(64, generator=g).to(torch.bfloat16),
               torch.randint(-9, 9, (30,), generator=g), torch.randn(70, generator=g, dtype=torch.float64),
               torch.randn(4100, generator=g), torch.ones(5, dtype=torch.bool)]
    want = _bucket_numbers(tensors, 16, False, monkeypatch)
    before = bucket_kernel.launches
    got = _bucket_numbers(tensors, 16, True, monkeypatch)
    assert bucket_kernel.launches == before + 2  # float32 and bfloat16
    for index, (ours, theirs) in enumerate(zip(got, want)):
        _assert_same_numbers(ours, theirs, f"tensor {index}")


def _captured_rows(folder, kernel, monkeypatch):
    monkeypatch.setenv("PROBE_TRITON", "1" if kernel else "0")
    torch.manual_seed(5)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    debugger = PrecisionDebugger(Config(dump_path=str(folder), level="mix"))
    with debugger.capture(model):
        model(torch.randn(8, 16)).square().mean().backward()
        optimizer.step()
    debugger.close()
    table = load(folder)
    rows = {row["key"]: row for row in table.records(step=0)}
    return rows


def test_a_step_captured_through_the_kernel_writes_the_torch_paths_statistics(
        kernel_path, monkeypatch, tmp_path):
    want = _captured_rows(tmp_path / "torch", False, monkeypatch)
    before = bucket_kernel.launches
    got = _captured_rows(tmp_path / "kernel", True, monkeypatch)
    assert bucket_kernel.launches > before
    assert got.keys() == want.keys() and len(got) > 30
    for key, theirs in want.items():
        ours = got[key]
        exact = ("min", "max", "nan_count", "inf_count")  # NaN where a record has no numbers
        np.testing.assert_equal([ours[c] for c in exact], [theirs[c] for c in exact], err_msg=key)
        np.testing.assert_allclose([ours["mean"], ours["norm"]], [theirs["mean"], theirs["norm"]],
                                   rtol=1e-12, atol=1e-15, err_msg=key)


def test_the_launch_count_of_a_captured_step_includes_the_kernels_launches(kernel_path, tmp_path):
    from bench import launch_count

    torch.manual_seed(5)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    batch = torch.randn(8, 16)

    def train():
        optimizer.zero_grad()
        model(batch).square().mean().backward()
        optimizer.step()

    debugger = PrecisionDebugger(Config(dump_path=str(tmp_path), level="api"))
    step = launch_count.captured_step(debugger, model, train)
    step()
    before = bucket_kernel.launches
    counted = launch_count.count(step)
    debugger.close()
    ran = bucket_kernel.launches - before
    assert ran >= 1
    assert counted.launches[launch_count.TRITON] == ran
    assert counted.total == sum(n for name, n in counted.launches.items() if name != launch_count.TRITON) + ran


def test_a_kernel_that_cannot_run_warns_once_and_the_torch_path_gives_the_numbers(monkeypatch):
    # compiled for a GPU (no interpreter) but handed CPU tensors: Triton finds no driver
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(bucket_kernel, "_state", {"kernels": {}, "failed": None})
    tensors = _tensors(torch.float32)
    want = _bucket_numbers(tensors, 16, False, monkeypatch)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = _bucket_numbers(tensors, 16, True, monkeypatch)
        second = _bucket_numbers(tensors, 16, True, monkeypatch)
    said = [str(w.message) for w in caught if "Triton statistics kernel failed" in str(w.message)]
    assert len(said) == 1 and "PROBE_TRITON=0" in said[0]
    assert not bucket_kernel.runs_on(torch.device("cpu"))
    for index, (ours, again, theirs) in enumerate(zip(first, second, want)):
        _assert_same_numbers(ours, theirs, f"tensor {index}")
        _assert_same_numbers(again, theirs, f"tensor {index}, second flush")


def test_the_kernel_stays_off_without_its_switch_on_a_cpu(monkeypatch):
    monkeypatch.delenv("PROBE_TRITON", raising=False)
    assert not bucket_kernel.runs_on(torch.device("cpu"))
    monkeypatch.setenv("PROBE_TRITON", "0")
    assert not bucket_kernel.runs_on(torch.device("cuda"))
