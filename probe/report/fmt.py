"""Number formatting shared by the human reports (terminal and HTML).

Errors (rel L2, max abs, ...) span many decades, so they are always written in scientific
notation with three significant digits ("1.15e-04", never "0.000115" next to "9.26e-05"):
a column of them lines up and compares at a glance. Scores and ratios are plain (".3g").
"""

from __future__ import annotations

import math


def _special(value) -> str | None:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return value
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    if value == 0:
        return "0"
    return None


def num(value, digits: int = 3) -> str:
    """A score, ratio or count: 5.03, 0.0981, 1.2e+03."""
    special = _special(value)
    return special if special is not None else f"{value:.{digits}g}"


def err(value) -> str:
    """An error magnitude: 1.15e-04 (0 stays 0)."""
    if isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    special = _special(value)
    return special if special is not None else f"{value:.2e}"
