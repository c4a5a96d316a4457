"""Write one step file for one rank, crash-safely and off the training thread.

A StepWriter creates ``{dump_path}/step{N}/rank{R}.{token}.h5.partial`` exclusively (O_EXCL,
a random token: two writers never share a temporary file), writes the tensors it is given on
one background thread (bounded by ``buffer_bytes`` of queued tensor data), keeps the records
in memory, and on close() writes the records and root attributes, closes the file and renames
it to ``rank{R}.h5``. Until that rename the file carries the ``.h5.partial`` suffix, so a
process killed mid-step leaves nothing that looks finished: readers skip ``*.h5.partial`` and
report them as incomplete.

Disk full: HDF5 must never see ENOSPC (or EFBIG). After a failed write HDF5 1.14 can free
memory it still uses, and h5py's flush()/close() then crashes the process (measured: SIGSEGV
in 24 of 25 statistics runs on a full tmpfs). So before every HDF5 call that can grow the
file, the writer reserves the bytes it is about to need (os.posix_fallocate beyond the
file's end, see SpaceReservation); when the reservation fails, HDF5 has not been asked to
write anything, the file is closed cleanly within its reservation and removed, and the
caller gets a DumpError. After the final flush the file is cut back to HDF5's own size.

One live writer per dump folder and rank: RankLock (an flock on ``.rank{R}.lock`` in the
dump folder, released by the kernel when the process dies) makes a second run on the same
dump_path fail at start() instead of overwriting the first run's steps.

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
import errno
import json
import os
import re
import secrets
import sys
import threading
import weakref

import h5py
import numpy as np

from probe.dump import schema
from probe.errors import DumpError

#: root attributes the writer computes itself; the caller supplies all the other ROOT_ATTRS.
COMPUTED_ATTRS = ("record_count", "tensor_count", "created")
REQUIRED_ATTRS = tuple(name for name in schema.ROOT_ATTRS
                       if name not in COMPUTED_ATTRS and name not in schema.OPTIONAL_ATTRS)

# Newest object formats that HDF5 1.10 still reads, so a dump written with a new h5py opens
# with an older one on another machine.
_LIBVER = ("earliest", "v110")
#: tensors of at least this many bytes are written with os.pwrite (see _create_direct)
DIRECT_WRITE_BYTES = 64 << 10
_HAVE_PWRITE = hasattr(os, "pwrite")  # not on Windows: HDF5 writes everything there
_NUMERIC_DTYPES = {"int64": np.int64, "float64": np.float64}
#: optional columns written only when some record of the file has a value: files of runs
#: without DTensors keep the layout older readers know
_ONLY_WHEN_SET = frozenset({"placement"})


#: bytes kept reserved beyond what the writer knows it will write next: HDF5's own metadata
#: (object headers, B-tree nodes, heaps; ~0.5-1 KiB per dataset) is allocated as it goes
RESERVE_SLACK = 32 << 10
#: estimated HDF5 metadata per dataset and per attribute, on top of their data bytes
#: (tests/test_dump_writer.py checks HDF5 never outgrows the reservation)
_DATASET_OVERHEAD = 1024
_ATTR_OVERHEAD = 128
_NO_SPACE = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)


def partial_path_for(final_path: str, token: str | None = None) -> str:
    """'.../rank0.h5' -> '.../rank0.{token}.h5.partial' (a new random token when None)."""
    token = secrets.token_hex(6) if token is None else token
    return f"{final_path[: -len(schema.FILE_SUFFIX)]}.{token}{schema.PARTIAL_SUFFIX}"


#: with more free space than this left after a write, and no file size limit near, a
#: free-space check is the reservation: allocating ahead costs ~15 ms per step file on ext4
#: (the rename and truncate of allocated blocks), and another process would have to fill
#: this much of the disk within milliseconds to make HDF5 see ENOSPC
PLENTY_FREE_BYTES = 1 << 30


class SpaceReservation:
    """Keeps the file's allocated size ahead of what HDF5 will write.

    ``ensure(size)`` makes sure the bytes [0, size) of the file can be written. With plenty
    of free space left (PLENTY_FREE_BYTES) and no file size limit (RLIMIT_FSIZE) near, a
    statvfs check says so; otherwise posix_fallocate allocates them on disk (it also extends
    the file, which HDF5 tolerates: it tracks its own end of file; ``extended`` tells the
    writer to cut the file back). Where posix_fallocate is missing or unsupported, the
    free-space check stands in. Raises OSError saying how many bytes it could not get.
    """

    def __init__(self, fd: int, path: str):
        self.fd = fd
        self.path = path
        self.reserved = 0
        self.extended = False
        #: most bytes HDF5 ever held beyond the reservation (seen at ensure()): must stay 0
        self.overshoot = 0

    def ensure(self, size: int) -> None:
        if size <= self.reserved:
            return
        if _plenty_of_space(self.path, size, size - self.reserved):
            self.reserved = size
            return
        # grow by an eighth more than asked: one call covers the next few small tensors
        for target in (size + size // 8, size):
            try:
                _allocate(self.fd, self.path, target - self.reserved, self.reserved)
            except OSError as error:
                if error.errno in _NO_SPACE and target != size:
                    continue
                raise OSError(error.errno, f"no space for {size} bytes ({error.strerror})") from None
            self.reserved = target
            self.extended = True
            return


def _plenty_of_space(path: str, size: int, extra: int) -> bool:
    try:
        stats = os.statvfs(os.path.dirname(path) or ".")
    except (OSError, AttributeError):  # no statvfs (Windows): allocate
        return False
    if stats.f_bavail * stats.f_frsize - extra < PLENTY_FREE_BYTES:
        return False
    try:
        import resource
    except ImportError:  # pragma: no cover - Windows
        return True
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    return limit == resource.RLIM_INFINITY or size + PLENTY_FREE_BYTES <= limit


def _allocate(fd: int, path: str, length: int, offset: int) -> None:
    if hasattr(os, "posix_fallocate"):
        try:
            os.posix_fallocate(fd, offset, length)
            return
        except OSError as error:
            if error.errno not in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                raise
    stats = os.statvfs(os.path.dirname(path) or ".")  # no fallocate here: check free space
    if stats.f_bavail * stats.f_frsize < length:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


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

        self.partial_path, self._raw_fd, self._space, self._file = _create_partial(self.path)
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
            raise DumpError(f"cannot write {self.path}: {_reason(error)}") from error
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
        self._reserve(array.nbytes + _DATASET_OVERHEAD + 3 * _ATTR_OVERHEAD)
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

    def _reserve(self, extra: int) -> None:
        """Reserve HDF5's current end of file + extra + slack before HDF5 may write it."""
        size = self._file.id.get_filesize()
        self._space.overshoot = max(self._space.overshoot, size - self._space.reserved)
        self._space.ensure(size + extra + RESERVE_SLACK)

    def _write_records(self, attrs: dict) -> None:
        # Text columns are dictionary-encoded (see schema.py): one int32 code per record and
        # one shared table of distinct strings as a UTF-8 byte blob plus end offsets. h5py's
        # variable-length strings cost ~5 us per value; this costs ~0.1 us per value.
        # Every array is built before HDF5 is asked for anything, so the space they need is
        # known and reserved first (module doc).
        count = len(self._rows)
        columns = list(zip(*self._rows)) if self._rows else [()] * len(schema.ALL_COLUMNS)
        layout, sketched = schema.row_layout(len(columns)) or (schema.ALL_COLUMNS, False)
        written = []  # (name, kind) of each array below
        vocabulary: dict[str, int] = {}
        arrays = []
        # rows without the optional columns leave them out of the file (zip stops early)
        for (name, kind), values in zip(layout, columns):
            if name in _ONLY_WHEN_SET and not any(values):
                continue  # a column no record of this file uses: older readers' layout
            written.append((name, kind))
            try:
                if kind == "str":
                    if set(map(type, values)) - {str}:  # map(type) runs in C: 10x an isinstance loop
                        bad = next(v for v in values if not isinstance(v, str))
                        raise TypeError(f"holds {bad!r}, expected str")
                    new = [text for text in dict.fromkeys(values) if text not in vocabulary]
                    vocabulary.update(zip(new, range(len(vocabulary), len(vocabulary) + len(new))))
                    arrays.append(np.fromiter(map(vocabulary.__getitem__, values), dtype=schema.TEXT_CODE_DTYPE, count=count))
                else:
                    arrays.append(np.array(values, dtype=_NUMERIC_DTYPES[kind]).reshape(-1))
            except (TypeError, ValueError, OverflowError) as error:
                raise DumpError(f"cannot write {self.path}: record column {name!r} {error}") from error
        sketches = None
        if sketched:
            sketches = _sketch_table(columns[len(layout)], self.path)
        blob, ends = _encode_texts(list(vocabulary))
        attr_bytes = sum(len(v) if isinstance(v, str) else 8 for v in attrs.values())
        self._reserve(sum(a.nbytes for a in arrays) + blob.nbytes + ends.nbytes
                      + (0 if sketches is None else sketches.nbytes + _DATASET_OVERHEAD)
                      + (len(arrays) + 3) * _DATASET_OVERHEAD
                      + 2 * attr_bytes + len(attrs) * _ATTR_OVERHEAD)
        group = self._file.require_group(schema.RECORDS_GROUP)
        for (name, _), array in zip(written, arrays):
            _create_array(group, name, array)
        if sketches is not None:
            _create_array(group, schema.SKETCH, sketches)
        _create_array(self._file, schema.TEXT_BYTES, blob)
        _create_array(self._file, schema.TEXT_ENDS, ends)
        for name, value in attrs.items():
            _set_attr(self._file, name, value)

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


