"""Tensor values mapped from a step file instead of copied out of it.

probe writes every tensor as one contiguous, unfiltered dataset (layout.create_array): its
bytes are one range of the step file. A numpy array over a read-only memory map of that range
takes the values straight from the page cache, without the fresh pages (faulted in and
zeroed) and the copy a read costs. compare reads its tensors this way
(``StepDump.tensor(tensor_id, mapped=True)``); ``StepDump.tensor`` copies by default, because:

- the pages of a mapping count in the process's resident memory while it is mapped. It is
  unmapped when the last array over it is freed, so a caller that drops each tensor once it
  is measured holds no more than the copies would take;
- touching a mapped page beyond the end of the file kills the process (SIGBUS). The range is
  checked against the file's size before it is mapped (a tensor of a step file cut short is
  read the ordinary way and fails with its DumpFormatError). A finished step file never
  changes (it is renamed into place whole), but one that another program truncates while an
  array still maps it would crash the process, where a copy would not.

The mapping keeps its own duplicate of the file descriptor: an array stays valid after its
step file is closed.
"""

from __future__ import annotations

import math
import mmap
import os

import h5py
import numpy as np

#: smaller tensors are read: a mapping costs two system calls and whole pages of address space
MIN_BYTES = 1 << 16
#: the whole range is mapped in the mapping call, on the read-ahead thread, and not one page
#: fault at a time where the values are first read
_FLAGS = ({"flags": mmap.MAP_SHARED | mmap.MAP_POPULATE, "prot": mmap.PROT_READ}
          if hasattr(mmap, "MAP_POPULATE") else {"access": mmap.ACCESS_READ})


def view(handle: h5py.File, dataset: h5py.Dataset) -> np.ndarray | None:
    """A read-only array over the dataset's stored bytes, in its shape and stored dtype; None
    where they cannot be mapped (chunked, filtered or unallocated storage, a small dataset or
    one of non-numeric dtype, a range past the end of the file, a file driver without a
    descriptor): the caller reads those."""
    try:
        return _view(handle, dataset)
    except (OSError, ValueError, TypeError, RuntimeError):  # a damaged file: the read tells how
        return None


def _view(handle: h5py.File, dataset: h5py.Dataset) -> np.ndarray | None:
    dtype = dataset.dtype
    if dtype.kind not in "biufc" or dtype.hasobject:
        return None
    dataset_id = dataset.id
    shape = dataset.shape
    count = math.prod(shape)
    nbytes = count * dtype.itemsize
    if nbytes < MIN_BYTES:
        return None
    offset = dataset_id.get_offset()
    if offset is None or dataset_id.get_storage_size() != nbytes:
        return None
    plist = dataset_id.get_create_plist()
    if plist.get_layout() != h5py.h5d.CONTIGUOUS or plist.get_nfilters():
        return None
    descriptor = handle.id.get_vfd_handle()
    if not isinstance(descriptor, int) or offset + nbytes > os.fstat(descriptor).st_size:
        return None
    start = offset - offset % mmap.ALLOCATIONGRANULARITY
    region = mmap.mmap(descriptor, offset + nbytes - start, offset=start, **_FLAGS)
    return np.frombuffer(region, dtype, count, offset - start).reshape(shape)
