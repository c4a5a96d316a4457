"""Turn observed tensors and values into schema rows for one step.

The Recorder is the state of one step of capture: the per-step name counters, the stack of
running modules, the records made so far, and a cache that makes each distinct tensor cost
one statistics computation (and, for task "tensor", one stored copy) per step however many
records reference it (an op's output is the next op's input).

Cache: the same tensor object again, unchanged (its version and address as they were), is
found by its id first. Otherwise the key is the hash of (data_ptr, dtype, shape, stride,
_version). data_ptr includes the storage offset, _version changes on every in-place write,
and for a hit the storage of the tensor the entry was made from (held by a weak reference)
must be alive and be the looked-up tensor's storage: freed memory may be reused by a new
tensor with the same layout, and that one must miss (FSDP2 frees memory by resizing a storage
that lives on). The storage, not the tensor object, because a tensor's Python object can die
while its memory lives on in an alias that shares its version counter: autograd hands a hook
the gradient, then stores ``grad.detach()`` as ``param.grad``, a new object over the same
bytes (torch keeps a storage's Python object alive exactly as long as the storage; measured:
232 of DeepMLP's 1076 statistics per step were such repeats). The key is the 64-bit hash
rather than the tuple because every object the cache keeps alive is work for Python's garbage
collector during the step (measured: docs/performance.md).

A record is kept small while the step runs: (call, slot, io, entry), the entry shared by
every record of the tensor. ``resolve()`` fills in the numbers still on their way, once per
entry, and turns the records into rows: tuples in schema.ALL_COLUMNS order followed by the
record's sketch (packed bytes, or None; schema.ROW_WIDTH). Where a tensor's numbers come from
is decided by numbers/route.py: on the CPU computed at once or a batch at a time; on other
devices (and on the CPU with PROBE_DEVICE_PATH=1) the tensors wait in a DeviceBucket
(device_bucket.py), whose statistics stay on the device until ``resolve()`` copies them to
the host once per step. A call that is about to write a tensor in place tells the recorder
first (``before_write``), so the bucket reads its values as they were recorded.
"""

from __future__ import annotations

import functools
import time
import weakref

import torch

from probe import compat
from probe.capture.numbers import stats
from probe.capture.numbers.device_bucket import DeviceBucket, device_path_on_cpu
from probe.capture.eager.placement import dtensor_class, local_and_placement
from probe.capture.numbers.route import UNKNOWN, numbers_of, resolve_device_stats, stored_values
from probe.capture.numbers.shard_sketch import shard_layout, shard_sketch
from probe.capture.numbers.sketch import pack as pack_sketch
from probe.capture.numbers.host_batch import HostBatch
from probe.capture.flush_points import FlushPoints
from probe.capture.eager.filters import BY_KEY, CaptureFilter
from probe.capture.eager.naming import Namer
from probe.capture.eager.values import SourceLocator, describe_value, flatten
from probe.config import Config
from probe.capture.eager import unwritten
from probe.dump.schema import BUFFERS, COLUMN_NAMES, UNINITIALIZED
from probe.errors import DumpError, ProbeError

_version_of = compat.tensor_version  # bumped by every in-place write

Tensor = torch.Tensor
NAN = float("nan")
#: where the numbers sit in a row's payload (dtype, shape, device, value, min, ...)
_STATS_AT = COLUMN_NAMES.index("min") - COLUMN_NAMES.index("dtype")  # min max mean norm nan inf
_STATS_END = _STATS_AT + 6
#: resolve pending numbers after this many distinct tensors (bounds the device memory held)
PENDING_LIMIT = 20_000
_ref = weakref.ref
_STRIDED = torch.strided
#: small float32/float64 CPU tensors' statistics and sketches a batch at a time (host_batch.py)
HOST_BATCH = True


def _DEAD():
    return None


_PLAIN = (bool, int, float, str, type(None))


class _Entry:
    """What the recorder knows of one distinct tensor of the step: its payload (the row's
    columns dtype..tensor_id), its sketch, and where its numbers arrive while they are not
    known (``pending``). Every record of the tensor shares the entry; resolving it once
    fills them all."""

    __slots__ = ("storage", "payload", "pending", "sketch")

    def __init__(self, storage, payload: tuple, pending, sketch):
        self.storage = storage  # weak reference to the storage (see the module docstring)
        self.payload = payload
        self.pending = pending
        self.sketch = sketch


