"""Load stage, across world sizes: plain tensors that are each rank's block of one logical tensor.

Tensor parallel code holds most of its activations as plain tensors, not DTensors: a
ColwiseParallel Linear hands on its output's local shard (``use_local_output``), and
everything computed from it up to the RowwiseParallel Linear (a Llama's query, key and
value heads, rotary embedding, attention scores and weights, the MLP's gated product) is
the rank's own heads or features, with no placement recorded. One device holds each of
those tensors whole, under the same key. Each rank's block has the same shape, and the
logical shape is that shape with one dimension times the number of ranks:

    one device   model.layers.0.self_attn/Tensor.transpose#0/forward/output.0   [2, 4, 8, 8]
    rank 0, 1    model.layers.0.self_attn/Tensor.transpose#0/forward/output.0   [2, 2, 8, 8]

``merge_rank_blocks`` merges such records into the logical tensor's record. Where each
block sits is read from the shapes, not from a placement, so the merge keeps first what
does not depend on it: min, max, mean, norm and NaN/Inf counts. There is no sketch (each
rank sketched its block as a whole tensor). Where the blocks' tensors were dumped (task
tensor) and the split dimension is not the first, the logical tensor is the blocks in rank
order, as tensor parallel lays out heads and features and sequence parallel positions; a
split of the first dimension can be a data-parallel batch, which a sampler deals out
strided, and is compared by its statistics alone. A record is merged only when the
other run holds the logical shape under the same key, every rank holds a block of one
shape and dtype, and exactly one dimension differs, by the number of ranks. A plain number
argument of such a call that is the block's size along that dimension (the rank's head count
passed to ``expand`` or ``reshape``) stands for the logical size, as the other run passes it.
Nothing here imports torch.
"""

from __future__ import annotations

import math

from probe.comparison.records import Records, parse_shape
from probe.comparison.shards import LOGICAL_IDS, MergedStep, combined_statistics, shape_text, view_with


def merge_rank_blocks(merged: MergedStep, reference: Records) -> int:
    """Merge the rank-local records of ``merged`` that are blocks of a tensor ``reference``
    (the other run's logical records) holds whole; they then count as logical tensors
    (``merged.logical``) and pair with it. Returns how many were merged."""
    ranks = sorted(merged.views)
    if len(ranks) < 2:
        return 0
    whole = dict(zip(reference.columns["key"], zip(reference.columns["shape"], reference.columns["dtype"],
                                                    reference.columns["value"])))
    views = [merged.views[rank] for rank in ranks]
    index = [dict(zip(view.columns["key"], range(len(view)))) for view in views]
    logical_rows = {}
    extents = {}  # call (key without its slot) -> (local, logical) extent of a split dimension
    arguments = []
    shapes, numbers = views[0].columns["shape"], views[0].columns["value"]
    for row, key in enumerate(views[0].columns["key"]):
        if key in merged.logical or key in merged.partial or key not in whole:
            continue
        if (shapes[row] or numbers[row]) and (shapes[row], numbers[row]) == (whole[key][0], whole[key][2]):
            continue  # the whole tensor, or the same number, on this rank already (most records)
        if not all(key in found for found in index):
            continue
        blocks = [view.row(found[key]) for view, found in zip(views, index)]
        if not blocks[0]["dtype"]:
            arguments.append((key, blocks))
            continue
        values = _merged(blocks, *whole[key][:2], len(ranks))
        if values is not None:
            _reassemble(merged, values, blocks, ranks)
            logical_rows[key] = values
            call, slot = key.rsplit("/", 1)
            if slot.startswith("output."):
                extents.setdefault(call, set()).add(_extents(blocks[0]["shape"], whole[key][0]))
    for key, blocks in arguments:
        logical = _logical_extent(blocks, whole[key][2], extents.get(key.rsplit("/", 1)[0], ()))
        if logical is not None:
            logical_rows[key] = dict(blocks[0], value=logical)
    if logical_rows:
        for rank, view in zip(ranks, views):
            merged.views[rank] = view_with(view, logical_rows)
        merged.logical |= set(logical_rows)
    return len(logical_rows)


def _merged(blocks, logical_shape, logical_dtype, world: int) -> dict | None:
    """The logical record of one block per rank, or None when they are not blocks of it."""
    first = blocks[0]
    if not first["dtype"] or first["dtype"] != logical_dtype:
        return None  # a plain number, or another dtype: not a block of that tensor
    if any(block["shape"] != first["shape"] or block["dtype"] != first["dtype"] for block in blocks):
        return None
    if _split_dimension(parse_shape(first["shape"]), parse_shape(logical_shape), world) is None:
        return None
    shape = parse_shape(logical_shape)
    numel = math.prod(shape)
    values = dict(first)
    values.update(combined_statistics(blocks, numel))
    values.update({"shape": shape_text(shape), "numel": numel, "checksum": "", "tensor_id": -1,
                   "sketch": None})
    return values


def _reassemble(merged: MergedStep, values: dict, blocks, ranks) -> None:
    """Where every block's tensor was dumped and the split is not of the first dimension,
    the logical tensor is the blocks in rank order (a tensor-parallel rank's heads or
    features, a sequence-parallel rank's positions): give the record a logical tensor id
    that MergedStep.fetch reassembles. A split of the first dimension can be a data-parallel
    batch, which a sampler deals out strided: its order is unknown, statistics only."""
    shape = parse_shape(values["shape"])
    block = parse_shape(blocks[0]["shape"])
    dim = _split_dimension(block, shape, len(ranks))
    if dim == 0 or any(int(found["tensor_id"]) < 0 for found in blocks):
        return
    values["tensor_id"] = LOGICAL_IDS + len(merged.assembled)
    merged.assembled[values["tensor_id"]] = (list(shape), [
        (rank, int(found["tensor_id"]), tuple(block[dim] * position if axis == dim else 0
                                              for axis in range(len(shape))))
        for position, (rank, found) in enumerate(zip(ranks, blocks))])


def _extents(block_shape, logical_shape) -> tuple:
    """(the block's, the logical tensor's) size along the split dimension of a merged record."""
    block, logical = parse_shape(block_shape), parse_shape(logical_shape)
    dim = [dim for dim, (own, whole) in enumerate(zip(block, logical)) if own != whole][0]
    return str(block[dim]), str(logical[dim])


def _logical_extent(blocks, other_value, extents) -> str | None:
    """A plain number argument of a call whose output was merged from blocks (a view, a
    reshape, an expand to the rank's own heads: ``expand(batch, 1, 2, length, 8)``) that is
    the block's size along the split dimension on every rank, where the other run passes the
    logical size there: the logical size, which the argument stands for. None otherwise."""
    values = {block["value"] for block in blocks}
    if len(values) != 1:
        return None
    value = values.pop()
    return other_value if (value, other_value) in extents else None


def _split_dimension(block: tuple, logical: tuple, world: int) -> int | None:
    """The one dimension the logical shape has ``world`` times the block's size in, every
    other dimension equal; None otherwise."""
    if len(block) != len(logical) or not block:
        return None
    differing = [dim for dim, (own, whole) in enumerate(zip(block, logical)) if own != whole]
    if len(differing) != 1:
        return None
    dim = differing[0]
    return dim if block[dim] * world == logical[dim] and block[dim] > 0 else None
