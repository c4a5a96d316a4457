"""The fingerprint file layout: the one contract between its writer and its reader.

A fingerprint file holds a few numbers per tensor and per optimizer step of one rank:
``{dump_path}/fingerprints/rank{R}.h5``. Nothing else spells out its dataset names; the
writer (``file.FingerprintWriter``) and the reader (``file.read``) import them from here.
This module imports neither torch nor h5py.

The file is written in HDF5's single-writer/multiple-reader mode (SWMR): every dataset
exists from the start and only grows. A step is one append to /rows (its tensors' rows, then
its step row) and one flush: one write per step, since each write and flush of an HDF5
dataset costs about as much as the whole step's numbers. A reader trusts a step only when
its step row is there and the rows before it carry its step number, so a process killed
mid-step leaves every finished step readable and the step in flight invisible (rows not yet
written read as the fill value, NaN)::

    /                     root attributes ROOT_ATTRS (run_id, probe and torch versions,
                          rank, sketch size k, the run's config as JSON)
    /names/text           uint8: the tensors' descriptions, JSON objects (TENSOR_FIELDS),
                          UTF-8, concatenated; a tensor is described once, at the first
                          step that has it
    /names/ends           int64: end offset of each description in /names/text; tensor t
                          is text[ends[t-1]:ends[t]]
    /rows                 float64 (rows, ROW_FIXED + k), fill value NaN. A tensor row: the
                          step, the tensor's index (its description, >= 0), min, max, mean,
                          L2 norm, NaN count, Inf count (NUMBERS), then the tensor's k-number
                          random-projection sketch (probe/capture/numbers/sketch.py; NaN where it
                          has none). After a step's tensor rows, its step row (STEP_ROW):
                          the step, STEP_MARK, the loss (NaN where none was seen), how many
                          tensor rows the step has, how many descriptions exist after it,
                          and the unit roundoff of the dtype autocast computed the step's
                          forwards in (2**-8 for bfloat16; 0: autocast was off; NaN: not
                          known, as in every version 1 file)

Bytes per step: ``row_bytes(k)`` per tensor and one more row for the step (192 bytes each
with k = 16), plus the one-time description of each tensor. Integers in the float64 tables are exact (below 2**53).
"""

from __future__ import annotations

#: 1: the first layout; 2: the step row's compute_unit (version 1 files read it as NaN, unknown)
FINGERPRINT_VERSION = 2
FOLDER = "fingerprints"
SUFFIX = ".h5"

NAMES_TEXT = "names/text"
NAMES_ENDS = "names/ends"
ROWS = "rows"
#: the statistics columns of /rows, after the step and the tensor index
NUMBERS = ("min", "max", "mean", "norm", "nan_count", "inf_count")
#: /rows columns before the sketch
ROW_FIXED = 2 + len(NUMBERS)
#: column 1 of a step row (tensor rows hold the tensor's index there, >= 0)
STEP_MARK = -1.0
#: the columns of a step row
STEP_ROW = ("step", "mark", "loss", "tensor_rows", "names_end", "compute_unit")
#: the keys of a tensor's description: its name ("grad/fc1.weight"), what it is ("param",
#: "grad" or "state"), the parameter it belongs to, the optimizer state's key ("exp_avg";
#: "" otherwise), dtype, shape and numel
TENSOR_FIELDS = ("name", "kind", "param", "state", "dtype", "shape", "numel")
KINDS = ("param", "grad", "state")

ROOT_ATTRS = ("fingerprint_version", "probe_version", "torch_version", "run_id", "rank",
              "sketch_size", "config")

def row_bytes(k: int) -> int:
    """Bytes one tensor (or the step row) adds to a step: step, tensor index, six numbers, k
    sketch numbers."""
    return 8 * (ROW_FIXED + k)


def file_name(rank: int) -> str:
    return f"rank{rank}{SUFFIX}"


def tensor_name(kind: str, param: str, state: str = "") -> str:
    """"param/fc1.weight", "grad/fc1.weight", "state/fc1.weight/exp_avg"."""
    return f"{kind}/{param}/{state}" if state else f"{kind}/{param}"


__all__ = ["FINGERPRINT_VERSION", "FOLDER", "NUMBERS", "TENSOR_FIELDS", "KINDS", "row_bytes",
           "file_name", "tensor_name"]
