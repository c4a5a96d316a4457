"""Non-tensor arguments, nested structures and the user's source line.

``flatten(obj, prefix)`` walks what a call took or returned and yields ``(slot, leaf)``:
tensors and plain values (numbers, strings, None, dtypes, devices, enums, shapes) are leaves;
tuples, lists, dicts, namedtuples, torch.return_types and dataclasses are walked:

    (logits, (h, c))           -> output.0, output.1.0, output.1.1
    {"logits": t, "aux": 0.5}  -> output.logits, output.aux
    torch.max(x, dim=1)        -> output.values, output.indices

A tuple or list of plain numbers (a shape, a list of dims) is one leaf whose value is the
JSON list, not one record per number. Objects probe cannot describe (functions, modules,
arbitrary classes) are skipped.

``encode_value`` renders a plain value as JSON text for the ``value`` column. ``SourceLocator``
finds the first frame outside torch and probe and names it ``file:line``; it caches per code
object whether a frame is internal, so a lookup is a short walk of dict hits.
"""

from __future__ import annotations

import dataclasses
import enum
import inspect
import json
import math
import numbers
import os
import sys

import torch

Tensor = torch.Tensor
_PLAIN_SCALARS = (bool, int, float, str, type(None))
MAX_DEPTH = 16


def encode_value(value) -> str | None:
    """JSON text for a non-tensor value, or None when it is not a value probe records."""
    kind = type(value)
    if kind is bool:
        return "true" if value else "false"
    if kind is int:
        return str(value)
    if kind is float:
        return _float_text(value)
    if value is None:
        return "null"
    if kind is str:
        return json.dumps(value, ensure_ascii=False)
    if kind is torch.dtype:
        return '"' + str(value).removeprefix("torch.") + '"'
    if kind is torch.device:
        return '"' + str(value) + '"'
    if kind is torch.Size or kind in (tuple, list):
        if all(type(item) in (int, bool) for item in value):
            return "[" + ", ".join(str(int(item)) for item in value) + "]"
        if all(type(item) in _PLAIN_SCALARS for item in value):
            return "[" + ", ".join(encode_value(item) for item in value) + "]"
        return None
    if kind is slice:
        return json.dumps(f"slice({value.start}, {value.stop}, {value.step})")
    if value is Ellipsis:
        return '"..."'
    if isinstance(value, enum.Enum):
        return json.dumps(f"{kind.__name__}.{value.name}")
    if isinstance(value, (torch.memory_format, torch.layout, torch.qscheme)):
        return json.dumps(str(value))
    if isinstance(value, bool):  # numpy.bool_ and friends
        return "true" if value else "false"
    if isinstance(value, numbers.Integral):
        return str(int(value))
    if isinstance(value, numbers.Real):
        return _float_text(float(value))
    if isinstance(value, numbers.Complex):
        return json.dumps(str(complex(value)))
    # a reduce op (dist.ReduceOp.SUM) or similar C enum: its printed name is its identity
    if type(value).__name__ in ("ReduceOp", "RedOpType"):
        return json.dumps(str(value))
    return None


#: types whose JSON value says what they were (schema column value_type "")
_SELF_DESCRIBING = frozenset({bool, int, float, str, type(None), list, tuple, torch.Size})


def value_type(value) -> str:
    """The schema's value_type of a recorded non-tensor value (schema 2): what its JSON text
    alone does not say, so that replay can rebuild it ("dtype" for torch.float32, whose value
    is the string "float32"). "" for numbers, bools, None, strings and lists."""
    kind = type(value)
    if kind in _SELF_DESCRIBING:
        return ""
    if kind is torch.dtype:
        return "dtype"
    if kind is torch.device:
        return "device"
    if isinstance(value, torch.memory_format):
        return "memory_format"
    if isinstance(value, torch.layout):
        return "layout"
    if isinstance(value, torch.qscheme):
        return "qscheme"
    if kind is slice:
        return "slice"
    if value is Ellipsis:
        return "ellipsis"
    if isinstance(value, enum.Enum):
        return "enum"
    if isinstance(value, (bool, numbers.Real)):  # numpy scalars: written as plain numbers
        return ""
    if isinstance(value, numbers.Complex):
        return "complex"
    if kind.__name__ in ("ReduceOp", "RedOpType"):
        return "reduce_op"
    return ""


#: types whose equal values always encode alike (so a value's text can be remembered):
#: not float (0.0 == -0.0), not tuple or list (1 == 1.0 == True inside them; see
#: describe_value)
_MEMO_TYPES = frozenset({int, str, bool, type(None), torch.dtype, torch.device, torch.Size})
#: (type, value) -> (text, value_type); the same few values (eps, dims, reduction names,
#: dtypes) come back in every step
_described: dict = {}
_MEMO_LIMIT = 50_000


