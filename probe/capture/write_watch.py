"""Which tensors a torch call is about to write, so the device bucket can keep their values.

The device path reads a recorded tensor when its bucket flushes, not when it was recorded
(device_bucket.py). A call that writes a tensor in between must say so first: the API mode
does it for every call it sees; at module level, where no mode records calls,
``WriteWatchMode`` sees every torch call and passes on only the writing ones. Both are
cheap for the calls that write nothing (a cached look-up of the call's name).

Writing calls: in-place methods and functions (``add_``, ``torch._foreach_mul_``,
``Tensor.__setitem__``, ``__iadd__``...), anything given ``out=``, and every collective of
torch.distributed (they write their buffers without bumping the autograd version).
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

from probe.capture import naming

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


def written_tensors(name: str, args: tuple, kwargs: dict) -> list:
    """The tensors a call may write: its first argument (a tensor or a list of them) for an
    in-place op, an ``out=`` buffer, and every tensor argument of a collective."""
    found: list = []
    if writes(name):
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

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        try:
            name = naming.op_name(func)
        except TypeError:
            name = None
        if name is not None and (kwargs.get("out") is not None or writes(name)):
            written = written_tensors(name, args, kwargs)
            if written:
                self.recorder.before_write(written)
        return func(*args, **kwargs)