class RankLock:
    """One live writer per dump folder and rank: an exclusive flock on
    ``{dump_path}/.rank{R}.lock``. The kernel drops it when the process dies, however it
    dies, so a killed run never leaves the folder locked (only an unlocked file, which the
    next run takes over). release() deletes the file. It holds the owner's pid and run id,
    for the message the next run gets. Without fcntl (Windows) there is no lock.
    """

    def __init__(self, dump_path: str, rank: int, run_id: str = ""):
        self.path = os.path.join(os.fspath(dump_path), f".rank{rank}.lock")
        self.rank = rank
        self._fd: int | None = None
        try:
            import fcntl
        except ImportError:  # pragma: no cover - Windows
            return
        while True:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
            except OSError as error:
                raise DumpError(f"cannot create the lock file {self.path}: {_reason(error)}") from error
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as error:
                owner = _read_owner(fd)
                os.close(fd)
                if error.errno in (errno.EWOULDBLOCK, errno.EACCES):
                    raise DumpError(
                        f"dump_path {dump_path} rank {rank} is being written by another live "
                        f"run{owner}; use another dump_path, or wait for that run to end"
                    ) from None
                raise DumpError(f"cannot lock {self.path}: {_reason(error)}") from error
            # the owner before us may have deleted the file between our open and our flock:
            # then we hold a lock nobody else can see, so take the file that is there now
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(self.path))
            except OSError:
                same = False
            if same:
                break
            os.close(fd)
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"pid {os.getpid()} run_id {run_id}\n".encode(), 0)
        except OSError:  # the lock itself is what matters, the text is a courtesy
            pass
        self._fd = fd

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            try:
                os.remove(self.path)  # still holding the lock: nobody else can own this file
            except OSError:
                pass
            os.close(fd)  # closing the descriptor drops the flock

    def __del__(self):
        self.release()


