"""Statistics and sketches of many device tensors at once, read by the host once per step.

On an accelerator the cost of capture is not arithmetic (statistics read each tensor once,
milliseconds of memory traffic against a step) but launches and waits: a per-tensor path
launches ~20 kernels per record, and any read of a number on the host waits for the device.
A DeviceBucket keeps both out of the step:

- ``add(tensor)`` launches nothing: it keeps an alias of the tensor (``detach()``: the same
  memory and version counter, but not a reference to the tensor itself, so autograd still
  hands a gradient to ``.grad`` without copying it) and its version, and returns a DeviceSlot
  that ``resolve()`` fills in.
- ``flush()`` computes every held tensor's statistics and sketch in a fixed number of torch
  calls per device, whatever the number of tensors or their dtypes (FLUSH_OPS):

      arena = the values of every tensor, as float64, each padded with zeros to whole
              super-rows of SPAN values (one cat; the tensors that are not contiguous are
              copied into their places by one multi-tensor copy)
      per super-row: the sketch's projection and the sum (one (S, SPAN) @ (SPAN, k + 1)
              product, signed per row), the sum of squares, NaN and Inf counts, min and max
              (of the values: a tensor's last row ends in padding)
      per tensor: each quantity summed, or its min / max taken, over the tensor's super-rows
              (segment_reduce: each tensor's rows are one run of the arena)

  The results stay on the device, one (T, 6 + k) float64 tensor per flush.
  On CUDA the float32, bfloat16 and float16 tensors skip the arena: bucket_kernel.py reads
  each once, in place, with one Triton kernel per dtype, into the same rows.
- ``resolve()`` flushes, joins every flush's results and copies them to the host in one copy
  per device (``host_transfers`` counts them), then fills the slots.

No call here reads a device number on the host before ``resolve()``; the layout of a bucket
(which row belongs to which tensor) is built on the host from sizes alone, sent to the device
once and kept for the next step with the same sizes.

Values are read at the flush, not when they were recorded, so a tensor must not change in
between. A write the capture sees (an in-place op, ``out=``, a collective, through any alias
of the memory, ``.data`` included) calls ``before_write`` first: if the bucket holds that
memory, the bucket is flushed, all of it, as one batch; nothing is copied. The recorder also
flushes where a step's tensors are next written or freed (recorder.py): when backward starts
(the forward is over), when it ends, and around the optimizer's step, so an optimizer's
in-place updates find the bucket empty. A change the capture cannot see (autograd
accumulating into ``.grad``, a C++ reducer, a storage freed by resizing it) is detected at the
flush by the tensor's version (views share their base's counter) or storage size, and that
record's statistics are reported unknown instead of wrong (``stale`` counts them). One write
escapes both: through a ``.data`` alias (its own version counter) by code the capture cannot
see (C++, or torch calls made with torch functions disabled); such a value is read as it is at
the flush. For sharded models, ``copy_on_add`` copies each tensor as it is added: FSDP2 frees
and refills its parameters' storage with no call the capture could see.

Numbers against the host path (stats.host_stats, sketch.sketch): min, max and the NaN/Inf
counts are identical; sums, sums of squares and sketches are accumulated in float64 here
(float32 values are exact in float64), so they agree to the host path's rounding.

``PROBE_DEVICE_PATH=1`` sends CPU tensors through this path too, so the tests hold it
without an accelerator (docs/performance.md).
"""

from __future__ import annotations

import math
import os

import numpy as np
import torch

from probe.capture.numbers import bucket_kernel, sketch
from probe.capture.numbers.bucket_kernel import on_device as _on
from probe.compat import flatten_dense_tensors, foreach_copy, local_tensor, tensor_version as _version_of

