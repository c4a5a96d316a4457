"""Write one step file for one rank, crash-safely and off the training thread.

A StepWriter creates ``{dump_path}/step{N}/rank{R}.{token}.h5.partial`` exclusively (O_EXCL,
a random token: two writers never share a temporary file), writes the tensors it is given on
one background thread (bounded by ``buffer_bytes`` of queued tensor data), keeps the records
in memory, and on close() writes the records and root attributes, closes the file and renames
it to ``rank{R}.h5``. Until that rename the file carries the ``.h5.partial`` suffix, so a
process killed mid-step leaves nothing that looks finished: readers skip ``*.h5.partial`` and
report them as incomplete.

Disk full: before every HDF5 call that can grow the file, the writer reserves the bytes it
is about to need (space.py: HDF5 must never see ENOSPC); when the reservation fails, the
file is closed cleanly within its reservation and removed, and the caller gets a DumpError.
After the final flush the file is cut back to HDF5's own size. How the file is laid out
(datasets, attributes, the ``.partial`` name) is layout.py; one live writer per dump folder
and rank is rank_lock.py.

This module imports h5py and numpy but not torch; torch is only touched through the
tensors the caller hands in, and encode.py (imported lazily by the writer thread).

Interpreter exit: h5py's own atexit hook unregisters the type converters that variable-
length strings need, after which records can no longer be written. So this module
registers an atexit hook *after* importing h5py (atexit runs hooks last-in first-out, so
ours runs before h5py's) that closes every StepWriter of this process still open. A
caller's own atexit hook registered after importing this module runs before that and may
close (or abort) its writers itself; close() is idempotent.
"""

from __future__ import annotations

import atexit
import collections
import datetime
import json
import os
import sys
import threading
import weakref

import h5py
import numpy as np

from probe.dump import layout, schema
from probe.dump.reasons import reason
from probe.dump.space import ATTR_OVERHEAD, DATASET_OVERHEAD, RESERVE_SLACK
from probe.errors import DumpError

#: root attributes the writer computes itself; the caller supplies all the other ROOT_ATTRS.
COMPUTED_ATTRS = ("record_count", "tensor_count", "created")
REQUIRED_ATTRS = tuple(name for name in schema.ROOT_ATTRS
                       if name not in COMPUTED_ATTRS and name not in schema.OPTIONAL_ATTRS)

#: tensors of at least this many bytes are written with os.pwrite (see _create_direct)
DIRECT_WRITE_BYTES = 64 << 10
_HAVE_PWRITE = hasattr(os, "pwrite")  # not on Windows: HDF5 writes everything there


