"""The arguments a call left at their default, so that a run that spells one out compares.

``F.gelu(x)`` and ``F.gelu(x, approximate="tanh")`` compute different functions, but the first
call passes no ``approximate``: without its default in the dump, compare sees one argument on
one side only and nothing to compare it with. Capture therefore records, per call, the
defaults that choose the function: numbers (eps, momentum, negative_slope, dropout's p),
strings (approximate, reduction, mode) and the flags among the booleans that change the
result (is_causal, training, unbiased, ...). Integers (stride, dim) and None are left out:
they change shapes, which compare already sees, or mean "derived from the input".

A default is recorded at slot ``default.<name>`` (schema: a value record like ``kwarg.*``),
never ``kwarg.*``: replay calls the function with what the call passed, and compare pairs a
``default.eps`` of one run with the other run's ``kwarg.eps``.

Signatures: ``inspect.signature`` of the function (Python functions such as F.layer_norm),
else the one of torch's table of overridable functions (built-ins such as F.gelu); looked up
once per function, then cached.
"""

from __future__ import annotations

import functools
import inspect

import torch

#: booleans that only say how or where a result is stored, never which values it holds
_STORAGE_FLAGS = frozenset({"inplace", "keepdim", "non_blocking", "copy", "pin_memory", "requires_grad",
                            "async_op", "out", "sorted", "return_inverse", "return_counts", "return_indices",
                            "ceil_mode", "return_complex", "onesided", "_stacklevel", "enable_gqa"})

#: slot prefix of a defaulted argument's record
DEFAULT_PREFIX = "default."


def _wanted(name: str, default) -> bool:
    if name in _STORAGE_FLAGS or name.startswith("_"):
        return False
    if isinstance(default, bool):
        return True
    return isinstance(default, (float, str))


@functools.lru_cache(maxsize=None)
def _table() -> dict:
    try:
        return torch.overrides.get_testing_overrides()
    except Exception:  # noqa: BLE001 - a torch without the table: Python signatures only
        return {}


@functools.lru_cache(maxsize=4096)
def signature_of(func) -> inspect.Signature | None:
    """The signature of a torch function, or None when neither source has one."""
    try:
        return inspect.signature(func)
    except (TypeError, ValueError):
        pass
    try:
        stand_in = _table().get(func)
    except TypeError:  # an unhashable callable
        return None
    if stand_in is None:
        return None
    try:
        return inspect.signature(stand_in)
    except (TypeError, ValueError):
        return None


@functools.lru_cache(maxsize=4096)
def _defaults(func) -> tuple:
    """((position, name, default), ...) of the parameters whose default chooses the function."""
    signature = signature_of(func)
    if signature is None:
        return ()
    found = []
    for position, parameter in enumerate(signature.parameters.values()):
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            continue
        default = parameter.default
        if default is parameter.empty or not _wanted(parameter.name, default):
            continue
        keyword_only = parameter.kind == parameter.KEYWORD_ONLY
        found.append((None if keyword_only else position, parameter.name, default))
    return tuple(found)


#: func -> ((position, name, slot, default), ...): what the hot path reads, one dict lookup
#: per call (most functions have no default that matters: an empty tuple)
TABLE: dict = {}
_TABLE_LIMIT = 4096


def defaults_of(func) -> tuple:
    """((position or None, name, "default.<name>", default), ...) of func's parameters whose
    default chooses the function; () for an unhashable callable."""
    try:
        found = TABLE.get(func)
    except TypeError:  # an unhashable callable
        return ()
    if found is None:
        found = tuple((position, name, DEFAULT_PREFIX + name, default)
                      for position, name, default in _defaults(func))
        if len(TABLE) < _TABLE_LIMIT:
            TABLE[func] = found
    return found


def bind_call(func, args, kwargs):
    """The call's arguments bound to func's (cached) signature; None when func has no
    signature or the arguments do not bind (torch raises its own error for the call)."""
    signature = signature_of(func)
    if signature is None:
        return None
    try:
        return signature.bind(*args, **kwargs)
    except TypeError:
        return None


def bound_values(func, args, kwargs) -> dict | None:
    """name -> value of every non-tensor argument of a call, its defaults included; None
    when the call does not bind to a known signature."""
    bound = bind_call(func, args, kwargs)
    if bound is None:
        return None
    bound.apply_defaults()
    return {name: value for name, value in bound.arguments.items() if not _holds_tensor(value)}


def _holds_tensor(value) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, (tuple, list)):
        return any(_holds_tensor(item) for item in value)
    if isinstance(value, dict):
        return any(_holds_tensor(item) for item in value.values())
    return False
