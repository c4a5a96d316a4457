"""Statistics and sketches of many device tensors at once, read by the host once per step.

On an accelerator the cost of capture is not arithmetic (statistics read each tensor once,
milliseconds of memory traffic against a step) but launches and waits: a per-tensor path
launches ~20 kernels per record, and any read of a number on the host waits for the device.
A DeviceBucket keeps both out of the step:

- ``add(tensor)`` records nothing on the device: it keeps a reference to the tensor and its
  autograd version, and returns a DeviceSlot that ``resolve()`` fills in.
- ``flush()`` runs when the bucket holds BUCKET_TENSORS tensors or BUCKET_BYTES bytes, before
  a tensor it holds is written in place (``before_write``), and at the end of the step. It
  computes every held tensor's statistics and sketch in a fixed number of torch calls per
  (device, dtype) group, whatever the number of tensors:

      arena = cat(each tensor flat, padded with zeros to whole super-rows of SPAN values)
      per super-row: sum, sum of squares (float64), NaN / +Inf / -Inf counts, min and max
      per tensor: one (T, S) @ (S, 5) product gathers the sums and counts of its rows, and
                  a (T, max rows) table of row minima / maxima gives its min and max
      sketch: one (T, S) @ (S, SPAN) product folds each tensor's super-rows (the same fold
              as sketch.sketch), then (T*GROUPS, BLOCK) @ (BLOCK, k) and a signed sum

  The results stay on the device, one (T, 7 + k) float64 tensor per group.
- ``resolve()`` flushes, concatenates every group's results and copies them to the host in
  one copy per device (``host_transfers`` counts them), then fills the slots.

No call here reads a device number on the host before ``resolve()``; the layout of a bucket
(which row belongs to which tensor) is built on the host from shapes alone and sent to the
device with a non-blocking copy, kept for the next step with the same shapes.

Values are read when the bucket flushes, not when they were recorded, so a tensor must not
change in between (for sharded models, ``copy_on_add`` copies each tensor as it is added:
FSDP2 frees and refills its parameters' storage with no call the capture could see). Writes the capture sees (an in-place op, ``out=``, a collective) call
``before_write`` first: a single tensor about to be overwritten is copied once (the copy
takes its place in the bucket), anything else flushes the bucket. A change the capture
cannot see (the autograd engine accumulating into ``.grad``, a storage freed by resizing it)
is detected at the flush by the tensor's version or storage size, and that record's
statistics are reported unknown instead of wrong (``stale`` counts them).

``PROBE_DEVICE_PATH=1`` sends CPU tensors through this path too, so the tests hold it
without an accelerator (docs/performance.md).
"""

from __future__ import annotations

import math
import os

import numpy as np
import torch

from probe.capture.numbers import sketch
from probe.compat import copy_tensors, flatten_dense_tensors, local_tensor, tensor_version as _version_of

#: flush when a bucket holds this many tensors or bytes (bounds the device memory it pins)
BUCKET_TENSORS = 256
BUCKET_BYTES = 64 << 20
#: values per super-row: the sketch's fold unit, so a tensor's rows are its super-rows
SPAN = sketch.GROUPS * sketch.BLOCK
#: what the bucket reads; other dtypes (complex, float8, quantized) take stats.device_stats
DTYPES = frozenset((torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8,
                    torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool))
NAN = float("nan")
_UNKNOWN = ((NAN, NAN, NAN, NAN, -1, -1), None)
_F64 = torch.float64
_HALF = (torch.float16, torch.bfloat16)
#: layouts (row owners, fold and gather matrices) kept per device for shapes seen again
_LAYOUT_CACHE_BYTES = 64 << 20


def device_path_on_cpu() -> bool:
    """PROBE_DEVICE_PATH=1: CPU tensors take the accelerator's path (for tests)."""
    return os.environ.get("PROBE_DEVICE_PATH", "") == "1"


