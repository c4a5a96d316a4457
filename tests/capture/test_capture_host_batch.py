"""probe/capture/numbers/host_batch.py: CPU statistics and sketches a batch at a time give the numbers
the per-record path (stats.host_stats_and_sketch) gives, whatever the tensors, the arena's
fill, the threads that record them, or what happens to a tensor after it was recorded."""

import math
import threading

import numpy as np
import pytest
import torch

from probe.capture.numbers import host_batch, sketch, stats
from probe.capture.numbers.host_batch import SMALL_MAX, HostBatch
from probe.capture.recorder import Recorder
from probe.config import Config

BLOCK = host_batch.BLOCK


def _tensors(dtype):
    generator = torch.Generator().manual_seed(7)

    def randn(*shape):
        return torch.randn(*shape, generator=generator, dtype=dtype)

    return [
        randn(()),  # 0-dim
        randn(1),
        randn(BLOCK - 1), randn(BLOCK), randn(BLOCK + 1),  # row boundaries
        randn(32, 256) * 3 + 1,
        randn(256, 32).t(),  # non-contiguous: copied in row-major order
        randn(64 * BLOCK) * 1e-3 - 5,  # the largest tensor the batch takes
        torch.zeros(300, dtype=dtype),
        torch.arange(1000, dtype=dtype),
    ]


def _batched(tensors, k):
    batch = HostBatch(k)
    slots = [batch.add(t.numpy()) for t in tensors]
    batch.compute()
    return [slot.result for slot in slots]


def _assert_same_numbers(got, want, dtype):
    (numbers, sketched), (want_numbers, want_sketch) = got, want
    sketched, want_sketch = sketch.unpack(sketched), sketch.unpack(want_sketch)
    assert numbers[0] == want_numbers[0] and numbers[1] == want_numbers[1]  # min, max exactly
    assert numbers[4:] == want_numbers[4:]  # NaN and Inf counts exactly
    rel = 1e-5 if dtype == torch.float32 else 1e-12
    assert numbers[2] == pytest.approx(want_numbers[2], rel=rel, abs=rel * want_numbers[3] / 10)
    assert numbers[3] == pytest.approx(want_numbers[3], rel=rel)
    assert (sketched is None) == (want_sketch is None)
    if sketched is not None:
        # the same linear map; the products may be blocked differently (float32 rounding)
        scale = max(map(abs, want_sketch)) or 1.0
        assert sketched == pytest.approx(want_sketch, abs=rel * scale)


