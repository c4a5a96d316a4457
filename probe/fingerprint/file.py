"""Fingerprint files on disk: an append-only writer and the readers (h5py; never torch).

The layout is schema.py's. The writer holds the file open in SWMR mode for the whole run and
appends one step at a time: its tensors' rows and its step row in one write, then a flush.
A reader opens with ``swmr=True``, which also opens the file of a process that was killed
(its "open for writing" mark still set), and counts only finished steps (finished_steps): a
step the writer had not finished is not there. ``Follower`` re-reads a file another process is still
writing, step by step (the live reference).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import numpy as np

from probe.errors import DumpError, DumpFormatError
from probe.fingerprint import schema

_CHUNK_ROWS = 256


class FingerprintWriter:
    """One rank's fingerprint file, grown one step at a time."""

    def __init__(self, path: str, attrs: dict, k: int) -> None:
        import h5py

        self.path = path
        self.k = k
        folder = os.path.dirname(path) or "."
        os.makedirs(folder, exist_ok=True)
        try:
            self._file = h5py.File(path, "w", libver="latest")
        except OSError as error:
            raise DumpError(f"cannot create the fingerprint file {path}: {error}") from None
        f = self._file
        for name, value in attrs.items():
            f.attrs[name] = value
        f.attrs["fingerprint_version"] = schema.FINGERPRINT_VERSION
        f.attrs["sketch_size"] = k

        def grow(name, dtype, width=None, chunk=_CHUNK_ROWS):
            shape, maxshape, chunks = (0,), (None,), (chunk,)
            if width is not None:
                shape, maxshape, chunks = (0, width), (None, width), (chunk, max(width, 1))
            return f.create_dataset(name, shape=shape, maxshape=maxshape, chunks=chunks, dtype=dtype)

        self._names_text = grow(schema.NAMES_TEXT, "uint8", chunk=4096)
        self._names_ends = grow(schema.NAMES_ENDS, "int64", chunk=256)
        self._rows = f.create_dataset(schema.ROWS, shape=(0, schema.ROW_FIXED + k), dtype="float64",
                                      maxshape=(None, schema.ROW_FIXED + k), fillvalue=np.nan,
                                      chunks=(_CHUNK_ROWS, schema.ROW_FIXED + k))
        f.swmr_mode = True  # from here on nothing is created, datasets only grow
        self._text_size = 0
        self._names = 0
        self._row_count = 0
        self._text_out, self._ends_out, self._rows_out = (
            _Appender(self._names_text), _Appender(self._names_ends), _Appender(self._rows))

    def append(self, step: int, loss: float, described: list[dict], rows: np.ndarray,
               compute_unit: float = np.nan) -> None:
        """One finished step: ``described`` the tensors seen for the first time (their
        descriptions, in index order), then ``rows`` (tensors + 1, ROW_FIXED + k): the
        tensors' rows with their indices in column 1, and a last row left for the step row
        (filled here, as is column 0, the step). ``compute_unit``: the unit roundoff of the
        dtype autocast computed the step in (0: none; NaN: not known)."""
        if described:
            blobs = [json.dumps(entry, separators=(",", ":")).encode() for entry in described]
            ends = self._text_size + np.cumsum([len(b) for b in blobs])
            self._text_out.extend(self._text_size, np.frombuffer(b"".join(blobs), dtype=np.uint8))
            self._ends_out.extend(self._names, ends.astype(np.int64))
            self._text_size = int(ends[-1])
            self._names += len(blobs)
        rows[:, 0] = step
        rows[-1, 1:] = np.nan
        rows[-1, 1:1 + len(schema.STEP_ROW) - 1] = (schema.STEP_MARK, loss, len(rows) - 1, self._names,
                                                    compute_unit)
        self._rows_out.extend(self._row_count, rows)
        self._row_count += len(rows)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class _Appender:
    """Grows one dataset by whole rows and flushes it, through h5py's low-level calls (a few
    microseconds where the high-level slicing costs tens). What does not change from step to
    step is made once: the memory type (h5py derives it from the array's dtype on every write
    otherwise, ~14 us) and the memory dataspace of each row count seen (a step appends the same
    count every time, ~7 us)."""

    def __init__(self, dataset) -> None:
        import h5py

        self._h5s = h5py.h5s
        self._dataset = dataset
        self._dtype = dataset.dtype
        self._memory_type = h5py.h5t.py_create(self._dtype)
        self._memory_spaces: dict = {}

    def extend(self, start: int, values: np.ndarray) -> None:
        dataset = self._dataset
        count = len(values)
        if count:
            # the rows' width from the values: h5py's dataset.shape costs tens of microseconds
            dataset.id.set_extent((start + count,) + values.shape[1:])
            values = np.ascontiguousarray(values, dtype=self._dtype)
            memory = self._memory_spaces.get(values.shape)
            if memory is None:
                if len(self._memory_spaces) >= 64:  # a run whose row counts keep changing
                    self._memory_spaces.clear()
                memory = self._memory_spaces[values.shape] = self._h5s.create_simple(values.shape)
            selection = dataset.id.get_space()
            selection.select_hyperslab((start,) + (0,) * (values.ndim - 1), values.shape)
            dataset.id.write(memory, selection, values, mtype=self._memory_type)
        dataset.flush()


