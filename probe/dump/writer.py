"""Write one step file for one rank, crash-safely and off the training thread.

A StepWriter opens ``{dump_path}/step{N}/rank{R}.h5.partial``, writes the tensors it is
given on one background thread (bounded by ``buffer_bytes`` of queued tensor data), keeps
the records in memory, and on close() writes the records and root attributes, closes the
file and renames it to ``rank{R}.h5``. Until that rename the file carries the
``.h5.partial`` suffix, so a process killed mid-step leaves nothing that looks finished:
readers skip ``*.h5.partial`` and report them as incomplete.

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
import re
import sys
import threading
import weakref

import h5py
import numpy as np

from probe.dump import schema
from probe.errors import DumpError

#: root attributes the writer computes itself; the caller supplies all the other ROOT_ATTRS.
COMPUTED_ATTRS = ("record_count", "tensor_count", "created")
REQUIRED_ATTRS = tuple(name for name in schema.ROOT_ATTRS if name not in COMPUTED_ATTRS)

# Newest object formats that HDF5 1.10 still reads, so a dump written with a new h5py opens
# with an older one on another machine.
_LIBVER = ("earliest", "v110")
#: tensors of at least this many bytes are written with os.pwrite (see _create_direct)
DIRECT_WRITE_BYTES = 64 << 10
_HAVE_PWRITE = hasattr(os, "pwrite")  # not on Windows: HDF5 writes everything there
_NUMERIC_DTYPES = {"int64": np.int64, "float64": np.float64}


def partial_path_for(final_path: str) -> str:
    """'.../rank0.h5' -> '.../rank0.h5.partial'."""
    return final_path[: -len(schema.FILE_SUFFIX)] + schema.PARTIAL_SUFFIX


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
        self.partial_path = partial_path_for(self.path)
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

        self._file = _create_partial(self.partial_path)
        self._tensors = None  # /tensors, created by the writer thread on first use
        self._raw_fd: int | None = None  # for _create_direct, opened on first use
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
        """Keep records (tuples in schema.RECORD_COLUMNS order, optionally followed by the
        record's sketch: schema.ROW_WIDTH) until close()."""
        self._require_open("add_rows")
        width = len(schema.RECORD_COLUMNS)
        for row in rows:
            if len(row) != width and len(row) != schema.ROW_WIDTH:
                raise ValueError(f"a record row has {len(row)} values, expected {width} or {schema.ROW_WIDTH}: {row!r}")
        self._rows.extend(rows)

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
            raise DumpError(f"cannot write {self.path}: {_reason(error)}") from error
        try:
            self._write_records()
            self._write_root_attrs(extra_attrs or {})
            self._close_raw_fd(sync=self._fsync)
            self._file.flush()
            if self._fsync:
                os.fsync(self._file.id.get_vfd_handle())
            self._file.close()
            os.replace(self.partial_path, self.path)
        except BaseException as error:  # includes KeyboardInterrupt: never leave a half file
            self._discard("failed")
            if isinstance(error, DumpError):
                raise
            if not isinstance(error, Exception):
                raise
            raise DumpError(f"cannot write {self.path}: {_reason(error)}") from error
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
        layout = encode.layout_name(tensor)
        array, dtype_name, shape = encode.to_storage(tensor)
        if self._tensors is None:
            self._tensors = self._file.require_group(schema.TENSORS_GROUP)
        if array.nbytes >= DIRECT_WRITE_BYTES and _HAVE_PWRITE:
            dataset = self._create_direct(str(tensor_id), array)
        else:
            dataset = _create_array(self._tensors, str(tensor_id), array)
        _set_attr(dataset, "dtype", dtype_name)
        _set_attr(dataset, "shape", np.asarray(shape, dtype=np.int64))
        if layout != "strided":
            _set_attr(dataset, "layout", layout)
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
        if self._raw_fd is None:
            self._raw_fd = os.open(self.partial_path, os.O_WRONLY)
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
        raise DumpError(f"cannot write {self.path}: {_reason(error)}") from error

    def _stop_thread(self, drop: bool) -> None:
        with self._cond:
            self._stopping = True
            self._dropping = self._dropping or drop
            self._cond.notify_all()
        if self._thread is not None and threading.current_thread() is not self._thread:
            self._thread.join()

    def _write_records(self) -> None:
        # Text columns are dictionary-encoded (see schema.py): one int32 code per record and
        # one shared table of distinct strings as a UTF-8 byte blob plus end offsets. h5py's
        # variable-length strings cost ~5 us per value; this costs ~0.1 us per value.
        group = self._file.require_group(schema.RECORDS_GROUP)
        count = len(self._rows)
        columns = list(zip(*self._rows)) if self._rows else [()] * len(schema.RECORD_COLUMNS)
        vocabulary: dict[str, int] = {}
        for (name, kind), values in zip(schema.RECORD_COLUMNS, columns):
            try:
                if kind == "str":
                    if set(map(type, values)) - {str}:  # map(type) runs in C: 10x an isinstance loop
                        bad = next(v for v in values if not isinstance(v, str))
                        raise TypeError(f"holds {bad!r}, expected str")
                    new = [text for text in dict.fromkeys(values) if text not in vocabulary]
                    vocabulary.update(zip(new, range(len(vocabulary), len(vocabulary) + len(new))))
                    codes = np.fromiter(map(vocabulary.__getitem__, values), dtype=schema.TEXT_CODE_DTYPE, count=count)
                    _create_array(group, name, codes)
                else:
                    _create_array(group, name, np.array(values, dtype=_NUMERIC_DTYPES[kind]).reshape(-1))
            except (TypeError, ValueError, OverflowError) as error:
                raise DumpError(f"cannot write {self.path}: record column {name!r} {error}") from error
        if len(columns) > len(schema.RECORD_COLUMNS):
            _write_sketches(group, columns[len(schema.RECORD_COLUMNS)], self.path)
        blob, ends = _encode_texts(list(vocabulary))
        _create_array(self._file, schema.TEXT_BYTES, blob)
        _create_array(self._file, schema.TEXT_ENDS, ends)

    def _write_root_attrs(self, extra_attrs: dict) -> None:
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
        for name, value in values.items():
            _set_attr(self._file, name, value)

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


def _write_sketches(group, sketches, path: str) -> None:
    """/records/sketch: (records, k) float64, NaN rows for records without a sketch; not
    written at all when no record has one (sketch_size 0)."""
    width = max((len(item) for item in sketches if item is not None), default=0)
    if not width:
        return
    missing = (np.nan,) * width
    try:  # one C call for the whole table
        table = np.array([missing if item is None else item for item in sketches], dtype=np.float64)
    except ValueError:
        table = None
    if table is None or table.shape != (len(sketches), width):
        sizes = sorted({len(item) for item in sketches if item is not None})
        raise DumpError(f"cannot write {path}: record sketches of different sizes {sizes} in one step")
    _create_array(group, schema.SKETCH, table)


def _create_array(parent, name: str, array: np.ndarray) -> h5py.h5d.DatasetID:
    """A contiguous dataset holding array: h5py's low-level API, half the cost of
    create_dataset (~20 us instead of ~45 us; a step file has 25 of them)."""
    if not array.flags.c_contiguous:  # (np.ascontiguousarray would make a 0-dim array 1-dim)
        array = np.ascontiguousarray(array)
    space = h5py.h5s.create_simple(array.shape) if array.ndim else h5py.h5s.create(h5py.h5s.SCALAR)
    dataset = h5py.h5d.create(parent.id, name.encode(), h5py.h5t.py_create(array.dtype), space)
    if array.size:
        dataset.write(h5py.h5s.ALL, h5py.h5s.ALL, array)
    return dataset


_SCALAR_STR = np.dtype(h5py.string_dtype("utf-8"))
_SCALAR_TYPES = {str: _SCALAR_STR, int: np.dtype(np.int64), float: np.dtype(np.float64)}


def _set_attr(target, name: str, value) -> None:
    """target.attrs[name] = value for a str, int, float or 1-D int64 array, through h5py's
    low-level API (the same stored types as h5py's attrs, at a fifth of the cost).
    target: an h5py object or a low-level object id."""
    target_id = target.id if isinstance(target, h5py.HLObject) else target
    if isinstance(value, np.ndarray) and value.dtype == np.int64 and value.ndim == 1 and value.size:
        array = value
        space = h5py.h5s.create_simple(value.shape)
    else:
        dtype = _SCALAR_TYPES.get(type(value))
        if dtype is None or (dtype.kind == "i" and not -(1 << 63) <= value < 1 << 63):
            h5py.AttributeManager(_object_for(target_id))[name] = value
            return
        array = np.array(value, dtype=dtype)
        space = h5py.h5s.create(h5py.h5s.SCALAR)
    attr = h5py.h5a.create(target_id, name.encode(), h5py.h5t.py_create(array.dtype, logical=True), space)
    attr.write(array)


def _object_for(target_id):
    if isinstance(target_id, h5py.h5d.DatasetID):
        return h5py.Dataset(target_id)
    if isinstance(target_id, h5py.h5f.FileID):
        return h5py.File(target_id)
    return h5py.Group(target_id)


def _encode_texts(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """(uint8 UTF-8 bytes of all texts concatenated, int64 end offset of each text)."""
    joined = "".join(texts)
    if joined.isascii():  # the usual case: one C call, byte lengths are character lengths
        data = joined.encode("ascii")
        lengths = np.fromiter(map(len, texts), dtype=np.int64, count=len(texts))
    else:
        encoded = [_utf8(text) for text in texts]
        data = b"".join(encoded)
        lengths = np.fromiter(map(len, encoded), dtype=np.int64, count=len(texts))
    return np.frombuffer(data, dtype=np.uint8), np.cumsum(lengths, dtype=np.int64)


def _utf8(text: str) -> bytes:
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:
        # lone surrogates (undecodable file names) have no UTF-8 form: store them escaped
        # rather than lose the step
        return text.encode("utf-8", "backslashreplace")


def make_folder(folder: str, label: str = "dump folder") -> None:
    """Create ``folder`` (and its parents) or raise one DumpError naming it and the OS reason."""
    try:
        os.makedirs(folder, exist_ok=True)
    except FileExistsError:
        raise DumpError(f"cannot create {label} {folder}: a file is in the way") from None
    except OSError as error:
        raise DumpError(f"cannot create {label} {folder}: {_reason(error)}") from error


def _create_partial(partial_path: str) -> h5py.File:
    make_folder(os.path.dirname(partial_path))
    final = partial_path[: -len(schema.PARTIAL_SUFFIX)] + schema.FILE_SUFFIX
    if os.path.isdir(final):
        raise DumpError(f"cannot write {final}: a folder is in the way")
    try:
        # no HDF5 file locks: nobody else opens a .partial file, and locks fail on some NFS mounts
        return h5py.File(partial_path, "w", libver=_LIBVER, locking=False)
    except OSError as error:
        raise DumpError(f"cannot create {partial_path}: {_reason(error)}") from error


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


_ERROR_MESSAGE = re.compile(r"error message = '([^']*)'")


def _reason(error: BaseException) -> str:
    """The OS's words for an error (h5py hides them inside a long message)."""
    match = _ERROR_MESSAGE.search(str(error))
    if match:
        return match.group(1)
    if isinstance(error, OSError) and error.strerror and "\n" not in error.strerror:
        return error.strerror
    text = str(error).strip().splitlines()
    return text[0] if text else type(error).__name__


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
