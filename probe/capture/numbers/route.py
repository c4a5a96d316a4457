"""Where a tensor's numbers come from: computed now, a CPU batch at a time, or a device bucket.

``numbers_of`` is the one place that decides it, for the recorder and for fingerprints alike:

* an empty tensor: its numbers now (numel 0, counts 0, the four statistics NaN);
* read later (an accelerator's tensor, or any tensor with PROBE_DEVICE_PATH=1): a
  DeviceBucket holds it (device_bucket.py: a fixed number of launches per bucket, one copy to
  the host per step); a dtype the bucket does not read (complex, float8) gets its statistics
  on the device at once, copied with the others of its device when resolved;
* a CPU tensor: through a HostBatch (host_batch.py: small float tensors copied into an arena,
  larger ones' sketches folded into it), else computed now (stats.host_stats_and_sketch).

It returns ``(numbers, sketch, pending)``: numbers (min, max, mean, norm, nan_count,
inf_count) and the packed sketch when they are known now; otherwise ``pending`` is where they
arrive (``pending.result`` = (numbers, sketch) once resolved: a HostBatch's ``compute()``, a
DeviceBucket's ``resolve()``, ``resolve_device_stats`` for the rest) and numbers are UNKNOWN.
A non-strided tensor (sparse) is described by its stored values.
"""

from __future__ import annotations

import torch

from probe import compat
from probe.capture.numbers import stats
from probe.capture.numbers.device_bucket import DTYPES as BUCKET_DTYPES
from probe.capture.numbers.host_batch import HostBatch

NAN = float("nan")
#: numbers not known (yet): NaN statistics, counts -1
UNKNOWN = (NAN, NAN, NAN, NAN, -1, -1)
_STRIDED = torch.strided


class DeviceStats:
    """Statistics computed on the device for a dtype the bucket does not read; ``result`` is
    filled by resolve_device_stats."""

    __slots__ = ("values", "counts", "numel", "result")

    def __init__(self, values, counts, numel: int):
        self.values, self.counts, self.numel = values, counts, numel
        self.result = None


def numbers_of(tensor: torch.Tensor, sketch_size: int, later: bool, batch: HostBatch | None,
               bucket, watched: torch.Tensor | None = None) -> tuple:
    """(numbers, sketch, pending) of tensor (module docstring). later: read it later, through
    ``bucket`` (a DeviceBucket); batch: the HostBatch for CPU tensors, or None (computed now);
    watched: the tensor whose version says whether a held tensor changed (a DTensor)."""
    values = tensor if tensor.layout is _STRIDED else stored_values(tensor)
    numel = values.numel()
    if numel == 0:
        return stats.EMPTY_STATS, None, None
    if later:
        if values.dtype in BUCKET_DTYPES and values.layout is _STRIDED:
            return UNKNOWN, None, bucket.add(values, watched)
        return UNKNOWN, None, DeviceStats(*stats.device_stats(values, sketch_size), numel)
    if batch is not None:
        numbers, sketched, pending = batch.take(values)
        return (UNKNOWN if numbers is None else numbers), sketched, pending
    numbers, sketched = stats.host_stats_and_sketch(values, sketch_size)
    return numbers, sketched, None


def resolve_device_stats(waiting: list) -> int:
    """Fill the ``result`` of every DeviceStats in waiting (others are left alone): one copy to
    the host per device for the whole list. Returns the copies made."""
    found = [item for item in waiting if type(item) is DeviceStats and item.result is None]
    if not found:
        return 0
    devices = {item.values.device for item in found}
    results = stats.resolve_device_stats([(item.values, item.counts, item.numel) for item in found])
    for item, result in zip(found, results):
        item.result = result
        item.values = item.counts = None  # the device memory goes now
    return 2 * len(devices)  # values and counts: stats.resolve_device_stats


def stored_values(tensor: torch.Tensor) -> torch.Tensor:
    """Sparse and other non-strided layouts: the stored values (docs/capture.md)."""
    try:
        if tensor.layout == torch.sparse_coo:
            return compat.sparse_values(tensor)
        return tensor.values()
    except (RuntimeError, NotImplementedError, AttributeError):
        return tensor.new_empty(0)
