"""Statistics and sketches of CPU tensors, a batch at a time.

Per record, ``stats.host_stats_and_sketch`` makes about ten numpy and torch calls (min, max,
dot, sum, the sketch's padding, product and signed sum, conversions). On the small tensors of
a small model those calls, not the arithmetic, are the cost: about 50 us per record of 8192
values, when the arithmetic takes a few. A ``HostBatch`` instead copies each tensor's values
into an arena while they are still in the cache (one numpy copy per record), and computes the
numbers of everything in the arena at once, when it is full or when the step ends.

Tensors of at most ``SMALL_MAX`` values (64 rows of BLOCK, the tensors sketch.array_sketch
projects unfolded) are packed one after another, each starting on a row of a (rows, BLOCK)
view, zero-padded to whole rows (the sketch's layout, sketch.py), and computed together:

    min, max  np.minimum / np.maximum.reduceat over each tensor's values
    sum       row sums (torch, in the values' dtype), then per tensor in float64
    norm      row norms (torch, in the values' dtype), squares summed per tensor in float64
    sketch    one (rows, BLOCK) @ (BLOCK, k) product for all of them, each row's products
              signed by F[r // GROUPS] * S[r % GROUPS] (r: the row within its tensor), summed
              per tensor in float64: sketch.array_sketch's unfolded form, the same numbers
    NaN/Inf   the tensors whose extremes are not finite, or so large that a row's squares
              could overflow, are computed alone by stats.host_stats (which counts them)

Larger float32/float64 tensors are not copied: a copy would cost about what their statistics
cost at record time (measured), and those calls are amortised over their size. Their sketch is
split (``add_folded``): the fold (sketch.fold_into, one pass while the values are in the cache
after the statistics) is written into the arena from its back end, at most GROUPS rows, and
the (rows, BLOCK) @ (BLOCK, k) products of all folds are one product when the batch is
computed. A fold's rows take the signs a small tensor's first GROUPS rows get, F[0] * S[g]
with F[0] = +1, which is the fold's own combine (sketch.combine_folded): the same sketch as
sketch.array_sketch's. The copies (front) and the folds (back) are two contiguous tables, so
the statistics pass never reads a fold.

Sketches leave the batch packed (sketch.pack: bytes, one object a record instead of 17).

Computing full arenas on a worker thread while training fills a second arena was tried and
measured slower on the wall clock (DeepMLP on a 2-core machine, one torch thread, k = 16: 5.7x
against 4.0x inline: the worker's Python and the numpy calls that keep the GIL stall the
training thread), so the batch is computed inline (docs/performance.md).

Statistics against ``host_stats``: min, max and the NaN/Inf counts are identical; the sum and
the sum of squares are accumulated per row in the tensor's dtype and then
in float64 instead of torch's float32 cascade, so mean and norm agree to rounding. Sketches are
the same linear map as the per-record ones (rounding-level differences from the products'
blocking; docs/format.md, "Sketch").
"""

from __future__ import annotations

import threading

import numpy as np
import torch

from probe.capture.numbers import sketch, stats
from probe.capture.numbers.host_view import host_read_view

BLOCK = sketch.BLOCK
#: values an arena holds (float32: 4 MB, so the batch pass reads them from the CPU's cache)
CAPACITY = 1 << 20
#: tensors up to this many values are batched (the unfolded sketch's tensors)
SMALL_MAX = sketch.DENSE_MAX
#: the dtypes a batch holds
BATCHED_DTYPES = (torch.float32, torch.float64)
#: a small tensor whose largest |value| squared times its size exceeds this may overflow a
#: row's sum of squares: it is computed alone (as stats.host_stats decides its norm's dtype)
_SQUARES_MAX = {4: 1e37, 8: 1e306}


class HostSlot:
    """Where a batched record's numbers arrive: ``result`` is None until the batch is
    computed, then ((min, max, mean, norm, nan_count, inf_count), sketch or None)."""

    __slots__ = ("result",)

    def __init__(self):
        self.result = None


