"""The dump file layout: the one contract between the writer and the reader.

Nothing else in probe spells out group names, column names or attribute names; writer.py
and reader.py import them from here. This module imports neither torch nor h5py.

Layout of one file, ``{dump_path}/step{N}/rank{R}.h5``::

    /                      root attributes, see ROOT_ATTRS
    /records/<column>      one 1-D dataset per column of RECORD_COLUMNS, all the same length;
                           row i of every column together is record i. A "str" column holds
                           int32 codes: code c is string c of the string table below
    /record_text           uint8: the distinct strings of all "str" columns, UTF-8 encoded
                           and concatenated (lone surrogates stored backslash-escaped)
    /record_text_ends      int64: end offset of each string in /record_text (exclusive);
                           string c is record_text[ends[c-1]:ends[c]], starting at 0 for c = 0
    /records/sketch        schema 2, optional: float64 of shape (records, k), row i = record
                           i's random-projection sketch (probe/capture/numbers/sketch.py); a row of
                           NaN where the record has none (a non-tensor, an empty tensor).
                           Absent when config sketch_size is 0, and in schema-1 files.
    /tensors/<tensor_id>   task "tensor" only: one dataset per distinct tensor of the step,
                           stored bit-exact in its storage dtype (see STORAGE_DTYPES) with the
                           attributes "dtype" (torch dtype name) and "shape", and optionally
                           "layout" ("sparse_coo", "sparse_csr", ...): the tensor was sparse and
                           is stored dense (absent = strided)

A record is one tensor (or one non-tensor argument) seen at one slot of one call:

    key        unique name, stable across runs: "{module}/{op}#{index}/{phase}/{slot}"
               e.g. "blocks.0.attn/functional.linear#1/forward/output.0"
    seq        global execution order of the event that produced the record (forward call or
               backward hook firing); records of one event share a seq. Decides "first",
               never identity.
    kind       "api" (a torch function call), "module" (an nn.Module call) or "param"
               (a parameter and its gradient)
    module     dotted path of the innermost module running the call ("" = the root model,
               or no model); for kind "module", the module's own path
    op         API name ("functional.linear", "torch.matmul", "Tensor.add_", "Tensor.mul"
               (x * y arrives as the method torch dispatches to, Tensor.mul),
               "distributed.all_reduce") or, for kind "module"/"param", the module class name
    index      call counter local to (module, op) within the step, starting at 0
    phase      "forward" or "backward"
    slot       where in the call: "input.0", "input.1.2" (nested), "kwarg.eps", "output.0",
               "output.logits", "grad_output.0", "grad_input.0", "param.weight",
               "param_grad.weight"
    io         "in" or "out": whether the slot feeds the computation of this event or is
               produced by it (forward inputs, params and grad_output are "in"; forward
               outputs, grad_input and param_grad are "out")
    dtype      torch dtype name without "torch." ("float32", "bfloat16"), "" for non-tensors
    shape      JSON list ("[32, 256]"), "" for non-tensors
    device     "cpu", "cuda:0", ... ; "" for non-tensors
    value      JSON text of a non-tensor argument (number, string, bool, None, dtype name,
               shape), "" for tensors
    min max mean norm      float64 statistics (L2 norm); NaN where not defined (empty tensor,
                           non-tensor). Complex: of the absolute values. Bool: as 0/1.
    nan_count inf_count numel   int64
    checksum   hex digest of the raw bytes (task "checksum" and "tensor"), "" otherwise
    tensor_id  int64 index into /tensors (task "tensor"), -1 when no data stored
    source     "path/to/file.py:123" of the user code line that made the call, "" if unknown

Optional columns (OPTIONAL_COLUMNS): added after schema 1, absent from older files; the reader
gives them their "absent" value for files without them, and the writer accepts rows without them.

    value_type (schema 2, for the replay) what kind of Python value a non-tensor argument was,
               where its JSON ``value`` alone does not say: "dtype" (value "float32"),
               "device" ("cuda:0"), "memory_format", "layout", "qscheme" (value is the printed
               name, "torch.preserve_format"), "slice", "ellipsis", "enum", "complex" and
               "reduce_op". "" for tensors, numbers, bools, None, strings and lists.

    sketch     (the 2-D dataset above) k numbers y = R x, R a fixed +-1 matrix the same in
               every run and on every device, x the tensor's values flattened row-major
               (complex as (real, imag) pairs, ints and bool as their values). Compare
               estimates ||a - b|| from y_a - y_b (probe/comparison/sketch.py).

    placement  (optional, written only when a record has one) a DTensor's place, JSON text:
               {"mesh": [2], "dims": ["tp"], "placements": ["S(0)"], "coord": [1],
               "shape": [16, 8], "offset": [8, 0]}: the device mesh's shape and dimension
               names, torch's placement per mesh dimension ("S(d)" sharded on dim d, "R"
               replicated, "P(sum)" partial), this rank's mesh coordinate, the logical tensor's
               shape and the first index of this rank's shard in it. The record's statistics,
               shape and numel are the local shard's; a shard's ("S(d)") sketch is taken
               at its logical positions, so the shards' sketches add up to the logical
               tensor's (probe/capture/numbers/shard_sketch.py).
               "" for every other record (probe/capture/eager/placement.py).

Schema history: 1 = the first release; 2 adds /records/sketch, the optional column value_type,
the root attribute run_id and unique partial names; all of them are optional on read, so a
schema-1 file still opens and compares, with the statistics' lower bounds as evidence.
"""

