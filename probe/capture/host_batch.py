"""Statistics and sketches of CPU tensors, a batch at a time (issues 10 and 12).

Per record, ``stats.host_stats_and_sketch`` makes about ten numpy and torch calls (min, max,
dot, sum, the sketch's padding, product and signed sum, conversions). On the small tensors of
a small model those calls, not the arithmetic, are the cost: about 50 us per record of 8192
values, when the arithmetic takes a few. A ``HostBatch`` instead copies each tensor's values
into an arena while they are still in the cache (one numpy copy per record), and computes the
numbers of everything in the arena at once, when it is full or when the step ends.

Small tensors (at most sketch's ``_DENSE_MAX`` values: 64 rows of BLOCK) are packed from the
front of the arena, each starting on a row of a (rows, BLOCK) view, zero-padded to whole rows
(the sketch's layout, sketch.py), and computed together:

    min, max  np.minimum / np.maximum.reduceat over each tensor's values
    sum       row sums (torch, in the values' dtype), then per tensor in float64
    norm      row norms (torch, in the values' dtype), squares summed per tensor in float64
    sketch    one (rows, BLOCK) @ (BLOCK, k) product for all of them, each row's products
              signed by F[r // GROUPS] * S[r % GROUPS] (r: the row within its tensor), summed
              per tensor in float64: sketch.array_sketch's unfolded form, the same numbers
    NaN/Inf   the tensors whose extremes are not finite, or so large that a row's squares
              could overflow, are computed alone by stats.host_stats (which counts them)

With a background worker (below), larger tensors (up to BIG_MAX values) are packed from the
back of the arena and computed one by one by the per-record functions (stats.host_stats,
sketch.array_sketch: the fold) on their copy: the same numbers as the per-record path, off the
training thread. Inline, they are not batched: their copy would cost about what their numbers
cost at record time.

Background (off by default): with ``BACKGROUND = True`` (or None: when torch.get_num_threads()
is below the CPUs this process may use) a full arena is computed on a worker thread while
training goes on into a second arena. It was measured slower on the wall clock, not faster
(DeepMLP on a 2-core machine, one torch thread, k = 16: 5.7x against 4.0x inline): the worker's
Python and the numpy calls that keep the GIL stall the training thread more than the work it
takes away. It stays for machines where that may differ; docs/performance.md.

Statistics against ``host_stats``: min, max and the NaN/Inf counts are identical; for small
tensors the sum and the sum of squares are accumulated per row in the tensor's dtype and then
in float64 instead of torch's float32 cascade, so mean and norm agree to rounding. Sketches are
the same linear map as the per-record ones (rounding-level differences from the products'
blocking; docs/format.md, "Sketch").
"""

from __future__ import annotations

import os
import threading

import numpy as np
import torch

from probe.capture import sketch, stats

BLOCK = sketch.BLOCK
#: values an arena holds (float32: 4 MB, so the batch pass reads them from the CPU's cache)
CAPACITY = 1 << 20
#: tensors up to this many values are batched together (the unfolded sketch's tensors)
SMALL_MAX = sketch._DENSE_MAX
#: tensors up to this many values are copied and computed off the training thread; larger ones
#: are computed at record time (their copy would cost about as much as their statistics)
BIG_MAX = 1 << 18
#: compute full arenas on a worker thread: False (measured slower, module doc), True, or None =
#: when torch leaves a core free
BACKGROUND: bool | None = False
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
    """One dtype's copied values: small tensors from the front, larger ones from the back."""

    def __init__(self, dtype: np.dtype):
        self.values = np.zeros(CAPACITY + 1, dtype=dtype)  # +1: reduceat's last end index
        self.front = 0  # small tensors use [0, front), whole rows
        self.back = CAPACITY  # larger tensors use [back, CAPACITY)
        self.small: list[tuple[int, int, HostSlot]] = []  # (start, size, slot)
        self.large: list[tuple[int, tuple, HostSlot]] = []  # (start, shape, slot)
        self.done: threading.Event | None = None  # set when a background pass finished

    def wait(self) -> None:
        if self.done is not None:
            self.done.wait()
            self.done = None