class _Arena:
    """One dtype's values: small tensors copied from the front, larger tensors' folds written
    from the back, so the statistics pass reads the copies alone and each region is one
    contiguous table. Each region's layout is kept in parallel lists of ints (one C-level
    conversion each when the arena is computed, not a generator over tuples)."""

    def __init__(self, dtype: np.dtype):
        self.values = np.zeros(CAPACITY + 1, dtype=dtype)  # +1: reduceat's last end index
        self.used = 0
        self.starts: list[int] = []  # copies: first value, size, slot
        self.sizes: list[int] = []
        self.slots: list[HostSlot] = []
        self.folds_start = CAPACITY
        self.fold_rows: list[int] = []  # folds, written from the back: rows, slot, statistics
        self.fold_slots: list[HostSlot] = []
        self.fold_numbers: list[tuple] = []
        #: (CAPACITY // BLOCK, k) products of the last compute, reused (torch.mm(out=...))
        self.products = None
        #: _Layout by (k, copies' sizes, folds' rows): at most LAYOUTS_KEPT, LAYOUT_BYTES of signs
        self.layouts: dict = {}
        self.layout_bytes = 0

    def empty(self) -> None:
        self.used, self.starts, self.sizes, self.slots = 0, [], [], []
        self.folds_start = CAPACITY
        self.fold_rows, self.fold_slots, self.fold_numbers = [], [], []