class Recorder:
    """Rows and caches of one step.

    ``open_writer``: a callable returning the step's probe.dump.writer.StepWriter, called on
    the first tensor to store (task "tensor"); other tasks never need the writer during the
    step, and the debugger writes their file off the training thread.
    """

    def __init__(self, config: Config, open_writer=None, *, defer_stats: bool | None = None,
                 capture_filter: CaptureFilter | None = None,
                 locate: SourceLocator | None = None,
                 host_batch: HostBatch | bool | None = None,
                 device_bucket: DeviceBucket | None = None):
        self.config = config
        self.task = config.task
        # both keep caches that stay valid across steps: the debugger passes the same ones
        self.filter = capture_filter or CaptureFilter(config)
        self.decisions = self.filter.decisions  # (module, op) -> decision, for the hot path
        self.writer = None
        self.open_writer = open_writer
        self.namer = Namer()
        self.locate = locate or SourceLocator()
        self.module_stack: list[str] = []
        #: the rows made by resolve(), in schema order (see the module docstring)
        self.rows: list[tuple] = []
        #: records since the last resolve(): (call, slot, io, _Entry or (text, value_type)),
        #: and a DTensor's placement after the entry
        self._records: list[tuple] = []
        #: entries whose numbers are still on their way
        self._waiting: list = []
        #: record position -> sketch of a shard record whose sketch is not its own values'
        #: (bytes, None, or a device tensor copied to the host at resolve())
        self._shard_sketches: dict = {}
        self.device: str | None = None
        #: hooks registered on activations check this: records of a finished step or of a
        #: stopped capture are dropped.
        self.active = False
        self.generation = 0
        self.calls = 0  # captured API and module calls (for the benchmark)
        #: [first_seq, last_seq, dtype] runs of API calls made under autocast (capture/eager/autocast.py);
        #: the debugger points it at the step's root attribute "autocast"
        self.autocast_runs: list = []
        self.autocast_last = [-1]  # seq of the previous API call
        #: the first DumpError of this step's tensor writes; storing stops after it
        self.write_error: DumpError | None = None
        # None: the device path for non-CPU tensors, and for CPU ones with PROBE_DEVICE_PATH=1
        self._defer = True if defer_stats is None and device_path_on_cpu() else defer_stats
        # a DeviceBucket the caller keeps across steps (its layouts are reused), or a new one
        if device_bucket is None:
            device_bucket = DeviceBucket(getattr(config, "sketch_size", 0))
        self._bucket = device_bucket
        self._stale_before = self._bucket.stale
        #: where the bucket is flushed besides a full bucket and before_write
        self._flush_points = FlushPoints(self._bucket)
        #: the DTensor whose local shard is being described (its version is the one to watch)
        self._watched = None
        #: device-to-host copies made for this step's numbers (the step file's cost)
        self.host_transfers = 0
        #: seconds spent in probe's code on the training thread during this step
        self.busy_s = 0.0
        self._cache: dict = {}
        #: id(tensor) -> (weak reference, version, address, entry): the same object again
        self._by_id: dict = {}
        #: DTensor's class once torch.distributed.tensor is imported (None matches no type)
        self._dtensor = dtensor_class()
        self._want_checksum = config.task == "checksum" or config.task == "tensor"
        self._want_tensor = config.task == "tensor"
        self._plain = not (self._want_checksum or self._want_tensor)
        self._heads: dict = {}  # (device, dtype, shape) -> payload head, see _compute
        self._sketch_size = getattr(config, "sketch_size", 0)
        # a HostBatch the caller keeps across steps (its arenas are reused), or a new one
        if host_batch is None:
            host_batch = HOST_BATCH
        if host_batch is True:
            host_batch = HostBatch(self._sketch_size)
        self._host_batch = host_batch or None
        #: storages of empty-family allocations nothing has written yet (eager/unwritten.py)
        self.unwritten: dict = {}
        #: keys of this step's records of such memory (the step file's root attribute
        #: uninitialized, see end_attrs)
        self.uninitialized: list[str] = []
        #: id -> (tensor, name) of the model's buffers (know_buffers); record key -> buffer name
        self._buffers, self.buffer_reads = {}, {}

    # ------------------------------------------------------------------ rows
    #
    # A "call" is the tuple every record of one event shares, built once per event:
    # (kind, module, op, index, phase, seq, source, decision, key prefix "module/op#index/phase/")

    def call(self, kind, module, op, index, phase, source, decision) -> tuple:
        """A new event of (module, op, index) in phase: takes the next seq."""
        namer = self.namer
        seq = namer.seq
        namer.seq = seq + 1
        if phase == "backward":
            self._flush_points.backward_event()
        return (kind, module, op, index, phase, seq, source, decision,
                f"{module}/{op}#{index}/{phase}/")

    def watch_optimizers(self) -> None:
        """Flush the device bucket around every optimizer step (flush_points.py)."""
        self._flush_points.watch()

    def unwatch_optimizers(self) -> None:
        self._flush_points.unwatch()

    def add(self, call: tuple, slot: str, io: str, value, fresh: bool = False) -> None:
        """One record for a tensor or a plain value at slot; anything else is skipped.

        fresh: the tensor was written without a version bump (a collective's buffer), so
        its cached statistics are stale: compute them again and replace the cache entry.
        """
        if call[7] == BY_KEY and not self.filter.key_wanted(call[2], call[8] + slot):
            return
        if isinstance(value, Tensor):
            if self._buffers:
                found = self._buffers.get(id(value))
                if found is not None and found[0] is value:
                    self.buffer_reads[call[8] + slot] = found[1]
            if self.unwritten and unwritten.holds(self.unwritten, value):
                self._add_unwritten(call, slot, io, value)
                return
            if not fresh:
                # the same tensor object again (an op's output is the next op's input)
                known = self._by_id.get(id(value))
                if known is not None and known[0]() is value and \
                        known[1] == _version_of(value) and known[2] == value.data_ptr():
                    self._records.append((call, slot, io, known[3]))
                    return
            if type(value) is self._dtensor:
                self._add_shard(call, slot, io, value, fresh)
            else:
                self._records.append((call, slot, io, self._entry(value, fresh)))
            return
        described = describe_value(value)  # (JSON text, value_type)
        if described is not None:
            self._records.append((call, slot, io, described))

    def _add_unwritten(self, call: tuple, slot: str, io: str, tensor: Tensor) -> None:
        """A record of memory nothing has written yet (eager/unwritten.py): its dtype, shape
        and device, no numbers; its key is listed in the step file's root attribute
        ``uninitialized``, so that nothing compares it."""
        self.uninitialized.append(call[8] + slot)
        try:
            payload = self._head(tensor) + (*UNKNOWN, tensor.numel(), "", -1)
        except Exception:  # a tensor type without these: as one whose values cannot be read
            payload = _opaque_payload(tensor)
        self._records.append((call, slot, io, _Entry(_DEAD, payload, None, None)))

    def _entry(self, value: Tensor, fresh: bool, wrapper=None) -> "_Entry":
        """The cache entry of value's numbers, by its key: found, or made now (see the
        module docstring; add() looks the tensor object up first). wrapper: the DTensor value
        is the local shard of (its in-place ops bump the wrapper's version only)."""
        try:
            version = _version_of(value)
            if wrapper is not None:
                version = (_version_of(wrapper), version)
            address = value.data_ptr()
            key = hash((address, value.dtype, value.shape, value.stride(), version))
        except (RuntimeError, NotImplementedError, AttributeError):
            return self._describe(value, None)  # sparse, nested, inference: not cached
        if fresh:
            self._forget_storage(value)
        entry = self._cache.get(key)
        # a hit must be over the same storage, not only the same address: FSDP2 frees its
        # unsharded parameters by resizing their storage to 0, and the address comes back
        # for a gradient while that storage object lives on
        if entry is None or fresh or entry.storage() is not _lifetime(value):
            entry = self._describe(value, key)
        if wrapper is None:
            try:
                self._by_id[id(value)] = (_ref(value), version, address, entry)
            except TypeError:  # a tensor type without weak references
                pass
        return entry

    def _add_shard(self, call: tuple, slot: str, io: str, value, fresh: bool) -> None:
        """A DTensor: its local shard's numbers, with its placement; a row shard's sketch is
        taken at its logical positions."""
        try:
            # DTensor's in-place ops bump the wrapper's version, not the local tensor's
            self._watched = value
            local, placed = local_and_placement(value)
            entry = self._entry(local, fresh, value)
        finally:
            self._watched = None
        if placed and "S(" in placed:
            layout = shard_layout(placed, local.shape)
            if not (layout == 0 and local.numel()):  # else its own sketch is the shard's
                found = None if layout is None else shard_sketch(local, layout, self._sketch_size)
                self._shard_sketches[len(self._records)] = found
        self._records.append((call, slot, io, entry, placed))

    def _forget_storage(self, tensor: Tensor) -> None:
        """Drop the cache entries of every tensor over tensor's storage: it was written
        without a version bump (FSDP2 copies the all-gathered values into the unsharded
        parameters through views of one buffer), so other views of it are stale too."""
        try:
            storage = _lifetime(tensor)
        except Exception:
            return
        stale = [key for key, entry in self._cache.items() if entry.storage() is storage]
        for key in stale:
            del self._cache[key]
        self._by_id.clear()

    def add_tree(self, call: tuple, prefix: str, io: str, obj) -> None:
        """Records for every leaf of a nested structure under prefix (see values.flatten)."""
        if isinstance(obj, Tensor):
            self.add(call, prefix, io, obj)
            return
        for slot, leaf in flatten(obj, prefix, []):
            self.add(call, slot, io, leaf)

    def add_output(self, call: tuple, io: str, out, name: str = "output",
                   fresh: bool = False) -> None:
        """A call's result: one tensor or value is ``output.0``; structures are walked."""
        if isinstance(out, Tensor) or type(out) in _PLAIN:
            self.add(call, name + ".0", io, out, fresh)
        else:
            for slot, leaf in flatten(out, name, []):
                self.add(call, slot, io, leaf, fresh)

    # ------------------------------------------------------------------ tensors

    def _describe(self, tensor: Tensor, cache_key: int | None) -> "_Entry":
        """A new cache entry for tensor: its payload (columns dtype..tensor_id), and where
        its numbers arrive when they are not known yet."""
        try:
            payload, pending, sketched = self._compute(tensor)
        except ProbeError:
            raise  # the writer failed (disk full, ...): the user must hear about it
        except Exception:  # a tensor type the statistics cannot read: never break training
            payload, pending, sketched = _opaque_payload(tensor), None, None
        try:
            storage = _ref(_lifetime(tensor))
        except TypeError:  # a tensor type without weak references
            storage = _DEAD
        entry = _Entry(storage, payload, pending, sketched)
        if pending is not None:
            self._waiting.append(entry)
            if len(self._waiting) >= PENDING_LIMIT:
                self._resolve_pending()
        if cache_key is not None:
            self._cache[cache_key] = entry
        return entry

    def _head(self, tensor: Tensor) -> tuple:
        """(dtype, shape, device, "") of a tensor: built once per layout, not three lookups
        per tensor."""
        layout = (tensor.device, tensor.dtype, tensor.shape)
        head = self._heads.get(layout)
        if head is None:
            head = (stats.dtype_name(tensor.dtype), stats.shape_text(tensor.shape),
                    stats.device_text(tensor.device), "")
            if len(self._heads) < 100_000:
                self._heads[layout] = head
        return head

    def _compute(self, tensor: Tensor) -> tuple[tuple, object, bytes | None]:
        """(payload, pending, sketch) of a tensor: its numbers through numbers_of."""
        head = self._head(tensor)
        if self.device is None:
            self.device = head[2]
        if tensor.is_meta:  # (is_meta/is_cpu: device.type costs 0.25 us, these 0.05)
            return head + (*UNKNOWN, tensor.numel(), "", -1), None, None
        values = tensor if tensor.layout is _STRIDED else stored_values(tensor)
        later = self._defer if self._defer is not None else not tensor.is_cpu
        numbers, sketched, pending = numbers_of(values, self._sketch_size, later,
                                                self._host_batch, self._bucket, self._watched)
        if self._plain:
            return head + numbers + (values.numel(), "", -1), pending, sketched
        digest = stats.checksum(tensor) if self._want_checksum else ""
        tensor_id = self._store(tensor) if self._want_tensor else -1
        return head + numbers + (values.numel(), digest, tensor_id), pending, sketched

    def copy_when_recorded(self, on: bool) -> None:
        """Device path: copy each tensor when it is recorded instead of reading it at the
        flush (sharded models: FSDP2 frees storage unseen; device_bucket.py)."""
        self._bucket.copy_on_add = on

    def before_write(self, tensors) -> None:
        """A call is about to write these tensors in place: if the device bucket holds their
        memory, it is flushed first (device_bucket.DeviceBucket.before_write)."""
        self._bucket.before_write(tensors)

    def _store(self, tensor: Tensor) -> int:
        if not _storable(tensor):
            return -1
        if self.write_error is not None:
            return -1  # storing stopped at the first failed write (disk full, ...)
        try:
            if self.writer is None:
                if self.open_writer is None:
                    return -1
                self.writer = self.open_writer()
            return self.writer.add_tensor(tensor.detach().clone())
        except DumpError as error:
            # never raise inside the user's forward/backward/optimizer step: remember it,
            # stop storing, and let the debugger report it at stop()/step() (on_write_error)
            self.write_error = error
            return -1

    # ------------------------------------------------------------------ step end

    def _resolve_pending(self) -> None:
        """Fill in every entry whose numbers were still on their way (one host copy per
        device for the device bucket's)."""
        bucket = self._bucket
        transfers = bucket.host_transfers
        bucket.resolve()
        self.host_transfers += bucket.host_transfers - transfers
        if self._host_batch is not None:
            self._host_batch.compute()
        waiting, self._waiting = self._waiting, []
        self.host_transfers += resolve_device_stats([entry.pending for entry in waiting])
        for entry in waiting:
            numbers, sketched = entry.pending.result
            payload = entry.payload
            entry.payload = payload[:_STATS_AT] + numbers + payload[_STATS_END:]
            if entry.sketch is None:
                entry.sketch = sketched
            entry.pending = None

    def _resolve_shard_sketches(self) -> dict:
        """Record position -> shard sketch (bytes or None), the ones still on a device copied
        to the host (one copy per device)."""
        shards, self._shard_sketches = self._shard_sketches, {}
        by_device: dict = {}
        for position, found in shards.items():
            if isinstance(found, Tensor):
                by_device.setdefault(found.device, []).append(position)
        for positions in by_device.values():
            values = torch.stack([shards[position] for position in positions]).cpu().numpy()
            self.host_transfers += 1
            for position, numbers in zip(positions, values):
                shards[position] = pack_sketch(numbers)
        return shards

    def resolve(self) -> None:
        """Fill in the numbers still on their way (one host copy per device) and turn the
        records made so far into rows (``rows``)."""
        self._resolve_pending()
        shards = self._resolve_shard_sketches()
        records, self._records = self._records, []
        rows = self.rows
        for position, record in enumerate(records):
            call, slot, io, found = record[0], record[1], record[2], record[3]
            kind, module, op, index, phase, seq, source, _, prefix = call
            if type(found) is _Entry:
                placed = record[4] if len(record) > 4 else ""
                sketched = shards[position] if position in shards else found.sketch
                rows.append((prefix + slot, seq, kind, module, op, index, phase, slot, io,
                             *found.payload, source, "", placed,  # value_type "" for tensors
                             sketched))
            else:
                rows.append((prefix + slot, seq, kind, module, op, index, phase, slot, io, "", "",
                             "", found[0], NAN, NAN, NAN, NAN, 0, 0, 0, "", -1, source,
                             found[1], "", None))

    def know_buffers(self, model) -> None:
        """The model's registered buffers, known by identity: a record of one is named in the
        step file (``buffers``), for compare to say "buffer rope.cos"."""
        self._buffers = {id(buffer): (buffer, name) for name, buffer in model.named_buffers()}

    def end_attrs(self) -> dict:
        """Root attributes of the step file known only at its end: ``uninitialized``, the keys
        of the records of memory nothing had written yet; ``buffers``, of buffers, named."""
        return {UNINITIALIZED: list(self.uninitialized), BUFFERS: dict(self.buffer_reads)}

    def cost(self) -> dict:
        """What capturing this step cost (the step file's ``cost`` attribute): device-to-host
        copies, milliseconds in probe's code on the training thread, and records whose tensor
        changed unseen before its statistics were read (reported unknown)."""
        return {"host_transfers": self.host_transfers,
                "capture_ms": round(self.busy_s * 1e3, 3),
                "stale_records": self._bucket.stale - self._stale_before}

    def end_step(self) -> None:
        """Forget everything step-local: counters, cache, module stack."""
        self.generation += 1
        self.namer.reset()
        self._cache.clear()
        self._by_id.clear()
        self.module_stack.clear()