@pytest.mark.parametrize("k", [0, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_batched_numbers_equal_the_per_record_numbers(dtype, k):
    tensors = _tensors(dtype)
    for got, tensor in zip(_batched(tensors, k), tensors):
        _assert_same_numbers(got, stats.host_stats_and_sketch(tensor, k), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_nan_inf_and_huge_values_get_exactly_the_per_record_numbers(dtype):
    huge = 1e20 if dtype == torch.float32 else 1e160  # squares beyond the dtype's range
    tensors = [torch.tensor([1.0, float("nan"), 2.0], dtype=dtype),
               torch.tensor([float("inf"), -float("inf"), 0.0, 3.0], dtype=dtype),
               torch.full((500,), huge, dtype=dtype),
               torch.tensor([-huge, 1.0], dtype=dtype),
               torch.randn(300, dtype=dtype)]
    batched = _batched(tensors, 16)
    for (numbers, _), tensor in zip(batched[:4], tensors):
        assert str(numbers) == str(stats.host_stats(tensor))  # NaN-aware exact equality
    assert batched[0][0][4:] == (1, 0) and batched[1][0][4:] == (0, 2)
    if dtype == torch.float32:  # float32 squares beyond float32 are summed in float64
        assert math.isfinite(batched[2][0][3]) and batched[2][0][3] > huge
    _assert_same_numbers(batched[4], stats.host_stats_and_sketch(tensors[4], 16), dtype)


def test_an_arena_filled_many_times_over_gives_every_tensor_its_own_numbers(monkeypatch):
    monkeypatch.setattr(host_batch, "CAPACITY", 40 * BLOCK)  # a few tensors per arena
    tensors = [torch.randn(n) for n in (10, 600, 2000, 3000, 251, 5000, 7, 9000, 260) * 4]
    for got, tensor in zip(_batched(tensors, 16), tensors):
        _assert_same_numbers(got, stats.host_stats_and_sketch(tensor, 16), torch.float32)


def test_values_are_frozen_when_recorded_not_when_computed():
    batch = HostBatch(16)
    tensor = torch.randn(1000)
    want = stats.host_stats_and_sketch(tensor, 16)
    slot = batch.add(tensor.numpy())
    tensor.mul_(10.0)  # an in-place write before the batch is computed
    batch.compute()
    _assert_same_numbers(slot.result, want, torch.float32)


def test_records_added_from_several_threads_all_get_their_own_numbers(monkeypatch):
    monkeypatch.setattr(host_batch, "CAPACITY", 30 * BLOCK)
    batch = HostBatch(8)
    per_thread = {name: [torch.full((n,), float(name * 100 + n)) for n in range(1, 400, 37)]
                  for name in range(4)}
    slots = {}

    def record(name):
        slots[name] = [batch.add(t.numpy()) for t in per_thread[name]]

    threads = [threading.Thread(target=record, args=(name,)) for name in per_thread]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    batch.compute()
    for name, tensors in per_thread.items():
        for slot, tensor in zip(slots[name], tensors):
            low, high, mean, _, _, _ = slot.result[0]
            assert low == high == mean == tensor[0].item()


def _recorded_rows(host_batch_on, tensors, writes):
    recorder = Recorder(Config(), host_batch=host_batch_on, defer_stats=False)  # the host path
    for position, tensor in enumerate(tensors):
        call = recorder.call("api", "", "torch.neg", position, "forward", "", 1)
        recorder.add(call, "input.0", "in", tensor)
        if position in writes:
            tensor.add_(1.0)  # in place after recording: the row keeps the recorded values
    recorder.add(recorder.call("api", "", "torch.neg", 99, "forward", "", 1), "input.0", "in", tensors[0])
    recorder.resolve()
    return recorder.rows


def test_recorder_rows_with_the_batch_equal_rows_computed_per_record():
    def fresh():
        torch.manual_seed(3)
        return [torch.randn(8, 16), torch.randn(300, requires_grad=True), torch.randn(70000),
                torch.randn(4, 4, dtype=torch.float64), torch.arange(6), torch.randn(3).half(),
                torch.randn(5, 5).t(), torch.randn(2_000_000)]

    batched = _recorded_rows(True, fresh(), writes={0, 2})
    per_record = _recorded_rows(False, fresh(), writes={0, 2})
    assert len(batched) == len(per_record) == 9
    for a, b in zip(batched, per_record):
        assert a[:13] == b[:13] and a[19:-1] == b[19:-1]
        assert a[13:15] == b[13:15] and a[17:19] == b[17:19]  # min, max, counts exactly
        assert a[15:17] == pytest.approx(b[15:17], rel=1e-5, abs=1e-6)
        got, want = sketch.unpack(a[-1]), sketch.unpack(b[-1])
        assert got == pytest.approx(want, abs=1e-5 * max(map(abs, want)))


# ---------------------------------------------------------------- larger tensors: deferred product

def _larger_tensors(dtype):
    generator = torch.Generator().manual_seed(11)

    def randn(*shape):
        return torch.randn(*shape, generator=generator, dtype=dtype)

    span = sketch.GROUPS * BLOCK
    return [
        randn(SMALL_MAX + 1),  # the smallest tensor that is not batched
        randn(70000) * 5 - 2,
        randn(5 * span),  # whole super-rows: no tail
        randn(600, 300).t(),  # non-contiguous: folded in row-major order
        randn(sketch.NUMPY_MAX + 5),  # folded by torch
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_deferred_sketches_of_larger_tensors_equal_the_sketch_computed_at_once(dtype, monkeypatch):
    monkeypatch.setattr(host_batch, "CAPACITY", 40 * BLOCK)  # the arena fills and is reused
    tensors = _larger_tensors(dtype)
    batch = HostBatch(16)
    wants = [stats.host_stats_and_sketch(t, 16) for t in tensors]
    slots = [batch.add_folded(t.numpy(), want[0]) for t, want in zip(tensors, wants)]
    batch.compute()
    for slot, want in zip(slots, wants):
        assert slot.result[0] is want[0]  # the statistics given, untouched
        _assert_same_numbers(slot.result, want, dtype)


def test_fold_into_writes_the_fold_the_device_path_computes():
    for n in (BLOCK - 3, 3 * BLOCK, sketch.GROUPS * BLOCK * 3 + 17, 100_000):
        values = torch.randn(n, dtype=torch.float64)
        out = np.full(sketch.GROUPS * BLOCK, np.nan)
        rows = sketch.fold_into(values.numpy(), out)
        fold = sketch.fold_sign_table(values.device, values.dtype, n // (sketch.GROUPS * BLOCK) + 1)
        want = sketch.fold_values(values, fold, lambda size: torch.zeros(size, dtype=values.dtype))
        assert rows == want.shape[0]
        np.testing.assert_allclose(out[: rows * BLOCK], want.reshape(-1).numpy(), rtol=1e-12, atol=1e-12)


def test_a_larger_tensor_written_in_place_after_recording_keeps_its_recorded_sketch():
    batch = HostBatch(16)
    tensor = torch.randn(50_000)
    want = stats.host_stats_and_sketch(tensor, 16)
    slot = batch.add_folded(tensor.numpy(), want[0])
    tensor.mul_(-3.0)
    batch.compute()
    _assert_same_numbers(slot.result, want, torch.float32)


def test_larger_tensors_with_nan_are_sketched_at_once_not_deferred():
    tensor = torch.randn(50_000)
    tensor[7] = float("nan")
    numbers, sketched, slot = stats.host_stats_and_later_sketch(
        tensor, 16, HostBatch(16).add_folded)
    assert slot is None and numbers[4] == 1
    assert len(sketch.unpack(sketched)) == 16  # NaN entries: compare reads the counts (docs/format.md)
    healthy = torch.randn(50_000)
    numbers, sketched, slot = stats.host_stats_and_later_sketch(healthy, 16, HostBatch(16).add_folded)
    assert sketched is None and isinstance(slot, host_batch.HostSlot)


def test_the_first_fold_sign_is_plus_one_so_a_fold_takes_a_small_tensors_row_signs():
    # HostBatch.add_folded puts a fold's rows where a small tensor's first GROUPS rows go:
    # they are signed F[0] * S[g], and a fold needs S[g]
    assert sketch.fold_signs(1)[0] == 1.0


def _step(batch, tensors):
    """Record tensors as a training step does (copies, or folds for the larger ones), compute,
    and return (result, the per-record numbers) per tensor."""
    slots, wants = [], []
    for tensor in tensors:
        want = stats.host_stats_and_sketch(tensor, batch.sketch_size)
        wants.append(want)
        if tensor.numel() > SMALL_MAX:
            slots.append(batch.add_folded(tensor.numpy(), want[0]))
        else:
            slots.append(batch.add(tensor.numpy()))
    batch.compute()
    return [(slot.result, want) for slot, want in zip(slots, wants)]


def test_folds_and_copies_sharing_an_arena_keep_their_own_numbers(monkeypatch):
    monkeypatch.setattr(host_batch, "CAPACITY", 50 * BLOCK)
    small = [torch.randn(n) for n in (300, 5000, 17)]
    small[1][3] = float("nan")  # computed alone, next to the folds
    large = [torch.randn(n) * 1e3 for n in (30_000, 70_000)]
    tensors = (small[0], large[0], small[1], large[1], small[2], large[0])
    for got, want in _step(HostBatch(16), tensors):
        if math.isnan(want[0][0]):
            assert str(got[0]) == str(want[0])
        else:
            _assert_same_numbers(got, want, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_layout_seen_in_an_earlier_step_gives_this_steps_numbers(dtype):
    # the layout (sizes, starts, row signs) is derived once and found again; the values are not
    batch = HostBatch(16)
    sizes = (300, 30_000, 8192, 17, 70_000, 1)
    for scale in (1.0, -4.0, 1e3):
        for got, want in _step(batch, [torch.randn(n, dtype=dtype) * scale for n in sizes]):
            _assert_same_numbers(got, want, dtype)
    assert len(batch._arenas[torch.empty(0, dtype=dtype).numpy().dtype].layouts) == 1


def test_the_same_copies_beside_other_folds_are_a_new_layout():
    batch = HostBatch(16)
    small = (300, 5000)
    for large in ((30_000,), (70_000,), (30_000, 20_000), ()):
        tensors = [torch.randn(n) for n in small + large]
        for got, want in _step(batch, tensors):
            _assert_same_numbers(got, want, torch.float32)


def test_the_layouts_kept_stay_bounded_when_every_step_differs():
    batch = HostBatch(16)
    for n in range(1, 3 * host_batch.LAYOUTS_KEPT):
        for got, want in _step(batch, [torch.randn(n * 37), torch.randn(20_000 + n)]):
            _assert_same_numbers(got, want, torch.float32)
        assert len(batch._arenas[np.dtype(np.float32)].layouts) <= host_batch.LAYOUTS_KEPT


def test_layouts_whose_signs_exceed_the_byte_budget_are_used_but_not_kept(monkeypatch):
    tensors = [torch.randn(n) for n in (5000, 300, 40_000)]
    kept = {}
    for budget in (1 << 30, 1000):  # room for every layout; less than one layout's signs
        monkeypatch.setattr(host_batch, "LAYOUT_BYTES", budget)
        batch = HostBatch(64)
        for _ in range(2):
            for got, want in _step(batch, tensors):
                _assert_same_numbers(got, want, torch.float32)
        arena = batch._arenas[np.dtype(np.float32)]
        assert arena.layout_bytes <= budget
        kept[budget] = len(arena.layouts)
    assert kept == {1 << 30: 1, 1000: 0}
