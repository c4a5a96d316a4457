"""Read an msprobe (mindstudio-probe) dump as probe reads its own: never unpickles.

    dump = probe.load("msprobe_dump/")     # the same Dump interface as a probe dump
    with dump.open(step=0, rank=0) as step:
        step.records.column("key")         # msprobe's records as probe's (msprobe_records.py)
        step.tensor(3)                     # a dump_tensor_data file, task "tensor"

The folder layout is msprobe_layout.py's, the mapping of records msprobe_records.py's. The
tensors msprobe keeps (``dump_tensor_data/*.npy`` or ``*.pt``) are read only when asked for:
``.npy`` through numpy with allow_pickle=False, ``.pt`` only through
``torch.load(weights_only=True)`` (torch is imported then, never before), which loads plain
tensors and refuses anything that would run code. A file that needs more is refused with a
DumpFormatError.
"""

from __future__ import annotations

import datetime
import importlib.util
import json
import os

import numpy as np

from probe.dump import decode, msprobe_layout, schema
from probe.dump.msprobe_records import LEVELS, StepRecords, read_step
from probe.dump.reader import Discovery, Dump
from probe.dump.table import ColumnTable
from probe.errors import DumpFormatError

FORMAT = "msprobe"
_HEADER_BYTES = 4096


def _header(folder: str) -> dict:
    """dump.json's fields before its data (task, level, framework), read from its first bytes;
    msprobe writes them first. {} when they cannot be read that way (the records will say why)."""
    path = os.path.join(folder, msprobe_layout.DUMP_JSON)
    try:
        with open(path, encoding="utf-8", errors="replace") as handle:
            head = handle.read(_HEADER_BYTES)
    except OSError:
        return {}
    cut = head.find('"data"')
    if cut < 0:
        return {}
    try:
        header = json.loads(head[:cut].rstrip().rstrip(",") + "}")
    except ValueError:
        return {}
    return header if isinstance(header, dict) else {}


class MsprobeStep:
    """One rank folder of one step, open. Records are read on first use."""

    def __init__(self, path: str, step: int, rank: int, world_size: int, cache: dict | None = None):
        self.path = path
        self._cache = {} if cache is None else cache  # folder -> StepRecords: the dump's last one read
        self.step, self.rank = step, rank
        self.schema_version = schema.SCHEMA_VERSION
        self._records: StepRecords | None = None
        header = _header(path)
        level = header.get("level", "")
        try:
            created = datetime.datetime.fromtimestamp(
                os.path.getmtime(os.path.join(path, msprobe_layout.DUMP_JSON)), datetime.timezone.utc)
            created_text = created.isoformat(timespec="seconds")
        except OSError:
            created_text = ""
        self.attrs: dict = {
            "format": FORMAT, "schema_version": self.schema_version, "step": step, "rank": rank,
            "world_size": world_size, "task": header.get("task", ""), "level": LEVELS.get(level, level),
            "device": "", "created": created_text, "run_id": msprobe_layout.run_of(os.path.basename(path)),
            "config": {name: value for name, value in header.items() if name != "dump_data_dir"},
        }

    def __enter__(self) -> "MsprobeStep":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"MsprobeStep(step={self.step}, rank={self.rank}, path={self.path!r})"

    def close(self) -> None:
        """Nothing is held open between reads."""

    @property
    def parsed(self) -> StepRecords:
        if self._records is None:
            self._records = self._cache.get(self.path)
        if self._records is None:
            self._records = read_step(self.path)
            self._drop_missing_tensors()
            self._cache.clear()  # one step's records at a time: the compare reads each once
            self._cache[self.path] = self._records
        if "record_count" not in self.attrs:
            self.attrs["record_count"] = len(self._records.table)
            self.attrs["tensor_count"] = self.tensor_count
            self.attrs["autocast"] = self._records.autocast
        return self._records

    @property
    def records(self):
        return self.parsed.table

    @property
    def tensor_count(self) -> int:
        """Tensors this step can hand the compare: 0 for .pt files without torch installed."""
        files = self.parsed.tensor_files
        if any(name.endswith(".pt") for name in files) and importlib.util.find_spec("torch") is None:
            return 0
        return len(files)

    def _drop_missing_tensors(self) -> None:
        """A record whose file msprobe did not write (a meta or null tensor) has no tensor."""
        files = self._records.tensor_files
        if not files:
            return
        folder = os.path.join(self.path, msprobe_layout.TENSOR_FOLDER)
        try:
            present = set(os.listdir(folder))
        except OSError:
            present = set()
        if all(name in present for name in files):
            return
        lists = self._records.table.as_lists()
        kept: list[str] = []
        renumbered: dict[int, int] = {}
        for number, name in enumerate(files):
            if name in present:
                renumbered[number] = len(kept)
                kept.append(name)
        lists["tensor_id"] = [renumbered.get(number, -1) if number >= 0 else -1 for number in lists["tensor_id"]]
        self._records.table = ColumnTable(lists, os.path.join(self.path, msprobe_layout.DUMP_JSON))
        self._records.tensor_files = kept

    def tensor_info(self, tensor_id: int) -> dict:
        row = list(self.records.column("tensor_id")).index(tensor_id)
        return {"dtype": self.records.column("dtype")[row], "shape": json.loads(self.records.column("shape")[row]),
                "layout": "strided"}

    def tensor(self, tensor_id: int) -> np.ndarray:
        """The values of tensor tensor_id, decoded as probe's reader decodes its own (decode.py)."""
        files = self.parsed.tensor_files
        if isinstance(tensor_id, (bool, np.bool_)) or not isinstance(tensor_id, (int, np.integer)) \
                or not 0 <= tensor_id < len(files):
            raise DumpFormatError(f"{self.path} has no tensor {tensor_id}: it holds ids 0..{len(files) - 1}")
        name = files[tensor_id]
        if os.path.basename(name) != name or name.startswith("."):
            raise DumpFormatError(f"{self.path}/dump.json names the tensor file {name!r}, outside "
                                  f"{msprobe_layout.TENSOR_FOLDER}/; refused")
        path = os.path.join(self.path, msprobe_layout.TENSOR_FOLDER, name)
        if name.endswith(".npy"):
            return _load_npy(path)
        if name.endswith(".pt"):
            return _load_pt(path)
        raise DumpFormatError(f"{path}: probe reads msprobe's .npy and .pt tensor files, not this one")


