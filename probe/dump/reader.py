"""Read probe dumps with numpy and h5py only: never imports torch, never unpickles.

    dump = probe.load("dump/")            # a dump root, a step folder or one step file
    dump.steps, dump.ranks, dump.incomplete
    with dump.open(step=0, rank=0) as step:
        step.records.column("key")        # numpy array, one entry per record
        step.records.row(0)               # dict
        step.tensor(3)                    # numpy array of tensor_id 3, original shape

Every problem with the input is a DumpFormatError: one sentence naming the path.

Read in the process that writes the dump (a PrecisionDebugger whose writer process still has
step files in hand), discover() and open_step_file() first wait for those files.
"""

from __future__ import annotations

import json
import os
import sys

import h5py
import numpy as np

from probe.dump import decode, schema
from probe.dump import hdf5_reads
from probe.dump.hdf5_reads import plain as _plain
from probe.dump.reasons import reason as _reason
from probe.errors import DumpFormatError

_COLUMN_KINDS = dict(schema.ALL_COLUMNS)
_ABSENT = {name: value for name, _, value in schema.OPTIONAL_COLUMNS}


def describe_incomplete(partial_path: str) -> str:
    """'step 3 rank 0 is incomplete (process killed?): <path>'."""
    name = os.path.basename(partial_path)
    rank = schema.parse_partial_file(name)
    step = schema.parse_step_dir(os.path.basename(os.path.dirname(partial_path)))
    where = f"step {step} rank {rank}" if step is not None and rank is not None else "a step file"
    return f"{where} is incomplete (process killed mid-step?): {partial_path}"