#: flush when a bucket holds this many tensors, or this many bytes of values: BUCKET_BYTES
#: on the CPU, a share of an accelerator's memory there (BUCKET_MEMORY_SHARE, at most
#: BUCKET_BYTES_MAX). A flush's arena holds the values as float64 (twice a float32 tensor's
#: bytes, four times a 16-bit one's); the fewer flushes, the fewer launches per step.
BUCKET_TENSORS = 4096
BUCKET_BYTES = 64 << 20
BUCKET_MEMORY_SHARE = 1 / 64
BUCKET_BYTES_MAX = 2 << 30
#: values per super-row: the sketch's fold unit, so a tensor's rows are its super-rows
SPAN = sketch.GROUPS * sketch.BLOCK
#: what the bucket reads; other dtypes (complex, float8, quantized) take stats.device_stats
DTYPES = frozenset((torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8,
                    torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool))
#: torch calls that launch a kernel in one flush (one device): the figure tests and docs quote
FLUSH_OPS = 19
NAN = float("nan")
_UNKNOWN = ((NAN, NAN, NAN, NAN, -1, -1), None)
_F64 = torch.float64
#: layouts (row lengths, signs, padding) kept per device for sizes seen again
_LAYOUT_CACHE_BYTES = 64 << 20


def device_path_on_cpu() -> bool:
    """PROBE_DEVICE_PATH=1: CPU tensors take the accelerator's path (for tests)."""
    return os.environ.get("PROBE_DEVICE_PATH", "") == "1"


def bucket_bytes(device) -> int:
    """How many bytes of values a bucket holds before it flushes, on this device."""
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        return int(min(max(total * BUCKET_MEMORY_SHARE, BUCKET_BYTES), BUCKET_BYTES_MAX))
    return BUCKET_BYTES


class DeviceSlot:
    """Where one tensor's numbers arrive: ``result`` is ((min, max, mean, norm, nan, inf),
    packed sketch or None) after the bucket's resolve(), None before."""

    __slots__ = ("result", "numel")

    def __init__(self, numel: int):
        self.result = None
        self.numel = numel