def charged(function):
    """Count a hook's time in its recorder's ``busy_s`` (the step file's capture_ms): the
    recorder is the first argument, or its ``recorder`` attribute."""
    clock = time.perf_counter

    @functools.wraps(function)
    def run(first, *args, **kwargs):
        began = clock()
        try:
            return function(first, *args, **kwargs)
        finally:
            getattr(first, "recorder", first).busy_s += clock() - began
    return run


def _lifetime(tensor: Tensor):
    """What a cache hit needs alive: the tensor's storage, else (no storage) the tensor."""
    try:
        return tensor.untyped_storage()
    except Exception:  # sparse, nested, wrapper subclasses: no plain storage
        return tensor


def _opaque_payload(tensor: Tensor) -> tuple:
    """What can be said about a tensor whose values could not be read (a custom subclass)."""
    try:
        dtype, shape = stats.dtype_name(tensor.dtype), stats.shape_text(tensor.shape)
    except Exception:
        dtype, shape = "unknown", "[]"
    return (dtype, shape, "", "", *UNKNOWN, 0, "", -1)


def _storable(tensor: Tensor) -> bool:
    if tensor.device.type == "meta":
        return False
    from probe.dump import encode  # torch + numpy only, never h5py

    return encode.is_storable(tensor.dtype)
