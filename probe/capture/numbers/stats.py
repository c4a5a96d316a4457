"""Per-tensor statistics and checksums, as cheap as the device allows.

Statistics of one tensor: min, max, mean, L2 norm, NaN count, Inf count (and numel), always
reported as float64 / int64 whatever the tensor's dtype:

* floating point: of the values; float16/bfloat16 are accumulated in float32.
* int and bool: of the values converted to float64 (bool as 0/1; int64 beyond 2**53 rounds).
* complex: of the absolute values.
* empty: numel 0, counts 0, the four statistics NaN.
* min/max are NaN when the tensor holds a NaN (NaN propagates, as in torch.aminmax).

CPU (``host_stats``): four calls that each pass over the data once, chosen by measurement
(docs/performance.md): numpy ``min`` and ``max`` on a zero-copy view, the sum of squares as
a BLAS dot product, and ``torch.sum`` for the sum. The sum deliberately stays with torch: a
mean near zero is a difference of large partial sums, and torch's summation order depends
only on the tensor's layout, while a BLAS dot may depend on memory alignment (MKL), which
would make two identical tensors report different means.
NaN and Inf are counted only when the sum or the norm is not finite, so a healthy tensor
pays nothing for them.

Other devices: the recorder sends most tensors through device_bucket.DeviceBucket (a whole
bucket of tensors in a fixed number of torch calls, read by the host once per step);
``device_stats`` is the per-tensor path for the dtypes the bucket does not read (complex,
float8): two small tensors per record, no host synchronisation per tensor, and
``resolve_device_stats`` copies a whole batch to the host at once.

Sketches (sketch.py) are computed next to the statistics: on CPU by ``host_stats_and_sketch``
(the sketch reads the numpy view the statistics made: one Tensor.numpy() per record), and on
other devices inside ``device_stats``, appended to the same small tensor, so they reach the
host in the same single copy.

``checksum``: CRC-32 (zlib) of the tensor's raw bytes in its own dtype, row-major, as
8 hex digits. It reads the bytes on the host: for a GPU tensor that is a copy and a sync per
tensor (checksum mode is for exactness, not speed).
"""

from __future__ import annotations

import math
import zlib

import numpy as np
import torch

from probe.capture.numbers import sketch
from probe.capture.numbers.host_view import host_array

NAN = float("nan")
EMPTY_STATS = (NAN, NAN, NAN, NAN, 0, 0)

_NUMPY_FLOATS = (torch.float32, torch.float64)
_FLOAT32, _FLOAT64 = _NUMPY_FLOATS
_minimum = np.minimum.reduce  # the ufuncs themselves: ndarray.min() adds a Python wrapper
_maximum = np.maximum.reduce
#: by itemsize: a sum of squares above this would overflow float32 / float64 (with headroom)
_SQUARES_MAX = {4: 1e37, 8: 1e306}
HALF_FLOATS = (torch.float16, torch.bfloat16)
#: [keep?, (tensor, numpy view)]: while host_stats_and_sketch runs, host_stats leaves the
#: numpy view it made here, so the sketch reads it instead of converting the tensor again
#: (Tensor.numpy() dispatches detach, to, resolve_conj and resolve_neg). host_stats is still
#: called through the module (tests count its calls to check the recorder's cache).
_shared_view: list = [False, None]
_dtype_names: dict = {}
_shape_texts: dict = {}
_device_texts: dict = {}


def dtype_name(dtype: torch.dtype) -> str:
    name = _dtype_names.get(dtype)
    if name is None:
        name = _dtype_names[dtype] = str(dtype).removeprefix("torch.")
    return name


def shape_text(shape) -> str:
    text = _shape_texts.get(shape)
    if text is None:
        text = "[" + ", ".join(str(int(size)) for size in shape) + "]"
        if len(_shape_texts) < 100_000:
            _shape_texts[tuple(shape)] = text
    return text


def device_text(device: torch.device) -> str:
    text = _device_texts.get(device)
    if text is None:
        text = _device_texts[device] = str(device)
    return text


