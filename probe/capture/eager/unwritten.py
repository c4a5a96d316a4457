"""Memory nothing has written yet: what an empty-family allocation holds until it is written.

``torch.empty`` (``empty_like``, ``new_empty``, ``empty_strided``, ...) hands back memory
holding whatever was there before. A record of such a tensor, or of a view of it, made
before anything writes it holds no value of the run: the same run twice differs there, and
leftover bytes read as 1e38 look like an error. trl's chunked log-probabilities do

    buf = torch.empty(rows, width)
    tile = buf[:n, :w]                  # Tensor.__getitem__: buf and the slice are recorded
    torch.mm(hidden, weight, out=tile)  # here, and the slice is written here

so the slice's record, and every record of the whole ``buf`` while part of it is unwritten,
are such records. A record of memory that has all been written is a value like any other.

The recorder keeps the allocations its API mode has seen and not yet seen written whole: a
dict ``{id(storage): _Allocation}`` (its ``unwritten``), empty for most models, so a record
costs one truth test of it. The API mode adds each empty-family allocation of the user's
code (``allocate``; a sharding framework's own buffers are left out, as its calls are) and,
while some allocation is tracked, reports every call before it runs (``written``): a call
that writes a tensor in place or into ``out=`` (an in-place method, ``copy_``,
``__setitem__``, ``out=``, a collective; write_watch.py names them) writes it, and a custom op
(``torch.ops.*``) may write any tensor it is given. A write of the whole allocation ends its tracking; a write of a part of it
(the tile above) is kept in a mask of the written elements, on the host (no device
synchronisation), made at the first such write. A read is uninitialized (``holds``) while
any element it covers is unwritten. An allocation of more than MASK_LIMIT elements gets no
mask: it counts as written at its first write. A freed allocation is forgotten (a weak
reference to its storage says when). Allocations made where the API mode is off (level
module) are not tracked: their records are compared as values. Memory written where no torch
call shows it (through ``.numpy()``, by a C++ extension's own function) stays unwritten: its
records are not compared.
"""

from __future__ import annotations

import weakref

import torch

_Tensor = torch.Tensor
#: ids of the functions that return memory nothing has written (the API mode sees them as
#: themselves; ids, because the mode also meets callables that cannot be hashed)
ALLOCATING = frozenset(id(function) for function in (
    torch.empty, torch.empty_like, torch.empty_strided, getattr(torch, "empty_permuted", None),
    _Tensor.new_empty, _Tensor.new_empty_strided) if function is not None)
#: largest allocation, in elements, whose partial writes are kept element by element (a
#: bool per element, on the host); a larger one counts as written at its first write
MASK_LIMIT = 1 << 27


class _Allocation:
    __slots__ = ("ref", "itemsize", "size", "mask")

    def __init__(self, ref, itemsize: int, size: int) -> None:
        self.ref = ref  # weak reference to the storage
        self.itemsize = itemsize  # element size of the allocation's dtype
        self.size = size  # elements in the storage
        self.mask = None  # bool per element, True where written (made at the first partial write)


def _storage(tensor):
    """The tensor's storage, or None (a tensor without a plain storage: sparse, nested, a
    wrapper subclass)."""
    try:
        return tensor.untyped_storage()
    except Exception:
        return None


def allocate(unwritten: dict, func, args, kwargs):
    """Run an empty-family call (its id in ALLOCATING) and keep what it returns as unwritten."""
    made = func(*args, **kwargs) if kwargs else func(*args)
    if isinstance(made, _Tensor):
        storage = _storage(made)
        if storage is not None:
            key = id(storage)

            def forget(_, key=key):
                found = unwritten.get(key)
                if found is not None and found.ref() is None:
                    del unwritten[key]

            try:
                ref = weakref.ref(storage, forget)
                itemsize = made.element_size()
                size = storage.nbytes() // itemsize
            except (TypeError, RuntimeError):  # a storage without weak references, ...
                return made
            if size:
                unwritten[key] = _Allocation(ref, itemsize, size)
    return made


def _entry(unwritten: dict, tensor):
    storage = _storage(tensor)
    if storage is None:
        return None, None
    key = id(storage)
    entry = unwritten.get(key)
    if entry is None:
        return None, None
    if entry.ref() is not storage:  # freed, and the id taken by another storage
        del unwritten[key]
        return None, None
    return key, entry


def _mask_view(entry: _Allocation, tensor):
    """The part of the allocation's mask that tensor covers; None where it cannot be told
    (a view in another dtype)."""
    if tensor.element_size() != entry.itemsize:
        return None
    return entry.mask.as_strided(tensor.shape, tensor.stride(), tensor.storage_offset())


def written(unwritten: dict, name: str, args, kwargs, tensors) -> None:
    """A call named name (naming.op_name) is about to run; tensors: what write_watch says it
    writes (its written_tensors), or None for a call it does not take for a writer. What the
    call writes of a tracked allocation holds values from now on. ``x[i] = v`` writes
    ``x[i]``, not x, where that is a view of x. A custom op (``torch.ops.*``: flash
    attention's kernels, FSDP2's copies) may fill any tensor it is given, so each tensor
    argument of one counts as written."""
    if tensors is None:
        if not name.startswith("ops."):
            return
        tensors = [value for value in (*args, *kwargs.values()) if isinstance(value, _Tensor)]
        tensors += [item for value in (*args, *kwargs.values()) if isinstance(value, (list, tuple))
                    for item in value if isinstance(item, _Tensor)]
    for tensor in tensors:
        if not isinstance(tensor, _Tensor):
            continue
        key, entry = _entry(unwritten, tensor)
        if entry is None:
            continue
        if name == "Tensor.__setitem__" and len(args) > 1 and tensor is args[0]:
            tensor = _indexed_view(tensor, args[1])
        if tensor.numel() >= entry.size or entry.size > MASK_LIMIT:
            del unwritten[key]  # the whole of it (or too large to keep by element)
            continue
        if entry.mask is None:
            entry.mask = torch.zeros(entry.size, dtype=torch.bool)
        part = _mask_view(entry, tensor)
        if part is None:
            del unwritten[key]
        else:
            part.fill_(True)


def _indexed_view(tensor, index):
    """tensor[index] where that is a view of tensor (basic indexing), else tensor itself
    (advanced indexing copies: its elements are taken as all written)."""
    try:
        part = tensor[index]
    except Exception:
        return tensor
    return part if part.untyped_storage() is tensor.untyped_storage() else tensor


def holds(unwritten: dict, tensor) -> bool:
    """A record of tensor reads memory nothing has written yet (call only when unwritten is
    not empty)."""
    key, entry = _entry(unwritten, tensor)
    if entry is None:
        return False
    if entry.mask is None:
        return True
    part = _mask_view(entry, tensor)
    return part is None or not bool(part.all())