@dataclass
class Fingerprints:
    """A fingerprint file read whole: plain numpy arrays.

    ``numbers[i, t]`` and ``sketch[i, t]`` are tensor t's at the i-th step of ``steps``
    (NaN where the step has no row for it)."""

    path: str
    attrs: dict
    tensors: list[dict]
    steps: np.ndarray
    loss: np.ndarray
    numbers: np.ndarray  # (steps, tensors, 6)
    sketch: np.ndarray  # (steps, tensors, k)
    index: dict = field(default_factory=dict)  # tensor name -> t
    #: per step, the unit roundoff autocast computed it in (0: none; NaN: not known)
    compute_unit: np.ndarray = field(default_factory=lambda: np.zeros(0))

    @property
    def k(self) -> int:
        return self.sketch.shape[2]

    @property
    def config(self) -> dict:
        try:
            return json.loads(self.attrs.get("config", "{}"))
        except ValueError:
            return {}


def _open(path: str):
    import h5py

    if not os.path.isfile(path):
        raise DumpError(f"{path}: no such fingerprint file")
    try:
        return h5py.File(path, "r", swmr=True)
    except OSError as error:
        raise DumpFormatError(f"{path}: not a readable fingerprint file ({error})") from None


def _attrs(handle) -> dict:
    out = {}
    for name, value in handle.attrs.items():
        out[name] = value.decode() if isinstance(value, bytes) else (value.item() if hasattr(value, "item") else value)
    return out


def _check(path: str, handle) -> None:
    for name in (schema.ROWS, schema.NAMES_ENDS):
        if name not in handle:
            raise DumpFormatError(f"{path}: not a fingerprint file (no /{name}); "
                                  "expected a file written with \"fingerprint\": true")


def _descriptions(handle, count: int) -> list[dict]:
    ends = handle[schema.NAMES_ENDS][:count]
    text = handle[schema.NAMES_TEXT][: int(ends[-1]) if count else 0].tobytes()
    starts = np.concatenate(([0], ends[:-1])) if count else []
    return [json.loads(text[int(s):int(e)]) for s, e in zip(starts, ends)]


def finished_steps(rows: np.ndarray, offset: int = 0) -> list[tuple]:
    """(step, loss, first row, end row, descriptions, compute unit) of every finished step in ``rows``
    (which start at row ``offset`` of the file), in file order. A step is finished when its
    step row is there and every tensor row before it carries its step number; the scan stops
    at the first step that is not (a write the process did not live to finish)."""
    found = []
    marks = np.flatnonzero(rows[:, 1] == schema.STEP_MARK)
    start = 0
    for mark in marks:
        step, _, loss, count, names, compute = rows[mark, :6]
        count = int(count)
        if mark - count != start or not np.all(rows[start:mark, 0] == step) or not np.all(rows[start:mark, 1] >= 0):
            break
        found.append((int(step), float(loss), offset + start, offset + int(mark), int(names),
                      float(compute)))
        start = int(mark) + 1
    return found


def read(path: str) -> Fingerprints:
    """Every finished step of a fingerprint file (a killed run's too)."""
    with _open(path) as handle:
        _check(path, handle)
        rows = handle[schema.ROWS][:]
        steps_found = finished_steps(rows)
        tensors = _descriptions(handle, steps_found[-1][4] if steps_found else 0)
        attrs = _attrs(handle)
    count = len(steps_found)
    k = rows.shape[1] - schema.ROW_FIXED
    grid_numbers = np.full((count, len(tensors), len(schema.NUMBERS)), np.nan)
    grid_sketch = np.full((count, len(tensors), k), np.nan)
    for position, (_, _, start, end, _, _) in enumerate(steps_found):
        which = rows[start:end, 1].astype(np.int64)
        grid_numbers[position, which] = rows[start:end, 2:schema.ROW_FIXED]
        grid_sketch[position, which] = rows[start:end, schema.ROW_FIXED:]
    return Fingerprints(path=path, attrs=attrs, tensors=tensors,
                        steps=np.array([s[0] for s in steps_found], dtype=np.int64),
                        loss=np.array([s[1] for s in steps_found]),
                        numbers=grid_numbers, sketch=grid_sketch,
                        index={entry["name"]: t for t, entry in enumerate(tensors)},
                        compute_unit=np.array([s[5] for s in steps_found]))