class StepWriter:
    """Writes one step file for one rank: {dump_path}/step{N}/rank{R}.h5.

    If a finished file for that step and rank already exists, close() replaces it
    (a re-run of the same step overwrites; the old file stays intact until then).
    """

    def __init__(
        self,
        dump_path: str,
        step: int,
        rank: int,
        root_attrs: dict,
        buffer_bytes: int = 512 << 20,
        *,
        fsync: bool = False,
    ):
        missing = [name for name in REQUIRED_ATTRS if name not in root_attrs]
        if missing:
            raise ValueError(f"StepWriter root_attrs lacks {', '.join(missing)}")
        if buffer_bytes <= 0:
            raise ValueError(f"StepWriter buffer_bytes must be positive, got {buffer_bytes}")
        self.path = schema.step_file_path(os.fspath(dump_path), step, rank)
        self.step = step
        self.rank = rank
        self.buffer_bytes = buffer_bytes
        self._fsync = fsync
        self._root_attrs = dict(root_attrs, step=step, rank=rank)
        self._rows: list[tuple] = []
        self._next_id = 0
        self._pid = os.getpid()

        # Everything below is shared with the writer thread and guarded by _cond.
        self._cond = threading.Condition()
        self._queue: collections.deque = collections.deque()
        self._pending = 0
        self._peak = 0
        self._written = 0
        self._error: BaseException | None = None
        self._stopping = False
        self._dropping = False
        self._state = "open"  # open -> closed | aborted | failed
        # close() may come from a finisher thread and from the atexit hook at the same time
        self._finish_lock = threading.Lock()

        self.partial_path, self._raw_fd, self._space, self._file = layout.create_partial(self.path)
        self._tensors = None  # /tensors, created by the writer thread on first use
        # Started by the first add_tensor: a statistics step never pays for starting and
        # joining a thread (~0.1-3 ms on a busy machine, as the join waits for the GIL).
        self._thread: threading.Thread | None = None
        _OPEN_WRITERS.add(self)

    def _start_thread(self) -> None:
        thread = threading.Thread(
            target=self._run, name=f"probe-writer-step{self.step}-rank{self.rank}", daemon=True
        )
        try:
            thread.start()
        except RuntimeError as error:  # "can't start new thread": no thread, no file
            with self._finish_lock:
                self._discard("failed")
            raise DumpError(f"cannot write {self.path}: {error}") from error
        self._thread = thread

    # ------------------------------------------------------------------ training thread

    @property
    def pending_bytes(self) -> int:
        """Bytes of tensor data queued or being written right now."""
        with self._cond:
            return self._pending

    @property
    def peak_pending_bytes(self) -> int:
        """Largest pending_bytes seen so far: at most max(buffer_bytes, largest tensor)."""
        with self._cond:
            return self._peak

    @property
    def tensor_count(self) -> int:
        """Number of tensors handed to add_tensor so far."""
        return self._next_id

    def add_tensor(self, tensor) -> int:
        """Queue a private copy of a tensor for writing; return its tensor_id.

        Blocks while the queue already holds more than buffer_bytes (a single tensor
        larger than the buffer still goes through, alone). A failure of the writer thread
        is raised here as DumpError.
        """
        self._require_open("add_tensor")
        _check_tensor(tensor)
        if self._thread is None:
            self._start_thread()
        nbytes = tensor.numel() * tensor.element_size()
        ready = _record_ready_event(tensor)
        with self._cond:
            while self._error is None and self._pending and self._pending + nbytes > self.buffer_bytes:
                self._cond.wait()
            error = self._error
            if error is None and self._stopping:
                raise DumpError(f"cannot add_tensor to {self.path}: the writer is being closed")
            if error is None:
                tensor_id = self._next_id
                self._next_id += 1
                self._queue.append((tensor_id, tensor, ready, nbytes))
                self._pending += nbytes
                self._peak = max(self._peak, self._pending)
                self._cond.notify_all()
        if error is not None:
            self._fail(error)  # outside the lock: it joins the writer thread
        return tensor_id

    def add_rows(self, rows: list[tuple]) -> None:
        """Keep records until close(): tuples in schema.ALL_COLUMNS order, optionally followed
        by the record's sketch (schema.ROW_WIDTH values). Rows of schema.RECORD_COLUMNS width
        (no optional columns, no sketch) are accepted too; all rows of one file have one width."""
        self._require_open("add_rows")
        width = len(self._rows[0]) if self._rows else (len(rows[0]) if rows else schema.ROW_WIDTH)
        for row in rows:
            if len(row) != width or schema.row_layout(width) is None:
                base = len(schema.RECORD_COLUMNS)
                raise ValueError(
                    f"a record row has {len(row)} values, expected {base} (the record columns), "
                    f"{base + 1} (with value_type), {base + 2} (and the sketch) or "
                    f"{schema.ROW_WIDTH} (every column and the sketch), "
                    f"the same for every row of the file: {row!r}")
        self._rows.extend(rows)

    def finish(self, rows: list[tuple], extra_attrs: dict | None = None) -> str:
        """add_rows(rows), then close(extra_attrs); any failure (Ctrl-C included) aborts the
        file first. Returns the file's path."""
        try:
            self.add_rows(rows)
            return self.close(extra_attrs)
        except BaseException:
            self.abort()
            raise

    def close(self, extra_attrs: dict | None = None) -> str:
        """Finish the file and rename it to its final name; return that name.

        Calling close() again after success returns the same path. Any failure removes the
        .partial file and raises DumpError.
        """
        with self._finish_lock:
            return self._close(extra_attrs)

    def _close(self, extra_attrs: dict | None) -> str:
        if self._state == "closed":
            return self.path
        if self._state != "open":
            raise DumpError(f"cannot close {self.path}: the writer was already {self._state}")
        self._stop_thread(drop=False)
        if self._error is not None:
            error = self._error
            self._discard("failed")
            raise DumpError(f"cannot write {self.path}: {reason(error)}") from error
        try:
            self._write_records(self._root_attr_values(extra_attrs or {}))
            self._file.flush()
            size = self._file.id.get_filesize()  # HDF5's end of file: the rest is reservation
            self._space.overshoot = max(self._space.overshoot, size - self._space.reserved)
            self._file.close()
            if self._space.extended:
                os.ftruncate(self._raw_fd, size)
            self._close_raw_fd(sync=self._fsync)
            os.replace(self.partial_path, self.path)
        except BaseException as error:  # includes KeyboardInterrupt: never leave a half file
            self._discard("failed")
            if isinstance(error, DumpError):
                raise
            if not isinstance(error, Exception):
                raise
            raise DumpError(f"cannot write {self.path}: {reason(error)}") from error
        self._state = "closed"
        _OPEN_WRITERS.discard(self)
        return self.path

    def abort(self) -> None:
        """Stop the writer thread and delete the .partial file. Never raises."""
        with self._finish_lock:
            if self._state != "open":
                return
            try:
                self._stop_thread(drop=True)
            except BaseException:
                pass
            self._discard("aborted")

    # ------------------------------------------------------------------ writer thread

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._stopping:
                    self._cond.wait()
                if not self._queue:
                    return
                tensor_id, tensor, ready, nbytes = self._queue.popleft()
                skip = self._error is not None or self._dropping
            try:
                if not skip:
                    self._write_tensor(tensor_id, tensor, ready)
            except BaseException as error:
                with self._cond:
                    if self._error is None:
                        self._error = error
            finally:
                # the bytes stay accounted until written, so memory is bounded honestly
                del tensor
                with self._cond:
                    self._pending -= nbytes
                    self._cond.notify_all()

    def _write_tensor(self, tensor_id: int, tensor, ready) -> None:
        from probe.dump import encode  # torch only on this thread, only when tensors are dumped

        if ready is not None:
            ready.synchronize()
        tensor_layout = encode.layout_name(tensor)
        array, dtype_name, shape = encode.to_storage(tensor)
        self._reserve(array.nbytes + DATASET_OVERHEAD + 3 * ATTR_OVERHEAD)
        if self._tensors is None:
            self._tensors = self._file.require_group(schema.TENSORS_GROUP)
        if array.nbytes >= DIRECT_WRITE_BYTES and _HAVE_PWRITE:
            dataset = self._create_direct(str(tensor_id), array)
        else:
            dataset = layout.create_array(self._tensors, str(tensor_id), array)
        layout.set_attr(dataset, "dtype", dtype_name)
        layout.set_attr(dataset, "shape", np.asarray(shape, dtype=np.int64))
        if tensor_layout != "strided":
            layout.set_attr(dataset, "layout", tensor_layout)
        with self._cond:
            self._written += 1

    def _create_direct(self, name: str, array: np.ndarray):
        """A dataset whose bytes are written with os.pwrite rather than by HDF5.

        h5py holds the GIL through every HDF5 call, so writing megabytes through it stalls
        the training thread; os.pwrite releases the GIL. The dataset is contiguous and
        allocated at creation, with no fill value ever written, so HDF5 never touches its
        bytes: they live at get_offset() in the file, and readers see an ordinary dataset.
        """
        if not array.flags.c_contiguous:
            array = np.ascontiguousarray(array)
        plist = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
        plist.set_layout(h5py.h5d.CONTIGUOUS)
        plist.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)
        plist.set_fill_time(h5py.h5d.FILL_TIME_NEVER)
        space = h5py.h5s.create_simple(array.shape) if array.ndim else h5py.h5s.create(h5py.h5s.SCALAR)
        dataset = h5py.h5d.create(self._tensors.id, name.encode(), h5py.h5t.py_create(array.dtype), space, dcpl=plist)
        offset = dataset.get_offset()
        if offset is None:  # not allocated after all: let HDF5 write it
            dataset.write(h5py.h5s.ALL, h5py.h5s.ALL, array)
            return dataset
        data = memoryview(array.reshape(-1).view(np.uint8))
        while data:
            done = os.pwrite(self._raw_fd, data, offset)
            data, offset = data[done:], offset + done
        return dataset

    def _close_raw_fd(self, sync: bool = False) -> None:
        fd, self._raw_fd = self._raw_fd, None
        if fd is not None:
            try:
                if sync:
                    os.fsync(fd)
            finally:
                os.close(fd)

    # ------------------------------------------------------------------ helpers

    def _require_open(self, what: str) -> None:
        if self._state != "open":
            raise DumpError(f"cannot {what} to {self.path}: the writer was already {self._state}")
        if self._error is not None:
            self._fail(self._error)

    def _fail(self, error: BaseException):
        """Turn a writer-thread failure into DumpError, after discarding the partial file."""
        with self._finish_lock:
            if self._state == "open":
                self._stop_thread(drop=True)
                self._discard("failed")
        raise DumpError(f"cannot write {self.path}: {reason(error)}") from error

    def _stop_thread(self, drop: bool) -> None:
        with self._cond:
            self._stopping = True
            self._dropping = self._dropping or drop
            self._cond.notify_all()
        if self._thread is not None and threading.current_thread() is not self._thread:
            self._thread.join()

    def _reserve(self, extra: int) -> None:
        """Reserve HDF5's current end of file + extra + slack before HDF5 may write it."""
        size = self._file.id.get_filesize()
        self._space.overshoot = max(self._space.overshoot, size - self._space.reserved)
        self._space.ensure(size + extra + RESERVE_SLACK)

    def _write_records(self, attrs: dict) -> None:
        # Every array is built before HDF5 is asked for anything, so the space they need is
        # known and reserved first (space.py).
        arrays, sketches, blob, ends = layout.record_arrays(self._rows, self.path)
        attr_bytes = sum(len(v) if isinstance(v, str) else 8 for v in attrs.values())
        self._reserve(sum(array.nbytes for _, array in arrays) + blob.nbytes + ends.nbytes
                      + (0 if sketches is None else sketches.nbytes + DATASET_OVERHEAD)
                      + (len(arrays) + 3) * DATASET_OVERHEAD
                      + 2 * attr_bytes + len(attrs) * ATTR_OVERHEAD)
        group = self._file.require_group(schema.RECORDS_GROUP)
        for name, array in arrays:
            layout.create_array(group, name, array)
        if sketches is not None:
            layout.create_array(group, schema.SKETCH, sketches)
        layout.create_array(self._file, schema.TEXT_BYTES, blob)
        layout.create_array(self._file, schema.TEXT_ENDS, ends)
        for name, value in attrs.items():
            layout.set_attr(self._file, name, value)

    def _root_attr_values(self, extra_attrs: dict) -> dict:
        values = {}
        for name, value in {**self._root_attrs, **extra_attrs}.items():
            if name in schema.JSON_ATTRS or not isinstance(value, (str, int, float, np.generic)):
                value = json.dumps(value, sort_keys=True, default=str)
            elif isinstance(value, str):
                value = str(value)  # str subclasses (torch.__version__) would become fixed-width
            values[name] = value
        values["schema_version"] = schema.SCHEMA_VERSION
        values["record_count"] = len(self._rows)
        values["tensor_count"] = self._written
        values["created"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        return values

    def _discard(self, state: str) -> None:
        self._state = state
        _OPEN_WRITERS.discard(self)
        self._rows = []
        try:
            self._close_raw_fd()
        except OSError:
            pass
        try:
            self._file.close()
        except Exception:
            pass
        try:
            os.remove(self.partial_path)
        except OSError:
            pass


def _check_tensor(tensor) -> None:
    """Refuse what the writer thread could not store, on the caller's thread."""
    device = getattr(tensor, "device", None)
    if device is None or not hasattr(tensor, "element_size"):
        raise TypeError(f"add_tensor expects a torch.Tensor, got {type(tensor).__name__}")
    if device.type == "meta":
        raise DumpError(f"cannot store a meta tensor of shape {list(tensor.shape)}: it holds no data")
    name = str(tensor.dtype).removeprefix("torch.")
    if name in schema.STORAGE_DTYPES:
        return
    from probe.dump import encode  # the caller has torch loaded already

    if not encode.is_storable(tensor.dtype):
        raise DumpError(
            f"cannot store a tensor of dtype {name}: storable dtypes are "
            f"{', '.join(encode.storable_dtype_names())}"
        )


def _record_ready_event(tensor):
    """An event on the caller's current stream, so the writer thread reads the tensor only
    after the copy the caller queued there has run (CUDA and accelerators alike)."""
    device = tensor.device
    if device.type in ("cpu", "meta"):
        return None
    import torch

    backend = getattr(torch, device.type, None)
    if backend is None or not hasattr(backend, "Event") or not hasattr(backend, "current_stream"):
        return None
    event = backend.Event()
    event.record(backend.current_stream(device))
    return event


_OPEN_WRITERS: "weakref.WeakSet[StepWriter]" = weakref.WeakSet()


def _close_open_writers_at_exit() -> None:
    for writer in list(_OPEN_WRITERS):
        if writer._pid != os.getpid():  # a forked child must not finish its parent's files
            continue
        try:
            writer.close()
        except Exception as error:
            print(f"probe: error: {error}", file=sys.stderr)


# Registered after `import h5py`, so it runs before h5py's own exit hook (see module doc).
atexit.register(_close_open_writers_at_exit)