class DeviceSlot:
    """Where one tensor's numbers arrive: ``result`` is ((min, max, mean, norm, nan, inf),
    packed sketch or None) after the bucket's resolve(), None before."""

    __slots__ = ("result", "numel", "_rows", "_row")

    def __init__(self, numel: int):
        self.result = None
        self.numel = numel
        self._rows = None  # the group's (T, 7 + k) results on the device
        self._row = -1


class DeviceBucket:
    """Tensors waiting for their statistics, and the results waiting for the host."""

    def __init__(self, sketch_size: int, max_tensors: int | None = None,
                 max_bytes: int | None = None):
        self.k = max(int(sketch_size), 0)
        self.max_tensors = BUCKET_TENSORS if max_tensors is None else max_tensors
        self.max_bytes = BUCKET_BYTES if max_bytes is None else max_bytes
        self._held: list = []  # [tensor, version, slot]
        self._storages: dict = {}  # storage address -> held entries over it
        self._bytes = 0
        self._groups: list = []  # (results on the device, [slots]) since the last resolve
        #: device-to-host copies made by resolve() (per step: the debugger reads and resets it)
        self.host_transfers = 0
        #: records whose tensor changed, unseen, between record and flush (reported unknown)
        self.stale = 0
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
                tensor = watched = tensor.detach().clone()
        watched = tensor if watched is None else watched
        entry = [tensor, _version_of(watched), slot, watched]
        self._held.append(entry)
        address = _address(tensor)
        self._storages.setdefault(address, []).append(entry)
        self._bytes += numel * tensor.element_size()
        if len(self._held) >= self.max_tensors or self._bytes >= self.max_bytes:
            self.flush()
        return slot

    def before_write(self, tensors) -> None:
        """The capture is about to let a call write these tensors: keep what the bucket holds
        of them as it is now. Tensors held as the same view are copied (one multi-tensor copy
        for a list: an optimizer's foreach step); a write through another view of a held
        tensor's storage flushes the bucket."""
        if not self._held:
            return
        storages = self._storages
        matched: dict = {}
        for tensor in tensors:
            tensor = local_tensor(tensor)
            address = _address(tensor)
            entries = storages.get(address)
            if entries is None or address in matched:
                continue
            if not all(_same_view(entry[0], tensor) for entry in entries):
                self.flush()
                return
            matched[address] = (tensor, entries)
        if matched:
            self._copy_in_place_of(list(matched.items()))

    def _copy_in_place_of(self, matched: list) -> None:
        """Copies of tensors about to be overwritten take their places in the bucket."""
        with torch.no_grad():
            copies = copy_tensors([tensor.detach() for _, (tensor, _) in matched])
        storages = self._storages
        for (address, (_, entries)), copy in zip(matched, copies):
            del storages[address]
            version = _version_of(copy)
            for entry in entries:
                entry[0], entry[1], entry[3] = copy, version, copy
            storages.setdefault(_address(copy), []).extend(entries)

    # ------------------------------------------------------------------ flush

    def flush(self) -> None:
        """Statistics of every held tensor, left on the device (no host synchronisation)."""
        if not self._held:
            return
        held, self._held, self._storages, self._bytes = self._held, [], {}, 0
        groups: dict = {}
        for tensor, version, slot, watched in held:
            if _version_of(watched) != version or not _storage_alive(tensor):
                slot.result = _UNKNOWN
                self.stale += 1
                continue
            groups.setdefault((tensor.device, tensor.dtype), []).append((tensor, slot))
        with torch.no_grad():
            for members in groups.values():
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

    def _add_group(self, members: list) -> None:
        rows = self._group_numbers([tensor for tensor, _ in members])
        self._groups.append((rows, [slot for _, slot in members]))

    def _group_numbers(self, tensors: list) -> torch.Tensor:
        """(T, 7 + k) float64: min, max, sum, sum of squares, NaN, +Inf, -Inf counts, sketch."""
        device, dtype = tensors[0].device, tensors[0].dtype
        accumulate = _accumulation(dtype, device)
        sizes = tuple(t.numel() for t in tensors)
        layout = self._layout(device, accumulate, sizes)
        pieces = []
        for tensor, pad in zip(tensors, layout.pads):
            pieces.append(tensor)
            if pad:
                pieces.append(_zeros(device, dtype, pad))
        arena = flatten_dense_tensors(pieces)
        if arena.dtype != accumulate:
            arena = arena.to(accumulate)
        rows = arena.view(-1, SPAN)
        # a row is SPAN values: its sums round like the host path's, the rows add in float64
        sums = rows.sum(1)
        squares = torch.linalg.vector_norm(rows, 2, dim=1).to(_F64).square()
        nans = torch.count_nonzero(torch.isnan(rows), dim=1)
        highs = torch.count_nonzero(torch.isposinf(rows), dim=1)
        lows = torch.count_nonzero(torch.isneginf(rows), dim=1)
        additive = torch.stack((sums.to(_F64), squares, nans.to(_F64), highs.to(_F64),
                                lows.to(_F64)), 1)
        totals = layout.owners @ torch.nan_to_num(additive, nan=0.0, posinf=0.0, neginf=0.0)
        minima, maxima = torch.aminmax(rows, dim=1)
        # the last super-row of each tensor ends in padding: its extremes come from its values
        last = rows.index_select(0, layout.last_rows)
        minima = minima.index_copy(0, layout.last_rows,
                                   torch.where(layout.valid_last, last, _fill(last, math.inf)).amin(1))
        maxima = maxima.index_copy(0, layout.last_rows,
                                   torch.where(layout.valid_last, last, _fill(last, -math.inf)).amax(1))
        low = _per_tensor(minima, layout, math.inf).amin(1)
        high = _per_tensor(maxima, layout, -math.inf).amax(1)
        columns = [low.to(_F64).unsqueeze(1), high.to(_F64).unsqueeze(1), totals]
        if self.k:
            clean = torch.nan_to_num(rows, nan=0.0, posinf=0.0, neginf=0.0)
            folded = (layout.fold @ clean).view(len(sizes) * sketch.GROUPS, sketch.BLOCK)
            projection, signs = sketch.projection_tables(device, accumulate, self.k)
            products = (folded @ projection).view(len(sizes), sketch.GROUPS, self.k)
            columns.append((products * signs).sum(1, dtype=_F64))
        return torch.cat(columns, 1)

    def _layout(self, device, accumulate, sizes: tuple) -> "_Layout":
        key = (device, accumulate, sizes)
        found = self._layouts.get(key)
        if found is None:
            found = _Layout(device, accumulate, sizes)
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
        for device, members in by_device.items():
            joined = torch.cat([rows for rows, _ in members]) if len(members) > 1 else members[0][0]
            host = _to_host(joined)
            self.host_transfers += 1
            start = 0
            for rows, slots in members:
                for slot, numbers in zip(slots, host[start:start + len(slots)]):
                    slot.result = _numbers(numbers, slot.numel, self.k)
                start += len(slots)


