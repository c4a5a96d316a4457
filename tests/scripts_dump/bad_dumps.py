"""Builders of unreadable dumps, shared by the reader and the inspect tests.

Each builder takes a folder and returns the path to hand to the reader; BAD_DUMPS maps a
case name to (builder, a fragment the one-sentence error must contain).
"""

from __future__ import annotations

import os

import h5py
import numpy as np

from probe.dump import schema
from scripts_dump.dumpkit import rows_for, write_step


def _valid(folder) -> str:
    return write_step(folder, 0, rows=rows_for(4))


def missing(folder) -> str:
    return os.path.join(folder, "no_such_dump")


def not_hdf5(folder) -> str:
    path = os.path.join(folder, "rank0.h5")
    with open(path, "w") as handle:
        handle.write("step,key,value\n0,fc1,1.0\n")
    return path


def hdf5_not_probe(folder) -> str:
    path = os.path.join(folder, "other.h5")
    with h5py.File(path, "w") as handle:
        handle.create_dataset("weights", data=np.arange(4))
    return path


def newer_schema(folder) -> str:
    path = _valid(folder)
    with h5py.File(path, "r+") as handle:
        handle.attrs["schema_version"] = schema.SCHEMA_VERSION + 1
    return path


def truncated(folder) -> str:
    path = _valid(folder)
    size = os.path.getsize(path)
    with open(path, "r+b") as handle:
        handle.truncate(size // 2)
    return path


def garbled(folder) -> str:
    path = _valid(folder)
    size = os.path.getsize(path)
    with open(path, "r+b") as handle:  # keep the HDF5 signature, scramble everything after it
        handle.seek(8)
        handle.write(np.random.default_rng(0).integers(0, 256, size - 8, dtype=np.uint8).tobytes())
    return path


def unequal_columns(folder) -> str:
    path = _valid(folder)
    with h5py.File(path, "r+") as handle:
        records = handle[schema.RECORDS_GROUP]
        shorter = records["seq"][:-1]
        del records["seq"]
        records.create_dataset("seq", data=shorter)
    return path


def record_count_mismatch(folder) -> str:
    path = _valid(folder)
    with h5py.File(path, "r+") as handle:
        handle.attrs["record_count"] = 99
    return path


def missing_column(folder) -> str:
    path = _valid(folder)
    with h5py.File(path, "r+") as handle:
        del handle[schema.RECORDS_GROUP]["norm"]
    return path


def bad_json_attr(folder) -> str:
    path = _valid(folder)
    with h5py.File(path, "r+") as handle:
        handle.attrs["config"] = "{not json"
    return path


def empty_folder(folder) -> str:
    path = os.path.join(folder, "dump")
    os.makedirs(os.path.join(path, "step0"))
    return path


def only_partial_files(folder) -> str:
    path = os.path.join(folder, "dump")
    os.makedirs(os.path.join(path, "step0"))
    with open(os.path.join(path, "step0", "rank0" + schema.PARTIAL_SUFFIX), "wb") as handle:
        handle.write(b"\x89HDF\r\n\x1a\n")
    return path


def partial_file_itself(folder) -> str:
    return os.path.join(only_partial_files(folder), "step0", "rank0" + schema.PARTIAL_SUFFIX)


BAD_DUMPS = {
    "missing": (missing, "does not exist"),
    "not_hdf5": (not_hdf5, "is not an HDF5 file"),
    "hdf5_not_probe": (hdf5_not_probe, "not a probe dump"),
    "newer_schema": (newer_schema, "written by a newer probe"),
    "truncated": (truncated, "truncated or corrupt"),
    "garbled": (garbled, "truncated or corrupt"),
    "unequal_columns": (unequal_columns, "unequal length"),
    "record_count_mismatch": (record_count_mismatch, "declares record_count 99"),
    "missing_column": (missing_column, "lacks the record column 'norm'"),
    "bad_json_attr": (bad_json_attr, "'config' is not valid JSON"),
    "empty_folder": (empty_folder, "holds no step files"),
    "only_partial_files": (only_partial_files, "incomplete .h5.partial"),
    "partial_file_itself": (partial_file_itself, "is incomplete"),
}
