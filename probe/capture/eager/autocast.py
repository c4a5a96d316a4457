"""Which calls ran under autocast: a lower precision that autocast chose is expected, one the
model's own casts chose is a finding (compare's precision rule, docs/compare.md).

Per step the recorder keeps runs ``[first_seq, last_seq, dtype]`` of consecutive API calls
made while autocast was on; the debugger writes them as the root attribute ``autocast`` (an
empty list: autocast was off for every call; absent in older dumps: unknown).
"""

from __future__ import annotations

import torch

from probe import compat

_DEVICES = ["cpu", "cuda", "xpu", "mps", "hpu", "npu"]


def _probe_devices() -> list:
    """The device types this torch can ask about (an unknown one raises) and has."""
    found = []
    for device in _DEVICES:
        backend = getattr(torch, device, None) if device != "cpu" else torch.cpu
        available = getattr(backend, "is_available", None)
        try:
            if device != "cpu" and (available is None or not available()):
                continue
            torch.is_autocast_enabled(device)
        except (TypeError, RuntimeError, ValueError, AttributeError):
            continue
        found.append(device)
    return found


_KNOWN = None


def _dtype_of(device: str) -> str:
    try:
        return str(torch.get_autocast_dtype(device)).removeprefix("torch.")
    except (AttributeError, TypeError, RuntimeError):  # torch < 2.4: the per-device getters
        getter = torch.get_autocast_cpu_dtype if device == "cpu" else torch.get_autocast_gpu_dtype
        return str(getter()).removeprefix("torch.")


def _enabled_legacy() -> str:
    if torch.is_autocast_cpu_enabled():
        return _dtype_of("cpu")
    if torch.is_autocast_enabled():
        return _dtype_of("cuda")
    return ""


_ANY = compat.any_autocast_enabled  # one cheap call on the hot path


def autocast_dtype() -> str:
    """The dtype autocast computes in right now ("bfloat16"), "" when it is off."""
    global _KNOWN
    if _ANY is not None and not _ANY():
        return ""
    if _KNOWN is None:
        _KNOWN = _probe_devices()
    if not _KNOWN:
        return _enabled_legacy()
    for device in _KNOWN:
        if torch.is_autocast_enabled(device):
            return _dtype_of(device)
    return ""


def note_call(runs: list, seq: int, dtype: str, last: list) -> None:
    """Extend the runs with one API call (seq) made under autocast in dtype; last[0] is the
    seq of the previous API call, so a call outside autocast in between starts a new run."""
    if runs and runs[-1][2] == dtype and runs[-1][1] == last[0]:
        runs[-1][1] = seq
    else:
        runs.append([seq, seq, dtype])