@dataclass
class StepPrint:
    """One step of one run: its loss and, per tensor name, (numbers (6,), sketch (k,))."""

    step: int
    loss: float
    tensors: dict  # name -> (numbers, sketch)
    compute_unit: float = np.nan  # the unit roundoff autocast computed it in (0: none)


class Follower:
    """A fingerprint file read step by step while (maybe) another process still writes it.

    ``get(step)`` returns that step's StepPrint, or None when the file has no such step: then
    ``last_step`` says where the file ends now. The file is re-read (HDF5 refresh) only when
    a step beyond the steps already seen is asked for."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._handle = _open(path)
        _check(path, self._handle)
        self.attrs = _attrs(self._handle)
        self._found: list[tuple] = []  # finished_steps() of the rows read so far
        self._positions: dict = {}
        self._tensors: list[dict] = []
        self._refresh()

    @property
    def last_step(self) -> int | None:
        return self._found[-1][0] if self._found else None

    def _refresh(self) -> None:
        handle = self._handle
        for name in (schema.ROWS, schema.NAMES_ENDS, schema.NAMES_TEXT):
            handle[name].refresh()
        start = self._found[-1][3] + 1 if self._found else 0
        rows = handle[schema.ROWS][start:]
        found = finished_steps(rows, offset=start)
        if not found:
            return
        for entry in found:
            self._positions[entry[0]] = len(self._found)
            self._found.append(entry)
        names = found[-1][4]
        if names > len(self._tensors):
            self._tensors = _descriptions(handle, names)

    def get(self, step: int) -> StepPrint | None:
        if step not in self._positions and (self.last_step is None or step > self.last_step):
            self._refresh()
        position = self._positions.get(step)
        if position is None:
            return None
        _, loss, start, end, _, compute = self._found[position]
        rows = self._handle[schema.ROWS][start:end]
        found = {}
        for row in rows:
            found[self._tensors[int(row[1])]["name"]] = (row[2:schema.ROW_FIXED], row[schema.ROW_FIXED:])
        return StepPrint(step=step, loss=loss, tensors=found, compute_unit=compute)

    def description(self, name: str) -> dict | None:
        for entry in self._tensors:
            if entry["name"] == name:
                return entry
        return None

    def close(self) -> None:
        if self._handle is not None:
            self._handle.close()
            self._handle = None


def find_file(path: str, rank: int = 0) -> str:
    """The fingerprint file of ``rank`` for a path a user gives: the file itself, a
    fingerprints folder, or a run's dump_path (holding ``fingerprints/``)."""
    if os.path.isfile(path):
        return path
    for folder in (os.path.join(path, schema.FOLDER), path):
        candidate = os.path.join(folder, schema.file_name(rank))
        if os.path.isfile(candidate):
            return candidate
    raise DumpError(f"{path}: no fingerprint file of rank {rank} (looked for "
                    f"{os.path.join(path, schema.FOLDER, schema.file_name(rank))}); expected a run "
                    "recorded with \"fingerprint\": true")


def ranks_in(path: str) -> list[int]:
    """The ranks with a fingerprint file under a run's path (a single file: [its rank])."""
    if os.path.isfile(path):
        return [0]
    found = []
    for folder in (os.path.join(path, schema.FOLDER), path):
        if os.path.isdir(folder):
            for name in os.listdir(folder):
                stem = name[:-len(schema.SUFFIX)] if name.endswith(schema.SUFFIX) else ""
                if stem.startswith("rank") and stem[4:].isdigit():
                    found.append(int(stem[4:]))
            if found:
                break
    return sorted(found)


def has_fingerprints(path: str) -> bool:
    """True when ``path`` is a fingerprint file or a folder holding fingerprint files."""
    if os.path.isfile(path):
        try:
            import h5py

            with h5py.File(path, "r", swmr=True) as handle:
                return schema.ROWS in handle and schema.NAMES_ENDS in handle
        except OSError:
            return False
    return os.path.isdir(path) and bool(ranks_in(path))


def has_step_files(path: str) -> bool:
    """True when ``path`` is a dump folder holding step folders (``step<N>/``)."""
    return os.path.isdir(path) and any(name.startswith("step") and os.path.isdir(os.path.join(path, name))
                                       for name in os.listdir(path))
