"""How a step file is laid out in HDF5: its datasets and attributes, written through h5py's
low-level API, and the uniquely named ``.partial`` file it is written to before the rename.

schema.py says what a step file holds; this module writes those objects. It imports h5py
and numpy, never torch.
"""

from __future__ import annotations

import os
import secrets

import h5py
import numpy as np

from probe.dump import schema
from probe.dump.reasons import reason
from probe.dump.space import RESERVE_SLACK, SpaceReservation
from probe.errors import DumpError

# Newest object formats that HDF5 1.10 still reads, so a dump written with a new h5py opens
# with an older one on another machine.
_LIBVER = ("earliest", "v110")
_NUMERIC_DTYPES = {"int64": np.int64, "float64": np.float64}
#: optional columns written only when some record of the file has a value: files of runs
#: without DTensors keep the layout older readers know
_ONLY_WHEN_SET = frozenset({"placement"})


def partial_path_for(final_path: str, token: str | None = None) -> str:
    """'.../rank0.h5' -> '.../rank0.{token}.h5.partial' (a new random token when None)."""
    token = secrets.token_hex(6) if token is None else token
    return f"{final_path[: -len(schema.FILE_SUFFIX)]}.{token}{schema.PARTIAL_SUFFIX}"


def sketch_table(sketches, path: str) -> np.ndarray | None:
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


def create_array(parent, name: str, array: np.ndarray) -> h5py.h5d.DatasetID:
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


def set_attr(target, name: str, value) -> None:
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


def encode_texts(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
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
        raise DumpError(f"cannot create {label} {folder}: {reason(error)}") from error


#: bytes reserved before HDF5 creates the file (its superblock and first metadata)
_INITIAL_RESERVE = 16 << 10


def create_partial(final: str) -> tuple[str, int, SpaceReservation, h5py.File]:
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
            raise DumpError(f"cannot create {partial_path}: {reason(error)}") from error
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
            raise DumpError(f"cannot write {final}: {reason(error)}") from error
        try:
            space.ensure(handle.id.get_filesize() + RESERVE_SLACK)
        except OSError as error:
            handle.close()
            raise DumpError(f"cannot write {final}: {reason(error)}") from error
    except BaseException:
        os.close(fd)
        try:
            os.remove(partial_path)
        except OSError:
            pass
        raise
    return partial_path, fd, space, handle


def record_arrays(rows: list[tuple], path: str) -> tuple[list[np.ndarray], np.ndarray | None, np.ndarray, np.ndarray]:
    """The record rows as the arrays of the step file: ((column name, array) per column, the sketch
    table or None, the string table's UTF-8 bytes, its end offsets).

    Text columns are dictionary-encoded (see schema.py): one int32 code per record and one
    shared table of distinct strings as a UTF-8 byte blob plus end offsets. h5py's
    variable-length strings cost ~5 us per value; this costs ~0.1 us per value."""
    count = len(rows)
    columns = list(zip(*rows)) if rows else [()] * len(schema.ALL_COLUMNS)
    columns_of_rows, sketched = schema.row_layout(len(columns)) or (schema.ALL_COLUMNS, False)
    vocabulary: dict[str, int] = {}
    arrays = []
    # rows without the optional columns leave them out of the file (zip stops early)
    for (name, kind), values in zip(columns_of_rows, columns):
        if name in _ONLY_WHEN_SET and not any(values):
            continue  # a column no record of this file uses: the layout older readers know
        try:
            if kind == "str":
                if set(map(type, values)) - {str}:  # map(type) runs in C: 10x an isinstance loop
                    bad = next(v for v in values if not isinstance(v, str))
                    raise TypeError(f"holds {bad!r}, expected str")
                new = [text for text in dict.fromkeys(values) if text not in vocabulary]
                vocabulary.update(zip(new, range(len(vocabulary), len(vocabulary) + len(new))))
                arrays.append((name, np.fromiter(map(vocabulary.__getitem__, values), dtype=schema.TEXT_CODE_DTYPE, count=count)))
            else:
                arrays.append((name, np.array(values, dtype=_NUMERIC_DTYPES[kind]).reshape(-1)))
        except (TypeError, ValueError, OverflowError) as error:
            raise DumpError(f"cannot write {path}: record column {name!r} {error}") from error
    sketches = None
    if sketched:
        sketches = sketch_table(columns[len(columns_of_rows)], path)
    blob, ends = encode_texts(list(vocabulary))
    return arrays, sketches, blob, ends