class DeviceBucket:
    """Tensors waiting for their statistics, and the results waiting for the host."""

    def __init__(self, sketch_size: int, max_tensors: int | None = None,
                 max_bytes: int | None = None):
        self.k = max(int(sketch_size), 0)
        self.max_tensors = BUCKET_TENSORS if max_tensors is None else max_tensors
        self.max_bytes = max_bytes  # None: bucket_bytes() of the first tensor's device
        self._held: list = []  # [alias, version, slot, watched]
        self._storages: set = set()  # storage addresses of the held tensors
        self._bytes = 0
        self._groups: list = []  # (results on the device, [slots]) since the last resolve
        #: device-to-host copies made by resolve() (per step: the debugger reads and resets it)
        self.host_transfers = 0
        #: records whose tensor changed, unseen, between record and flush (reported unknown)
        self.stale = 0
        #: flushes that computed something (for the benchmarks and tests)
        self.flushes = 0
        self._layouts: dict = {}
        self._layout_bytes = 0
        #: copy each tensor as it is added (one copy per record): for sharded models, whose
        #: unsharded parameters FSDP2 frees by resizing their storage, where no call is seen
        self.copy_on_add = False

    def __len__(self) -> int:
        return len(self._held)

    # ------------------------------------------------------------------ record time

    def add(self, tensor: torch.Tensor, watched: torch.Tensor | None = None) -> DeviceSlot:
        """Hold tensor until the flush. watched: the tensor whose autograd version says
        whether its values changed (a DTensor for its local shard: DTensor's in-place ops bump
        the wrapper's version only); tensor itself by default."""
        numel = tensor.numel()
        slot = DeviceSlot(numel)
        if self.copy_on_add:
            with torch.no_grad():
                tensor = tensor.detach().clone()
            watched = None
        else:
            # an alias over the same memory and version counter: holding the tensor itself
            # would make autograd copy a gradient into .grad instead of handing it over
            tensor = tensor.detach()
        if watched is None:
            watched = tensor
        self._held.append([tensor, _version_of(watched), slot, watched])
        self._storages.add(_address(tensor))
        self._bytes += numel * tensor.element_size()
        if self.max_bytes is None:
            self.max_bytes = bucket_bytes(tensor.device)
        if len(self._held) >= self.max_tensors or self._bytes >= self.max_bytes:
            self.flush()
        return slot

    def holds(self, tensor: torch.Tensor) -> bool:
        """Does the bucket hold values in tensor's memory (any view of its storage)?"""
        return bool(self._held) and _address(local_tensor(tensor)) in self._storages

    def before_write(self, tensors) -> None:
        """The capture is about to let a call write these tensors: if the bucket holds any of
        their memory, flush it (every held tensor, one batch) while the values are the
        recorded ones."""
        if not self._held:
            return
        storages = self._storages
        for tensor in tensors:
            if _address(local_tensor(tensor)) in storages:
                self.flush()
                return

    # ------------------------------------------------------------------ flush

    def flush(self) -> bool:
        """Statistics of every held tensor, left on the device (no host synchronisation).
        Returns whether it held any."""
        if not self._held:
            return False
        held, self._held, self._storages, self._bytes = self._held, [], set(), 0
        groups: dict = {}
        kernel_reads: dict = {}  # device -> does bucket_kernel read it (asked once a flush)
        for tensor, version, slot, watched in held:
            if _version_of(watched) != version or not _storage_alive(tensor):
                slot.result = _UNKNOWN
                self.stale += 1
                continue
            device = tensor.device
            # the kernel reads one dtype per launch; the torch path takes mixed dtypes at once
            # plain tensors only: a subclass's memory may not be where data_ptr() says
            kernel = tensor.dtype in bucket_kernel.KERNEL_DTYPES and type(tensor) is torch.Tensor
            if kernel:
                kernel = kernel_reads.get(device)
                if kernel is None:
                    kernel = kernel_reads[device] = bucket_kernel.runs_on(device)
            groups.setdefault((device, tensor.dtype if kernel else None), []).append((tensor, slot))
        with torch.no_grad():
            for (_, kernel_dtype), members in groups.items():
                if kernel_dtype is not None and self._kernel_group(members):
                    continue
                try:
                    self._add_group(members)
                except (RuntimeError, TypeError, ValueError, NotImplementedError):
                    # a tensor whose values cannot be read (a subclass without storage):
                    # each on its own, so only those get unknown statistics
                    for member in members:
                        try:
                            self._add_group([member])
                        except (RuntimeError, TypeError, ValueError, NotImplementedError):
                            member[1].result = _UNKNOWN
        return True

    def _kernel_group(self, members: list) -> bool:
        """The group's numbers through bucket_kernel; False (and the torch path from now on)
        if the kernel fails."""
        tensors = [tensor for tensor, _ in members]
        device = tensors[0].device
        try:
            layout = self._layout(device, tuple(t.numel() for t in tensors), None)
            rows = _per_tensor(*bucket_kernel.super_rows(tensors, layout, self.k, device), layout.lengths)
        except Exception as error:  # noqa: BLE001  (a compiler's or driver's error of any kind)
            bucket_kernel.give_up(error)
            return False
        self._keep(rows, members)
        return True

    def _add_group(self, members: list) -> None:
        self._keep(self._group_numbers([tensor for tensor, _ in members]), members)

    def _keep(self, rows: torch.Tensor, members: list) -> None:
        """A flushed group's numbers, on the device until resolve()."""
        self.flushes += 1
        self._groups.append((rows, [slot for _, slot in members]))

    def _group_numbers(self, tensors: list) -> torch.Tensor:
        """(T, 6 + k) float64 on the tensors' device: min, max, sketch (k), sum, sum of
        squares, NaN count, Inf count of each tensor."""
        device = tensors[0].device
        dense = [t.is_contiguous() for t in tensors]
        layout = self._layout(device, tuple(t.numel() for t in tensors), tuple(dense))
        arena = _arena(tensors, dense, layout, device)
        rows = arena.view(-1, SPAN)
        # per super-row: [sketch (k), sum] in one product, its sketch columns signed F[m]
        projected = (rows @ _projection(device, self.k)).mul_(layout.row_signs)
        squares = torch.linalg.vector_norm(rows, 2, dim=1, keepdim=True).square_()
        nans = torch.isnan(rows).sum(1, dtype=_F64, keepdim=True)
        infs = torch.isinf(rows).sum(1, dtype=_F64, keepdim=True)
        # a tensor's last super-row ends in padding: extremes are taken over the values only
        valid = _columns(device) < layout.row_ends
        lows = torch.where(valid, rows, _constant(device, math.inf)).amin(1)
        highs = torch.where(valid, rows, _constant(device, -math.inf)).amax(1)
        return _per_tensor(torch.cat((projected, squares, nans, infs), 1), lows, highs, layout.lengths)

    def _layout(self, device, sizes: tuple, dense: tuple | None):
        """The layout of a flush of these sizes (dense None: the kernel's), made once."""
        key = (device, sizes, dense)
        found = self._layouts.get(key)
        if found is None:
            if dense is None:
                found = bucket_kernel.KernelLayout(device, sizes)
            else:
                found = _Layout(device, sizes, dense, self.k)
            if self._layout_bytes + found.nbytes > _LAYOUT_CACHE_BYTES:
                self._layouts.clear()
                self._layout_bytes = 0
            self._layouts[key] = found
            self._layout_bytes += found.nbytes
        return found

    # ------------------------------------------------------------------ end of step

    def resolve(self) -> None:
        """Flush, then bring every result to the host: one copy per device."""
        self.flush()
        groups, self._groups = self._groups, []
        by_device: dict = {}
        for rows, slots in groups:
            by_device.setdefault(rows.device, []).append((rows, slots))
        k = self.k
        for members in by_device.values():
            joined = torch.cat([rows for rows, _ in members]) if len(members) > 1 else members[0][0]
            host = _to_host(joined)
            self.host_transfers += 1
            start = 0
            for rows, slots in members:
                for slot, numbers in zip(slots, host[start:start + len(slots)].tolist()):
                    slot.result = _numbers(numbers, slot.numel, k)
                start += len(slots)