class HostBatch:
    """Small float32/float64 CPU tensors' statistics and sketches, computed a batch at a time.

    ``add(array)`` copies a numpy array's values and returns a HostSlot, filled when the batch
    is computed: when its arena is full, or at ``compute()`` (which fills every slot).
    Thread-safe: autograd may call hooks from its own threads."""

    def __init__(self, sketch_size: int):
        self.sketch_size = sketch_size
        # arenas live as long as the batch: the debugger keeps one HostBatch for all steps
        self._arenas: dict = {}
        self._lock = threading.Lock()

    def add(self, array: np.ndarray) -> HostSlot:
        """A slot for array's numbers (float32 or float64, 1 <= size <= SMALL_MAX)."""
        size = array.size
        need = -(-size // BLOCK) * BLOCK
        slot = HostSlot()
        with self._lock:
            arena = self._arena(array.dtype, need)
            start = arena.used
            end = start + size
            # reshape of the contiguous destination: a strided source is copied in order
            np.copyto(arena.values[start:end].reshape(array.shape), array)
            if size != need:
                arena.values[end:start + need] = 0  # the sketch reads whole rows
            arena.used = start + need
            arena.starts.append(start)
            arena.sizes.append(size)
            arena.slots.append(slot)
        return slot

    def take(self, values: torch.Tensor) -> tuple:
        """(numbers, sketch, slot) of a strided, non-empty CPU tensor: a float32/float64 one of
        at most SMALL_MAX values is copied into the batch (numbers and sketch None: the slot
        will hold both); a larger one's statistics are computed now and its sketch's fold is
        batched (sketch None: the slot will hold it); anything else is computed now (slot None)."""
        if values.dtype in BATCHED_DTYPES:
            if values.numel() <= SMALL_MAX:
                try:
                    return None, None, self.add(host_read_view(values))
                except (RuntimeError, TypeError):  # conj/neg bits, subclasses without numpy()
                    pass
            if self.sketch_size > 0:
                return stats.host_stats_and_later_sketch(values, self.sketch_size, self.add_folded)
        return (*stats.host_stats_and_sketch(values, self.sketch_size), None)

    def add_folded(self, array: np.ndarray, numbers: tuple) -> HostSlot:
        """A slot for the sketch of a larger float32/float64 array whose statistics (numbers)
        are known: the values are folded into the arena now (one pass: sketch.fold_into), and
        the product that turns the fold into the sketch is the batch's. The slot's result is
        (numbers, sketch). The caller passes finite values (NaN/Inf go through
        sketch.array_sketch, whose warnings it silences) and sketch_size > 0."""
        flat = array.reshape(-1)
        rows = sketch.fold_rows(flat.size)
        slot = HostSlot()
        with self._lock:
            arena = self._arena(flat.dtype, rows * BLOCK)
            start = arena.folds_start - rows * BLOCK
            sketch.fold_into(flat, arena.values[start:])
            arena.folds_start = start
            arena.fold_rows.append(rows)
            arena.fold_slots.append(slot)
            arena.fold_numbers.append(numbers)
        return slot

    def _arena(self, dtype: np.dtype, need: int) -> _Arena:
        """dtype's arena with room for need more values (computed and emptied when full)."""
        arena = self._arenas.get(dtype)
        if arena is None:
            arena = self._arenas[dtype] = _Arena(dtype)
        if arena.used + need > arena.folds_start:
            _compute(arena, self.sketch_size)
        return arena

    def compute(self) -> None:
        """Fill every pending slot."""
        with self._lock:
            for arena in self._arenas.values():
                _compute(arena, self.sketch_size)


def _compute(arena: _Arena, sketch_size: int) -> None:
    """Fill the slots of an arena's tensors and empty it. Never raises: a tensor whose numbers
    could not be computed gets unknown statistics (NaN, counts -1) and no sketch, a fold its
    statistics without a sketch."""
    copies, folds = arena.slots, arena.fold_slots
    if not copies and not folds:
        # stop() and step() both compute: the second finds the arena empty (an empty product
        # raised inside _arena_sketches, about 0.1 ms a step on a small model)
        return
    try:
        # NaN/Inf and huge values are expected (the statistics count them): no warnings
        with np.errstate(all="ignore"):
            layout = _layout(arena, sketch_size)
            numbers = _numbers(arena, layout) if copies else []
            packed = [None] * (len(copies) + len(folds))
            if sketch_size > 0:
                try:
                    packed = _packed(_arena_sketches(arena, layout, sketch_size))
                except Exception:  # the statistics stay, without sketches
                    pass
            for slot, found, sketched in zip(copies, numbers, packed):
                slot.result = (found, sketched)
            # the folds' sketches follow the copies' in the order of the values: last added first
            for slot, found, sketched in zip(reversed(folds), reversed(arena.fold_numbers),
                                             packed[len(copies):]):
                slot.result = (found, sketched)
    except Exception:  # never break training over statistics (as Recorder._describe)
        for slot in copies:
            slot.result = slot.result or (_UNKNOWN, None)
        for slot, found in zip(folds, arena.fold_numbers):
            slot.result = slot.result or (found, None)
    finally:
        arena.empty()


_UNKNOWN = (float("nan"),) * 4 + (-1, -1)


class _Layout:
    """What an arena's computation derives from its layout alone: the sizes of its copies and
    the rows of its folds. A training step records the same tensors every step, so each layout
    is derived once and found again (about ten numpy calls a computation fewer, each costing
    several times its arithmetic right after a training step, docs/performance.md)."""

    __slots__ = ("starts", "sizes", "bounds", "copy_rows", "sketch_starts", "signs")

    def __init__(self, arena: _Arena, k: int):
        self.starts = np.array(arena.starts, dtype=np.intp)
        self.sizes = np.array(arena.sizes, dtype=np.intp)
        self.bounds = np.empty(2 * len(self.starts), dtype=np.intp)
        self.bounds[0::2], self.bounds[1::2] = self.starts, self.starts + self.sizes
        self.copy_rows = self.starts // BLOCK
        self.sketch_starts = self.signs = None
        if k > 0:
            self._sketch_layout(arena, k)

    def _sketch_layout(self, arena: _Arena, k: int) -> None:
        """Each tensor's first product row (copies, then folds in value order) and every
        product row's sign (_arena_sketches), in float64: a product times +-1 is exact in
        either width, so signing in float64 is also the widening."""
        fold_counts = np.array(arena.fold_rows[::-1], dtype=np.intp)
        row_counts = np.concatenate((-(-self.sizes // BLOCK), fold_counts))
        copied_rows = arena.used // BLOCK
        # a fold's rows follow the previous fold's: their starts are a running sum
        fold_starts = copied_rows + np.cumsum(fold_counts) - fold_counts
        self.sketch_starts = np.concatenate((self.copy_rows, fold_starts))
        total = copied_rows + int(fold_counts.sum())
        table = sketch.row_signs_table(arena.values.dtype, k, int(row_counts.max()))
        local_rows = np.arange(total) - np.repeat(self.sketch_starts, row_counts)
        self.signs = np.take(table, local_rows, axis=0).astype(np.float64)


#: layouts kept per arena: a step's arena fills a few times when the step records more than
#: CAPACITY values (each fill its own layout); beyond this the cache starts again
LAYOUTS_KEPT = 8
#: bytes of row signs the kept layouts of one arena may hold. A full arena's signs take
#: CAPACITY // BLOCK * k * 8 bytes: 0.5 MB at k = 16, but 34 MB at the largest sketch_size
#: (1024), whose layouts are then derived every time instead of kept
LAYOUT_BYTES = 16 << 20


def _layout(arena: _Arena, k: int) -> _Layout:
    key = (k, tuple(arena.sizes), tuple(arena.fold_rows))
    layout = arena.layouts.get(key)
    if layout is None:
        layout = _Layout(arena, k)
        size = 0 if layout.signs is None else layout.signs.nbytes
        if len(arena.layouts) >= LAYOUTS_KEPT or arena.layout_bytes + size > LAYOUT_BYTES:
            arena.layouts.clear()
            arena.layout_bytes = 0
        if size <= LAYOUT_BYTES:
            arena.layouts[key] = layout
            arena.layout_bytes += size
    return layout


def _numbers(arena: _Arena, layout: _Layout) -> list[tuple]:
    """[(min, max, mean, norm, nan, inf)] of the arena's copied tensors."""
    values, used = arena.values, arena.used
    starts, sizes, bounds, row_starts = layout.starts, layout.sizes, layout.bounds, layout.copy_rows
    # the odd segments are the padding between tensors (possibly empty: reduceat then gives
    # one value of the next tensor); only the even ones are read
    lows = np.minimum.reduceat(values[: used + 1], bounds)[0::2]
    highs = np.maximum.reduceat(values[: used + 1], bounds)[0::2]
    rows = torch.from_numpy(values[:used].reshape(-1, BLOCK))
    totals = np.add.reduceat(rows.sum(1).numpy().astype(np.float64), row_starts)
    row_norms = torch.linalg.vector_norm(rows, dim=1).numpy().astype(np.float64)
    norms = np.sqrt(np.add.reduceat(np.square(row_norms), row_starts))
    means = totals / sizes

    largest = np.maximum(-lows, highs).astype(np.float64)
    alone = np.flatnonzero(~(np.square(largest) * sizes <= _SQUARES_MAX[values.dtype.itemsize]))
    numbers = list(zip(lows.tolist(), highs.tolist(), means.tolist(), norms.tolist(),
                       [0] * len(starts), [0] * len(starts)))
    for i in alone.tolist():  # NaN/Inf, or squares that may overflow: as the per-record path
        start = int(starts[i])
        numbers[i] = stats.host_stats(torch.from_numpy(values[start:start + int(sizes[i])]))
    return numbers


def _arena_sketches(arena: _Arena, layout: _Layout, k: int) -> np.ndarray:
    """(copies + folds, k) float64: the copies' sketches in their order, then the folds' in the
    order of their values (the reverse of the order they were added).

    A copy's rows are projected unfolded: row r of a tensor signed F[r // GROUPS] *
    S[r % GROUPS] (sketch.array_sketch's dense form). A fold has at most GROUPS rows, so its
    row g gets F[0] * S[g], which is S[g] because F[0] is +1 (tests/capture/test_capture_host_batch.py):
    its own combine (sketch.combine_folded). One product per region (two contiguous tables) into one
    buffer the arena keeps, then one signed sum for all (the signs from the layout)."""
    # P as a CPU tensor, cached like a device's (one conversion per process, not per compute)
    columns, _ = sketch.projection_tables("cpu", torch.from_numpy(arena.values[:0]).dtype, k)
    products = arena.products
    if products is None or products.shape[1] != k:
        products = arena.products = torch.empty(CAPACITY // BLOCK, k, dtype=columns.dtype)
    # torch's product: it honours torch.set_num_threads; numpy's OpenBLAS would take every
    # core (measured 9x slower on a busy 2-core machine)
    copied_rows = arena.used // BLOCK
    if copied_rows:
        torch.mm(torch.from_numpy(arena.values[:arena.used].reshape(-1, BLOCK)), columns,
                 out=products[:copied_rows])
    fold_rows = (CAPACITY - arena.folds_start) // BLOCK
    if fold_rows:
        torch.mm(torch.from_numpy(arena.values[arena.folds_start:CAPACITY].reshape(-1, BLOCK)),
                 columns, out=products[copied_rows:copied_rows + fold_rows])
    signed = np.multiply(products[:copied_rows + fold_rows].numpy(), layout.signs)
    return np.add.reduceat(signed, layout.sketch_starts, axis=0)


def _packed(sketches: np.ndarray) -> list[bytes]:
    """sketch.pack of every row, sliced from one bytes object: bytes, not tuples of floats
    (17 fewer Python objects a record)."""
    blob, width = sketch.pack(sketches), 8 * sketches.shape[1]
    return [blob[at:at + width] for at in range(0, len(blob), width)]
