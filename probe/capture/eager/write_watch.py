"""Which tensors a torch call is about to write, so the device bucket can keep their values.

The device path reads a recorded tensor when its bucket flushes, not when it was recorded
(device_bucket.py). A call that writes a tensor in between must say so first: the API mode
does it for every call it sees; at module level, where no mode records calls,
``WriteWatchMode`` sees every torch call and passes on only the writing ones. Both are
cheap for the calls that write nothing (a cached look-up of the call's name).

Writing calls: in-place methods and functions (``add_``, ``torch._foreach_mul_``,
``Tensor.__setitem__``, ``__iadd__``...), torch.nn.functional calls told ``inplace=True``,
anything given ``out=``, and every collective of torch.distributed (they write their buffers
without bumping the autograd version).
"""

from __future__ import annotations

import inspect

import torch
from torch.overrides import TorchFunctionMode

from probe.capture.eager import naming

_Tensor = torch.Tensor
_IN_PLACE_OPERATORS = frozenset(
    f"Tensor.__i{op}__" for op in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow",
                                   "matmul", "and", "or", "xor", "lshift", "rshift"))
_writes_cache: dict = {}


def writes(name: str) -> bool:
    """The call of this name (naming.op_name) writes one of its arguments."""
    found = _writes_cache.get(name)
    if found is None:
        short = name.rsplit(".", 1)[-1]
        found = _writes_cache[name] = (
            (short.endswith("_") and not short.endswith("__"))
            or name in _IN_PLACE_OPERATORS or name == "Tensor.__setitem__"
            or name.startswith("distributed."))
    return found


_inplace_positions: dict = {}


def _inplace_flag(func, args: tuple, kwargs: dict) -> bool:
    """A torch.nn.functional call told to work in place (``F.relu(x, inplace=True)``,
    ``F.dropout(x, p, training, True)``)."""
    if kwargs.get("inplace") is True:
        return True
    try:
        position = _inplace_positions.get(func, -2)
    except TypeError:
        return False
    if position == -2:
        try:
            names = list(inspect.signature(func).parameters)
            position = names.index("inplace") if "inplace" in names else -1
        except (TypeError, ValueError):
            position = -1
        _inplace_positions[func] = position
    return 0 <= position < len(args) and args[position] is True


def may_write(name: str, func, args: tuple, kwargs: dict) -> bool:
    """The call may write one of its tensor arguments (see written_tensors)."""
    if writes(name) or kwargs.get("out") is not None:
        return True
    return name.startswith("functional.") and _inplace_flag(func, args, kwargs)


def written_tensors(name: str, args: tuple, kwargs: dict) -> list:
    """The tensors a call may write: its first argument (a tensor or a list of them) for an
    in-place op or a functional call with ``inplace=True``, an ``out=`` buffer, and every
    tensor argument of a collective. Call it for calls may_write accepted."""
    found: list = []
    if writes(name) or name.startswith("functional."):
        arguments = args if name.startswith("distributed.") else args[:1]
        for arg in arguments:
            _collect(arg, found)
        if name.startswith("distributed."):
            for arg in kwargs.values():
                _collect(arg, found)
    out = kwargs.get("out") if kwargs else None
    if out is not None:
        _collect(out, found)
    return found


def _collect(value, found: list) -> None:
    if isinstance(value, _Tensor):
        found.append(value)
    elif isinstance(value, (list, tuple)):
        for item in value:
            if isinstance(item, _Tensor):
                found.append(item)
            elif isinstance(item, (list, tuple)):
                found.extend(t for t in item if isinstance(t, _Tensor))


class WriteWatchMode(TorchFunctionMode):
    """Tells the recorder before any torch call writes a tensor (module level's device path)."""

    def __init__(self, recorder) -> None:
        super().__init__()
        self.recorder = recorder

    def __enter__(self):
        self.recorder.watch_optimizers()  # the device bucket's flushes around their steps
        return super().__enter__()

    def __exit__(self, exc_type, exc_value, traceback):
        self.recorder.unwatch_optimizers()
        return super().__exit__(exc_type, exc_value, traceback)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        try:
            name = naming.op_name(func)
        except TypeError:
            name = None
        if name is not None and may_write(name, func, args, kwargs):
            written = written_tensors(name, args, kwargs)
            if written:
                self.recorder.before_write(written)
        return func(*args, **kwargs)
