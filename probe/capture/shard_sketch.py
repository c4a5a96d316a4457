"""The sketch of a DTensor shard, taken with the projection entries of its logical positions.

A sketch is linear and the coefficient of a value depends only on its position in the flat
(row-major) tensor (capture/sketch.py): R[j, i] = F[i // (GROUPS*BLOCK)] * S[(i // BLOCK) %
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
  GROUPS*BLOCK values (the same columns of every run), and a piece of run r lands in at most
  two super-rows: at position lead_r = base_r % SPAN on, with sign F[m_r] up to the end of
  super-row m_r and F[m_r + 1] after it. Runs with the same lead and the same pair of signs
  (up to one common sign) are summed first, one add per value (``index_add_`` of rows), and
  only those sums are scattered into the fold, so the cost is a few passes over the values
  whatever the layout (bench/shard_sketch.py measures it). The sums are in the values' dtype,
  as a whole tensor's fold; the pieces' folds are added in float64.

An empty shard (torch's chunking leaves the last ones empty) has the zero sketch, so the
shards still add up. Partial placements (``P(sum)``) are sketched as their shard; compare
leaves such records per rank.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass

import numpy as np
import torch

from probe.capture.host_view import host_array
from probe.capture.sketch import (BLOCK, GROUPS, _combine, _fold, _fold_table, _projection_tables,
                                  pack, sketch, sketch_values)

_SPAN = GROUPS * BLOCK
#: (placement JSON, local shape) -> flat offset, Block or None: a few per model
_layouts: dict = {}
_LAYOUTS_LIMIT = 10_000
#: values per pass of the short-run path: bounds its temporaries (a few MiB)
_CHUNK = 1 << 20
#: (Block, device) -> the short-run path's per-run tables on that device
_plans: dict = {}
_PLANS_LIMIT = 256
#: placements whose offset says where the shard's values sit (torch's strided shards do not)
_PLACED = re.compile(r"R|S\(\d+\)|P\(\w+\)")


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
    the placement does not say (no offset, a strided shard)."""
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
    if not all(_PLACED.fullmatch(str(name)) for name in place.get("placements") or ()):
        return None
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
            found = block_sketch(sketch_values(local), layout, k)
            return pack(found.numpy()) if local.device.type == "cpu" else found
        offset = layout
        if local.device.type == "cpu":
            values = local.detach().reshape(-1)
            if values.dtype not in (torch.float32, torch.float64):
                values = sketch_values(values)
            return pack(array_sketch_at(host_array(values), offset, k))
        if offset == 0:
            return sketch(local, k)
        return _torch_sketch_at(sketch_values(local), offset, k)
    except (RuntimeError, TypeError, ValueError, NotImplementedError):
        return None


def array_sketch_at(values: np.ndarray, offset: int, k: int) -> np.ndarray:
    """(k,) float64: the sketch of flat float32/float64 values at positions offset.. ."""
    columns, rows = _projection_tables("numpy", values.dtype, k)
    folded = _fold_at(values, offset, lambda count: _fold_table("numpy", values.dtype, count),
                      lambda size: np.zeros(size, dtype=values.dtype))
    return _combine(folded, columns, rows).sum(0, dtype=np.float64)


def _torch_sketch_at(values: torch.Tensor, offset: int, k: int) -> torch.Tensor:
    device, dtype = values.device, values.dtype
    columns, rows = _projection_tables(device, dtype, k)
    folded = _fold_at(values, offset, lambda count: _fold_table(device, dtype, count),
                      lambda size: torch.zeros(size, device=device, dtype=dtype))
    return _combine(folded, columns, rows).sum(0, dtype=torch.float64)


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
        rest = _fold(values[head:], fold[start + 1:], zeros)
        folded[: rest.shape[0] * BLOCK] += rest.reshape(-1)
    return folded.reshape(GROUPS, BLOCK)


def block_sketch(values: torch.Tensor, block: Block, k: int) -> torch.Tensor:
    """(k,) float64 on the values' device: the sketch of a Block's flat values (sketch_values)
    taken at their logical positions. Nothing is copied to the host."""
    device = values.device
    rows = values.reshape(block.runs, block.length)
    folded = torch.zeros(_SPAN, dtype=torch.float64, device=device)
    if block.runs <= -(-block.length // _SPAN):
        # few long runs (Shard(1) of a 3-D tensor): each folded at its place, one pass
        dtype = values.dtype
        fold = lambda count: _fold_table(device, dtype, count)  # noqa: E731
        zeros = lambda size: torch.zeros(size, device=device, dtype=dtype)  # noqa: E731
        for run, base in enumerate(block.bases(0, block.runs).tolist()):
            folded += _fold_at(rows[run], base, fold, zeros).reshape(-1)
    else:
        for piece, first, stop, plan in _short_run_plan(block, device):
            _fold_short_runs(rows[first:stop, piece:piece + plan[3]], plan, folded)
    columns, signs = _projection_tables(device, torch.float64, k)
    return _combine(folded.reshape(GROUPS, BLOCK), columns, signs).sum(0, dtype=torch.float64)


def _fold_short_runs(values: torch.Tensor, plan: tuple, folded: torch.Tensor) -> None:
    """Add the fold of a (runs, width <= SPAN) piece to `folded`. Each run's piece starts at
    position lead of super-row m and may cross into super-row m + 1: it is written at lead
    of an extended row of SPAN + width, the second of two such rows where F[m + 1] differs
    from F[m]; runs sharing that place are summed first (``_short_run_plan``)."""
    group, sign, places, width = plan
    device, dtype = values.device, values.dtype
    # in the values' dtype, as the fold of a whole tensor (a sign flip is exact): a product
    # promoted to float64 costs five times as much on the CPU
    signed = values * sign.to(dtype)[:, None]
    summed = torch.zeros(places.shape[0], width, dtype=dtype, device=device)
    summed.index_add_(0, group, signed)
    extended = torch.zeros(2 * (_SPAN + width), dtype=dtype, device=device)
    at = places[:, None] + torch.arange(width, device=device)
    extended.index_add_(0, at.reshape(-1), summed.reshape(-1))
    same, flipped = extended[: _SPAN + width], extended[_SPAN + width:]
    folded += same[:_SPAN] + flipped[:_SPAN]
    folded[:width] += same[_SPAN:] - flipped[_SPAN:]


def _short_run_plan(block: Block, device):
    """[(piece start, first run, stop run, (group of each run, its sign F[m], the groups'
    places, width))] for a Block of many short runs, on the device: the data-independent half
    of the fold, kept per layout (a parameter's shard is recorded every step)."""
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
            supers, leads = np.divmod(block.bases(first, stop) + piece, _SPAN)
            fold = _fold_table("numpy", np.float64, int(supers.max()) + 2)
            sign = fold[supers]
            places, group = np.unique(leads + (fold[supers + 1] != sign) * (_SPAN + width),
                                      return_inverse=True)
            tables = (group.reshape(-1), sign, places)
            # non_blocking: from pageable memory the copy is staged at once, no device sync
            group_t, sign_t, places_t = (torch.from_numpy(np.ascontiguousarray(table)).to(
                device, non_blocking=True) for table in tables)
            found.append((piece, first, stop, (group_t, sign_t, places_t, width)))
    if len(_plans) < _PLANS_LIMIT:
        _plans[key] = found
    return found
