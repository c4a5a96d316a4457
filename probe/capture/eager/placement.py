"""A DTensor as the shard this rank holds, plus where that shard sits in the logical tensor.

FSDP2 parameters and gradients, and every tensor of tensor/sequence parallel code, are
DTensors: a wrapper around the rank's local tensor with no memory of its own. Reading its
values as a tensor would run DTensor's ops, which communicate; capture never communicates.
So a DTensor is recorded as its local shard's values (``_local_tensor``, the tensor
``to_local()`` returns, without adding an autograd node) and its placement, as JSON text in
the record's ``placement`` column (probe/dump/schema.py):

    {"mesh": [2], "dims": ["tp"], "placements": ["S(0)"], "coord": [1],
     "shape": [16, 8], "offset": [8, 0]}

``shape`` is the logical (global) shape and ``offset`` the shard's first index in it
(torch's own compute_local_shape_and_global_offset, which reads only the mesh coordinate of
this rank). Placements are torch's short names: ``S(d)`` sharded on dim d, ``R`` replicated,
``P(sum)`` / ``P(avg)`` partial; anything else (strided shards of 2-D FSDP + TP) is written
as torch prints it, and compare leaves such records per rank.

torch.distributed.tensor is the public home of DTensor from torch 2.5; torch 2.4 has the
same class in torch.distributed._tensor. Nothing here imports either: a DTensor exists only
once its module is imported, so the class is looked up in sys.modules.
"""

from __future__ import annotations

import json
import sys

from probe import compat

#: where DTensor lives, newest first
_MODULES = ("torch.distributed.tensor", "torch.distributed._tensor")
#: placement JSON by (mesh, placements, global shape): a few per model
_described: dict = {}
_DESCRIBED_LIMIT = 10_000


def dtensor_class() -> type | None:
    """The DTensor class, or None while no module defining it has been imported."""
    for name in _MODULES:
        module = sys.modules.get(name)
        cls = getattr(module, "DTensor", None) if module is not None else None
        if isinstance(cls, type):
            return cls
    return None


def local_and_placement(dtensor) -> tuple:
    """(the rank's local tensor, placement JSON text) of a DTensor; no communication."""
    local, spec = compat.dtensor_local_and_spec(dtensor)
    mesh, placements = spec.mesh, tuple(spec.placements)
    shape = tuple(dtensor.shape)
    key = (id(mesh), placements, shape)
    found = _described.get(key)
    if found is not None and found[0] is mesh:
        return local, found[1]
    text = _describe(mesh, placements, shape)
    if len(_described) < _DESCRIBED_LIMIT:
        _described[key] = (mesh, text)  # the mesh is kept: its id stays its own
    return local, text


def _describe(mesh, placements, shape) -> str:
    coordinate = mesh.get_coordinate()
    offset = None
    if coordinate is not None:
        try:
            offset = list(_local_offset(shape, mesh, placements))
        except Exception:  # a placement this torch cannot place: the merge leaves it per rank
            offset = None
    return json.dumps({
        "mesh": list(mesh.shape),
        "dims": list(mesh.mesh_dim_names) if mesh.mesh_dim_names else None,
        "placements": [str(placement) for placement in placements],
        "coord": list(coordinate) if coordinate is not None else None,
        "shape": list(shape),
        "offset": offset,
    }, separators=(",", ":"))


def _local_offset(shape, mesh, placements) -> tuple:
    return compat.local_shape_and_global_offset(shape, mesh, placements)[1]