class RecordTable:
    """The records of one step file, column by column (read from the file on first use).

    len(table), table.column(name) -> numpy array (object array of str for text columns),
    table.row(i) -> dict, iter(table) -> dicts, table.index_of(key) -> row number.
    table.sketches() -> (records, k) float64 array of the sketches, or None (schema 1, or
    dumped with sketch_size 0); the 2-D sketch dataset is not one of the columns.
    """

    def __init__(self, group: h5py.Group, path: str, count: int, handle: h5py.File | None = None,
                 uninitialized=None, buffers=None, opened: dict | None = None):
        self._group = group
        #: column name -> its low-level dataset id, opened when the table was checked
        self._opened = opened or {}
        self._handle = handle
        self._strings: np.ndarray | None = None
        self._path = path
        self._count = count
        self._cache: dict[str, np.ndarray] = {}
        self._index: dict[str, int] | None = None
        known = schema.COLUMN_NAMES + schema.OPTIONAL_COLUMN_NAMES
        self.columns: tuple[str, ...] = known + tuple(
            sorted(name for name in group if name not in known and name != schema.SKETCH))
        self._sketches: np.ndarray | None = None
        #: keys of the records of memory nothing had written yet (root attribute
        #: uninitialized): a bool column "uninitialized", in files that have the attribute
        self._uninitialized = None if uninitialized is None else frozenset(uninitialized)
        if self._uninitialized is not None:
            self.columns += (schema.UNINITIALIZED,)
        #: record key -> the model buffer it holds (root attribute buffers): a str column "buffer"
        self._buffers = buffers
        if buffers is not None:
            self.columns += (schema.BUFFER,)

    def sketches(self) -> np.ndarray | None:
        """The /records/sketch dataset as a (records, k) float64 array; None when absent."""
        if self._sketches is not None or schema.SKETCH not in self._group:
            return self._sketches
        try:
            dataset = self._group[schema.SKETCH]
            if dataset.ndim != 2 or dataset.shape[0] != self._count:
                raise DumpFormatError(
                    f"{self._path} record sketches have shape {dataset.shape}, expected ({self._count}, k)")
            values = np.asarray(dataset[()], dtype=np.float64)
        except (OSError, KeyError, ValueError, RuntimeError) as error:
            raise DumpFormatError(
                f"cannot read the record sketches of {self._path}: {_reason(error)} (truncated or corrupt file)"
            ) from error
        values.setflags(write=False)
        self._sketches = values
        return values

    def __len__(self) -> int:
        return self._count

    def __repr__(self) -> str:
        return f"RecordTable({self._count} records from {self._path})"

    def _keep(self, name: str, values: np.ndarray) -> np.ndarray:
        values.setflags(write=False)
        self._cache[name] = values
        return values

    def column(self, name: str) -> np.ndarray:
        if name in self._cache:
            return self._cache[name]
        if name not in self.columns:
            raise KeyError(f"no record column {name!r}; columns are {', '.join(self.columns)}")
        if not self._group.id.valid:
            raise ValueError(f"{self._path} was closed; reopen it to read records")
        # columns made from a root attribute that names records by key
        if name == schema.UNINITIALIZED and self._uninitialized is not None:
            keys = self._uninitialized
            return self._keep(name, np.fromiter((key in keys for key in self.column("key")), dtype=bool,
                                                count=self._count))
        if name == schema.BUFFER and self._buffers is not None:
            return self._keep(name, np.array([self._buffers.get(key, "") for key in self.column("key")],
                                             dtype=object))
        if name in _ABSENT and name not in self._group:  # an older file: the column's default
            values = np.empty(self._count, dtype=object if isinstance(_ABSENT[name], str) else None)
            values[:] = _ABSENT[name]
            return self._keep(name, values)
        try:
            # through h5py's low-level API: a third of what its Dataset objects cost a column
            dataset_id = self._opened.pop(name, None) or h5py.h5d.open(self._group.id, name.encode())
            shape, dtype = dataset_id.shape, dataset_id.dtype
            values = hdf5_reads.read_numeric(dataset_id, shape, dtype) if shape and len(shape) == 1 else None
            dataset = h5py.Dataset(dataset_id) if values is None else None
            if dataset is not None and h5py.check_string_dtype(dataset.dtype) is not None:  # variable-length strings
                values = dataset.asstr()[()] if self._count else np.array([], dtype=object)
            elif _COLUMN_KINDS.get(name) == "str":
                values = self._decode_codes(name, dataset[()] if values is None else values)
            elif values is None:
                values = dataset[()]
        except (OSError, KeyError, ValueError, RuntimeError) as error:
            raise DumpFormatError(
                f"cannot read record column {name!r} of {self._path}: {_reason(error)} "
                "(truncated or corrupt file)"
            ) from error
        return self._keep(name, values)

    def _decode_codes(self, name: str, codes: np.ndarray) -> np.ndarray:
        strings = self._string_table()
        if codes.dtype.kind not in "iu":
            raise DumpFormatError(f"{self._path} record column {name!r} has dtype {codes.dtype}, expected text codes")
        if codes.size and (codes.min() < 0 or codes.max() >= len(strings)):
            raise DumpFormatError(
                f"{self._path} record column {name!r} has codes outside its string table of {len(strings)} "
                "(truncated or corrupt file)"
            )
        return strings[codes]

    def _string_table(self) -> np.ndarray:
        if self._strings is not None:
            return self._strings
        if self._handle is None or schema.TEXT_BYTES not in self._handle or schema.TEXT_ENDS not in self._handle:
            raise DumpFormatError(f"{self._path} lacks its string table /{schema.TEXT_BYTES} (truncated or corrupt file)")
        data = np.asarray(self._handle[schema.TEXT_BYTES][()], dtype=np.uint8).tobytes()
        ends = np.asarray(self._handle[schema.TEXT_ENDS][()], dtype=np.int64)
        if ends.ndim != 1 or (ends.size and (ends[-1] != len(data) or (np.diff(ends) < 0).any() or ends[0] < 0)):
            raise DumpFormatError(f"{self._path} has a string table whose offsets do not fit its bytes (corrupt file)")
        starts = np.concatenate(([0], ends[:-1])).tolist()
        stops = ends.tolist()
        if data.isascii():  # the usual case: byte offsets are character offsets
            text = data.decode("ascii")
            texts = [text[start:stop] for start, stop in zip(starts, stops)]
        else:
            texts = [data[start:stop].decode("utf-8", "replace") for start, stop in zip(starts, stops)]
        strings = np.empty(len(texts), dtype=object)
        strings[:] = texts
        strings.setflags(write=False)
        self._strings = strings
        return strings

    def row(self, index: int) -> dict:
        if not -self._count <= index < self._count:
            raise IndexError(f"record {index} out of range: {self._path} has {self._count} records")
        return {name: _plain(self.column(name)[index]) for name in self.columns}

    def to_dicts(self) -> list[dict]:
        """All records as dicts of plain Python values (faster than row() in a loop)."""
        names = self.columns
        columns = [self.column(name).tolist() for name in names]
        return [dict(zip(names, values)) for values in zip(*columns)]

    def __iter__(self):
        return iter(self.to_dicts())

    def index_of(self, key: str) -> int:
        """Row number of the record with that key (KeyError if none)."""
        if self._index is None:
            index: dict[str, int] = {}
            for position, name in enumerate(self.column("key")):
                index.setdefault(name, position)
            self._index = index
        try:
            return self._index[key]
        except KeyError:
            raise KeyError(f"no record with key {key!r} in {self._path}") from None


