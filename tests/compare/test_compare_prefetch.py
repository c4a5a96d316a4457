"""The tensor read-ahead serves planned pairs in order, steps aside otherwise, never hangs."""

import json
import threading

import numpy as np
import pytest

from probe.comparison.metrics import Prefetcher
from probe.errors import DumpFormatError


def _fetch(log, fail_on=None):
    def fetch(tensor_id):
        if tensor_id == fail_on:
            raise DumpFormatError(f"tensor {tensor_id} is corrupt")
        log.append(tensor_id)
        return np.full(3, tensor_id, np.float32)
    return fetch


def test_planned_pairs_are_served_in_order():
    log_a, log_b = [], []
    keys = [(0, 10), (1, 11), (2, 12)]
    prefetcher = Prefetcher(keys, _fetch(log_a), _fetch(log_b))
    try:
        for id_a, id_b in keys:
            a, b = prefetcher.take((id_a, id_b))
            assert a[0] == id_a and b[0] == id_b
    finally:
        prefetcher.close()
    assert log_a == [0, 1, 2] and log_b == [10, 11, 12]


def test_unplanned_skipped_or_repeated_keys_are_left_to_the_caller():
    keys = [(0, 0), (1, 1), (2, 2), (3, 3)]
    prefetcher = Prefetcher(keys, _fetch([]), _fetch([]))
    try:
        assert prefetcher.take((9, 9)) is None
        assert prefetcher.take((2, 2))[0][0] == 2  # (0, 0) and (1, 1) are skipped
        assert prefetcher.take((1, 1)) is None  # asked after a later key: not served
        assert prefetcher.take((2, 2)) is None  # asked twice
        assert prefetcher.take((3, 3))[1][0] == 3
    finally:
        prefetcher.close()


def test_a_read_error_reaches_the_measuring_thread():
    prefetcher = Prefetcher([(0, 0), (1, 1)], _fetch([], fail_on=1), _fetch([]))
    try:
        assert prefetcher.take((0, 0)) is not None
        with pytest.raises(DumpFormatError, match="corrupt"):
            prefetcher.take((1, 1))
    finally:
        prefetcher.close()


def test_close_stops_the_reader_without_consuming_everything():
    prefetcher = Prefetcher([(i, i) for i in range(100)], _fetch([]), _fetch([]))
    prefetcher.take((0, 0))
    prefetcher.close()
    assert not any(t.name == "probe-compare-prefetch" and t.is_alive() for t in threading.enumerate())


def _mapped_dumps(root):
    """Two dumps of 8 float32 tensors each large enough to be mapped (mapped.MIN_BYTES), B = A + noise
    in every element, and bfloat16 copies of them (decoded, so not mapped)."""

    import torch

    from probe.dump import mapped
    from scripts_dump.dumpkit import make_row, write_step

    generator = torch.Generator().manual_seed(0)
    size = mapped.MIN_BYTES // 2
    base = [torch.randn(size, generator=generator) for _ in range(8)]
    for side, noise in (("a", 0.0), ("b", 1e-3)):
        tensors = [t + noise * torch.randn(size, generator=generator) for t in base]
        tensors += [t.bfloat16() for t in tensors[:2]]
        rows = [make_row(module=f"layers.{i}", seq=i, dtype=str(t.dtype).removeprefix("torch."),
                         shape=json.dumps([size]), numel=size, tensor_id=i, min=float(t.min()), max=float(t.max()),
                         mean=float(t.float().mean()), norm=float(t.float().norm()))
                for i, t in enumerate(tensors)]
        write_step(root / side, 0, tensors=tensors, rows=rows)
    return str(root / "a"), str(root / "b")


def test_a_compare_reading_mapped_tensors_measures_what_copies_measure(tmp_path, monkeypatch):
    """More tensor pairs than the read-ahead holds, each array a mapping of its file while it is
    measured: the same metrics, to the last digit, as a compare that copies every tensor."""
    from probe.comparison import load
    from probe.comparison.api import compare

    a, b = _mapped_dumps(tmp_path)
    seen = []
    mapped_fetch = load.tensor_fetch

    def watched(step_file):
        fetch = mapped_fetch(step_file)

        def read(tensor_id):
            values = fetch(tensor_id)
            seen.append(values.flags.writeable)
            return values
        return read

    monkeypatch.setattr(load, "tensor_fetch", watched)
    through_mappings = compare(a, b).to_dict()
    assert seen.count(False) == 16 and seen.count(True) == 4  # 8 float32 pairs mapped, 2 bfloat16 pairs decoded
    monkeypatch.setattr(load, "tensor_fetch", lambda step_file: step_file.tensor)
    assert compare(a, b).to_dict() == through_mappings


def test_only_large_pairs_not_mapped_on_both_sides_are_read_ahead():
    """A small pair is read where it is measured (a thread's hand-over costs more than it
    saves); a large one that must be decoded is read ahead; one mapped on both sides is not."""
    from types import SimpleNamespace

    from probe.comparison.measure import READ_AHEAD_MIN_ELEMENTS, read_ahead_keys

    big = READ_AHEAD_MIN_ELEMENTS
    sizes = [16, big - 1, big, big, big, 16]
    dtypes = ["bfloat16", "bfloat16", "bfloat16", "float32", "bfloat16", "bfloat16"]
    columns = {"dtype": dtypes, "shape": [json.dumps([n]) for n in sizes], "numel": sizes,
               "tensor_id": [0, 1, 2, 3, -1, 5]}
    paired = [SimpleNamespace(a=row, b=row) for row in range(len(sizes))]
    maps = lambda dtype: dtype == "float32"  # noqa: E731 (as MappedFetch.maps: native dtypes)
    # row 2: large bfloat16, decoded; row 3: large float32, mapped on both sides; row 4: no tensor stored
    assert read_ahead_keys(columns, columns, paired, maps, maps) == [(2, 2)]
    assert read_ahead_keys(columns, columns, paired) == [(2, 2), (3, 3)]  # a format that maps nothing