class _Layout:
    """Which super-row of a bucket's arena belongs to which tensor, as device tensors.

    owners (T, S) float64: 1 where row s is tensor t's; fold (T, S): F[m] there instead
    (m: the row's place within its tensor), the sketch's fold signs; last_rows (T,) and
    valid_last (T, SPAN): each tensor's last row and which of its places hold values;
    table (S,): each row's place in a (T, most rows) table of per-row extremes."""

    def __init__(self, device, accumulate, sizes: tuple):
        counts = np.array([-(-n // SPAN) for n in sizes], dtype=np.int64)
        self.pads = tuple(int(c) * SPAN - n for c, n in zip(counts, sizes))
        tensors, rows = len(sizes), int(counts.sum())
        self.widest = int(counts.max())
        owner = np.repeat(np.arange(tensors), counts)
        starts = np.cumsum(counts) - counts
        place = np.arange(rows) - np.repeat(starts, counts)
        tails = np.array(sizes, dtype=np.int64) - (counts - 1) * SPAN
        host = torch.from_numpy(np.concatenate((owner, place, starts + counts - 1, tails,
                                                 owner * self.widest + place)))
        if device.type == "cuda":
            host = host.pin_memory()
        index = host.to(device, non_blocking=True)
        owner_t = index[:rows]
        place_t = index[rows:2 * rows]
        self.last_rows = index[2 * rows:2 * rows + tensors]
        tails_t = index[2 * rows + tensors:2 * rows + 2 * tensors]
        self.table = index[2 * rows + 2 * tensors:]
        every_row = torch.arange(rows, device=device)
        self.owners = torch.zeros(tensors, rows, dtype=_F64, device=device)
        # values as device tensors: a Python number would be copied from the host
        self.owners.index_put_((owner_t, every_row), torch.ones((), dtype=_F64, device=device))
        fold_signs = sketch.fold_sign_table(device, accumulate, self.widest)[place_t]
        self.fold = torch.zeros(tensors, rows, dtype=accumulate, device=device)
        self.fold.index_put_((owner_t, every_row), fold_signs)
        self.valid_last = torch.arange(SPAN, device=device).unsqueeze(0) < tails_t.unsqueeze(1)
        self.tensors = tensors
        self.nbytes = tensors * rows * (8 + self.fold.element_size()) + tensors * SPAN


def _per_tensor(per_row: torch.Tensor, layout: _Layout, fill: float) -> torch.Tensor:
    """(T, most rows): each tensor's row values, the rest fill (neutral for min / max)."""
    table = per_row.new_full((layout.tensors * layout.widest,), fill)
    table[layout.table] = per_row
    return table.view(layout.tensors, layout.widest)


def _fill(like: torch.Tensor, value: float) -> torch.Tensor:
    return torch.full((), value, dtype=like.dtype, device=like.device)


def _accumulation(dtype, device) -> torch.dtype:
    """float32 for 32- and 16-bit floats, float64 for float64 and integer values (as
    stats._as_real); float64 on CUDA while TF32 may round float32 products (as sketch)."""
    if dtype == _F64 or not dtype.is_floating_point:
        return _F64
    if device.type == "cuda" and sketch.tf32_allowed():
        return _F64
    return torch.float32


_zero_tables: dict = {}


def _zeros(device, dtype, count: int) -> torch.Tensor:
    """A view of count zeros, the same object every time (no call per padded tensor)."""
    key = (device, dtype, count)
    found = _zero_tables.get(key)
    if found is None:
        base = _zero_tables.get((device, dtype))
        if base is None:
            base = _zero_tables[(device, dtype)] = torch.zeros(SPAN, dtype=dtype, device=device)
        found = _zero_tables[key] = base[:count]
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


def _same_view(held: torch.Tensor, tensor: torch.Tensor) -> bool:
    return (held.data_ptr() == tensor.data_ptr() and held.shape == tensor.shape
            and held.stride() == tensor.stride() and held.dtype == tensor.dtype)


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


def _numbers(values: np.ndarray, numel: int, k: int) -> tuple:
    """A row of a group's results -> ((min, max, mean, norm, nan, inf), packed sketch)."""
    low, high, total, squares, nans, highs, lows = (float(v) for v in values[:7])
    nans, infs = int(nans), int(highs) + int(lows)
    mean, norm = total / numel, math.sqrt(squares)
    if nans:
        mean = norm = NAN
    elif infs:
        norm = math.inf
        mean = NAN if highs and lows else (math.inf if highs else -math.inf)
    sketched = None
    if k:
        sketched = sketch.pack(values[7:7 + k] if not (nans or infs) else np.full(k, NAN))
    return (low, high, mean, norm, nans, infs), sketched