class StepDump:
    """One open step file. Use as a context manager, or call close()."""

    maps_tensors = True  # tensor(tensor_id, mapped=True) may map the file (mapped.fetch)

    def __init__(self, path: str, handle: h5py.File):
        self.path = path
        self._file = handle
        self.attrs = _read_attrs(path, handle)
        self.schema_version: int = self.attrs["schema_version"]
        self.step: int = self.attrs["step"]
        self.rank: int = self.attrs["rank"]
        self.records = _read_record_table(path, handle, self.attrs)
        self._tensors = handle.get(schema.TENSORS_GROUP)
        self.tensor_count = 0 if self._tensors is None else len(self._tensors)
        declared = self.attrs.get("tensor_count", self.tensor_count)
        if declared != self.tensor_count:
            raise DumpFormatError(
                f"{path} declares {declared} tensors but holds {self.tensor_count} (truncated or corrupt file)"
            )

    def __enter__(self) -> "StepDump":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"StepDump(step={self.step}, rank={self.rank}, records={len(self.records)}, path={self.path!r})"

    def close(self) -> None:
        if self._file.id.valid:
            self._file.close()

    def tensor_info(self, tensor_id: int) -> dict:
        """{'dtype': torch dtype name, 'shape': list, 'layout': 'strided' | 'sparse_coo' | ...}."""
        return self._open_tensor(tensor_id)[1]

    def stored_tensor(self, tensor_id: int) -> tuple[np.ndarray, str]:
        """(raw stored array, torch dtype name): the exact bits, e.g. uint16 for bfloat16."""
        dataset, info = self._open_tensor(tensor_id)
        return self._read(tensor_id, dataset), info["dtype"]

    def tensor(self, tensor_id: int, mapped: bool = False) -> np.ndarray:
        """Tensor tensor_id's values in its original shape (see decode.py for dtypes). mapped: may be
        a read-only view of the file's pages (mapped.py), for a caller that drops it once used."""
        dataset, info = self._open_tensor(tensor_id)
        try:
            values = decode.from_storage(self._read(tensor_id, dataset, mapped), info["dtype"])
        except ValueError as error:
            raise DumpFormatError(f"cannot decode tensor {tensor_id} of {self.path}: {error}") from None
        if list(values.shape) != info["shape"]:
            raise DumpFormatError(
                f"tensor {tensor_id} of {self.path} has shape {list(values.shape)}, "
                f"its shape attribute says {info['shape']}"
            )
        return values

    def _open_tensor(self, tensor_id) -> tuple:
        if not self._file.id.valid:
            raise ValueError(f"{self.path} was closed; reopen it to read tensors")
        if isinstance(tensor_id, (bool, np.bool_)) or not isinstance(tensor_id, (int, np.integer)):
            raise TypeError(f"tensor_id must be an int, got {tensor_id!r}")
        return hdf5_reads.open_tensor(self._tensors, tensor_id, self.path, self.tensor_count)

    def _read(self, tensor_id, dataset, mapped: bool = False) -> np.ndarray:
        return hdf5_reads.read(self._file, dataset, tensor_id, self.path, mapped)


def _read_attrs(path: str, handle: h5py.File) -> dict:
    try:
        raw = hdf5_reads.read_attributes(handle.id)
        if raw is None:  # an attribute of a kind the low-level path leaves to h5py
            raw = {name: handle.attrs[name] for name in handle.attrs}
        has_records = schema.RECORDS_GROUP in handle
    except (OSError, KeyError) as error:
        raise DumpFormatError(f"cannot read {path}: {_reason(error)} (truncated or corrupt file)") from error
    if "schema_version" not in raw or not has_records:
        missing = "schema_version attribute" if "schema_version" not in raw else f"/{schema.RECORDS_GROUP} group"
        raise DumpFormatError(f"{path} is an HDF5 file but not a probe dump (no {missing})")
    attrs = {name: _plain(value) for name, value in raw.items()}
    version = attrs["schema_version"]
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise DumpFormatError(f"{path} has schema_version {version!r}, expected an integer >= 1")
    if version > schema.SCHEMA_VERSION:
        raise DumpFormatError(
            f"{path} was written by a newer probe (schema version {version}, this probe reads up to "
            f"{schema.SCHEMA_VERSION}); upgrade probe to read it"
        )
    for name in schema.JSON_ATTRS:
        if name in attrs:
            try:
                attrs[name] = json.loads(attrs[name])
            except (TypeError, ValueError):
                raise DumpFormatError(f"{path} root attribute {name!r} is not valid JSON") from None
    for name in ("step", "rank"):
        if not isinstance(attrs.get(name), int):
            raise DumpFormatError(f"{path} lacks an integer {name!r} root attribute")
    return attrs


