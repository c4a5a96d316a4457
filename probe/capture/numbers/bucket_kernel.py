"""A device bucket's floating tensors read once, in place, by one Triton kernel per dtype.

Why: the bucket's torch path (device_bucket._arena) first copies every value into a float64
arena, then reads that arena about seven times (product, norm, NaN, Inf, two masked
extremes). On an H200, a GPT-2-small-shape step (T 512, batch 8, level api) holds 2.5 G
values, and those flushes took 139 ms of GPU time against a 60 ms step, where reading the
values once takes about 3 ms at the card's bandwidth. Here each value is read once, in its
own dtype, from the tensor's own memory.

One program per super-row (sketch.GROUPS x sketch.BLOCK values of one tensor): it finds its
tensor's address in a table, loads the super-row as a (GROUPS, BLOCK) tile, and writes the
super-row's partial numbers in the torch path's layout: min and max, the sketch (its products
in float32 with IEEE rounding, as the host path; signed F[m]), the sum and the sum of squares
(float64), NaN and Inf counts. The bucket then reduces them per tensor as it does the
arena's rows. Per flush and dtype: one host-to-device copy of the address table, one kernel,
and one multi-tensor copy when some tensors are not contiguous (they are packed first).

Numbers against the torch path: min, max and the counts are identical; the sums are float64
sums of the exact values, so they agree to float64 rounding; the sketch agrees to float32
rounding (comparison/sketch.py's floor). A super-row holding a NaN reports NaN extremes, as
amin/amax do there.

Where it runs: CUDA tensors of float32, bfloat16 and float16 when Triton 3.2 or later imports
(it ships with CUDA builds of torch from 2.6); ``PROBE_TRITON=0`` turns it off. ``PROBE_TRITON=1`` with
``TRITON_INTERPRET=1`` runs it on CPU tensors through Triton's interpreter, which is how the
tests hold it without a GPU. If the kernel fails (an unsupported GPU, a Triton that cannot
compile it), a warning says so once and the bucket goes on with the torch path.
"""

from __future__ import annotations

import os
import warnings

import numpy as np
import torch

from probe.capture.numbers import sketch
from probe.compat import foreach_copy

#: the oldest Triton the kernel runs with: 3.6 compiled it on an H200 and 3.6 and 3.9 ran it
#: in the interpreter; 3.0 (torch 2.4's) cannot interpret it, so it is not trusted to compile it
MIN_TRITON = (3, 2)
#: the dtypes the kernel reads (values widened to float32 exactly); others take the torch path
KERNEL_DTYPES = frozenset((torch.float32, torch.bfloat16, torch.float16))
#: a super-row's columns padded to a power of two (tl.arange needs one)
_COLUMNS = 256
_SPAN = sketch.GROUPS * sketch.BLOCK
#: warps per program: on an H200, one flush of 1.2 G float32 values with k 16 took 20 ms at 8,
#: 34 ms at 4 and 94 ms at 2 (a float32 tl.dot with tf32x3 rounding: 26 ms; one sketch
#: number at a time without tl.dot: 21 ms; k 0: 6 ms)
_WARPS = 8
#: the jitted kernels (one per TRITON_INTERPRET setting), and the error that made the bucket
#: give the kernel up
_state: dict = {"kernels": {}, "failed": None}
#: triton.language once a kernel is built (_build)
tl = None
#: kernel launches so far (the tests check the kernel, not the torch path, gave the numbers)
launches = 0


def runs_on(device: torch.device) -> bool:
    """Does the kernel read this device's bucket? CUDA, unless PROBE_TRITON=0; CPU only with
    PROBE_TRITON=1 (Triton's interpreter: TRITON_INTERPRET=1)."""
    setting = os.environ.get("PROBE_TRITON", "")
    if setting == "0" or _state["failed"] is not None:
        return False
    if device.type == "cuda" or (device.type == "cpu" and setting == "1"):
        return _kernel() is not None
    return False


def give_up(error: BaseException) -> None:
    """The kernel failed: say so once, and leave every later flush to the torch path."""
    if _state["failed"] is None:
        _state["failed"] = error
        warnings.warn(f"probe: the Triton statistics kernel failed ({type(error).__name__}: {error}); "
                      "device statistics go on through torch ops, slower on a GPU "
                      "(PROBE_TRITON=0 skips the kernel)", RuntimeWarning, stacklevel=2)


def on_device(device, host: torch.Tensor) -> torch.Tensor:
    """A host table on the device: through pinned memory, without waiting."""
    if device.type == "cpu":
        return host
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