def _load_npy(path: str) -> np.ndarray:
    try:
        return np.load(path, allow_pickle=False)
    except ValueError as error:
        raise DumpFormatError(f"refused {path}: it holds Python objects that only unpickling would read "
                              f"({error}); probe never unpickles") from None
    except OSError as error:
        raise DumpFormatError(f"cannot read {path}: {error}") from None


def _load_pt(path: str) -> np.ndarray:
    try:
        import torch
    except ImportError:
        raise DumpFormatError(f"{path} is a torch file: reading msprobe's .pt tensors needs torch "
                              "(pip install torch)") from None
    try:
        value = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # the weights-only unpickler refuses whatever is not plain tensor data
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise DumpFormatError(f"refused {path}: torch.load(weights_only=True) does not read it ({reason}); "
                              "probe reads plain tensors and never unpickles more") from None
    if not isinstance(value, torch.Tensor):
        raise DumpFormatError(f"refused {path}: it holds a {type(value).__name__}, not a tensor")
    value = value.detach().contiguous()
    name = str(value.dtype).removeprefix("torch.")
    if name in schema.STORAGE_DTYPES and name != "complex32":
        bits = torch.int16 if schema.STORAGE_DTYPES[name] == "uint16" else torch.uint8
        stored = value.view(bits).numpy().view(schema.STORAGE_DTYPES[name])
        return decode.from_storage(stored, name)
    try:
        return value.resolve_conj().resolve_neg().numpy()
    except (TypeError, RuntimeError) as error:
        raise DumpFormatError(f"cannot read the {name} tensor of {path} as numpy: {error}") from None


class MsprobeDump(Dump):
    """An msprobe dump: its rank folders by (step, rank). What probe.load returns for one."""

    format = FORMAT

    def __init__(self, path: str):
        super().__init__(path, Discovery(msprobe_layout.discover(path)))
        self._parsed: dict = {}
        self._world = {step: sum(1 for s, _ in self.files if s == step) for step in self.steps}

    def open(self, step: int, rank: int = 0) -> MsprobeStep:
        if (step, rank) not in self.files:
            raise DumpFormatError(
                f"{self.path} has no step {step} rank {rank} (steps: {self.steps}, ranks: {self.ranks})")
        return MsprobeStep(self.files[(step, rank)], step, rank, self._world[step], self._parsed)

    def run_id(self, step: int, rank: int = 0):
        """None: an msprobe dump carries no run id of probe's."""
        return None

    def __repr__(self) -> str:
        return f"MsprobeDump({self.path!r}, steps={self.steps}, ranks={self.ranks}, files={len(self.files)})"


def open_step(path) -> MsprobeStep:
    """One rank folder (or its dump.json) of an msprobe dump."""
    found = msprobe_layout.discover(path)
    if len(found) != 1:
        raise DumpFormatError(f"{path} holds {len(found)} msprobe rank folders; name one of them")
    (step, rank), folder = next(iter(found.items()))
    return MsprobeStep(folder, step, rank, 1)


def load(path) -> MsprobeDump:
    return MsprobeDump(os.fspath(path))