def _read_record_table(path: str, handle: h5py.File, attrs: dict) -> RecordTable:
    group = handle[schema.RECORDS_GROUP]
    opened = {}  # kept for RecordTable.column: each is opened once
    try:
        lengths = {}
        for name in schema.COLUMN_NAMES:
            try:
                dataset = h5py.h5d.open(group.id, name.encode())
            except KeyError:  # missing, or not a dataset
                raise DumpFormatError(f"{path} lacks the record column {name!r}") from None
            if dataset.shape is None or len(dataset.shape) != 1:
                raise DumpFormatError(f"{path} record column {name!r} has shape {dataset.shape}, expected 1-D")
            lengths[name] = dataset.shape[0]
            opened[name] = dataset
    except OSError as error:
        raise DumpFormatError(f"cannot read {path}: {_reason(error)} (truncated or corrupt file)") from error
    if len(set(lengths.values())) > 1:
        common = max(set(lengths.values()), key=list(lengths.values()).count)
        odd = ", ".join(f"{name!r} has {length}" for name, length in lengths.items() if length != common)
        raise DumpFormatError(
            f"{path} has record columns of unequal length ({odd}, the others {common}; truncated or corrupt file)"
        )
    count = lengths[schema.COLUMN_NAMES[0]]
    declared = attrs.get("record_count")
    if declared != count:
        raise DumpFormatError(
            f"{path} declares record_count {declared} but its record columns hold {count} (truncated or corrupt file)"
        )
    uninitialized = attrs.get(schema.UNINITIALIZED)
    if uninitialized is not None and not (isinstance(uninitialized, list)
                                          and all(isinstance(key, str) for key in uninitialized)):
        raise DumpFormatError(f"{path} root attribute {schema.UNINITIALIZED!r} is not a list of "
                              "record keys")
    buffers = attrs.get(schema.BUFFERS)
    if buffers is not None and not (isinstance(buffers, dict) and all(
            isinstance(key, str) and isinstance(name, str) for key, name in buffers.items())):
        raise DumpFormatError(f"{path} root attribute {schema.BUFFERS!r} is not a map of record keys to "
                              "buffer names")
    return RecordTable(group, path, count, handle, uninitialized, buffers, opened)


def _wait_for_writes(path: str) -> None:
    """Step files this process is still writing under path are waited for (background.py;
    nothing to do unless this process writes a dump)."""
    background = sys.modules.get("probe.dump.background")
    if background is not None:
        background.wait_for_path(path)


def open_step_file(path) -> StepDump:
    """Open and validate one step file (rank<R>.h5)."""
    path = os.fspath(path)
    _wait_for_writes(path)
    if not os.path.exists(path):
        raise DumpFormatError(f"{path} does not exist")
    if os.path.isdir(path):
        raise DumpFormatError(f"{path} is a folder, expected a step file (use probe.load for folders)")
    if path.endswith(schema.PARTIAL_SUFFIX):
        raise DumpFormatError(describe_incomplete(path) + " (a .h5.partial file is never finished)")
    try:
        is_hdf5 = h5py.is_hdf5(path)
    except OSError as error:
        raise DumpFormatError(f"cannot read {path}: {_reason(error)}") from error
    if not is_hdf5:
        raise DumpFormatError(f"{path} is not an HDF5 file (not a probe dump)")
    try:
        # finished step files never change (they are renamed into place), so no HDF5 lock is
        # needed, and locks fail on some network file systems
        handle = h5py.File(path, "r", locking=False)
    except OSError as error:
        raise DumpFormatError(f"cannot open {path}: {_reason(error)} (truncated or corrupt HDF5 file)") from error
    try:
        return StepDump(path, handle)
    except BaseException:
        handle.close()
        raise


class Discovery(dict):
    """(step, rank) -> step file path; .incomplete lists the *.h5.partial files skipped."""

    def __init__(self, files=(), incomplete=()):
        super().__init__(files)
        self.incomplete: list[str] = sorted(incomplete)


