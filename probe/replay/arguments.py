"""Whether the two sides called the same function: their non-tensor arguments, by name.

Replay binds each side's recorded arguments to the function's signature, defaults filled in
(probe/capture/eager/defaults.py), so ``F.gelu(x)`` and ``F.gelu(x, approximate="tanh")`` differ in
``approximate`` and ``F.layer_norm(x, s, w, b, 1e-3)`` against ``eps=1e-5`` in ``eps``.
Where a tensor lives or which dtype a cast names is not a different function (precision is
judged on its own), so placement and dtype arguments are left out.
"""

from __future__ import annotations

import math

import torch

#: arguments that say where or how a result is stored, not what it is
_IGNORED = frozenset({"device", "dtype", "non_blocking", "memory_format", "layout", "pin_memory", "copy",
                      "out", "inplace", "requires_grad", "async_op", "_stacklevel"})


def differing_arguments(side_a: dict | None, side_b: dict | None) -> dict:
    """name -> (A's value, B's value) of the arguments both sides bound that differ."""
    if not side_a or not side_b:
        return {}
    differ = {}
    for name, value_a in side_a.items():
        if name in _IGNORED or name not in side_b:
            continue
        value_b = side_b[name]
        if _placement(value_a) or _placement(value_b) or _same(value_a, value_b):
            continue
        differ[name] = (value_a, value_b)
    return differ


def arguments_text(differ: dict) -> str:
    """'arguments differ: eps 1e-05 vs 0.001'"""
    parts = [f"{name} {_show(a)} vs {_show(b)}" for name, (a, b) in differ.items()]
    return "arguments differ: " + ", ".join(parts)


def _placement(value) -> bool:
    return isinstance(value, (torch.device, torch.dtype))


def _same(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - values without a plain equality: compare their text
        return repr(a) == repr(b)


def _show(value) -> str:
    return repr(value) if isinstance(value, str) else str(value)
