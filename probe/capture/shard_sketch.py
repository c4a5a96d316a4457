"""The sketch of a DTensor shard, taken with the projection entries of its logical positions.

A sketch is linear and the coefficient of a value depends only on its position in the flat
(row-major) tensor (capture/sketch.py): R[j, i] = F[i // (GROUPS*BLOCK)] * S[(i // BLOCK) %
GROUPS, j] * P[i % BLOCK, j]. So when each rank sketches its shard with the entries of the
positions the shard holds in the logical tensor, the shards' sketches add up to the logical
tensor's sketch, and compare sums them (comparison/shards.py) without any rank reading
another's values.

Cheap where the shard is one contiguous run of the logical flat index: ``Shard(0)`` (a block
of rows: FSDP2's parameters and gradients, ColwiseParallel's weight and bias), or
``Shard(d)`` where every dimension before d has size 1. Then a shard starting at flat
position o is the plain sketch of its values with the fold table read from super-row
o // (GROUPS*BLOCK) on and the first super-row's values shifted by o % (GROUPS*BLOCK): one
pass over the values, as for any tensor. Other shards (``Shard(1)`` of a matrix: a column
block, strided in the flat index) get no sketch; their statistics still merge.
"""

from __future__ import annotations

import json
import math

import numpy as np
import torch

from probe.capture.host_view import host_array
from probe.capture.sketch import (BLOCK, GROUPS, _combine, _fold, _fold_table, _projection_tables,
                                  pack, sketch, sketch_values)

_SPAN = GROUPS * BLOCK
#: (placement JSON, local shape) -> flat offset or None: a few per model
_offsets: dict = {}
_OFFSETS_LIMIT = 10_000


def flat_offset(placement: str, shape) -> int | None:
    """The shard's first position in the logical tensor's flat index, when the shard is one
    contiguous run of that index; None otherwise (or when the placement has no offset)."""
    key = (placement, tuple(shape))
    found = _offsets.get(key, -1)
    if found == -1:
        found = _contiguous_offset(placement, tuple(shape))
        if len(_offsets) < _OFFSETS_LIMIT:
            _offsets[key] = found
    return found


def _contiguous_offset(placement: str, shape: tuple) -> int | None:
    try:
        place = json.loads(placement)
        whole, start = list(place["shape"]), place["offset"]
    except (ValueError, KeyError, TypeError):
        return None
    if start is None or len(whole) != len(shape) or len(start) != len(shape):
        return None
    split = next((d for d in range(len(shape)) if shape[d] != whole[d]), len(shape))
    if any(shape[d] != 1 for d in range(split)):
        return None  # whole rows of an outer dimension around a part of an inner one
    if any(start[d] for d in range(split + 1, len(shape))):
        return None
    return sum(int(start[d]) * math.prod(whole[d + 1:]) for d in range(len(shape)))


def shard_sketch(local: torch.Tensor, offset: int, k: int):
    """The sketch of a shard whose values start at flat position `offset` of the logical
    tensor: packed bytes for a CPU tensor, a (k,) float64 tensor on the shard's device
    otherwise (resolved with the deferred statistics); None when it cannot be taken."""
    if k <= 0 or local.numel() == 0:
        return None
    try:
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
