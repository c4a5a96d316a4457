"""Statistics and sketches of a bucket of tensors in a handful of torch calls: the accelerator
path.

``stats.device_stats`` costs about 14 kernel launches per tensor (aminmax, casts, sum, norm,
stack, isnan, isinf, sums, stack, to(float64)) and its sketch about 7 more; on a GPU the device
sits idle while Python launches them. ``bulk_device_stats`` returns the same per-tensor pair
for a whole list, with a fixed number of calls per (device, dtype) group, however many tensors
it holds:

    flat = cat(flattened tensors)                  one copy of the bucket
    min, max, sum = segment_reduce(flat, ...)      one call each, segments = the tensors
    norms = _foreach_norm(tensors)                 one multi-tensor call on CUDA
    nan, inf = segment sums of isnan / isinf       two more each
    sketches (bulk_sketches)                       cat with zero padding, one product, two
                                                   gathers, one segment sum
    stack, cat, to(float64)

Per tensor only views remain (reshape, and a row of the results), which launch nothing.
min, max and the NaN/Inf counts are exactly device_stats'; sum and norm are the same sums
in another order, and the sketches the same linear map evaluated unfolded (rounding-level
differences, like device_stats against host_stats).

The recorder uses it when ``recorder.BULK_STATS`` is on (off by default until measured on a
GPU): each record's values are frozen by one copy at record time, since the tensor may be
written in place before the bucket is flushed. See docs/performance.md.
"""

from __future__ import annotations

import numpy as np
import torch

from probe import compat
from probe.capture.numbers import sketch
from probe.capture.numbers.stats import HALF_FLOATS, as_real, device_stats

_COUNT_DTYPE = torch.float64  # segment sums of 0/1: exact up to 2**53 elements


def _accumulation(dtype: torch.dtype) -> torch.dtype:
    """The dtype device_stats accumulates a real tensor of this dtype in."""
    accumulate = torch.float32 if dtype in HALF_FLOATS else dtype
    if not accumulate.is_floating_point or accumulate.itemsize < 4:
        accumulate = torch.float32
    return accumulate


def bulk_device_stats(tensors: list[torch.Tensor], sketch_size: int = 0) -> list[tuple]:
    """[device_stats(t, sketch_size) for t in tensors], computed per (device, dtype) group
    in a fixed number of torch calls. No host synchronisation except small copies of the
    segment layout per group; every tensor must be non-empty (as for device_stats)."""
    results: list = [None] * len(tensors)
    groups: dict = {}
    for position, tensor in enumerate(tensors):
        groups.setdefault((tensor.device, tensor.dtype), []).append(position)
    for positions in groups.values():
        members = [tensors[p].detach() for p in positions]
        try:
            pairs = _group_stats(members, sketch_size)
        except (RuntimeError, TypeError, NotImplementedError):
            # a dtype the segment reductions do not support (float8, ...): one by one
            pairs = [device_stats(x, sketch_size) for x in members]
        for position, pair in zip(positions, pairs):
            results[position] = pair
    return results


def bulk_sketches(tensors: list[torch.Tensor], k: int) -> list[torch.Tensor | None]:
    """[sketch.sketch(t, k) for t in tensors] (None where a tensor has no sketch: quantized
    values), a (device, dtype) group at a time in a fixed number of torch calls:

        lay the values out one tensor after another, each padded to whole rows of BLOCK
        (one cat with slices of a cached zero tensor); one (rows, BLOCK) @ (BLOCK, k)
        product; each row's products signed by F[r // GROUPS] * S[r % GROUPS] (r: the row
        within its tensor, two gathers); one index_add_ of the rows into (tensors, k) in
        float64.

    The same linear map as sketch.sketch, evaluated unfolded (k multiply-adds per value: on
    an accelerator the product is not the cost, the launches are), so the numbers agree to
    rounding."""
    results: list = [None] * len(tensors)
    groups: dict = {}
    for position, tensor in enumerate(tensors):
        try:
            flat = sketch.sketch_values(tensor)
        except (RuntimeError, TypeError, ValueError, NotImplementedError):
            continue  # values a sketch cannot read (quantized): the statistics stay
        groups.setdefault((flat.device, flat.dtype), []).append((position, flat))
    for (device, dtype), members in groups.items():
        flats = [flat for _, flat in members]
        try:
            rows = _group_sketches(flats, device, dtype, k)
        except (RuntimeError, TypeError, NotImplementedError):
            rows = [sketch.sketch(flat, k) for flat in flats]
        for (position, _), row in zip(members, rows):
            results[position] = row
    return results