def discover(path) -> Discovery:
    """Find the step files under a dump root, a step folder, or one step file."""
    path = os.fspath(path)
    _wait_for_writes(path)
    if not os.path.exists(path):
        raise DumpFormatError(f"{path} does not exist")
    if not os.path.isdir(path):
        with open_step_file(path) as step_file:
            return Discovery({(step_file.step, step_file.rank): path})
    try:
        entries = sorted(os.listdir(path))
    except OSError as error:
        raise DumpFormatError(f"cannot list {path}: {error.strerror or error}") from error
    step_dirs = [
        (step, os.path.join(path, name))
        for name in entries
        if (step := schema.parse_step_dir(name)) is not None and os.path.isdir(os.path.join(path, name))
    ]
    own_step = schema.parse_step_dir(os.path.basename(os.path.normpath(path)))
    if not step_dirs and own_step is not None:
        step_dirs = [(own_step, path)]
    found, incomplete = {}, []
    for step, folder in step_dirs:
        try:
            names = sorted(os.listdir(folder))
        except OSError as error:
            raise DumpFormatError(f"cannot list {folder}: {error.strerror or error}") from error
        for name in names:
            full = os.path.join(folder, name)
            rank = schema.parse_rank_file(name)
            if rank is not None and os.path.isfile(full):
                found[(step, rank)] = full
            elif name.endswith(schema.PARTIAL_SUFFIX):
                incomplete.append(full)
    if not found:
        note = ""
        if incomplete:
            note = f"; found {len(incomplete)} incomplete .h5.partial file(s): the process writing them was killed mid-step"
        raise DumpFormatError(f"{path} holds no step files (expected step<N>/rank<R>.h5){note}")
    return Discovery(dict(sorted(found.items())), incomplete)


class Dump:
    """A dump: the finished step files under one path. What probe.load returns."""

    def __init__(self, path: str, found: Discovery):
        self.path = path
        self.files: dict[tuple[int, int], str] = dict(found)
        self.incomplete: list[str] = list(found.incomplete)
        self.steps: list[int] = sorted({step for step, _ in self.files})
        self.ranks: list[int] = sorted({rank for _, rank in self.files})

    def __repr__(self) -> str:
        return f"Dump({self.path!r}, steps={self.steps}, ranks={self.ranks}, files={len(self.files)})"

    def incomplete_messages(self) -> list[str]:
        return [describe_incomplete(path) for path in self.incomplete]

    def incomplete_at(self, step: int, rank: int) -> str | None:
        """The .h5.partial file left for this step and rank (the run died while writing it)."""
        for path in self.incomplete:
            if (schema.parse_partial_file(os.path.basename(path)) == rank
                    and schema.parse_step_dir(os.path.basename(os.path.dirname(path))) == step):
                return path
        return None

    def open(self, step: int, rank: int = 0) -> StepDump:
        if (step, rank) not in self.files:
            raise DumpFormatError(
                f"{self.path} has no step {step} rank {rank} (steps: {self.steps}, ranks: {self.ranks})"
            )
        return open_step_file(self.files[(step, rank)])

    def run_id(self, step: int, rank: int = 0):
        """The id of the run that wrote a step file (None where it has none), read from the
        file's attributes alone: a fifteenth of what opening it costs (its record table)."""
        _wait_for_writes(self.files[(step, rank)])
        with h5py.File(self.files[(step, rank)], "r", locking=False) as handle:
            found = handle.attrs.get("run_id")
        return None if found is None else _plain(found)

    def records(self, step: int | None = None, rank: int | None = None) -> list[dict]:
        """Records of the matching step files, one dict each, with 'step' and 'rank' added."""
        selected = [
            key for key in self.files if (step is None or key[0] == step) and (rank is None or key[1] == rank)
        ]
        if not selected:
            raise DumpFormatError(
                f"{self.path} has no step file for step {step} rank {rank} "
                f"(steps: {self.steps}, ranks: {self.ranks})"
            )
        rows: list[dict] = []
        for file_step, file_rank in selected:
            with self.open(file_step, file_rank) as step_file:
                for row in step_file.records.to_dicts():
                    row["step"], row["rank"] = file_step, file_rank
                    rows.append(row)
        return rows


def load(path) -> Dump:
    """Open a dump root, a step folder or one step file (no data is read until asked)."""
    path = os.fspath(path)
    return Dump(path, discover(path))