from __future__ import annotations

import os
import re

#: 2: optional column value_type (the replay), root attribute run_id and unique partial
#: names; other version-2 fields are listed with their columns
SCHEMA_VERSION = 2
FILE_SUFFIX = ".h5"
#: a step file is written under a temporary name ending in this suffix and renamed to its
#: final name only once complete, so a process killed mid-step never leaves a file that looks
#: finished. Since schema 2 the temporary name is unique per writer,
#: ``rank{R}.{token}.h5.partial`` (created with O_EXCL); schema 1 wrote ``rank{R}.h5.partial``.
PARTIAL_SUFFIX = ".h5.partial"

RECORDS_GROUP = "records"
TENSORS_GROUP = "tensors"
#: the distinct strings of all "str" record columns: UTF-8 bytes, concatenated (uint8) ...
TEXT_BYTES = "record_text"
#: ... and the end offset (int64, exclusive) of each string in TEXT_BYTES; string i is
#: TEXT_BYTES[TEXT_ENDS[i-1]:TEXT_ENDS[i]] (start 0 for i = 0)
TEXT_ENDS = "record_text_ends"
#: storage dtype of a "str" record column: each value is an index into the string table
TEXT_CODE_DTYPE = "int32"

#: (column name, numpy dtype string). "str" columns are stored as TEXT_CODE_DTYPE codes into
#: the file's string table (TEXT_BYTES + TEXT_ENDS); readers get Python str back.
RECORD_COLUMNS: tuple[tuple[str, str], ...] = (
    ("key", "str"),
    ("seq", "int64"),
    ("kind", "str"),
    ("module", "str"),
    ("op", "str"),
    ("index", "int64"),
    ("phase", "str"),
    ("slot", "str"),
    ("io", "str"),
    ("dtype", "str"),
    ("shape", "str"),
    ("device", "str"),
    ("value", "str"),
    ("min", "float64"),
    ("max", "float64"),
    ("mean", "float64"),
    ("norm", "float64"),
    ("nan_count", "int64"),
    ("inf_count", "int64"),
    ("numel", "int64"),
    ("checksum", "str"),
    ("tensor_id", "int64"),
    ("source", "str"),
)
COLUMN_NAMES: tuple[str, ...] = tuple(name for name, _ in RECORD_COLUMNS)

#: Columns newer than schema 1: (name, kind, value for records of files without it). Rows
#: written by capture carry them after the RECORD_COLUMNS; rows of RECORD_COLUMNS width alone
#: (older writers, tests) are accepted and the column is then absent from the file.
OPTIONAL_COLUMNS: tuple[tuple[str, str, object], ...] = (
    ("value_type", "str", ""),  # schema 2: see the module docstring (replay)
    ("placement", "str", ""),  # schema 2, optional: a DTensor shard's place (docstring)
)
OPTIONAL_COLUMN_NAMES: tuple[str, ...] = tuple(name for name, _, _ in OPTIONAL_COLUMNS)
#: every column a row may hold, in row order
ALL_COLUMNS: tuple[tuple[str, str], ...] = RECORD_COLUMNS + tuple((n, k) for n, k, _ in OPTIONAL_COLUMNS)
#: the optional 2-D record dataset of sketches (float64, one row per record); not one of
#: RECORD_COLUMNS, which are 1-D and required
SKETCH = "sketch"
SKETCH_DTYPE = "float64"
#: a record row as the capture side hands it to the writer: the ALL_COLUMNS values, then the
#: sketch: its k float64 numbers as bytes in the machine's order (probe/capture/numbers/sketch.py,
#: pack), a sequence of k floats, or None. Narrower rows are accepted too (row_layout).
ROW_WIDTH = len(ALL_COLUMNS) + 1


def row_layout(width: int) -> tuple[tuple[tuple[str, str], ...], bool] | None:
    """(the columns a row of this width holds, in order; whether a sketch follows them), or
    None for a width no writer makes: the record columns alone; with value_type; with
    value_type and the sketch (the rows of writers before the placement column); every
    column and the sketch (ROW_WIDTH)."""
    base = len(RECORD_COLUMNS)
    value_type = RECORD_COLUMNS + (ALL_COLUMNS[base],)
    return {
        base: (RECORD_COLUMNS, False),
        base + 1: (value_type, False),
        base + 2: (value_type, True),
        ROW_WIDTH: (ALL_COLUMNS, True),
    }.get(width)

