"""OtherRounding: a torch-function mode that sums every reduction in another order.

Each handled call computes the same function of the same values; only the order in which
its partial sums are added changes, as it does between a CPU's kernels and a GPU's:

- matmul, mm, bmm, ``@``, linear: the contracted dimension K is cut into ``chunks`` uneven
  pieces, each piece multiplied on its own and the pieces added last to first (split-K);
- conv1d/2d/3d with one group: the input channels are cut the same way;
- sum and mean of floating tensors: the reduced values are cut the same way.

Low-precision inputs (float16, bfloat16, or any input under autocast) are multiplied and
accumulated in float32 and rounded once at the end, as a tensor core does: the emulation adds
no rounding step a real device would not have. Sum and mean under autocast are left as they
are (autocast decides their dtype per device). Calls with ``out=``, integer tensors, tensor
subclasses (DTensor) and anything too short to cut pass through unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

_LOW = (torch.float16, torch.bfloat16)


def _edges(n: int, chunks: int) -> list[int]:
    """Uneven cut points of range(n) into at most ``chunks`` pieces (never a power-of-two
    block, so no cut lines up with a kernel's own tiling)."""
    cuts = {0, n}
    for i in range(1, chunks):
        cuts.add(min(n - 1, max(1, (n * i) // chunks + (i % 2))))
    return sorted(cuts)


def _pieces(n: int, chunks: int) -> list[tuple[int, int]]:
    edges = _edges(n, chunks)
    return [(start, stop - start) for start, stop in zip(edges, edges[1:])]


def _add_last_to_first(parts: list):
    total = parts[-1]
    for part in reversed(parts[:-1]):
        total = total + part
    return total


def _autocast_dtype(device_type: str):
    """The dtype autocast computes in on this device type now, None when it is off."""
    try:
        if not torch.is_autocast_enabled(device_type):
            return None
        return torch.get_autocast_dtype(device_type)
    except (TypeError, AttributeError, RuntimeError):  # torch < 2.4: per-device getters
        if device_type == "cpu":
            return torch.get_autocast_cpu_dtype() if torch.is_autocast_cpu_enabled() else None
        return torch.get_autocast_gpu_dtype() if torch.is_autocast_enabled() else None


class _Precision:
    """How one product-like call rounds: the dtype its inputs are cast to (autocast) and the
    dtype its result is rounded to once; products are accumulated in float32 in between."""

    def __init__(self, tensors: list):
        first = tensors[0]
        self.device_type = first.device.type
        self.cast = _autocast_dtype(self.device_type)
        result = self.cast or first.dtype
        self.low = result in _LOW
        self.result = result

    def inputs(self, tensors: list) -> list:
        if self.cast is not None:
            tensors = [t.to(self.cast) if t is not None and t.is_floating_point() else t
                       for t in tensors]
        if self.low:
            tensors = [t.float() if t is not None else t for t in tensors]
        return tensors

    def run(self, compute):
        if self.cast is None:
            return compute()
        with torch.autocast(self.device_type, enabled=False):
            return compute()

    def finish(self, value):
        return value.to(self.result) if value.dtype != self.result else value


def _plain_tensors(*values) -> bool:
    return all(v is None or type(v) in (torch.Tensor, torch.nn.Parameter) for v in values)


def _split_product(func, a, b, a_dim: int, b_dim: int, chunks: int, extra=()):
    """func(a, b, *extra) with the contracted dimension (a's a_dim, b's b_dim) cut."""
    k = a.shape[a_dim]
    if k < 2 or b.shape[b_dim] != k:
        return None
    precision = _Precision([a, b])
    a, b = precision.inputs([a, b])

    def compute():
        return _add_last_to_first([func(a.narrow(a_dim, start, size), b.narrow(b_dim, start, size),
                                        *extra)
                                   for start, size in _pieces(k, chunks)])

    return precision, precision.run(compute)


class OtherRounding(TorchFunctionMode):
    """Reductions summed in another order (module docstring); ``chunks`` pieces per cut."""

    def __init__(self, chunks: int = 3):
        super().__init__()
        if not isinstance(chunks, int) or chunks < 2:
            raise ValueError(f"chunks must be an integer of at least 2, not {chunks!r}")
        self.chunks = chunks
        self._handlers = {
            F.linear: self._linear,
            torch.matmul: self._matmul, torch.Tensor.matmul: self._matmul,
            torch.Tensor.__matmul__: self._matmul,
            torch.mm: self._matmul, torch.Tensor.mm: self._matmul,
            torch.bmm: self._matmul, torch.Tensor.bmm: self._matmul,
            F.conv1d: self._conv, F.conv2d: self._conv, F.conv3d: self._conv,
            torch.sum: self._sum, torch.Tensor.sum: self._sum,
            torch.mean: self._mean, torch.Tensor.mean: self._mean,
        }

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        handler = self._handlers.get(func)
        if handler is not None and "out" not in kwargs:
            found = handler(func, args, kwargs)
            if found is not None:
                return found
        return func(*args, **kwargs)

    # -------------------------------------------------------------- products

    def _linear(self, func, args, kwargs):
        names = ("input", "weight", "bias")
        values = dict(zip(names, args), **kwargs)
        x, weight, bias = values.get("input"), values.get("weight"), values.get("bias")
        if x is None or weight is None or not _plain_tensors(x, weight, bias):
            return None
        if x.dim() == 0 or not x.is_floating_point():
            return None
        split = _split_product(F.linear, x, weight, -1, -1, self.chunks)
        if split is None:
            return None
        precision, out = split
        if bias is not None:
            out = precision.run(lambda: out + precision.inputs([bias])[0])
        return precision.finish(out)

    def _matmul(self, func, args, kwargs):
        if len(args) != 2 or kwargs:
            return None
        a, b = args
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) \
                or not _plain_tensors(a, b):
            return None
        if a.dim() == 0 or b.dim() == 0 or not a.is_floating_point():
            return None
        split = _split_product(func, a, b, -1, -2 if b.dim() >= 2 else 0, self.chunks)
        if split is None:
            return None
        precision, out = split
        return precision.finish(out)

    def _conv(self, func, args, kwargs):
        names = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")
        values = dict(zip(names, args), **kwargs)
        x, weight, bias = values.get("input"), values.get("weight"), values.get("bias")
        if values.get("groups", 1) != 1 or x is None or weight is None \
                or not _plain_tensors(x, weight, bias) or not x.is_floating_point():
            return None
        options = {name: values[name] for name in ("stride", "padding", "dilation")
                   if name in values}

        def conv(x_part, w_part):
            return func(x_part, w_part, None, **options)

        channel = 1 if x.dim() == weight.dim() else 0  # unbatched input: channels first
        split = _split_product(conv, x, weight, channel, 1, self.chunks)
        if split is None:
            return None
        precision, out = split
        if bias is not None:
            shape = [1] * out.dim()
            shape[channel] = -1
            out = precision.run(lambda: out + precision.inputs([bias])[0].reshape(shape))
        return precision.finish(out)

    # -------------------------------------------------------------- sums

    def _sum(self, func, args, kwargs):
        return self._reduce(args, kwargs, mean=False)

    def _mean(self, func, args, kwargs):
        return self._reduce(args, kwargs, mean=True)

    def _reduce(self, args, kwargs, mean: bool):
        if not args or not isinstance(args[0], torch.Tensor):
            return None
        x = args[0]
        rest = args[1:]
        dim = rest[0] if rest else kwargs.get("dim")
        keepdim = rest[1] if len(rest) > 1 else kwargs.get("keepdim", False)
        dtype = rest[2] if len(rest) > 2 else kwargs.get("dtype")
        if not _plain_tensors(x) or x.dim() == 0 or not x.is_floating_point() \
                or _autocast_dtype(x.device.type) is not None:
            return None
        if dim is None or (isinstance(dim, (list, tuple)) and len(dim) == 0):
            dims = list(range(x.dim()))
        elif isinstance(dim, int):
            dims = [dim]
        elif isinstance(dim, (list, tuple)) and all(isinstance(d, int) for d in dim):
            dims = list(dim)
        else:  # named dimensions
            return None
        dims = sorted({d % x.dim() for d in dims})
        kept = x.dim() - len(dims)
        kept_shape = [x.shape[d] for d in range(x.dim()) if d not in dims]
        flat = x.movedim(dims, list(range(kept, x.dim()))).reshape(*kept_shape, -1)
        n = flat.shape[-1]
        if n < 2:
            return None
        result = dtype or x.dtype
        accumulate = torch.float32 if result in _LOW else result
        total = _add_last_to_first([flat.narrow(-1, start, size).sum(-1, dtype=accumulate)
                                    for start, size in _pieces(n, self.chunks)])
        if mean:
            total = total / n
        total = total.to(result)
        if keepdim:
            for d in dims:
                total = total.unsqueeze(d)
        return total


def other_rounding(chunks: int = 3) -> OtherRounding:
    """A context manager (an OtherRounding mode): ``with other_rounding(): train()``."""
    return OtherRounding(chunks)