def _group_sketches(flats: list[torch.Tensor], device, dtype, k: int) -> list[torch.Tensor]:
    block, groups = sketch.BLOCK, sketch.GROUPS
    sizes = [flat.numel() for flat in flats]
    row_counts = [-(-size // block) for size in sizes]
    zeros = _zeros(device, dtype, block)
    pieces = []
    for flat, size, rows in zip(flats, sizes, row_counts):
        pieces.append(flat)
        if rows * block != size:
            pieces.append(zeros[: rows * block - size])
    table = torch.cat(pieces).view(-1, block)
    columns, row_signs = sketch.projection_tables(device, dtype, k)
    products = table @ columns
    # the layout, made on the host and copied once: each row's super-row and group within
    # its tensor, and the tensors' row counts
    local = np.arange(table.shape[0]) - np.repeat(np.cumsum(row_counts) - row_counts, row_counts)
    layout = torch.from_numpy(np.concatenate((local // groups, local % groups, row_counts)))
    layout = layout.to(device)
    rows = table.shape[0]
    fold = sketch.fold_sign_table(device, dtype, max(row_counts) // groups + 1)
    signed = products * fold[layout[:rows]].unsqueeze(1) * row_signs[layout[rows:2 * rows]]
    # segment_reduce, not index_add_: a fixed summation order (deterministic on CUDA too)
    out = torch.segment_reduce(signed.to(torch.float64), "sum", lengths=layout[2 * rows:], axis=0)
    return list(out)


_zero_tables: dict = {}


def _zeros(device, dtype, size: int) -> torch.Tensor:
    key = (device, dtype)
    found = _zero_tables.get(key)
    if found is None:
        found = _zero_tables[key] = torch.zeros(size, device=device, dtype=dtype)
    return found


def _group_stats(members: list[torch.Tensor], sketch_size: int) -> list[tuple]:
    """(float64[min, max, sum, norm, *sketch], int64[nan, inf]) per tensor of one device and
    dtype: rows of two matrices, so a record costs no launch of its own."""
    xs = [as_real(x) for x in members]
    accumulate = _accumulation(xs[0].dtype)
    flats = [x.reshape(-1) for x in xs]
    device = flats[0].device
    lengths = torch.tensor([f.numel() for f in flats], device=device)
    flat = torch.cat(flats)
    low = torch.segment_reduce(flat, "min", lengths=lengths)
    high = torch.segment_reduce(flat, "max", lengths=lengths)
    total = torch.segment_reduce(flat.to(accumulate), "sum", lengths=lengths)
    norms = torch.stack(compat.foreach_norm(flats, 2, dtype=accumulate))
    values = torch.stack((low.to(accumulate), high.to(accumulate), total, norms), dim=1)
    values = values.to(torch.float64)
    if sketch_size > 0:
        try:
            values = torch.cat((values, torch.stack(bulk_sketches(members, sketch_size))), dim=1)
        except (TypeError, ValueError):  # a tensor without a sketch (None): statistics only
            pass
    nans = torch.segment_reduce(torch.isnan(flat).to(_COUNT_DTYPE), "sum", lengths=lengths)
    infs = torch.segment_reduce(torch.isinf(flat).to(_COUNT_DTYPE), "sum", lengths=lengths)
    counts = torch.stack((nans, infs), dim=1).to(torch.int64)
    return [(values[row], counts[row]) for row in range(len(xs))]
