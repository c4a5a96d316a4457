"""A numpy view of a CPU tensor's memory that leaves the tensor's storage as it was.

``Tensor.numpy()`` marks the tensor's storage as not resizable, for good: torch's way of
keeping the array's memory alive. Frameworks resize storages they own. FSDP2 frees the
memory of every unsharded parameter after forward (``storage.resize_(0)``) and allocates it
again before the next all-gather; after one ``.numpy()`` on such a parameter, or on any view
of it, the next reshard raises "Trying to resize storage that is not resizable". An ``out=``
buffer that grows fails the same way. Capture reads a tensor's values for the length of one
call and keeps nothing, so it must not leave that mark behind: ``host_array`` builds the
array from the tensor's address through numpy's array interface instead (about 0.3 us more
than ``.numpy()``, measured on float32 64x64). The array keeps the tensor object alive, not
its memory: callers use it within the call that made it and copy what they keep.
"""

from __future__ import annotations

import numpy as np
import torch

#: torch dtype -> (numpy type string, bytes per element), for the dtypes numpy has
_TYPESTRS = {
    dtype: (np.dtype(numpy_type).str, np.dtype(numpy_type).itemsize)
    for dtype, numpy_type in (
        (torch.float32, np.float32), (torch.float64, np.float64), (torch.float16, np.float16),
        (torch.uint8, np.uint8), (torch.int8, np.int8), (torch.int16, np.int16),
        (torch.int32, np.int32), (torch.int64, np.int64), (torch.bool, np.bool_),
        (torch.complex64, np.complex64), (torch.complex128, np.complex128),
    )
}
_asarray = np.asarray
_TENSOR, _PARAMETER = torch.Tensor, torch.nn.Parameter


class _Alias:
    """What np.asarray reads the address from; ``owner`` keeps the tensor object alive as
    long as the array (the array's base is this object)."""

    __slots__ = ("__array_interface__", "owner")


def host_array(tensor: torch.Tensor) -> np.ndarray:
    """A writable numpy array over a strided CPU tensor's values, without ``Tensor.numpy()``'s
    side effect on the storage. A tensor subclass other than Parameter gets its own
    ``numpy()`` (its __torch_function__ decides how its values read). Raises TypeError for a dtype numpy lacks, RuntimeError for
    what ``Tensor.numpy()`` also refuses (conjugate or negative bits, no storage)."""
    if type(tensor) is not _TENSOR and type(tensor) is not _PARAMETER:
        # a subclass decides how its values read (it may wait for a collective, or refuse)
        return (tensor.detach() if tensor.requires_grad else tensor).numpy()
    found = _TYPESTRS.get(tensor.dtype)
    if found is None:
        raise TypeError(f"numpy has no dtype for {tensor.dtype}")
    if tensor.is_neg() or tensor.is_conj() or not tensor.is_cpu:
        raise RuntimeError("host_array reads CPU tensors without conjugate or negative bits")
    typestr, itemsize = found
    address = tensor.data_ptr()
    if not address and tensor.numel():
        raise RuntimeError("the tensor has no memory (freed, or a wrapper without storage)")
    alias = _Alias()
    interface = {"data": (address, False), "shape": tensor.shape,
                 "typestr": typestr, "version": 3}
    if not tensor.is_contiguous():
        interface["strides"] = tuple([step * itemsize for step in tensor.stride()])
    alias.__array_interface__ = interface
    alias.owner = tensor
    return _asarray(alias)
