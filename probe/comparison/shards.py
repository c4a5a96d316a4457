"""Normalize stage: the records of every rank of one step -> records of logical tensors.

FSDP2 and tensor parallel record each DTensor as the rank's local shard plus its placement
(the ``placement`` column, probe/capture/eager/placement.py). A shard pairs with nothing in a run
sharded differently, or not at all: what pairs is the logical tensor. ``merge_ranks`` takes
the records of all ranks of one step file set and gives each rank a view in which every
sharded record stands for its logical tensor:

* shards (``S(d)``, possibly replicated on other mesh dimensions): one copy per distinct
  offset; min and max of the copies' extremes, the sum from each shard's mean and numel,
  the norm from the shards' squared norms, NaN and Inf counts added; shape and numel are
  the logical tensor's. The sketch is the sum of the shards' sketches: capture takes each
  with the projection entries of the shard's logical positions (capture/numbers/shard_sketch.py),
  so the sum is the logical tensor's sketch; where a shard has none (a placement without an
  offset; a column block in a dump of a version that sketched row shards only), the logical
  record has none. There is no checksum of the logical tensor; where
  the shards' tensors were dumped (task tensor), the logical tensor is reassembled from them
  when compare reads it (``MergedStep.fetch``).
* ``R`` (replicated everywhere): one copy; the copies must agree (statistics and checksum),
  and a copy that differs is a finding named with its rank (``MergedStep.replicas``).
* ``P(...)`` (partial): the logical tensor is a reduction of the copies whose statistics
  cannot be combined; such records stay rank-local.

Records without a placement are rank-local (the activations of a data-parallel rank), except
where every rank recorded the same values under the same key (a loss, a replicated output
of a tensor-parallel block): ``logical_view`` counts those as the logical tensor.

Pairing (``plan_views``, used by api.compare): with equal world sizes every rank's view is
compared with the other run's view of the same rank; with different world sizes one view
per side, holding the logical records alone, and the rank-local records are counted, not
compared. Nothing here imports torch.

Rank blocks
-----------

Plain tensors that are each rank's block of one logical tensor.

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

import json
import math
from dataclasses import dataclass, field

from probe.comparison.records import Records, parse_shape

PLACEMENT = "placement"
#: tensor ids of reassembled logical tensors start here (a step file's own ids are far below)
LOGICAL_IDS = 1 << 48
_STATISTICS = ("min", "max", "mean", "norm", "nan_count", "inf_count")
#: what two copies of one replicated tensor must share
_SAME = ("dtype", "shape", "min", "max", "mean", "norm", "nan_count", "inf_count", "checksum")


@dataclass
class MergedStep:
    """Per-rank views of one step, and what the merge did."""

    views: dict  # rank -> Records, sharded records standing for their logical tensors
    logical: set = field(default_factory=set)  # keys of the merged (logical) records
    shards: dict = field(default_factory=dict)  # key -> number of shards merged
    partial: set = field(default_factory=set)  # keys left rank-local: partial placements
    replicas: list = field(default_factory=list)  # (key, rank) of copies that disagree
    #: tensor_id of a logical record (LOGICAL_IDS + n) -> (shape, [(rank, tensor_id, offset)])
    assembled: dict = field(default_factory=dict)

    def fetch(self, fetch_by_rank: dict, own_fetch):
        """A tensor fetch for a view: logical tensors are reassembled from their shards
        (each rank's own fetch), every other id is read through own_fetch."""
        def fetch(tensor_id):
            found = self.assembled.get(tensor_id)
            if found is None:
                return own_fetch(tensor_id)
            shape, parts = found
            return assemble(shape, [(fetch_by_rank[rank](part), offset) for rank, part, offset in parts])
        return fetch


def _placement(text):
    if not text:
        return None
    try:
        found = json.loads(text)
    except ValueError:
        return None
    return found if isinstance(found, dict) and isinstance(found.get("placements"), list) else None


def merge_ranks(by_rank: dict) -> MergedStep:
    """{rank: Records} of one step -> MergedStep (each rank's view, the merge's summary)."""
    merged = MergedStep(views={})
    rows_of: dict = {}  # key -> [(rank, row, placement)]
    for rank, records in sorted(by_rank.items()):
        placements = records.columns.get(PLACEMENT)
        if not placements:
            continue
        keys = records.columns["key"]
        for row, text in enumerate(placements):
            place = _placement(text)
            if place is not None:
                rows_of.setdefault(keys[row], []).append((rank, row, place))
    logical_rows: dict = {}  # key -> the logical record's values {column: value}
    for key, copies in rows_of.items():
        try:
            values = _logical(key, copies, by_rank, merged)
        except (KeyError, TypeError, ValueError, AttributeError):
            values = None  # a placement this reader cannot follow: the record stays rank-local
        if values is not None:
            logical_rows[key] = values
    for rank, records in by_rank.items():
        merged.views[rank] = view_with(records, logical_rows)
    merged.logical = set(logical_rows)
    return merged


def _logical(key, copies, by_rank, merged: MergedStep):
    placements = copies[0][2]["placements"]
    if any(name.startswith("P(") for name in placements):
        reduced = _reduced(copies, by_rank)
        if reduced is None:
            merged.partial.add(key)
        return reduced
    if not all(name == "R" or (name.startswith("S(") and name.endswith(")"))
               for name in placements):
        return None  # a placement compare does not know (strided shards): rank-local
    by_offset: dict = {}
    for rank, row, place in copies:
        record = by_rank[rank].row(row)
        offset = tuple(place.get("offset") or ())
        first = by_offset.get(offset)
        if first is None:
            by_offset[offset] = (rank, record)
        elif any(not _equal(first[1][name], record[name]) for name in _SAME):
            merged.replicas.append((key, rank))
    shards = [record for _, record in by_offset.values()]
    shape = copies[0][2].get("shape") or []
    numel = math.prod(shape)
    if sum(int(record["numel"]) for record in shards) != numel:
        return None  # not every shard was recorded (a rank filter): stays rank-local
    base = dict(shards[0])
    base["shape"] = shape_text(shape)
    base["numel"] = numel
    if len(shards) > 1:
        base.update(combined_statistics(shards, numel))
        if "sketch" in base:
            base["sketch"] = _summed_sketch([record["sketch"] for record in shards])
        base["checksum"] = ""
        base["tensor_id"] = -1
    merged.shards[key] = len(shards)
    if len(shards) > 1 and all(int(record["tensor_id"]) >= 0 for _, record in by_offset.values()):
        base["tensor_id"] = LOGICAL_IDS + len(merged.assembled)
        merged.assembled[base["tensor_id"]] = (shape, [
            (rank, int(record["tensor_id"]), offset) for offset, (rank, record) in by_offset.items()])
    return base


#: how far after a partial output its reduction is looked for (the collective's input, its
#: output, the wait or autograd wrapper: a few records)
_REDUCTION_WITHIN = 8
#: ops whose output is the result of the all-reduce that tensor parallel makes of a partial
_REDUCING = ("all_reduce", "wait_tensor", "_wrap_tensor_autograd")
#: the columns that say which record it is (kept from the partial record)
_IDENTITY = ("key", "seq", "kind", "module", "op", "index", "phase", "slot", "io", "source", PLACEMENT)


def _reduced(copies, by_rank) -> dict | None:
    """A partial output's logical tensor, where the run recorded it: tensor parallel (a
    RowwiseParallel Linear) all-reduces the partial sums at once, and the reduction's result
    (an output recorded right after, in the same module, of the logical shape, equal on every
    rank) is what the op computes on one device. Its values stand for the partial record's;
    None when no such record follows."""
    shape = shape_text(copies[0][2].get("shape") or [])
    found = []
    for rank, row, _ in copies:
        records = by_rank[rank]
        module = records.get("module", row)
        for later in range(row + 1, min(row + 1 + _REDUCTION_WITHIN, len(records))):
            if records.get("module", later) != module:
                return None
            op, slot = records.get("op", later), records.get("slot", later)
            if slot == "output.0" and any(name in op for name in _REDUCING) \
                    and records.get("shape", later) == shape:
                found.append(records.row(later))
                break
        else:
            return None
    first = found[0]  # one per rank: the copies must agree, as a replicated tensor's do
    if any(not _equal(first[name], other[name]) for other in found[1:] for name in _SAME):
        return None
    rank, row, _ = copies[0]
    logical = by_rank[rank].row(row)  # the op's own record, with the reduction's values
    logical.update({name: value for name, value in first.items() if name not in _IDENTITY})
    return logical


def shape_text(shape) -> str:
    """[4, 16]: a shape as the records' shape column writes it."""
    return "[" + ", ".join(str(int(size)) for size in shape) + "]"


def assemble(shape, parts):
    """The logical tensor from its shards: [(array, offset)] placed into one array."""
    import numpy as np

    out = np.zeros(shape, dtype=np.result_type(*[array for array, _ in parts]))
    for array, offset in parts:
        out[tuple(slice(start, start + size) for start, size in zip(offset, array.shape))] = array
    return out


def combined_statistics(shards, numel) -> dict:
    finite = [record for record in shards if int(record["numel"]) > 0]
    total = sum(record["mean"] * int(record["numel"]) for record in finite)
    return {
        "min": min((record["min"] for record in finite), default=math.nan, key=_nan_first),
        "max": max((record["max"] for record in finite), default=math.nan, key=_nan_last),
        "mean": total / numel if numel else math.nan,
        "norm": math.sqrt(sum(record["norm"] ** 2 for record in finite)),
        "nan_count": sum(int(record["nan_count"]) for record in shards),
        "inf_count": sum(int(record["inf_count"]) for record in shards),
    }


def _summed_sketch(sketches):
    """The sum of the shards' sketches, or None when a shard has none (a NaN row in the file)."""
    import numpy as np

    if any(found is None for found in sketches):
        return None
    if len({len(found) for found in sketches}) != 1:
        return None
    total = np.sum([np.asarray(found, dtype=np.float64) for found in sketches], axis=0)
    return total if np.isfinite(total).all() else None


def _nan_first(value):
    """min() with NaN winning, as torch.aminmax propagates it."""
    return (0, 0.0) if value != value else (1, value)


def _nan_last(value):
    return (1, 0.0) if value != value else (0, value)


def _equal(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float) and a != a and b != b:
        return True
    return a == b


def view_with(records: Records, logical_rows: dict) -> Records:
    """records with each sharded record's values replaced by its logical record's."""
    columns = {name: list(values) for name, values in records.columns.items()}
    keys = columns["key"]
    replaced = [name for name in columns if name not in ("seq", "source", PLACEMENT)]
    for row, key in enumerate(keys):
        values = logical_rows.get(key)
        if values is None:
            continue
        for name in replaced:
            if name in values:
                columns[name][row] = values[name]
        if "sketch" in columns and "sketch" not in values:
            columns["sketch"][row] = None
    return Records(columns, records.source)


def logical_view(merged: MergedStep) -> tuple[Records, int]:
    """One view for a compare across world sizes: the lowest rank's view with only the
    logical records: merged DTensors, and plain records every rank holds with the same
    values. Returns (records, number of rank-local records left out)."""
    ranks = sorted(merged.views)
    first = merged.views[ranks[0]]
    others = [merged.views[rank] for rank in ranks[1:]]
    index = [dict(zip(view.columns["key"], range(len(view)))) for view in others]
    keys = first.columns["key"]
    keep = []
    for row, key in enumerate(keys):
        if key in merged.logical:
            keep.append(row)
            continue
        if key in merged.partial:
            continue
        record = first.row(row)
        if all(key in found and all(_equal(record[name], view.get(name, found[key]))
                                    for name in _SAME)
               for view, found in zip(others, index)):
            keep.append(row)
    columns = {name: [values[row] for row in keep] for name, values in first.columns.items()}
    return Records(columns, first.source), len(first) - len(keep)


def has_placements(records: Records) -> bool:
    placements = records.columns.get(PLACEMENT)
    return bool(placements) and any(placements)


def summary(side: str, merged: MergedStep, world_size: int) -> list[str]:
    """Notes for the report: what was merged, from how many shards, and replicas that differ."""
    notes = []
    if merged.shards:
        counts = sorted(set(merged.shards.values()))
        notes.append(f"{side}: merged {len(merged.shards)} DTensor records of {world_size} ranks "
                     f"into logical tensors (from {'/'.join(map(str, counts))} shards each)")
    if merged.partial:
        notes.append(f"{side}: {len(merged.partial)} partial (P) DTensor records left rank-local")
    for key, rank in merged.replicas[:5]:
        notes.append(f"{side}: replicated tensor {key} differs on rank {rank} from the first copy")
    if len(merged.replicas) > 5:
        notes.append(f"{side}: {len(merged.replicas) - 5} more replicas differ")
    return notes


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