class _Layout:
    """Where each tensor of a flush sits in its arena, as small device tensors.

    pads: zeros after each tensor (to whole super-rows); places: each tensor's first value in
    the arena (for the tensors copied in after the cat); lengths (T,): super-rows per tensor;
    row_signs (S, k + 1): F[m] for the sketch columns of row m of a tensor, 1 for the sum;
    row_ends (S, 1): how many of a row's SPAN places hold values."""

    def __init__(self, device, sizes: tuple, dense: tuple, k: int):
        counts = np.array([-(-n // SPAN) for n in sizes], dtype=np.int64)
        self.pads = tuple(int(c) * SPAN - n for c, n in zip(counts, sizes))
        rows = int(counts.sum())
        starts = np.cumsum(counts) - counts
        place = np.arange(rows) - np.repeat(starts, counts)
        ends = np.full(rows, SPAN, dtype=np.int64)
        ends[starts + counts - 1] = np.array(sizes, dtype=np.int64) - (counts - 1) * SPAN
        self.places = (starts * SPAN).tolist()
        signs = np.ones((rows, k + 1))
        signs[:, :k] = sketch.fold_signs(int(counts.max()))[place][:, None]
        self.lengths = _on(device, torch.from_numpy(counts))
        self.row_ends = _on(device, torch.from_numpy(ends).view(rows, 1))
        self.row_signs = _on(device, torch.from_numpy(signs))
        self.nbytes = rows * 8 * (k + 2) + len(sizes) * 8


def _per_tensor(additive: torch.Tensor, lows: torch.Tensor, highs: torch.Tensor,
                lengths: torch.Tensor) -> torch.Tensor:
    """Super-rows' numbers -> (T, 6 + k) per tensor (each tensor's rows are one run of
    lengths): min, max, then additive's columns (sketch, sum, sum of squares, NaN and Inf
    counts) summed."""
    totals = torch.segment_reduce(additive, "sum", lengths=lengths, axis=0, unsafe=True)
    low = torch.segment_reduce(lows, "min", lengths=lengths, axis=0, unsafe=True)
    high = torch.segment_reduce(highs, "max", lengths=lengths, axis=0, unsafe=True)
    return torch.cat((low.unsqueeze(1), high.unsqueeze(1), totals), 1)


def _arena(tensors: list, dense: list, layout: _Layout, device) -> torch.Tensor:
    """Every tensor's values as float64, one after another, each padded with zeros to whole
    super-rows: one cat (float64 padding pieces make the result float64 whatever the
    tensors' dtypes), then one multi-tensor copy of the tensors that are not contiguous
    (their places hold zeros until then)."""
    pieces = []
    later_from, later_to = [], []
    for tensor, contiguous, pad in zip(tensors, dense, layout.pads):
        if contiguous:
            pieces.append(tensor)
        else:
            later_from.append(tensor)
            pad += tensor.numel()
        pieces.append(_zeros(device, pad))
    arena = flatten_dense_tensors(pieces)
    if later_from:
        for tensor, contiguous, place in zip(tensors, dense, layout.places):
            if not contiguous:
                later_to.append(arena[place:place + tensor.numel()].view(tensor.shape))
        foreach_copy(later_to, later_from)
    return arena


_tables: dict = {}


def _zeros(device, count: int) -> torch.Tensor:
    """A view of count float64 zeros (count 0 too: it still makes the cat float64), the same
    object every time."""
    key = (device, count)
    found = _tables.get(key)
    if found is None:
        base = _tables.get((device, "zeros"))
        if base is None or base.numel() < count:
            base = _tables[(device, "zeros")] = torch.zeros(max(count, SPAN), dtype=_F64, device=device)
        found = base[:count]
        if len(_tables) < 100_000:
            _tables[key] = found
    return found


def _constant(device, value: float) -> torch.Tensor:
    """A float64 number on the device, made once (a Python number would make a tensor at
    every call)."""
    key = (device, value)
    found = _tables.get(key)
    if found is None:
        found = _tables[key] = torch.tensor(value, dtype=_F64, device=device)
    return found


def _columns(device) -> torch.Tensor:
    """(1, SPAN): a value's place within its super-row, 0 to SPAN - 1."""
    key = (device, "columns")
    found = _tables.get(key)
    if found is None:
        found = _tables[key] = torch.arange(SPAN, device=device).view(1, SPAN)
    return found


def _projection(device, k: int) -> torch.Tensor:
    """(SPAN, k + 1) float64: column j < k projects a super-row onto sketch number j
    (S[g, j] * P[c, j] for the value at group g, column c: the fold's per-row map), column k
    sums it."""
    key = (device, "projection", k)
    found = _tables.get(key)
    if found is None:
        columns, rows = sketch.column_signs(k), sketch.row_signs(k)
        table = np.ones((SPAN, k + 1))
        table[:, :k] = (rows[:, None, :] * columns[None, :, :]).reshape(SPAN, k)
        found = _tables[key] = _on(device, torch.from_numpy(table))
    return found


def _address(tensor: torch.Tensor) -> int:
    try:
        return tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return id(tensor)


def _storage_alive(tensor: torch.Tensor) -> bool:
    """The storage still holds the tensor's values (FSDP2 frees by resizing it to 0)."""
    try:
        needed = (tensor.storage_offset() + 1) * tensor.element_size()
        return tensor.untyped_storage().nbytes() >= needed
    except (RuntimeError, NotImplementedError):
        return True


def _to_host(rows: torch.Tensor) -> np.ndarray:
    """The results as numpy: through pinned memory and an event on CUDA (the one wait)."""
    if rows.device.type == "cpu":
        return rows.numpy()
    if rows.device.type == "cuda":
        pinned = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
        pinned.copy_(rows, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        done.synchronize()
        return pinned.numpy()
    return rows.cpu().numpy()


def _numbers(values: list, numel: int, k: int) -> tuple:
    """A row of a flush's results -> ((min, max, mean, norm, nan, inf), packed sketch)."""
    low, high = values[0], values[1]
    total, squares, nans, infs = values[2 + k:6 + k]
    nans, infs = int(nans), int(infs)
    mean, norm = total / numel, math.sqrt(squares)
    if nans:
        mean = norm = NAN
    elif infs:
        norm = math.inf
        highs, lows = high == math.inf, low == -math.inf
        mean = NAN if highs and lows else (math.inf if highs else -math.inf)
    sketched = None
    if k:
        sketched = sketch.pack(values[2:2 + k] if not (nans or infs) else [NAN] * k)
    return (low, high, mean, norm, nans, infs), sketched