KINDS = ("api", "module", "param")
PHASES = ("forward", "backward")
IO_VALUES = ("in", "out")

#: Root attributes. JSON-valued ones are stored as JSON text.
ROOT_ATTRS = {
    "schema_version": "int: SCHEMA_VERSION of the writer",
    "probe_version": "str",
    "torch_version": "str",
    "created": "str: ISO-8601 UTC time the step file was finished",
    "step": "int",
    "rank": "int",
    "world_size": "int",
    "task": "str: statistics | tensor | checksum",
    "level": "str: module | api | mix",
    "device": "str: device the model ran on (first one seen), e.g. cpu, cuda:0",
    "config": "JSON: the Config the dump was made with",
    "seed_report": "JSON: what seed_all set (null when not seeded by probe)",
    "determinism": "JSON: cuDNN flags, deterministic algorithms, TF32, matmul precision, "
    "threads, relevant environment variables, at the time of the step",
    "record_count": "int: number of records (a check against truncation)",
    "tensor_count": "int: number of datasets under /tensors",
    "run_id": "str (schema 2, optional on read): random id of the PrecisionDebugger that wrote "
    "the file; step files of one dump folder with different run ids come from different runs",
    "autocast": "JSON (optional on read): [[first_seq, last_seq, dtype], ...], the runs of API calls made "
    "while autocast was on (dtype: the one autocast computes in); [] = autocast was off for every "
    "call; absent in older files (unknown)",
    "cost": "JSON (optional on read): what capturing the step cost: {host_transfers: device-to-host "
    "copies made for its numbers, capture_ms: milliseconds in probe's code on the training thread, "
    "stale_records: records whose tensor changed unseen before its statistics were read (their "
    "statistics are unknown)}; absent in older files",
    "uninitialized": "JSON (optional on read): [key, ...], the records of memory nothing had written "
    "yet (an empty-family allocation, or a view of one, read before its first write): dtype, shape and "
    "device only, statistics NaN and counts -1, no sketch, checksum or tensor; never compared. "
    "[] when there is none; absent in older files",
    "buffers": "JSON (optional on read): {key: name, ...}, the records whose tensor is a buffer the model "
    "registered (model.named_buffers(), by identity), with the buffer's name (\"rope.cos\"); {} when no "
    "record is one; absent in older files (not known)",
}
#: the root attribute listing the records of memory nothing had written yet
UNINITIALIZED = "uninitialized"
#: the root attribute naming the records of the model's registered buffers (and the reader's
#: column of those names)
BUFFERS = "buffers"
BUFFER = "buffer"
#: root attributes a reader must not require: absent in files of older schema versions.
OPTIONAL_ATTRS = ("run_id", "autocast", "cost", UNINITIALIZED, BUFFERS)
JSON_ATTRS = ("config", "seed_report", "determinism", "autocast", "cost", UNINITIALIZED, BUFFERS)

#: How tensor dtypes without a numpy equivalent are stored bit-exact: same-width unsigned
#: integers holding the raw bits; the "dtype" attribute says how to read them.
STORAGE_DTYPES = {
    "bfloat16": "uint16",
    "float8_e4m3fn": "uint8",
    "float8_e4m3fnuz": "uint8",
    "float8_e5m2": "uint8",
    "float8_e5m2fnuz": "uint8",
    "float8_e8m0fnu": "uint8",
    # complex32 (chalf) is stored as its float16 (real, imag) pairs, last axis of size 2.
    "complex32": "float16",
}

_STEP_DIR = re.compile(r"^step(\d+)$")
_RANK_FILE = re.compile(r"^rank(\d+)\.h5$")
_PARTIAL_FILE = re.compile(r"^rank(\d+)(?:\.[0-9A-Za-z_-]+)?\.h5\.partial$")


def step_dir_name(step: int) -> str:
    return f"step{step}"


def rank_file_name(rank: int) -> str:
    return f"rank{rank}{FILE_SUFFIX}"


def step_file_path(dump_path: str, step: int, rank: int) -> str:
    return os.path.join(dump_path, step_dir_name(step), rank_file_name(rank))


def parse_step_dir(name: str) -> int | None:
    match = _STEP_DIR.match(name)
    return int(match.group(1)) if match else None


def parse_rank_file(name: str) -> int | None:
    match = _RANK_FILE.match(name)
    return int(match.group(1)) if match else None


def parse_partial_file(name: str) -> int | None:
    """The rank of a temporary step file name (either schema's form), else None."""
    match = _PARTIAL_FILE.match(name)
    return int(match.group(1)) if match else None


def make_key(module: str, op: str, index: int, phase: str, slot: str) -> str:
    return f"{module}/{op}#{index}/{phase}/{slot}"
