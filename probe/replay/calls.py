"""One recorded call, rebuilt from a step file: its arguments, outputs and gradients.

A call's records share the key prefix ``{module}/{op}#{index}/{phase}/``; their slots say where
each value went: ``input.2`` is the third positional argument, ``input.0.1`` the second item of
a list in the first, ``kwarg.eps`` a keyword argument, ``output.0`` the result, ``grad_output.0``
/ ``grad_input.1`` the gradients of a backward record, ``param.weight`` a module's parameter.
Tensors are read one call at a time (``StepSource.tensor``), never the whole file.

Values come back as float64 wherever they were floating point (bfloat16, float16 and the float8
formats widen exactly), so the replay computes the float64 truth of the very inputs the side
had. Non-tensor arguments are rebuilt from their JSON value and, since schema 2, their
value_type ("dtype" -> torch.float32, ...); schema-1 dumps get the same by name (a string
that names a torch dtype is one).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

import numpy as np
import torch

from probe.dump.formats import open_step_file
from probe.replay.ops import NotReplayable

_FLOAT_NAMES = frozenset({"float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e4m3fnuz",
                          "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu"})
_COMPLEX_NAMES = frozenset({"complex32", "complex64", "complex128"})
_NONFINITE = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf")}
_SLICE = re.compile(r"^slice\((.*), (.*), (.*)\)$")
_DEVICE = re.compile(r"^(cpu|cuda|mps|xpu|npu|hpu|meta)(:\d+)?$")


def is_float(dtype_name: str) -> bool:
    return dtype_name in _FLOAT_NAMES


def is_checked(dtype_name: str) -> bool:
    """Outputs replay checks: floating point (in ulps) and integers/bools (exactly)."""
    return dtype_name in _FLOAT_NAMES or dtype_name.startswith(("int", "uint")) or dtype_name == "bool"


def epsilon(dtype_name: str) -> float:
    """Machine epsilon of a floating dtype; 1 for integers and bools (any difference is a unit)."""
    if dtype_name in _FLOAT_NAMES:
        return torch.finfo(getattr(torch, dtype_name)).eps
    return 1.0


@dataclass
class Record:
    slot: str
    io: str
    kind: str
    dtype: str
    shape: str
    value: str
    value_type: str
    tensor_id: int

    @property
    def is_tensor(self) -> bool:
        return self.dtype != ""


@dataclass
class Call:
    """The records of one call of one side, by slot."""

    prefix: str
    records: dict[str, Record] = field(default_factory=dict)

    def slots(self, *starts: str) -> list[str]:
        return [slot for slot in self.records if slot.split(".", 1)[0] in starts]


class StepSource:
    """One step file opened for replay: the records of a call by key prefix, tensors on demand."""

    def __init__(self, path: str):
        self.path = path
        self.file = open_step_file(path)
        self.bytes_read = 0
        table = self.file.records
        names = ("slot", "io", "kind", "dtype", "shape", "value", "value_type", "tensor_id")
        self._columns = [table.column(name).tolist() for name in names]
        # schema 2 records say what a non-tensor value was (value_type); older ones are guessed
        self._typed = self.file.schema_version >= 2
        self._calls: dict[str, list[int]] = {}
        for row, (key, slot) in enumerate(zip(table.column("key").tolist(), self._columns[0])):
            if key.endswith(slot):
                self._calls.setdefault(key[: len(key) - len(slot)], []).append(row)

    def close(self) -> None:
        self.file.close()

    def call(self, prefix: str) -> Call | None:
        rows = self._calls.get(prefix)
        if rows is None:
            return None
        call = Call(prefix)
        for row in rows:
            slot, io, kind, dtype, shape, value, value_type, tensor_id = (column[row] for column in self._columns)
            call.records.setdefault(slot, Record(slot, io, kind, dtype, shape, value, value_type, int(tensor_id)))
        return call

    def tensor(self, record: Record, wide: bool = True) -> torch.Tensor:
        """The stored tensor (float64/complex128 when wide and floating); NotReplayable if absent."""
        if record.tensor_id < 0:
            raise NotReplayable(f"no saved inputs: {record.slot} has no stored tensor (dump with task 'tensor')")
        array = np.array(self.file.tensor(record.tensor_id), copy=True, order="C")  # 0-d stays 0-d
        self.bytes_read += array.nbytes
        if array.dtype.kind not in "biufc":
            raise NotReplayable(f"tensor of dtype {record.dtype} at {record.slot} cannot be replayed")
        tensor = torch.from_numpy(array)
        if wide and tensor.is_floating_point():
            return tensor.to(torch.float64)
        if wide and tensor.is_complex():
            return tensor.to(torch.complex128)
        return tensor

    def value(self, record: Record):
        return decode_value(record, self._typed)


def decode_value(record: Record, typed: bool):
    """The Python value of a non-tensor record (the inverse of capture's encode_value)."""
    text, kind = record.value, record.value_type
    try:
        value = json.loads(text)
    except ValueError:
        raise NotReplayable(f"argument {record.slot} has the unreadable value {text!r}") from None
    if kind == "dtype" or (not typed and isinstance(value, str) and _is_dtype_name(value)):
        return getattr(torch, value)
    if kind == "device" or (isinstance(value, str) and _DEVICE.match(value)):
        # replay runs on the CPU, whatever device the run used ("cuda:0" given as a string too)
        return torch.device("cpu")
    if kind in ("memory_format", "layout") or (not typed and isinstance(value, str) and value.startswith("torch.")
                                                and value.endswith(("_format", "strided", "sparse_coo"))):
        return getattr(torch, value.removeprefix("torch."))
    if kind == "slice":
        match = _SLICE.match(value)
        if match is None:
            raise NotReplayable(f"argument {record.slot}: cannot read the slice {value!r}")
        return slice(*(None if part == "None" else int(part) for part in match.groups()))
    if kind == "ellipsis":
        return Ellipsis
    if kind == "complex":
        return complex(value)
    if kind:
        raise NotReplayable(f"argument {record.slot} is a {kind} ({value}), which replay cannot rebuild")
    if isinstance(value, str) and value in _NONFINITE:
        return _NONFINITE[value]  # capture writes non-finite floats as these strings
    return value


def _is_dtype_name(name: str) -> bool:
    return isinstance(getattr(torch, name, None), torch.dtype)


def to_float64_dtype(value):
    """In the float64 replay a floating dtype argument (x.to(torch.bfloat16)) becomes float64."""
    if isinstance(value, torch.dtype):
        if value.is_floating_point:
            return torch.float64
        if value.is_complex:
            return torch.complex128
    return value


def rebuild_arguments(call: Call, load, leaf=None) -> tuple[list, dict]:
    """(args, kwargs) of a forward call from its ``input.*`` / ``kwarg.*`` records.

    load(record) gives a tensor record's tensor or a value record's value; leaf(slot, value)
    may replace each rebuilt leaf (to mark it as requiring grad). A positional argument with
    no record (an object capture could not describe) makes the call not replayable.
    """
    positional: dict = {}
    keywords: dict = {}
    for slot, record in call.records.items():
        head, _, rest = slot.partition(".")
        if head not in ("input", "kwarg") or record.io != "in" or record.kind == "param":
            continue
        value = load(record)
        if leaf is not None:
            value = leaf(slot, value)
        parts = rest.split(".")
        if head == "input":
            if not parts[0].isdigit():
                raise NotReplayable(f"argument slot {slot} is not positional")
            _place(positional, [int(parts[0])] + parts[1:], value)
        else:
            _place(keywords, parts, value)
    args = []
    for position in range(len(positional)):
        if position not in positional:
            raise NotReplayable(f"argument input.{position} was not recorded (an object probe cannot describe)")
        args.append(_freeze(positional[position]))
    kwargs = {name: _freeze(value) for name, value in keywords.items()}
    return args, kwargs


def _place(tree: dict, parts: list, value) -> None:
    for part in parts[:-1]:
        key = int(part) if isinstance(part, str) and part.isdigit() else part
        tree = tree.setdefault(key, {})
    last = parts[-1]
    tree[int(last) if isinstance(last, str) and last.isdigit() else last] = value


def _freeze(node):
    """Nested dicts of positions -> tuples (tensors of torch.cat or a foreach op; an index)."""
    if not isinstance(node, dict):
        return node
    if node and all(isinstance(key, int) for key in node):
        if sorted(node) != list(range(len(node))):
            raise NotReplayable("a list argument has items that were not recorded")
        return tuple(_freeze(node[position]) for position in range(len(node)))
    return {key: _freeze(value) for key, value in node.items()}
