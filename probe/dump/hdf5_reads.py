"""A step file's objects read through h5py's low-level API: its root attributes, its record
columns (reader.py) and its stored tensors, one dataset each under /tensors, named by tensor id,
with its torch dtype, shape and (sparse tensors only) layout as attributes.

A tensor dump holds thousands of small tensors, and compare opens every one of them on both
sides. Through h5py's high-level objects a small tensor costs about 0.27 ms to open, read its
attributes and copy out (``Group.get`` alone resolves the object's type and wraps it);
through the low-level API, as the writer (layout.py) creates them, a little over half of that.
A step file's open reads its ~20 root attributes and ~25 record columns the same way. Anything
this path does not expect (an attribute of an unusual type, an empty dataspace, a damaged file)
is handed to the high-level path, which gives the values and errors it always gave.
"""

from __future__ import annotations

import math

import h5py
import numpy as np

from probe.dump.mapped import MIN_BYTES, view as mapped_view
from probe.dump.reasons import reason
from probe.errors import DumpFormatError

_ATTRS = (b"dtype", b"shape", b"layout")


def open_tensor(group, tensor_id: int, path: str, tensor_count: int) -> tuple:
    """(dataset, info) of tensor tensor_id; group: the /tensors group, None in a file without.
    dataset: a low-level dataset id, or an h5py Dataset where the fast path stepped aside;
    info: {'dtype': torch dtype name, 'shape': list, 'layout': 'strided' | 'sparse_coo' | ...}."""
    if tensor_id >= 0 and group is not None:
        found = _open_fast(group, tensor_id)
        if found is not None:
            return found
    return _open_checked(group, tensor_id, path, tensor_count)


def read(handle, dataset, tensor_id: int, path: str, mapped: bool = False) -> np.ndarray:
    """The stored values of an opened tensor (mapped from the file where ``mapped`` and the
    dataset allow it, mapped.py)."""
    try:
        if isinstance(dataset, h5py.h5d.DatasetID):
            shape, dtype = dataset.shape, dataset.dtype  # each read makes a new HDF5 object
            if mapped and shape is not None and math.prod(shape) * dtype.itemsize >= MIN_BYTES:
                view = mapped_view(handle, dataset)
                if view is not None:
                    return view
            values = read_numeric(dataset, shape, dtype)
            # not numeric (so never mapped): as h5py's Dataset reads it
            return values if values is not None else np.asarray(h5py.Dataset(dataset)[()])
        view = mapped_view(handle, dataset) if mapped else None
        return np.asarray(dataset[()]) if view is None else view
    except OSError as error:
        raise _corrupt(path, tensor_id, error) from error


def _corrupt(path: str, tensor_id: int, error: OSError) -> DumpFormatError:
    return DumpFormatError(f"cannot read tensor {tensor_id} of {path}: {reason(error)} (truncated or corrupt file)")


def _open_fast(group, tensor_id: int) -> tuple | None:
    try:
        dataset = h5py.h5d.open(group.id, str(int(tensor_id)).encode())
        attrs = {}
        for name in _ATTRS:
            if h5py.h5a.exists(dataset, name):
                value = attribute(h5py.h5a.open(dataset, name))
                if value is UNREAD:
                    return None
                attrs[name] = plain(value)
    except Exception:  # missing, not a dataset, damaged: the checked path says which
        return None
    dtype, shape = attrs.get(b"dtype"), attrs.get(b"shape")
    if not isinstance(dtype, str) or not isinstance(shape, list):
        return None
    return dataset, {"dtype": dtype, "shape": shape, "layout": attrs.get(b"layout", "strided")}


#: what attribute() returns for an attribute it leaves to h5py's AttributeManager
UNREAD = object()
#: (numpy dtype, string info) -> the HDF5 memory type an attribute of that dtype is read as
_MEMORY_TYPES: dict = {}


def attribute(attr):
    """An opened low-level attribute's value as h5py's AttributeManager reads it (a numpy
    scalar, an array, a str); UNREAD for an empty dataspace or an array dtype."""
    shape, dtype = attr.shape, attr.dtype
    if shape is None or dtype.subdtype is not None:
        return UNREAD
    values = np.zeros(shape, dtype=dtype)
    string = h5py.h5t.check_string_dtype(dtype)
    # numpy's dtype equality ignores which strings an object dtype holds: key on that too
    key = (dtype, string)
    memory_type = _MEMORY_TYPES.get(key)
    if memory_type is None:
        memory_type = _MEMORY_TYPES[key] = h5py.h5t.py_create(dtype)
    attr.read(values, mtype=memory_type)
    if string is not None and string.length is None:  # variable-length: bytes to str, as h5py
        values = np.array([item.decode("utf-8", "surrogateescape") for item in values.flat],
                          dtype=dtype).reshape(values.shape)
    return values[()] if values.ndim == 0 else values


def read_attributes(object_id) -> dict | None:
    """Every attribute of an object (a low-level id; for a file's, its root group's), by name
    in the order h5py lists them, each as attribute() reads it; None when one of them is left
    to h5py, or a read fails (h5py's path then says why)."""
    try:
        if isinstance(object_id, h5py.h5f.FileID):  # h5py keeps a file's attributes on "/"
            object_id = h5py.h5g.open(object_id, b"/")
        plist = object_id.get_create_plist()
        tracked = plist.get_attr_creation_order() & h5py.h5p.CRT_ORDER_TRACKED
        names: list = []
        h5py.h5a.iterate(object_id, lambda name, *_: names.append(name),
                         index_type=h5py.h5.INDEX_CRT_ORDER if tracked else h5py.h5.INDEX_NAME)
        found = {}
        for name in names:
            value = attribute(h5py.h5a.open(object_id, name))
            if value is UNREAD:
                return None
            found[name.decode("utf-8", "surrogateescape")] = value
    except Exception:  # a damaged file
        return None
    return found


def read_numeric(dataset, shape, dtype) -> np.ndarray | None:
    """A numeric dataset's values (a low-level id, of that shape and dtype) copied out in one
    read; None for any other kind. The record columns are read this way too (reader.py)."""
    if shape is None or dtype.kind not in "biufc" or dtype.hasobject or dtype.subdtype is not None:
        return None
    values = np.empty(shape, dtype=dtype)
    if values.size:
        dataset.read(h5py.h5s.ALL, h5py.h5s.ALL, values)
    return values


def plain(value):
    """An h5py attribute or column value as plain Python (str, int, float, bool, list)."""
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    return value


def _open_checked(group, tensor_id: int, path: str, tensor_count: int) -> tuple:
    """Through h5py's high-level objects, with an error that says what is wrong."""
    dataset = None
    if tensor_id >= 0 and group is not None:
        try:
            dataset = group.get(str(int(tensor_id)))
        except OSError as error:
            raise _corrupt(path, tensor_id, error) from error
    if not isinstance(dataset, h5py.Dataset):
        held = f"ids 0..{tensor_count - 1}" if tensor_count else "no tensors (task was not 'tensor')"
        raise DumpFormatError(f"{path} has no tensor {tensor_id}: it holds {held}")
    try:
        attrs = {name: plain(value) for name, value in dataset.attrs.items()}
    except OSError as error:
        raise _corrupt(path, tensor_id, error) from error
    if "dtype" not in attrs or "shape" not in attrs:
        raise DumpFormatError(f"tensor {tensor_id} in {path} lacks its dtype/shape attributes")
    return dataset, {"dtype": attrs["dtype"], "shape": list(attrs["shape"]), "layout": attrs.get("layout", "strided")}
