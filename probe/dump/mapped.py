"""Tensor values mapped from a step file instead of copied out of it.

probe writes every tensor as one contiguous, unfiltered dataset (layout.create_array): its
bytes are one range of the step file. A numpy array over a read-only memory map of that range
takes the values straight from the page cache, without the fresh pages (faulted in and
zeroed) and the copy a read costs. compare reads its tensors this way (``fetch``, which
calls ``StepDump.tensor(tensor_id, mapped=True)``); ``StepDump.tensor`` copies by default,
because:

- the pages of a mapping count in the process's resident memory while it is mapped. It is
  unmapped when the last array over it is freed, so a caller that drops each tensor once it
  is measured holds no more than the copies would take;
- touching a mapped page beyond the end of the file kills the process (SIGBUS). The range is
  checked against the file's size before it is mapped, and one that runs past the end is read
  the ordinary way instead (a step file cut short before it is opened fails to open, with its
  DumpFormatError). A finished step file never changes (it is renamed into place whole), but
  one that another program truncates while an array still maps it would crash the process,
  where a copy would not.

The mapping keeps its own duplicate of the file descriptor: an array stays valid after its
step file is closed.
"""

from __future__ import annotations

import math
import mmap
import os

import numpy as np

from probe.dump import decode

#: smaller tensors are read: a mapping costs two system calls and whole pages of address space
MIN_BYTES = 1 << 16
#: the whole range is mapped in the one call (its pages are in the page cache), not one page
#: fault at a time where the values are first read
_FLAGS = ({"flags": mmap.MAP_SHARED | mmap.MAP_POPULATE, "prot": mmap.PROT_READ}
          if hasattr(mmap, "MAP_POPULATE") else {"access": mmap.ACCESS_READ})


def fetch(step_file):
    """compare's tensor_id -> values of one open step file; None when it holds no tensors. A probe
    step file's large tensors come mapped (MappedFetch), another format's are read."""
    if not step_file.tensor_count:
        return None
    return MappedFetch(step_file) if getattr(step_file, "maps_tensors", False) else step_file.tensor


class MappedFetch:
    """tensor_id -> values of a probe step file, a large tensor stored as itself mapped."""

    __slots__ = ("_tensor",)

    def __init__(self, step_file):
        self._tensor = step_file.tensor
        if not _ALLOCATOR_SETTLED:
            _settle_allocator()

    def __call__(self, tensor_id: int) -> np.ndarray:
        return self._tensor(tensor_id, mapped=True)

    @staticmethod
    def maps(dtype_name: str) -> bool:
        """Whether a (large) tensor of that dtype comes mapped: nothing to decode, no copy, so
        little to gain from reading it ahead of time."""
        return dtype_name in decode.NATIVE_DTYPES


_ALLOCATOR_SETTLED = False


def _settle_allocator() -> None:
    """glibc's malloc gives a block above its mmap threshold (128 KB at start) fresh pages from
    the kernel, faulted in and zeroed at first touch, and raises the threshold to the size of
    such a block once one is freed. Reading copies freed a tensor-sized block at every tensor;
    mapping frees none, and the metrics' chunk buffers (a few hundred KB, metrics.CHUNK) would be
    fresh pages at every chunk. One 8 MB block freed here lets them come from the heap again
    (another allocator ignores it)."""
    global _ALLOCATOR_SETTLED
    np.empty(8 << 20, np.uint8)  # allocated and freed, never touched
    _ALLOCATOR_SETTLED = True


def view(handle, dataset) -> np.ndarray | None:
    """A read-only array over the stored bytes of a dataset (an h5py Dataset or a low-level id),
    in its shape and stored dtype; None where they cannot be mapped (chunked, filtered or
    unallocated storage, a small dataset or one of non-numeric dtype, a range past the end of
    the file, a file driver without a descriptor): the caller reads those."""
    try:
        return _view(handle, dataset)
    except (OSError, ValueError, TypeError, RuntimeError):  # a damaged file: the read tells how
        return None


def _view(handle, dataset) -> np.ndarray | None:
    from h5py import h5d  # loaded with the step file

    dataset_id = dataset if isinstance(dataset, h5d.DatasetID) else dataset.id
    dtype = dataset_id.dtype
    if dtype.kind not in "biufc" or dtype.hasobject:
        return None
    shape = dataset_id.shape
    if shape is None:  # an empty dataspace
        return None
    count = math.prod(shape)
    nbytes = count * dtype.itemsize
    if nbytes < MIN_BYTES:
        return None
    offset = dataset_id.get_offset()
    if offset is None or dataset_id.get_storage_size() != nbytes:
        return None
    plist = dataset_id.get_create_plist()
    if plist.get_layout() != h5d.CONTIGUOUS or plist.get_nfilters():
        return None
    descriptor = handle.id.get_vfd_handle()
    if not isinstance(descriptor, int) or offset + nbytes > os.fstat(descriptor).st_size:
        return None
    start = offset - offset % mmap.ALLOCATIONGRANULARITY
    region = mmap.mmap(descriptor, offset + nbytes - start, offset=start, **_FLAGS)
    return np.frombuffer(region, dtype, count, offset - start).reshape(shape)