class HostBatch:
    """Float32/float64 CPU tensors' statistics and sketches, computed a batch at a time.

    ``add(array)`` copies a numpy array's values and returns a HostSlot, filled when the batch
    is computed: when its arena is full, or at ``compute()`` (which fills every slot).
    Thread-safe: autograd may call hooks from its own threads.

    background: compute full arenas on a worker thread (None: host_batch.BACKGROUND, whose
    default None means when a core is free, above)."""

    def __init__(self, sketch_size: int, background: bool | None = None):
        self.sketch_size = sketch_size
        if background is None:
            background = BACKGROUND
        self.background = _spare_core() if background is None else background
        #: the largest tensor add() takes. Inline, a large tensor's copy would cost about what
        #: its numbers cost at record time (measured), so only small ones are batched; in the
        #: background the copy is all the training thread pays.
        self.limit = BIG_MAX if self.background else SMALL_MAX
        self._arenas: dict = {}  # dtype -> [filling, spare]
        self._lock = threading.Lock()

    def add(self, array: np.ndarray) -> HostSlot:
        """A slot for array's numbers (float32 or float64, 1 <= size <= self.limit)."""
        size = array.size
        slot = HostSlot()
        with self._lock:
            pair = self._arenas.get(array.dtype)
            if pair is None:
                pair = self._arenas[array.dtype] = [_Arena(array.dtype), None]
            arena = pair[0]
            small = size <= SMALL_MAX
            need = -(-size // BLOCK) * BLOCK if small else size
            if arena.front + need > arena.back:
                arena = self._rotate(pair)
            if small:
                start = arena.front
                end = start + size
                # reshape of the contiguous destination: a strided source is copied in order
                np.copyto(arena.values[start:end].reshape(array.shape), array)
                if size != need:
                    arena.values[end:start + need] = 0  # the sketch reads whole rows
                arena.front = start + need
                arena.small.append((start, size, slot))
            else:
                start = arena.back - need
                np.copyto(arena.values[start:arena.back].reshape(array.shape), array)
                arena.back = start
                arena.large.append((start, array.shape, slot))
        return slot

    def compute(self) -> None:
        """Fill every pending slot (waits for the worker)."""
        with self._lock:
            for pair in self._arenas.values():
                if pair[1] is not None:
                    pair[1].wait()
                pair[0].wait()
                _compute(pair[0], self.sketch_size)

    def _rotate(self, pair: list) -> _Arena:
        """Hand the full arena to the worker (or compute it now); fill the other one."""
        full = pair[0]
        spare = pair[1]
        if not self.background or not self._submit(full):
            _compute(full, self.sketch_size)
            return full
        if spare is None:
            spare = _Arena(full.values.dtype)
        spare.wait()
        pair[0], pair[1] = spare, full
        return spare

    def _submit(self, arena: _Arena) -> bool:
        jobs = _worker_queue()
        if jobs is None:
            return False
        arena.done = threading.Event()
        jobs.put((arena, self.sketch_size))
        return True


#: (process id, queue) of this process's one statistics worker thread, started on first use
_worker: list = [None, None]
_worker_lock = threading.Lock()


def _worker_queue():
    """The worker's job queue; None when no thread can be started (interpreter shutdown).
    A forked child starts its own: the parent's thread does not exist there."""
    with _worker_lock:
        if _worker[0] != os.getpid():
            import queue

            jobs = queue.SimpleQueue()
            try:
                threading.Thread(target=_work, args=(jobs,), daemon=True,
                                 name="probe-statistics").start()
            except RuntimeError:
                return None
            _worker[0], _worker[1] = os.getpid(), jobs
        return _worker[1]


def _spare_core() -> bool:
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return torch.get_num_threads() < cores


def _work(jobs) -> None:
    while True:
        arena, sketch_size = jobs.get()
        try:
            _compute(arena, sketch_size)
        finally:
            arena.done.set()


def _compute(arena: _Arena, sketch_size: int) -> None:
    """Fill the slots of an arena's tensors and empty it. Never raises: a tensor whose numbers
    could not be computed gets unknown statistics (NaN, counts -1) and no sketch."""
    small, large = arena.small, arena.large
    if not small and not large:
        return
    try:
        # NaN/Inf and huge values are expected (the statistics count them): no warnings
        with np.errstate(all="ignore"):
            if small:
                for (_, _, slot), result in zip(small, _small_numbers(arena, sketch_size)):
                    slot.result = result
            for start, shape, slot in large:
                view = arena.values[start:start + _numel(shape)]
                tensor = torch.from_numpy(view).reshape(shape)
                slot.result = (stats.host_stats(tensor),
                               sketch.array_sketch(view, sketch_size) if sketch_size > 0 else None)
    except Exception:  # never break training over statistics (as Recorder._describe)
        for _, _, slot in small:
            slot.result = slot.result or (_UNKNOWN, None)
        for _, _, slot in large:
            slot.result = slot.result or (_UNKNOWN, None)
    finally:
        arena.front, arena.back, arena.small, arena.large = 0, CAPACITY, [], []


_UNKNOWN = (float("nan"),) * 4 + (-1, -1)


def _numel(shape: tuple) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def _small_numbers(arena: _Arena, k: int) -> list[tuple]:
    """[((min, max, mean, norm, nan, inf), sketch or None)] of the arena's small tensors."""
    values, used = arena.values, arena.front
    starts = np.fromiter((start for start, _, _ in arena.small), dtype=np.intp, count=len(arena.small))
    sizes = np.fromiter((size for _, size, _ in arena.small), dtype=np.intp, count=len(arena.small))
    bounds = np.empty(2 * len(starts), dtype=np.intp)
    bounds[0::2], bounds[1::2] = starts, starts + sizes
    # the odd segments are the padding between tensors (possibly empty: reduceat then gives
    # one value of the next tensor); only the even ones are read
    lows = np.minimum.reduceat(values[: used + 1], bounds)[0::2]
    highs = np.maximum.reduceat(values[: used + 1], bounds)[0::2]
    table = values[:used].reshape(-1, BLOCK)
    rows = torch.from_numpy(table)
    row_starts = starts // BLOCK
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
    if k <= 0:
        return [(found, None) for found in numbers]
    sketches = _small_sketches(table, row_starts, -(-sizes // BLOCK), k)
    return list(zip(numbers, map(tuple, sketches.tolist())))


def _small_sketches(table: np.ndarray, row_starts: np.ndarray, row_counts: np.ndarray,
                    k: int) -> np.ndarray:
    """(tensors, k) float64: sketch.array_sketch's unfolded projection of every tensor."""
    columns, _ = sketch._projection_tables("numpy", table.dtype, k)
    # torch's product: it honours torch.set_num_threads; numpy's OpenBLAS would take every
    # core (measured 9x slower on a busy 2-core machine)
    products = torch.from_numpy(table).mm(torch.from_numpy(columns)).numpy()
    local_rows = np.arange(table.shape[0]) - np.repeat(row_starts, row_counts)
    signs = sketch._row_signs_table(table.dtype, k, int(row_counts.max()))
    signed = np.multiply(products, signs[local_rows])
    return np.add.reduceat(signed.astype(np.float64), row_starts, axis=0)
