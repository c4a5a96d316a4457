"""Statistics of a bucket of tensors in a handful of torch calls: the accelerator path.

``stats.device_stats`` costs about 14 kernel launches per tensor (aminmax, casts, sum, norm,
stack, isnan, isinf, sums, stack, to(float64)); on a GPU the device sits idle while Python
launches them. ``bulk_device_stats`` returns the same per-tensor pair for a whole list, with
a fixed number of calls per (device, dtype) group, however many tensors it holds:

    flat = cat(flattened tensors)                  one copy of the bucket
    min, max, sum = segment_reduce(flat, ...)      one call each, segments = the tensors
    norms = _foreach_norm(tensors)                 one multi-tensor call on CUDA
    nan, inf = segment sums of isnan / isinf       two more each
    stack, to(float64)

Per tensor only views remain (reshape, and a row of the results), which launch nothing.
min, max and the NaN/Inf counts are exactly device_stats'; sum and norm are the same sums
in another order (rounding-level differences, like device_stats against host_stats).

Sketches (sketch.py) are still one call per tensor here: the fold of a whole bucket is the
next step (docs/format.md, "Folding into a bulk statistics pass").

The recorder uses it when ``recorder.BULK_STATS`` is on (off by default until measured on a
GPU): each record's values are frozen by one copy at record time, since the tensor may be
written in place before the bucket is flushed. See docs/performance.md.
"""

from __future__ import annotations

import torch

from probe.capture import sketch
from probe.capture.stats import _HALF_FLOATS, _as_real, device_stats

_COUNT_DTYPE = torch.float64  # segment sums of 0/1: exact up to 2**53 elements


def _accumulation(dtype: torch.dtype) -> torch.dtype:
    """The dtype device_stats accumulates a real tensor of this dtype in."""
    accumulate = torch.float32 if dtype in _HALF_FLOATS else dtype
    if not accumulate.is_floating_point or accumulate.itemsize < 4:
        accumulate = torch.float32
    return accumulate


def bulk_device_stats(tensors: list[torch.Tensor], sketch_size: int = 0) -> list[tuple]:
    """[device_stats(t, sketch_size) for t in tensors], computed per (device, dtype) group
    in a fixed number of torch calls. No host synchronisation except one small copy of the
    segment lengths per group; every tensor must be non-empty (as for device_stats)."""
    results: list = [None] * len(tensors)
    groups: dict = {}
    for position, tensor in enumerate(tensors):
        x = _as_real(tensor.detach())
        groups.setdefault((x.device, x.dtype), []).append((position, x))
    for (device, dtype), members in groups.items():
        try:
            pairs = _group_stats([x for _, x in members], _accumulation(dtype))
        except (RuntimeError, TypeError, NotImplementedError):
            # a dtype the segment reductions do not support (float8, ...): one by one
            pairs = [device_stats(x) for _, x in members]
        for (position, _), (values, counts) in zip(members, pairs):
            if sketch_size > 0:
                try:
                    values = torch.cat((values, sketch.sketch(tensors[position], sketch_size)))
                except (RuntimeError, TypeError, ValueError, NotImplementedError):
                    pass  # as device_stats: the statistics stay, without a sketch
            results[position] = (values, counts)
    return results


def _group_stats(xs: list[torch.Tensor], accumulate: torch.dtype) -> list[tuple]:
    """(float64[min, max, sum, norm], int64[nan, inf]) per tensor of one device and dtype."""
    flats = [x.reshape(-1) for x in xs]
    device = flats[0].device
    lengths = torch.tensor([f.numel() for f in flats], device=device)
    flat = torch.cat(flats)
    low = torch.segment_reduce(flat, "min", lengths=lengths)
    high = torch.segment_reduce(flat, "max", lengths=lengths)
    total = torch.segment_reduce(flat.to(accumulate), "sum", lengths=lengths)
    norms = torch.stack(torch._foreach_norm(flats, 2, dtype=accumulate))
    values = torch.stack((low.to(accumulate), high.to(accumulate), total, norms), dim=1)
    values = values.to(torch.float64)
    nans = torch.segment_reduce(torch.isnan(flat).to(_COUNT_DTYPE), "sum", lengths=lengths)
    infs = torch.segment_reduce(torch.isinf(flat).to(_COUNT_DTYPE), "sum", lengths=lengths)
    counts = torch.stack((nans, infs), dim=1).to(torch.int64)
    return [(values[row], counts[row]) for row in range(len(xs))]