def _read_owner(fd: int) -> str:
    try:
        text = os.pread(fd, 200, 0).decode("ascii", "replace").split()
    except OSError:
        return ""
    if len(text) >= 2 and text[0] == "pid":
        return f" (pid {text[1]}" + (f", run id {text[3]})" if len(text) >= 4 else ")")
    return ""


def _sketch_table(sketches, path: str) -> np.ndarray | None:
    """The /records/sketch table: (records, k) float64, NaN rows for records without a sketch;
    None (no dataset at all) when no record has one (sketch_size 0)."""
    sizes = {_sketch_size(item) for item in sketches if item is not None}
    if not sizes:
        return None
    if len(sizes) > 1:
        raise DumpError(f"cannot write {path}: record sketches of different sizes {sorted(sizes)} in one step")
    width = sizes.pop()
    missing = np.full(width, np.nan).tobytes()
    # one join and one buffer for the whole table (the capture side packs its sketches)
    joined = b"".join(missing if item is None else item if type(item) is bytes
                      else np.asarray(item, dtype=np.float64).tobytes() for item in sketches)
    return np.frombuffer(joined, dtype=np.float64).reshape(len(sketches), width)


def _sketch_size(item) -> int:
    """Numbers in one row's sketch: packed bytes (8 per number) or a sequence of floats."""
    return len(item) // 8 if type(item) is bytes else len(item)


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


#: bytes reserved before HDF5 creates the file (its superblock and first metadata)
_INITIAL_RESERVE = 16 << 10


def _create_partial(final: str) -> tuple[str, int, SpaceReservation, h5py.File]:
    """Create a new, uniquely named .partial file: (its path, a raw fd, its reservation,
    the h5py file). The name is taken with O_EXCL, so no other writer shares it."""
    make_folder(os.path.dirname(final))
    if os.path.isdir(final):
        raise DumpError(f"cannot write {final}: a folder is in the way")
    for _ in range(100):
        partial_path = partial_path_for(final)
        try:
            fd = os.open(partial_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
            break
        except FileExistsError:
            continue
        except OSError as error:
            raise DumpError(f"cannot create {partial_path}: {_reason(error)}") from error
    else:  # pragma: no cover - 100 collisions of 48 random bits
        raise DumpError(f"cannot create a unique temporary file next to {final}")
    space = SpaceReservation(fd, partial_path)
    try:
        # HDF5 truncates the file and writes its superblock at once: make sure that space
        # exists, then reserve again (the truncation gave the first reservation back)
        try:
            space.ensure(_INITIAL_RESERVE)
            space.reserved = 0
            # no HDF5 file locks: nobody else opens a .partial file, and locks fail on some NFS mounts
            handle = h5py.File(partial_path, "w", libver=_LIBVER, locking=False)
        except OSError as error:
            raise DumpError(f"cannot write {final}: {_reason(error)}") from error
        try:
            space.ensure(handle.id.get_filesize() + RESERVE_SLACK)
        except OSError as error:
            handle.close()
            raise DumpError(f"cannot write {final}: {_reason(error)}") from error
    except BaseException:
        os.close(fd)
        try:
            os.remove(partial_path)
        except OSError:
            pass
        raise
    return partial_path, fd, space, handle


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
