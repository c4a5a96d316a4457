"""The tensor read-ahead serves planned pairs in order, steps aside otherwise, never hangs."""

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
