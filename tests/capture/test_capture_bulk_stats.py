"""The bulk statistics path (probe/capture/numbers/bulk_stats.py), forced on CPU tensors: the same
numbers as the per-tensor device path, in a number of torch calls that does not grow with
the number of tensors."""

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from probe.capture.numbers import sketch, stats
from probe.capture.numbers.bulk_stats import bulk_device_stats


def _bucket():
    g = torch.Generator().manual_seed(0)
    with_nonfinite = torch.randn(40, generator=g)
    with_nonfinite[[3, 7]] = float("nan")
    with_nonfinite[11] = float("inf")
    with_nonfinite[12] = float("-inf")
    only_inf = torch.randn(9, generator=g)
    only_inf[0] = float("inf")
    return [
        torch.randn(32, 256, generator=g),
        torch.randn(7, 5, generator=g).t(),  # not contiguous
        torch.randn(300, generator=g, dtype=torch.float64) * 1e3 + 5,
        torch.tensor(2.5),  # zero-dimensional
        with_nonfinite,
        only_inf,
        torch.randn(64, 3, generator=g).to(torch.float16),
        torch.randn(50, generator=g).to(torch.bfloat16),
        torch.randint(-5, 5, (6, 6), generator=g),
        torch.rand(17, generator=g) > 0.5,
        torch.randn(8, generator=g, dtype=torch.complex64),
        torch.randn(33, 251, generator=g),
    ]


def _same(a, b, rel):
    if math.isnan(a):
        return math.isnan(b)
    return a == pytest.approx(b, rel=rel, abs=rel)


@pytest.mark.parametrize("sketch_size", [0, 16])
def test_bulk_statistics_equal_the_per_tensor_device_statistics(sketch_size):
    bucket = _bucket()
    per_tensor = stats.resolve_device_stats(
        [(*stats.device_stats(t, sketch_size), t.numel()) for t in bucket])
    bulk = stats.resolve_device_stats(
        [(*pair, t.numel()) for pair, t in zip(bulk_device_stats(bucket, sketch_size), bucket)])
    for tensor, (want, want_sketch), (got, got_sketch) in zip(bucket, per_tensor, bulk):
        low, high, mean, norm, nans, infs = got
        # order-free: min, max and the counts are exact
        assert (nans, infs) == want[4:], tensor
        for g, w in ((low, want[0]), (high, want[1])):
            assert (math.isnan(g) and math.isnan(w)) or g == w, tensor
        # sums in another order: rounding-level differences only
        rel = 1e-12 if tensor.dtype == torch.float64 else 1e-5
        assert _same(mean, want[2], rel) and _same(norm, want[3], rel), tensor
        # the same linear map, unfolded: equal to float32 rounding (NaN where the tensor has one)
        _assert_same_sketch(got_sketch, want_sketch)


def _assert_same_sketch(got, want):
    got, want = sketch.unpack(got), sketch.unpack(want)
    assert (got is None) == (want is None)
    if got is not None:
        scale = max((abs(w) for w in want if math.isfinite(w)), default=1.0) or 1.0
        for g, w in zip(got, want):
            assert (math.isnan(g) and math.isnan(w)) or g == pytest.approx(w, rel=1e-5, abs=1e-5 * scale)


class _CountOps(TorchDispatchMode):
    """Counts the torch operators that compute (views and detach launch nothing)."""

    FREE = {"view", "reshape", "_unsafe_view", "select", "detach", "alias", "t", "transpose",
            "as_strided", "_reshape_alias", "unsqueeze", "expand", "slice"}

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ not in self.FREE:
            self.count += 1
        return func(*args, **(kwargs or {}))


def _ops(fn) -> int:
    with _CountOps() as counter:
        fn()
    return counter.count


def test_bulk_statistics_take_a_fixed_number_of_computing_operators_per_bucket():
    g = torch.Generator().manual_seed(1)
    few = [torch.randn(32, 64, generator=g) for _ in range(4)]
    many = [torch.randn(32, 64, generator=g) for _ in range(64)]
    bulk_few, bulk_many = _ops(lambda: bulk_device_stats(few)), _ops(lambda: bulk_device_stats(many))
    per_tensor_many = _ops(lambda: [stats.device_stats(t) for t in many])
    # measured: 17 operators for 4 tensors and for 64, against 640 for device_stats one by one
    assert bulk_many == bulk_few
    assert bulk_many < per_tensor_many / 10


def test_bulk_sketches_take_a_fixed_number_of_computing_operators_per_bucket():
    g = torch.Generator().manual_seed(2)
    few = [torch.randn(32, 64, generator=g) for _ in range(4)]
    many = [torch.randn(32, 64, generator=g) for _ in range(64)]
    bulk_device_stats(few, 16)  # the sign tables are made once per process: not counted
    bulk_few = _ops(lambda: bulk_device_stats(few, 16))
    bulk_many = _ops(lambda: bulk_device_stats(many, 16))
    per_tensor_many = _ops(lambda: [stats.device_stats(t, 16) for t in many])
    assert bulk_many == bulk_few  # the sketch adds a fixed number of operators, not one per tensor
    assert bulk_many < per_tensor_many / 10


def _recorded(recorder, steps):
    """Rows of one call per entry of steps: (tensor, optional in-place write after it)."""
    for position, (tensor, write) in enumerate(steps):
        call = recorder.call("api", "", "torch.neg", position, "forward", "", 1)
        recorder.add(call, "input.0", "in", tensor)
        if write is not None:
            write(tensor)
    recorder.resolve()
    return recorder.rows


@pytest.mark.parametrize("sketch_size", [0, 16])
def test_recorder_bulk_rows_equal_per_tensor_rows_even_after_in_place_writes(monkeypatch, sketch_size):
    from probe.capture import recorder as recorder_module
    from probe.capture.recorder import Recorder
    from probe.config import Config

    monkeypatch.setattr(recorder_module, "BUCKET_TENSORS", 3)  # several flushes in one step

    def steps():
        g = torch.Generator().manual_seed(2)
        shared = torch.randn(16, 16, generator=g)
        return [(shared, lambda t: t.mul_(-3.0)),  # recorded, then written in place
                (shared, None),  # its new version: a second record
                (torch.randn(5, 7, generator=g).t(), None),
                (torch.randn(9, generator=g).to(torch.float16), lambda t: t.zero_()),
                (torch.arange(-4, 8), None),
                (torch.tensor([float("nan"), 1.0, float("inf")]), None),
                (torch.randn(40, generator=g, dtype=torch.float64), None)]

    config = Config(sketch_size=sketch_size)
    per_tensor = _recorded(Recorder(config, defer_stats=True, bulk_stats=False), steps())
    bulk = _recorded(Recorder(config, defer_stats=True, bulk_stats=True), steps())
    assert len(per_tensor) == len(bulk) == 7
    for a, b in zip(per_tensor, bulk):
        assert a[:13] == b[:13] and a[19:-1] == b[19:-1]
        low, high, mean, norm, nans, infs = b[13:19]
        assert (nans, infs) == a[17:19]
        assert str((low, high)) == str(a[13:15])  # exact, NaN included
        assert (mean, norm) == pytest.approx(a[15:17], rel=1e-5, abs=1e-6, nan_ok=True)
        _assert_same_sketch(b[-1], a[-1])  # the sketch of the same (frozen) values
    # the first record kept the values it had when recorded, not the later write's
    assert bulk[0][13:17] != bulk[1][13:17]