def as_real(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor whose values the statistics describe (see the module docstring)."""
    dtype = tensor.dtype
    if dtype.is_floating_point:
        return tensor
    if dtype.is_complex:
        return tensor.abs()
    return tensor.to(torch.float64)


def host_stats(tensor: torch.Tensor) -> tuple:
    """(min, max, mean, norm, nan_count, inf_count) of a CPU tensor, as Python numbers."""
    numel = tensor.numel()
    if numel == 0:
        return EMPTY_STATS
    x = tensor.detach() if tensor.requires_grad else tensor
    dtype = x.dtype
    if dtype is not _FLOAT32 and dtype is not _FLOAT64:  # dtypes are singletons
        if dtype in HALF_FLOATS:
            return _torch_stats(x, numel, torch.float32)
        x = as_real(x)
        if x.dtype not in _NUMPY_FLOATS:  # a real float type numpy lacks (float8, ...)
            return _torch_stats(x, numel, torch.float32)
    array = host_array(x)
    if _shared_view[0]:
        _shared_view[1] = (tensor, array)
    low = float(_minimum(array, axis=None))
    high = float(_maximum(array, axis=None))
    largest = max(-low, high)
    if not largest * largest * numel <= _SQUARES_MAX[array.dtype.itemsize]:
        # the sum of squares could overflow this dtype, or there is a NaN/Inf: float64, and
        # no numpy overflow warning
        norm = float(torch.linalg.vector_norm(x, dtype=torch.float64))
    elif array.flags.c_contiguous:
        flat = array.reshape(-1)
        norm = math.sqrt(float(np.dot(flat, flat)))
    else:
        norm = float(torch.linalg.vector_norm(x))
    total = float(x.sum())
    nans = infs = 0
    if not (math.isfinite(total) and math.isfinite(norm)):
        nans, infs = _count_nonfinite(x)
    return (low, high, total / numel, norm, nans, infs)


def host_stats_and_sketch(tensor: torch.Tensor, k: int) -> tuple:
    """(host_stats(tensor), sketch.host_sketch(tensor, k)), the same numbers, with fewer torch
    calls: the sketch of a float32/float64 tensor (most records) reads its numpy view
    directly instead of going through a torch reshape."""
    if k <= 0:
        return host_stats(tensor), None
    numbers, array = _stats_and_view(tensor)
    if tensor.numel() == 0:
        return numbers, None
    return numbers, _sketch_now(tensor, array, numbers, k)


def host_stats_and_later_sketch(tensor: torch.Tensor, k: int, fold_later) -> tuple:
    """(numbers, sketch, slot): host_stats_and_sketch's numbers, but the sketch of a finite
    float32/float64 tensor is left to ``fold_later(array, numbers)`` (HostBatch.add_folded),
    which returns the slot that will hold (numbers, sketch); then sketch is None. Otherwise
    (other dtypes, NaN/Inf) the sketch is computed now and slot is None. k > 0."""
    numbers, array = _stats_and_view(tensor)
    if tensor.numel() == 0:
        return numbers, None, None
    dtype = tensor.dtype
    if array is not None and (dtype is _FLOAT32 or dtype is _FLOAT64) and _tame(numbers):
        return numbers, None, fold_later(array, numbers)
    return numbers, _sketch_now(tensor, array, numbers, k), None


def _stats_and_view(tensor: torch.Tensor) -> tuple:
    """(host_stats(tensor), the numpy view it read, or None when it read no view)."""
    _shared_view[0] = True
    try:
        numbers = host_stats(tensor)
    finally:
        view, _shared_view[0], _shared_view[1] = _shared_view[1], False, None
    return numbers, (view[1] if view is not None and view[0] is tensor else None)


def _sketch_now(tensor: torch.Tensor, array, numbers: tuple, k: int) -> bytes | None:
    if _tame(numbers):
        return _host_sketch(tensor, array, k)
    # NaN/Inf, or values near the float limits: the sketch holds NaN/Inf too (compare reads the
    # statistics' counts for those), and numpy's "invalid value" warnings would only be noise
    with np.errstate(all="ignore"):
        return _host_sketch(tensor, array, k)


#: beyond this magnitude a float32 sketch's sums may overflow
_TAME_LIMIT = 1e30


def _tame(numbers: tuple) -> bool:
    """Finite statistics well inside the float32 range (checked on the numbers already made)."""
    low, high, _mean, norm = numbers[:4]
    return -_TAME_LIMIT < low and high < _TAME_LIMIT and norm < _TAME_LIMIT


def _host_sketch(tensor: torch.Tensor, array, k: int) -> bytes | None:
    dtype = tensor.dtype
    if dtype is not _FLOAT32 and dtype is not _FLOAT64:
        if array is None or dtype.is_floating_point or dtype.is_complex:
            return sketch.host_sketch(tensor, k)
        # an integer or bool tensor's statistics read its float64 values (as_real), which
        # are its sketch's values (sketch.sketch_values): no second conversion
    try:
        if array is None:  # host_stats took another path, or another thread's view was left
            array = host_array(tensor)
        return sketch.array_sketch(array, k)
    except (RuntimeError, TypeError, ValueError):  # as host_sketch: the statistics stay
        return None


def _torch_stats(x: torch.Tensor, numel: int, accumulate: torch.dtype) -> tuple:
    low, high = torch.aminmax(x)
    total = x.sum(dtype=accumulate)
    norm = torch.linalg.vector_norm(x, dtype=accumulate)
    low, high, total, norm = torch.stack(
        (low.to(accumulate), high.to(accumulate), total, norm)
    ).tolist()
    nans = infs = 0
    if not (math.isfinite(total) and math.isfinite(norm)):
        nans, infs = _count_nonfinite(x)
    return (low, high, total / numel, norm, nans, infs)


def _count_nonfinite(x: torch.Tensor) -> tuple[int, int]:
    return int(torch.isnan(x).sum()), int(torch.isinf(x).sum())


def device_stats(tensor: torch.Tensor, sketch_size: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Statistics left on the tensor's device: (float64[min, max, sum, norm, *sketch],
    int64[nan, inf]); the sketch (sketch.py) has sketch_size numbers, none when 0.

    No host synchronisation; the caller must guard numel() == 0 itself.
    """
    x = as_real(tensor.detach())
    accumulate = torch.float32 if x.dtype in HALF_FLOATS else x.dtype
    if not accumulate.is_floating_point or accumulate.itemsize < 4:
        accumulate = torch.float32
    low, high = torch.aminmax(x)
    values = torch.stack(
        (low.to(accumulate), high.to(accumulate), x.sum(dtype=accumulate),
         torch.linalg.vector_norm(x, dtype=accumulate))
    ).to(torch.float64)
    if sketch_size > 0:
        try:
            values = torch.cat((values, sketch.sketch(tensor, sketch_size)))
        except (RuntimeError, TypeError, ValueError, NotImplementedError):
            pass  # values a sketch cannot read (quantized): the statistics stay, without a sketch
    counts = torch.stack((torch.isnan(x).sum(), torch.isinf(x).sum()))
    return values, counts


def resolve_device_stats(pending: list[tuple[torch.Tensor, torch.Tensor, int]]) -> list[tuple]:
    """[(values, counts, numel)] from device_stats -> [((min, max, mean, norm, nan, inf), sketch)]
    where sketch is packed (sketch.pack), or None when device_stats made none.

    One stacked copy to the host per device (one synchronisation), however many records.
    """
    results: list[tuple | None] = [None] * len(pending)
    by_device: dict = {}
    for position, (values, counts, numel) in enumerate(pending):
        by_device.setdefault(values.device, []).append(position)
    for positions in by_device.values():
        # one concatenation, not a stack: records may carry sketches of different sizes
        sizes = [pending[p][0].numel() for p in positions]
        host = torch.cat([pending[p][0] for p in positions]).cpu()
        flat, raw = host.tolist(), host.numpy()
        counts = torch.stack([pending[p][1] for p in positions]).cpu().tolist()
        start = 0
        for p, size, (nans, infs) in zip(positions, sizes, counts):
            low, high, total, norm = flat[start:start + 4]
            sketched = sketch.pack(raw[start + 4:start + size]) if size > 4 else None
            start += size
            results[p] = ((low, high, total / pending[p][2], norm, nans, infs), sketched)
    return results


def checksum(tensor: torch.Tensor) -> str:
    """CRC-32 of the raw bytes (own dtype, row-major) as 8 hex digits; "" when not readable."""
    x = tensor.detach()
    if x.layout != torch.strided or x.device.type == "meta":
        return ""
    if x.device.type != "cpu":
        x = x.cpu()
    x = x.contiguous().reshape(-1)
    if x.dtype == torch.bool:
        x = x.view(torch.uint8)
    try:
        raw = host_array(x.view(torch.uint8))
    except (RuntimeError, TypeError):  # a dtype without a byte view: conj/neg bits, quantized
        return ""
    return format(zlib.crc32(raw), "08x")