def describe_value(value) -> tuple[str, str] | None:
    """(encode_value(value), value_type(value)) of a non-tensor value, or None when it is
    not a value probe records. Plain scalars, dtypes, devices and shapes are remembered."""
    kind = type(value)
    key = None
    if kind in _MEMO_TYPES or (kind is float and value != 0.0 and value == value):
        key = (kind, value)
    elif kind is tuple:
        # a shape or a list of dims: equal tuples with items of the same types encode
        # alike, floats aside; a nested tuple is not recorded whatever it holds
        types = tuple(map(type, value))
        if float not in types:
            key = (kind, value, types)
    if key is not None:
        try:
            described = _described.get(key)
        except TypeError:  # an unhashable item
            key = described = None
        if described is not None:
            return described
    text = encode_value(value)
    if text is None:
        return None
    described = (text, value_type(value))
    if key is not None and len(_described) < _MEMO_LIMIT:
        _described[key] = described
    return described


def _float_text(value: float) -> str:
    if math.isfinite(value):
        return repr(value)
    return '"nan"' if value != value else ('"inf"' if value > 0 else '"-inf"')


def is_plain_sequence(value) -> bool:
    """A tuple/list of plain scalars: recorded as one JSON list, not walked."""
    return all(type(item) in _PLAIN_SCALARS for item in value)


def flatten(obj, prefix: str, out: list, depth: int = 0) -> list:
    """Append (slot, leaf) pairs of obj under prefix to out; returns out."""
    if isinstance(obj, Tensor):
        out.append((prefix, obj))
        return out
    kind = type(obj)
    if kind in _PLAIN_SCALARS:
        out.append((prefix, obj))
        return out
    if depth >= MAX_DEPTH:
        return out
    if isinstance(obj, (tuple, list)):
        if kind is torch.Size or is_plain_sequence(obj):
            out.append((prefix, obj))
            return out
        names = getattr(kind, "_fields", None) or getattr(kind, "__match_args__", None)
        if names and len(names) == len(obj):  # namedtuple, torch.return_types.*
            for name, item in zip(names, obj):
                flatten(item, f"{prefix}.{name}", out, depth + 1)
        else:
            for position, item in enumerate(obj):
                flatten(item, f"{prefix}.{position}", out, depth + 1)
        return out
    if isinstance(obj, dict):
        for name, item in obj.items():
            flatten(item, f"{prefix}.{name}", out, depth + 1)
        return out
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for field in dataclasses.fields(obj):
            flatten(getattr(obj, field.name), f"{prefix}.{field.name}", out, depth + 1)
        return out
    if encode_value(obj) is not None:
        out.append((prefix, obj))
    return out


def tensors_in(obj, depth: int = 0):
    """Every tensor inside obj (same walk as flatten), without building slot names."""
    if isinstance(obj, Tensor):
        yield obj
    elif depth < MAX_DEPTH and isinstance(obj, (tuple, list)):
        for item in obj:
            yield from tensors_in(item, depth + 1)
    elif depth < MAX_DEPTH and isinstance(obj, dict):
        for item in obj.values():
            yield from tensors_in(item, depth + 1)


_INTERNAL_ROOTS = tuple(
    os.path.dirname(os.path.abspath(module.__file__)) + os.sep
    for module in (torch, sys.modules["probe"])
)


#: code flags of frames that can be resumed from another caller (their f_back changes)
_RESUMABLE = inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR


class SourceLocator:
    """``file:line`` of the first frame outside torch and probe, walking out from the caller.

    The walk from torch code to the user's line passes several frames (an nn.Module call is
    four), each made into a frame object on the way. A loop inside torch (an optimizer's
    per-parameter loop) starts every walk at the same internal frame: while that frame runs,
    the frames above it stay where they were, so its answer is remembered until the walk
    starts somewhere else (the frame is held until then; forget() lets it go).
    """

    __slots__ = ("_names", "_start", "_text")

    def __init__(self) -> None:
        self._names: dict = {}  # code object -> display file name, or None for internal code
        self._start = None  # the internal frame the last walk started at
        self._text = ""  # that walk's answer

    def __call__(self, depth: int = 2) -> str:
        try:
            frame = sys._getframe(depth)
        except ValueError:
            return ""
        if frame is self._start:
            return self._text
        names = self._names
        start = frame
        while frame is not None:
            code = frame.f_code
            try:
                name = names.get(code, False)
            except TypeError:
                # a code object hashes its constants: dynamo's resumed frames can hold a
                # slice there, unhashable before Python 3.12
                name = display_name(code.co_filename)
            else:
                if name is False:
                    name = names[code] = display_name(code.co_filename)
            if name is not None:
                text = f"{name}:{frame.f_lineno}"
                if frame is not start and not start.f_code.co_flags & _RESUMABLE:
                    self._start, self._text = start, text
                return text
            frame = frame.f_back
        return ""

    def forget(self) -> None:
        """Drop the remembered frame (at the end of a capture: it holds its locals)."""
        self._start = None
        self._text = ""


def display_name(filename: str) -> str | None:
    if filename.startswith("<frozen"):
        return None
    absolute = os.path.abspath(filename) if not filename.startswith("<") else filename
    if absolute.startswith(_INTERNAL_ROOTS):
        return None
    try:
        relative = os.path.relpath(absolute)
    except ValueError:  # another drive on Windows
        return absolute
    return absolute if relative.startswith("..") else relative
