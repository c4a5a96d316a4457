"""torch tensor -> the bit-exact numpy array stored under /tensors (see schema.STORAGE_DTYPES).

Only the writer's background thread imports this module, so importing probe.dump.writer
stays free of torch. Decoding back to numbers lives in decode.py, which needs numpy only.

Storage rules:
  * dtypes numpy has (float16/32/64, complex64/128, int8..int64, uint8..uint64, bool) are
    stored as themselves;
  * bfloat16 and the float8 family are stored as their raw bits in a same-width unsigned
    integer (uint16 / uint8);
  * complex32 is stored as float16 (real, imag) pairs on a trailing axis of size 2;
  * sparse tensors are stored dense; the writer records the original layout in the
    dataset attribute "layout" (e.g. "sparse_coo"), dense ones carry no such attribute;
  * conjugate / negative views are resolved first, so the stored values are the ones the
    program sees.
"""

from __future__ import annotations

import numpy as np
import torch

from probe.dump import schema
from probe.errors import DumpError

_NATIVE = {
    torch.float16: "float16",
    torch.float32: "float32",
    torch.float64: "float64",
    torch.complex64: "complex64",
    torch.complex128: "complex128",
    torch.int8: "int8",
    torch.int16: "int16",
    torch.int32: "int32",
    torch.int64: "int64",
    torch.uint8: "uint8",
    torch.bool: "bool",
}
# uint16/32/64 became real torch dtypes (with .numpy()) in torch 2.3.
for _name in ("uint16", "uint32", "uint64"):
    if hasattr(torch, _name):
        _NATIVE[getattr(torch, _name)] = _name

# Same-width integer dtypes to reinterpret the bits through; signed int16 because
# torch < 2.3 cannot convert uint16 tensors to numpy.
_BIT_VIEWS = {"uint16": (torch.int16, np.uint16), "uint8": (torch.uint8, np.uint8)}


def dtype_name(dtype: torch.dtype) -> str:
    """'float32' for torch.float32: the name the schema stores."""
    return str(dtype).removeprefix("torch.")


def storable_dtype_names() -> tuple[str, ...]:
    names = set(_NATIVE.values()) | {n for n in schema.STORAGE_DTYPES if hasattr(torch, n)}
    return tuple(sorted(names))


def is_storable(dtype: torch.dtype) -> bool:
    return dtype in _NATIVE or dtype_name(dtype) in schema.STORAGE_DTYPES


def layout_name(tensor: torch.Tensor) -> str:
    """'strided' for ordinary tensors, 'sparse_coo', 'sparse_csr', ... otherwise."""
    return str(tensor.layout).removeprefix("torch.")


def to_storage(tensor: torch.Tensor) -> tuple[np.ndarray, str, list[int]]:
    """Return (host array in storage dtype, torch dtype name, logical shape).

    The array is C-contiguous and owns or shares memory with a host copy of the tensor;
    its bits are exactly the tensor's bits. Raises DumpError for tensors that hold no
    data (meta) or dtypes that have no bit-exact storage (quantized, sub-byte).
    """
    name = dtype_name(tensor.dtype)
    if tensor.device.type == "meta":
        raise DumpError(f"cannot store a meta tensor of shape {list(tensor.shape)}: it holds no data")
    if not is_storable(tensor.dtype):
        raise DumpError(
            f"cannot store a tensor of dtype {name}: storable dtypes are "
            f"{', '.join(storable_dtype_names())}"
        )
    shape = list(tensor.shape)
    host = tensor.detach()
    if host.layout != torch.strided:
        host = host.to_dense()
    if host.device.type != "cpu":
        host = host.to("cpu")
    host = host.resolve_conj().resolve_neg().contiguous()

    if tensor.dtype in _NATIVE:
        array = host.numpy()
    elif name == "complex32":
        array = torch.view_as_real(host).numpy()
    else:
        torch_view, numpy_view = _BIT_VIEWS[schema.STORAGE_DTYPES[name]]
        array = host.view(torch_view).numpy().view(numpy_view)
    # host is contiguous, so every view above is too (np.ascontiguousarray would turn 0-dim into 1-dim).
    return array, name, shape
