"""Pair an argument one run left at its default with the same argument the other run spelled out.

Capture records a call's defaults that choose the function at ``default.<name>``
(probe/capture/eager/defaults.py), what the call passed at ``kwarg.<name>``. ``F.gelu(x)`` in A and
``F.gelu(x, approximate="tanh")`` in B then compare as ``kwarg.approximate``: "none" in A,
"tanh" in B, a changed argument. A default whose name the other run did not pass by keyword
is not compared (both runs recorded it alike, or the other passed it by position), so dumps
of older versions, which record no defaults, compare as before.
"""

from __future__ import annotations

DEFAULT, KEYWORD = "default.", "kwarg."


def pair_defaults(slots_a: dict, slots_b: dict) -> tuple[dict, dict]:
    """(slots_a, slots_b) with each default renamed to the keyword slot the other side has,
    or dropped when unpaired; the inputs are not modified."""
    if not any(slot.startswith(DEFAULT) for slot in slots_a) and not any(slot.startswith(DEFAULT) for slot in slots_b):
        return slots_a, slots_b
    return _renamed(slots_a, slots_b), _renamed(slots_b, slots_a)


def _renamed(own: dict, other: dict) -> dict:
    out = {}
    for slot, row in own.items():
        if slot.startswith(DEFAULT):
            name = slot[len(DEFAULT):]
            keyword = KEYWORD + name
            if keyword in other and keyword not in own:
                out[keyword] = row  # the other run passed it: compare it with this default
            elif slot in other:
                out[slot] = row  # both left it at the default: the same, recorded alike
            continue
        out[slot] = row
    return out
