"""The fingerprint file layout: the one contract between its writer and its reader.

A fingerprint file holds a few numbers per tensor and per optimizer step of one rank:
``{dump_path}/fingerprints/rank{R}.h5``. Nothing else spells out its dataset names; the
writer (``file.FingerprintWriter``) and the reader (``file.read``) import them from here.
This module imports neither torch nor h5py.

The file is written in HDF5's single-writer/multiple-reader mode (SWMR): every dataset
exists from the start and only grows; a step is one write to /rows and then one to /steps,
each flushed. A reader (a later ``probe compare``, or a live run reading
its reference) counts only the steps in the step table, so a process killed mid-step leaves
every finished step readable and the step in flight invisible::

    /                     root attributes ROOT_ATTRS (run_id, probe and torch versions,
                          rank, sketch size k, the run's config as JSON)
    /names/text           uint8: the tensors' descriptions, JSON objects (TENSOR_FIELDS),
                          UTF-8, concatenated; a tensor is described once, at the first
                          step that has it
    /names/ends           int64: end offset of each description in /names/text; tensor t
                          is text[ends[t-1]:ends[t]]
    /rows                 float64 (rows, ROW_FIXED + k), one row per tensor per step: the
                          step, the tensor's index (its description), min, max, mean, L2
                          norm, NaN count, Inf count (NUMBERS), then the tensor's k-number
                          random-projection sketch (probe/capture/sketch.py; NaN where it
                          has none). One dataset, so a step is one write
    /steps                float64 (steps, 4), one row per step, written last (STEP_COLUMNS):
                          the optimizer step (the debugger's step counter), its loss (NaN
                          where none was seen), the end (exclusive) of its rows in /rows and
                          how many tensor descriptions exist after it

Bytes per step: ``row_bytes(k)`` per tensor (192 with k = 16) plus ``STEP_BYTES``, plus the
one-time description of each tensor. Integers in the float64 tables are exact (below 2**53).
"""

from __future__ import annotations

#: 1: the first layout
FINGERPRINT_VERSION = 1
FOLDER = "fingerprints"
SUFFIX = ".h5"

NAMES_TEXT = "names/text"
NAMES_ENDS = "names/ends"
ROWS = "rows"
STEPS = "steps"
#: the statistics columns of /rows, after the step and the tensor index
NUMBERS = ("min", "max", "mean", "norm", "nan_count", "inf_count")
#: /rows columns before the sketch
ROW_FIXED = 2 + len(NUMBERS)
#: the columns of /steps
STEP_COLUMNS = ("step", "loss", "rows_end", "names_end")
#: the keys of a tensor's description: its name ("grad/fc1.weight"), what it is ("param",
#: "grad" or "state"), the parameter it belongs to, the optimizer state's key ("exp_avg";
#: "" otherwise), dtype, shape and numel
TENSOR_FIELDS = ("name", "kind", "param", "state", "dtype", "shape", "numel")
KINDS = ("param", "grad", "state")

ROOT_ATTRS = ("fingerprint_version", "probe_version", "torch_version", "run_id", "rank",
              "sketch_size", "config")

STEP_BYTES = 8 * len(STEP_COLUMNS)


def row_bytes(k: int) -> int:
    """Bytes one tensor adds to a step: step, tensor index, six numbers, k sketch numbers."""
    return 8 * (ROW_FIXED + k)


def file_name(rank: int) -> str:
    return f"rank{rank}{SUFFIX}"


def tensor_name(kind: str, param: str, state: str = "") -> str:
    """"param/fc1.weight", "grad/fc1.weight", "state/fc1.weight/exp_avg"."""
    return f"{kind}/{param}/{state}" if state else f"{kind}/{param}"


__all__ = ["FINGERPRINT_VERSION", "FOLDER", "NUMBERS", "TENSOR_FIELDS", "KINDS", "row_bytes",
           "file_name", "tensor_name"]
