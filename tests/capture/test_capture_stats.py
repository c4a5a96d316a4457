"""Statistics kernels, the deferred (device) path, checksums and the per-step cache."""

import math
import zlib

import pytest
import torch

from probe.capture.numbers import sketch, stats
from probe.capture.recorder import Recorder
from probe.config import Config


def _reference(tensor):
    """(min, max, mean, norm) in float64 the slow, obvious way."""
    values = tensor.detach()
    if values.is_complex():
        values = values.abs()
    values = values.to(torch.float64).reshape(-1)
    return (values.min().item(), values.max().item(), values.mean().item(),
            values.norm().item())


CASES = {
    "float32": torch.randn(6, 7),
    "float64": torch.randn(5, dtype=torch.float64),
    "bfloat16": torch.randn(9).to(torch.bfloat16),
    "float16": torch.randn(3, 3).to(torch.float16),
    "int64": torch.tensor([3, -7, 12]),
    "int8": torch.tensor([1, -2, 3], dtype=torch.int8),
    "bool": torch.tensor([True, False, True, True]),
    "complex64": torch.randn(4, dtype=torch.complex64),
    "transposed": torch.randn(4, 5).t(),
    "scalar": torch.tensor(2.5),
    "requires_grad": torch.randn(3, requires_grad=True),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_host_statistics_match_a_float64_reference(name):
    tensor = CASES[name]
    low, high, mean, norm, nans, infs = stats.host_stats(tensor)
    ref = _reference(tensor)
    assert (low, high) == pytest.approx(ref[:2], rel=1e-6)
    assert mean == pytest.approx(ref[2], rel=1e-5, abs=1e-6)
    assert norm == pytest.approx(ref[3], rel=1e-5)
    assert (nans, infs) == (0, 0)


@pytest.mark.parametrize("name", sorted(CASES))
def test_deferred_device_statistics_equal_host_statistics(name):
    tensor = CASES[name]
    values, counts = stats.device_stats(tensor)
    ((deferred, sketched),) = stats.resolve_device_stats([(values, counts, tensor.numel())])
    assert sketched is None  # no sketch asked
    assert deferred == pytest.approx(stats.host_stats(tensor), rel=1e-5, abs=1e-6)


def test_nonfinite_values_are_counted_only_when_present():
    tensor = torch.tensor([1.0, float("nan"), float("inf"), 3.0, float("-inf")])
    assert stats.host_stats(tensor)[4:] == (1, 2)
    values, counts = stats.device_stats(tensor)
    assert stats.resolve_device_stats([(values, counts, 5)])[0][0][4:] == (1, 2)


def test_large_finite_values_do_not_report_an_infinite_norm():
    tensor = torch.full((4,), 3e30)
    norm = stats.host_stats(tensor)[3]
    assert norm == pytest.approx(6e30, rel=1e-6)
    assert stats.host_stats(tensor)[4:] == (0, 0)


def test_checksum_is_crc32_of_the_raw_bytes_and_sees_one_flipped_bit():
    tensor = torch.randn(8)
    raw = tensor.numpy().tobytes()
    assert stats.checksum(tensor) == format(zlib.crc32(raw), "08x")
    flipped = tensor.clone()
    flipped.view(torch.int32)[3] ^= 1
    assert stats.checksum(flipped) != stats.checksum(tensor)
    bf16 = torch.randn(5).to(torch.bfloat16)
    assert stats.checksum(bf16) == format(zlib.crc32(bf16.view(torch.int16).numpy().tobytes()),
                                          "08x")
    assert stats.checksum(torch.randn(3, 4).t()) != ""  # non-contiguous: row-major bytes


def _rows(recorder, tensors):
    call = recorder.call("api", "", "torch.neg", 0, "forward", "", 1)
    for position, tensor in enumerate(tensors):
        recorder.add(call, f"input.{position}", "in", tensor)
    recorder.resolve()
    return recorder.rows


def test_deferred_recorder_rows_equal_immediate_rows():
    tensors = [torch.randn(4, 4), torch.arange(6), torch.randn(3).to(torch.bfloat16),
               torch.tensor([float("nan"), 1.0])]
    tensors.append(tensors[0])  # a cache hit on a pending entry
    immediate = _rows(Recorder(Config()), tensors)
    deferred = _rows(Recorder(Config(), defer_stats=True), tensors)
    assert len(immediate) == len(deferred) == 5
    for a, b in zip(immediate, deferred):
        assert a[:13] == b[:13] and a[19:-1] == b[19:-1]
        assert a[13:19] == pytest.approx(b[13:19], rel=1e-6, nan_ok=True)
        # sketches: same numbers up to float32 rounding (numpy and torch sum in other orders)
        got, want = sketch.unpack(a[-1]), sketch.unpack(b[-1])
        assert (got is None) == (want is None)
        if got is not None:
            scale = max(map(abs, got)) if all(map(math.isfinite, got)) else 1.0
            assert got == pytest.approx(want, abs=1e-6 * scale, nan_ok=True)


def test_statistics_are_computed_once_per_unchanged_tensor(monkeypatch):
    calls = []
    recorder = Recorder(Config())
    original = recorder._compute  # statistics of one tensor, whichever path computes them
    monkeypatch.setattr(recorder, "_compute", lambda t: calls.append(1) or original(t))
    x = torch.randn(10)
    view = x.view(10)  # another object, same data and layout: the same entry
    _rows(recorder, [x, x, view])
    assert len(calls) == 1
    x.add_(1.0)  # in place: _version moved, the entry no longer applies
    rows = _rows(recorder, [x])
    assert len(calls) == 2
    assert rows[-1][15] == pytest.approx(x.mean().item())


def test_an_alias_outliving_the_recorded_tensor_object_still_hits_the_cache(monkeypatch):
    # autograd gives a hook the gradient, then keeps grad.detach() as param.grad: the hooked
    # object dies, the bytes live on in a new object with the same version counter
    calls = []
    recorder = Recorder(Config())
    original = recorder._compute  # statistics of one tensor, whichever path computes them
    monkeypatch.setattr(recorder, "_compute", lambda t: calls.append(1) or original(t))
    x = torch.randn(64)
    kept = x.detach()
    _rows(recorder, [x])
    del x
    _rows(recorder, [kept])
    assert len(calls) == 1
    kept.mul_(2.0)  # written through the alias: its version moved, so it is computed again
    rows = _rows(recorder, [kept])
    assert len(calls) == 2
    assert rows[-1][15] == pytest.approx(kept.mean().item())


def test_a_freed_tensor_whose_memory_is_reused_is_not_served_from_the_cache():
    recorder = Recorder(Config())
    for fill in (1.0, 2.0, 3.0):
        tensor = torch.full((256,), fill)  # often lands on the freed block of the last one
        _rows(recorder, [tensor])
        del tensor
    assert [row[14] for row in recorder.rows] == [1.0, 2.0, 3.0]


def test_meta_tensors_record_dtype_and_shape_only():
    recorder = Recorder(Config())
    (row,) = _rows(recorder, [torch.empty(2, 3, device="meta")])
    assert (row[9], row[10], row[11], row[19]) == ("float32", "[2, 3]", "meta", 6)
    assert math.isnan(row[13]) and row[17] == -1


def test_sparse_tensors_get_statistics_of_their_stored_values():
    dense = torch.tensor([[0.0, 2.0], [-3.0, 0.0]])
    recorder = Recorder(Config())
    (row,) = _rows(recorder, [dense.to_sparse()])
    assert (row[13], row[14], row[15], row[19]) == (-3.0, 2.0, -0.5, 2)


class Opaque(torch.Tensor):
    """A tensor subclass whose data cannot be read as numpy or by torch reductions."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in (torch.Tensor.numpy, torch.aminmax, torch.Tensor.sum):
            raise RuntimeError("opaque tensor")
        return super().__torch_function__(func, types, args, kwargs or {})


def test_a_tensor_whose_values_cannot_be_read_gets_unknown_statistics_not_an_error():
    recorder = Recorder(Config())
    (row,) = _rows(recorder, [torch.randn(3).as_subclass(Opaque)])
    assert (row[9], row[10]) == ("float32", "[3]")
    assert math.isnan(row[13]) and row[17] == -1