class KernelLayout:
    """Which tensor and which values each super-row of a flush reads, as device tables, for
    one tuple of sizes (kept by the bucket for the next step with the same sizes)."""

    def __init__(self, device, sizes: tuple):
        counts = np.array([-(-n // _SPAN) for n in sizes], dtype=np.int64)
        rows = int(counts.sum())
        starts = np.cumsum(counts) - counts
        index = np.arange(rows) - np.repeat(starts, counts)  # m: the super-row within its tensor
        owner = np.repeat(np.arange(len(sizes), dtype=np.int32), counts)
        left = np.repeat(np.array(sizes, dtype=np.int64), counts) - index * _SPAN
        self.rows = rows
        self.lengths = on_device(device, torch.from_numpy(counts))
        self.owner = on_device(device, torch.from_numpy(owner))
        self.start = on_device(device, torch.from_numpy(index * _SPAN))
        self.count = on_device(device, torch.from_numpy(np.minimum(left, _SPAN).astype(np.int32)))
        fold = sketch.fold_signs(int(counts.max())) if rows else np.ones(1)
        self.sign = on_device(device, torch.from_numpy(np.ascontiguousarray(fold[index], dtype=np.float64)))
        self.nbytes = rows * 24 + len(sizes) * 8


def super_rows(tensors: list, layout: KernelLayout, k: int, device) -> tuple:
    """(additive, lows, highs) of every super-row, float64 on the device, in the torch path's
    columns: additive (S, k + 4) the sketch (k), sum, sum of squares, NaN and Inf counts; lows
    and highs (S,). The bucket reduces them per tensor as it does the arena's. The tensors
    share one dtype of KERNEL_DTYPES."""
    global launches
    kernel = _kernel()
    dtype = tensors[0].dtype
    sources = _readable(tensors, dtype, device)
    addresses = on_device(device, torch.tensor([t.data_ptr() for t in sources], dtype=torch.int64))
    rows = layout.rows
    additive = torch.empty((rows, k + 4), dtype=torch.float64, device=device)
    lows = torch.empty(rows, dtype=torch.float64, device=device)
    highs = torch.empty(rows, dtype=torch.float64, device=device)
    if rows:
        # without a sketch the kernel never reads P and S: any device tensor stands in
        columns, groups = sketch.projection_tables(device, torch.float32, k) if k else (layout.sign,) * 2
        kernel[(rows,)](addresses, layout.owner, layout.start, layout.count, layout.sign,
                        columns, groups, additive, lows, highs, k,
                        DTYPE={torch.float32: tl.float32, torch.bfloat16: tl.bfloat16,
                               torch.float16: tl.float16}[dtype],
                        GROUPS=sketch.GROUPS, BLOCK=sketch.BLOCK, COLUMNS=_COLUMNS,
                        KB=min(64, max(16, 1 << max(k - 1, 0).bit_length())), num_warps=_WARPS)
        launches += 1
    return additive, lows, highs


def _readable(tensors: list, dtype, device) -> list:
    """The tensors as the kernel reads them: contiguous ones in place; the others packed into
    one buffer of their dtype by one multi-tensor copy."""
    loose = [t for t in tensors if not t.is_contiguous()]
    if not loose:
        return tensors
    packed = torch.empty(sum(t.numel() for t in loose), dtype=dtype, device=device)
    places, at = [], 0
    for tensor in loose:
        places.append(packed[at:at + tensor.numel()].view(tensor.shape))
        at += tensor.numel()
    foreach_copy(places, loose)
    moved = iter(places)
    return [t if t.is_contiguous() else next(moved) for t in tensors]


def _kernel():
    """The jitted kernel, made on first use (Triton reads TRITON_INTERPRET when it is made);
    None where Triton does not import."""
    mode = os.environ.get("TRITON_INTERPRET", "")
    kernels = _state["kernels"]
    if mode not in kernels:
        kernels[mode] = _build() if triton_version() >= MIN_TRITON else None
    return kernels[mode]


def triton_version() -> tuple:
    """(major, minor) of the Triton that imports here; (0, 0) where none does."""
    try:
        import triton  # ships with CUDA builds of torch
    except ImportError:
        return (0, 0)
    try:
        return tuple(int(part) for part in triton.__version__.split(".")[:2])
    except ValueError:
        return (0, 0)


def _build():
    # a module global, not a local: some Triton versions look triton.language up in the
    # kernel's __globals__ (this module's)
    global tl
    import triton
    import triton.language as tl

    @triton.jit
    def super_row_numbers(addresses, owner, start, count, sign, columns, groups,
                          additive, lows, highs, k: tl.constexpr, DTYPE: tl.constexpr,
                          GROUPS: tl.constexpr, BLOCK: tl.constexpr, COLUMNS: tl.constexpr,
                          KB: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        base = tl.load(addresses + tl.load(owner + row)).to(tl.pointer_type(DTYPE))
        group = tl.arange(0, GROUPS)[:, None]
        column = tl.arange(0, COLUMNS)[None, :]
        place = group * BLOCK + column
        valid = (column < BLOCK) & (place < tl.load(count + row))
        x = tl.load(base + tl.load(start + row) + place, mask=valid, other=0.0).to(tl.float32)
        nans = tl.sum(tl.sum((x != x).to(tl.int32), 1), 0)
        infs = tl.sum(tl.sum(((x == float("inf")) | (x == float("-inf"))).to(tl.int32), 1), 0)
        low = tl.min(tl.min(tl.where(valid, x, float("inf")), 1), 0).to(tl.float64)
        high = tl.max(tl.max(tl.where(valid, x, float("-inf")), 1), 0).to(tl.float64)
        wide = x.to(tl.float64)
        out = additive + row * (k + 4)
        if k > 0:
            fold = tl.load(sign + row)
            rows_of_p = tl.arange(0, COLUMNS)[:, None]
            for first in tl.static_range(0, k, KB):
                j = first + tl.arange(0, KB)
                p = tl.load(columns + rows_of_p * k + j[None, :],
                            mask=(rows_of_p < BLOCK) & (j[None, :] < k), other=0.0)
                s = tl.load(groups + group * k + j[None, :], mask=j[None, :] < k, other=0.0)
                products = tl.dot(x, p, input_precision="ieee")  # (GROUPS, KB): Z[g] @ P
                tl.store(out + j, tl.sum(products.to(tl.float64) * s.to(tl.float64), 0) * fold,
                         mask=j < k)
        tl.store(out + k, tl.sum(tl.sum(wide, 1), 0))
        tl.store(out + k + 1, tl.sum(tl.sum(wide * wide, 1), 0))
        tl.store(out + k + 2, nans.to(tl.float64))
        tl.store(out + k + 3, infs.to(tl.float64))
        tl.store(lows + row, tl.where(nans > 0, float("nan"), low))
        tl.store(highs + row, tl.where(nans > 0, float("nan"), high))

    return super_row_numbers
