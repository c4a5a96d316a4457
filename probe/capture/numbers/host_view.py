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
``host_read_view`` gives the same values read-only through DLPack in ~0.75 us against
``host_array``'s ~1.1 us: the recorder reads every small float tensor through it.
"""

from __future__ import annotations

import numpy as np
import torch

from probe import compat

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
    address = _readable_address(tensor)
    typestr, itemsize = found
    alias = _Alias()
    interface = {"data": (address, False), "shape": tensor.shape,
                 "typestr": typestr, "version": 3}
    if not tensor.is_contiguous():
        interface["strides"] = tuple([step * itemsize for step in tensor.stride()])
    alias.__array_interface__ = interface
    alias.owner = tensor
    return _asarray(alias)


def _readable_address(tensor: torch.Tensor) -> int:
    """The tensor's address, after the checks ``Tensor.numpy()`` makes too: RuntimeError for
    conjugate or negative bits, a tensor off the CPU, or one without memory."""
    if tensor.is_neg() or tensor.is_conj() or not tensor.is_cpu:
        raise RuntimeError("host_array reads CPU tensors without conjugate or negative bits")
    address = tensor.data_ptr()
    if not address and tensor.numel():
        raise RuntimeError("the tensor has no memory (freed, or a wrapper without storage)")
    return address


_from_dlpack = getattr(np, "from_dlpack", None)
_to_dlpack = compat.to_dlpack
#: what host_read_view reads through DLPack; other dtypes take host_array
_DLPACK_DTYPES = frozenset((torch.float32, torch.float64))


class _Capsule:
    """What np.from_dlpack reads a CPU tensor from: torch's capsule without Tensor.__dlpack__'s
    Python checks (those that matter are made by host_read_view). The capsule holds the
    tensor, as the array interface's owner does."""

    __slots__ = ("tensor",)

    def __dlpack__(self, *args, **kwargs):
        return _to_dlpack(self.tensor)

    def __dlpack_device__(self):
        return (1, 0)  # kDLCPU


def host_read_view(tensor: torch.Tensor) -> np.ndarray:
    """host_array's array, read-only, for reading a CPU tensor's values once (copying them,
    reducing them): the same checks and the same untouched storage, in about half the time
    (DLPack hands numpy the address, shape and strides in one capsule; the array interface
    is a dict numpy parses on every call). Other dtypes and tensor subclasses: host_array."""
    if (type(tensor) is not _TENSOR and type(tensor) is not _PARAMETER) \
            or tensor.dtype not in _DLPACK_DTYPES or not _DLPACK:
        return host_array(tensor)
    _readable_address(tensor)
    capsule = _Capsule()
    capsule.tensor = tensor
    return _from_dlpack(capsule)


def _dlpack_works() -> bool:
    """This torch and numpy pass a CPU tensor through _Capsule as host_array reads it."""
    if _from_dlpack is None or _to_dlpack is None:
        return False
    try:
        probe = torch.arange(6, dtype=torch.float32).reshape(2, 3).t()
        capsule = _Capsule()
        capsule.tensor = probe
        array = _from_dlpack(capsule)
        return array.shape == (3, 2) and array.tolist() == probe.tolist()
    except Exception:  # noqa: BLE001 - any failure: the array interface path
        return False


_DLPACK = _dlpack_works()
