"""The sketch of a DTensor shard, taken with the projection entries of its logical positions.

A sketch is linear and the coefficient of a value depends only on its position in the flat
(row-major) tensor (capture/numbers/sketch.py): R[j, i] = F[i // (GROUPS*BLOCK)] * S[(i // BLOCK) %
GROUPS, j] * P[i % BLOCK, j]. So when each rank sketches its shard with the entries of the
positions the shard holds in the logical tensor, the shards' sketches add up to the logical
tensor's sketch, and compare sums them (comparison/shards.py) without any rank reading
another's values. Every shard whose placement gives the logical shape and the shard's offset
is a rectangular block of the logical tensor and is sketched this way (``shard_layout``):

* One contiguous run of the logical flat index: ``Shard(0)`` (a block of rows: FSDP2's
  parameters and gradients, ColwiseParallel's weight and bias), or ``Shard(d)`` where every
  dimension before d has size 1. A shard starting at flat position o is the plain sketch of
  its values with the fold table read from super-row o // (GROUPS*BLOCK) on and the first
  super-row's values shifted by o % (GROUPS*BLOCK): one pass over the values, as for any
  tensor.
* Any other block (``Shard(1)`` of a matrix: RowwiseParallel's weight, a column block; a
  2-D mesh's ``Shard(0)`` x ``Shard(1)``; ``Shard(1)`` of a 3-D tensor): runs of `length`
  values, one per index of the dimensions before the last one the shard splits, each
  contiguous in the shard and in the logical tensor (``Block``). Few long runs are folded
  one by one at their positions, as above. Many short ones are cut into pieces of at most
  GROUPS*BLOCK values (the same columns of every run); a piece of run r starts at position
  lead_r = base_r % (GROUPS*BLOCK) of super-row m_r and lands in at most two super-rows,
  with sign F[m_r] and then F[m_r + 1]. Runs with the same lead and the same two signs are
  summed first (``index_add_`` of rows: one add per value) where that saves work, and the
  sums are placed into the fold (numpy slices on the CPU, ``index_add_`` on a device).
  Cost: two or three passes over the values whatever the layout; on the CPU 2 to 5 times
  the plain sketch of as many values, about what their statistics cost
  (bench/shard_sketch.py). The per-run tables are made once per layout. A small CPU block
  (at most _SMALL values) is one weighted bincount of its values into the fold instead,
  with each value's place and sign kept per layout: fewer calls.

An empty shard (torch's chunking leaves the last ones empty) has the zero sketch, so the
shards still add up. Partial placements (``P(sum)``) are sketched as their shard; compare
leaves such records per rank.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import numpy as np
import torch

from probe.capture.numbers.host_view import host_array
from probe.capture.numbers.sketch import (NUMPY_MAX, BLOCK, GROUPS, combine_folded, fold_values, fold_sign_table,
                                  projection_tables, pack, sketch, sketch_values)

_SPAN = GROUPS * BLOCK
#: (placement JSON, local shape) -> flat offset, Block or None: a few per model
_layouts: dict = {}
_LAYOUTS_LIMIT = 10_000
#: values per pass of the short-run path: bounds its temporaries (a few MiB)
_CHUNK = 1 << 20
#: CPU blocks of at most this many values are sketched with numpy (small_block_sketch)
_SMALL = 4096
#: (Block, device) -> the short-run path's per-run tables on that device; (Block, "small")
#: -> small_block_sketch's per-value tables
_plans: dict = {}
_PLANS_LIMIT = 256


@dataclass(frozen=True)
class Block:
    """A shard that is a block of the logical tensor but not one run of its flat index: runs
    of `length` values, one per index of the local dimensions `sizes`, whose strides in the
    logical flat index are `strides`; the first value sits at flat position `start`."""

    sizes: tuple
    strides: tuple
    start: int
    length: int

    @property
    def runs(self) -> int:
        return math.prod(self.sizes)

    def bases(self, first: int, stop: int) -> np.ndarray:
        """int64: the flat positions of runs first..stop-1 (row-major over `sizes`)."""
        index = np.unravel_index(np.arange(first, stop), self.sizes)
        found = np.full(stop - first, self.start, dtype=np.int64)
        for position, stride in zip(index, self.strides):
            found += position.astype(np.int64) * stride
        return found


def shard_layout(placement: str, shape):
    """Where a shard's values sit in the logical tensor's flat index: the first position (an
    int) where they are one contiguous run of it, a Block for any other block, None where
    the placement does not say (no offset) or says something impossible. (A strided shard of
    2-D FSDP + TP is sketched at the block its offset names: distinct positions, so a valid
    sketch for comparing that rank's record, which compare leaves per rank.)"""
    key = (placement, tuple(shape))
    found = _layouts.get(key, -1)
    if found == -1:
        found = _layout(placement, tuple(shape))
        if len(_layouts) < _LAYOUTS_LIMIT:
            _layouts[key] = found
    return found


def flat_offset(placement: str, shape) -> int | None:
    """The shard's first position in the logical tensor's flat index, when the shard is one
    contiguous run of that index; None otherwise (or when the placement has no offset)."""
    found = shard_layout(placement, shape)
    return found if type(found) is int else None


def _layout(placement: str, shape: tuple):
    try:
        place = json.loads(placement)
        whole, start = [int(size) for size in place["shape"]], place["offset"]
        if start is None or len(whole) != len(shape) or len(start) != len(shape):
            return None
        start = [int(first) for first in start]
    except (ValueError, KeyError, TypeError):
        return None
    split = next((d for d in range(len(shape)) if shape[d] != whole[d]), len(shape))
    inner = range(split + 1, len(shape))
    if all(shape[d] == 1 for d in range(split)) and all(shape[d] == whole[d] for d in inner) \
            and not any(start[d] for d in inner):
        return sum(start[d] * math.prod(whole[d + 1:]) for d in range(len(shape)))
    if any(first < 0 or first + size > total for first, size, total in zip(start, shape, whole)):
        return None
    last = max(d for d in range(len(shape)) if shape[d] != whole[d])
    strides = [math.prod(whole[d + 1:]) for d in range(len(shape))]
    return Block(sizes=tuple(shape[:last]), strides=tuple(strides[:last]),
                 start=sum(first * stride for first, stride in zip(start, strides)),
                 length=math.prod(shape[last:]))


def shard_sketch(local: torch.Tensor, layout, k: int):
    """The sketch of a shard at `layout` (``shard_layout``: a flat offset or a Block):
    packed bytes for a CPU tensor, a (k,) float64 tensor on the shard's device otherwise
    (resolved with the deferred statistics); None when it cannot be taken."""
    if k <= 0:
        return None
    if local.numel() == 0:
        return pack(np.zeros(k))  # an empty shard adds nothing to the logical tensor's sketch
    try:
        if type(layout) is Block:
            values = sketch_values(local)
            if local.device.type == "cpu" and values.numel() <= _SMALL:
                return pack(small_block_sketch(host_array(values), layout, k))
            found = block_sketch(values, layout, k)
            return pack(found.numpy()) if local.device.type == "cpu" else found
        offset = layout
        if local.device.type == "cpu":
            values = local.detach().reshape(-1)
            if values.dtype not in (torch.float32, torch.float64):
                values = sketch_values(values)
            if values.numel() > NUMPY_MAX:
                # torch's gemv keeps to torch.set_num_threads; numpy's OpenBLAS takes every
                # core from about 1M values (measured 40x slower beside another busy process)
                return pack(sketch_at(values, offset, k).numpy())
            return pack(sketch_at(host_array(values), offset, k))
        if offset == 0:
            return sketch(local, k)
        return sketch_at(sketch_values(local), offset, k)
    except (RuntimeError, TypeError, ValueError, IndexError, NotImplementedError):
        return None  # a record without a sketch; capture never breaks training


def sketch_at(values, offset: int, k: int):
    """(k,) float64: the sketch of flat float32/float64 values at positions offset.. ; a
    numpy array for a numpy array, a tensor on the values' device for a tensor."""
    if isinstance(values, np.ndarray):
        where, f64 = "numpy", np.float64
        zeros = lambda size: np.zeros(size, dtype=values.dtype)  # noqa: E731
    else:
        where, f64 = values.device, torch.float64
        zeros = lambda size: torch.zeros(size, device=where, dtype=values.dtype)  # noqa: E731
    columns, rows = projection_tables(where, values.dtype, k)
    folded = _fold_at(values, offset, lambda count: fold_sign_table(where, values.dtype, count), zeros)
    return combine_folded(folded, columns, rows).sum(0, dtype=f64)


def _fold_at(values, offset: int, fold_table, zeros):
    """Z of the values placed at positions offset.. (zeros elsewhere), as (GROUPS, BLOCK):
    the values up to the next super-row boundary go into super-row offset // SPAN at their
    shifted positions, the rest are folded from the following super-row on."""
    start, lead = divmod(offset, _SPAN)
    n = values.shape[0]
    head = min(n, _SPAN - lead)
    fold = fold_table(start + (n - head) // _SPAN + 2)
    folded = zeros(_SPAN)
    folded[lead:lead + head] += fold[start] * values[:head]
    if n > head:
        rest = fold_values(values[head:], fold[start + 1:], zeros)
        folded[: rest.shape[0] * BLOCK] += rest.reshape(-1)
    return folded.reshape(GROUPS, BLOCK)


def small_block_sketch(values: np.ndarray, block: Block, k: int) -> np.ndarray:
    """(k,) float64: block_sketch of a small CPU block, in a few numpy calls (block_sketch's
    torch calls cost more than the values): each value's place in the fold and sign F[m],
    kept per layout, then one weighted bincount."""
    key = (block, "small")
    found = _plans.get(key)
    if found is None:
        index = (block.bases(0, block.runs)[:, None] + np.arange(block.length)).reshape(-1)
        supers, places = np.divmod(index, _SPAN)
        found = (places, fold_sign_table("numpy", np.float64, int(supers.max()) + 1)[supers])
        if len(_plans) < _PLANS_LIMIT:
            _plans[key] = found
    places, signs = found
    folded = np.bincount(places, weights=values * signs, minlength=_SPAN)  # float64
    columns, rows = projection_tables("numpy", np.float64, k)
    return combine_folded(folded.reshape(GROUPS, BLOCK), columns, rows).sum(0)


def block_sketch(values: torch.Tensor, block: Block, k: int, host: bool | None = None) -> torch.Tensor:
    """(k,) float64 on the values' device: the sketch of a Block's flat values (sketch_values)
    taken at their logical positions. Nothing is copied to the host. host: place the runs'
    sums with numpy slices (CPU values; the default there) rather than torch's index_add_."""
    device = values.device
    rows = values.reshape(block.runs, block.length)
    folded = torch.zeros(_SPAN, dtype=torch.float64, device=device)
    if block.runs <= -(-block.length // _SPAN):
        # few long runs (Shard(1) of a 3-D tensor): each folded at its place, one pass
        dtype = values.dtype
        fold = lambda count: fold_sign_table(device, dtype, count)  # noqa: E731
        zeros = lambda size: torch.zeros(size, device=device, dtype=dtype)  # noqa: E731
        for run, base in enumerate(block.bases(0, block.runs).tolist()):
            folded += _fold_at(rows[run], base, fold, zeros).reshape(-1)
    else:
        host = device.type == "cpu" if host is None else host
        for piece, first, stop, plan in _short_run_plan(block, device):
            _fold_short_runs(rows[first:stop, piece:piece + plan.width], plan, folded, host)
    columns, signs = projection_tables(device, torch.float64, k)
    return combine_folded(folded.reshape(GROUPS, BLOCK), columns, signs).sum(0, dtype=torch.float64)


@dataclass
class _Plan:
    """The data-independent half of the fold of one (runs, width) piece: the place of each
    group of runs in the extended rows (below) and whether its sum is subtracted, as lists
    (host slices) and as tensors on the device; `group` (each run's, on the device) where
    runs share a group, None where every run is its own (places in the runs' order)."""

    width: int
    group: torch.Tensor | None
    places: list
    negative: list
    places_t: torch.Tensor
    signs_t: torch.Tensor


#: pieces narrower than this are placed with index_add_ on the CPU too: a numpy slice add
#: costs about as much as index_add_ of 100 values
_SLICE_WIDTH = 64
#: on the CPU, pieces at least this wide are summed by group only where that halves the
#: slices (measured: the sum's pass costs about a slice add per 1000 values)
_WIDE = 256


def _fold_short_runs(values: torch.Tensor, plan: _Plan, folded: torch.Tensor, host: bool) -> None:
    """Add the fold of a (runs, width <= SPAN) piece to `folded`. A run's piece starts at
    position lead of super-row m and may cross into super-row m + 1: it is written at lead of
    an extended row of SPAN + width values, the second of two such rows where F[m + 1]
    differs from F[m], added where F[m] is +1 and subtracted where it is -1. Runs sharing
    row, place and sign are summed first (index_add_ of rows: one add per value, in the
    values' dtype, as a whole tensor's fold)."""
    width, device, dtype = plan.width, values.device, values.dtype
    if plan.group is None:
        summed = values
    else:
        summed = torch.zeros(len(plan.places), width, dtype=dtype, device=device)
        summed.index_add_(0, plan.group, values)
    extended = torch.zeros(2 * (_SPAN + width), dtype=dtype, device=device)
    if host and width >= _SLICE_WIDTH:
        rows, target = host_array(summed), host_array(extended)
        for row, place, negative in zip(rows, plan.places, plan.negative):
            if negative:
                target[place:place + width] -= row
            else:
                target[place:place + width] += row
    else:
        at = plan.places_t[:, None] + torch.arange(width, device=device)
        extended.index_add_(0, at.reshape(-1), (summed * plan.signs_t.to(dtype)[:, None]).reshape(-1))
    same, flipped = extended[: _SPAN + width], extended[_SPAN + width:]
    folded += same[:_SPAN] + flipped[:_SPAN]
    folded[:width] += same[_SPAN:] - flipped[_SPAN:]


def _short_run_plan(block: Block, device) -> list:
    """[(piece start, first run, stop run, _Plan)] for a Block of many short runs, cut into
    pieces of at most SPAN columns and passes of at most _CHUNK values; kept per layout (a
    parameter's shard is recorded every step)."""
    key = (block, device)
    found = _plans.get(key)
    if found is not None:
        return found
    found = []
    for piece in range(0, block.length, _SPAN):
        width = min(_SPAN, block.length - piece)
        step = max(1, _CHUNK // width)
        for first in range(0, block.runs, step):
            stop = min(block.runs, first + step)
            found.append((piece, first, stop, _plan(block.bases(first, stop) + piece, width, device)))
    if len(_plans) < _PLANS_LIMIT:
        _plans[key] = found
    return found


def _plan(bases: np.ndarray, width: int, device) -> _Plan:
    supers, leads = np.divmod(bases, _SPAN)
    fold = fold_sign_table("numpy", np.float64, int(supers.max()) + 2)
    sign = fold[supers]
    row = _SPAN + width
    keys = leads + (fold[supers + 1] != sign) * row + (sign < 0) * (2 * row)
    places, group = np.unique(keys, return_inverse=True)
    if places.shape[0] == keys.shape[0] or (
            torch.device(device).type == "cpu" and width >= _WIDE and 2 * places.shape[0] > keys.shape[0]):
        # every run its own place, or wide pieces of runs that seldom share one: the sum's
        # pass over the values costs more than the numpy slices it saves
        group, places = None, keys
    else:
        # non_blocking: from pageable memory the copy is staged at once, no device sync
        group = torch.from_numpy(group.reshape(-1).astype(np.int64)).to(device, non_blocking=True)
    negative = places >= 2 * row
    places = places - negative * (2 * row)
    signs = np.where(negative, -1.0, 1.0)
    return _Plan(width=width, group=group, places=places.tolist(), negative=negative.tolist(),
                 places_t=torch.from_numpy(places).to(device, non_blocking=True),
                 signs_t=torch.from_numpy(signs).to(device, non_blocking=True))
