"""Per-dtype tolerances: the defaults, their overrides, and which dtype decides.

A pair of tensors is judged with the tolerance of the *lower-precision* side (a bf16 run
against an fp32 run is held to bf16's tolerance), so a dtype difference alone never fails.
The judgement itself (see record_rules.py) is on the relative L2 error with an absolute floor:

    ||a - b|| <= rtol * ||a|| + atol * sqrt(numel)      (a = A = the reference)

i.e. the RMS error may be rtol times the RMS of the reference plus atol. docs/compare.md
gives the reasoning behind each default; ``probe compare --rtol/--atol/--tol/--tol-file``
override them.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass
from typing import Iterable, Mapping

from probe.errors import ConfigError


@dataclass(frozen=True)
class Tolerance:
    rtol: float
    atol: float

    def budget(self, ref_norm: float, numel: int) -> float:
        """Largest ||a - b|| this tolerance accepts for a reference of norm ref_norm."""
        return self.rtol * ref_norm + self.atol * math.sqrt(max(numel, 0))

    def to_dict(self) -> dict:
        return {"rtol": self.rtol, "atol": self.atol}


#: Significand bits (without the implicit one) of every floating dtype: fewer = less precise.
#: Complex dtypes count as their component dtype.
MANTISSA_BITS = {
    "float8_e8m0fnu": 0,
    "float8_e5m2": 2,
    "float8_e5m2fnuz": 2,
    "float8_e4m3fn": 3,
    "float8_e4m3fnuz": 3,
    "bfloat16": 7,
    "float16": 10,
    "complex32": 10,
    "float32": 23,
    "complex64": 23,
    "float64": 52,
    "complex128": 52,
}
COMPONENT_DTYPE = {"complex32": "float16", "complex64": "float32", "complex128": "float64"}
FLOAT8_DTYPES = tuple(name for name in MANTISSA_BITS if name.startswith("float8"))
#: the dtypes a user may name in --tol / a tolerance file
TOLERANCE_DTYPES = ("float64", "float32", "float16", "bfloat16", *FLOAT8_DTYPES, "exact")

#: The defaults. Reasoning and the measurements behind them: docs/compare.md.
DEFAULTS: dict[str, Tolerance] = {
    "float64": Tolerance(rtol=1e-10, atol=1e-12),
    "float32": Tolerance(rtol=2e-5, atol=1e-6),
    "float16": Tolerance(rtol=2e-3, atol=1e-5),
    "bfloat16": Tolerance(rtol=8e-3, atol=1e-5),
    # float8: one rounding is up to 2**-4 (e4m3) or 2**-3 (e5m2) relative; e8m0 holds powers of two
    **{name: Tolerance(rtol=6e-2, atol=1e-3) for name in ("float8_e4m3fn", "float8_e4m3fnuz")},
    **{name: Tolerance(rtol=1.2e-1, atol=1e-3) for name in ("float8_e5m2", "float8_e5m2fnuz")},
    "float8_e8m0fnu": Tolerance(rtol=0.5, atol=1e-3),
    # integers, bool and anything that is not floating point: equal or not
    "exact": Tolerance(rtol=0.0, atol=0.0),
}


@functools.lru_cache(maxsize=1024)  # a few dtype names, asked of every record
def tolerance_dtype(dtype_a: str, dtype_b: str) -> str:
    """The dtype whose tolerance judges a pair: the lower-precision floating side.

    A floating side beats an integer side (an int64 index tensor against a float one is a
    float comparison); two non-floating sides compare exactly.
    """
    bits_a = MANTISSA_BITS.get(dtype_a)
    bits_b = MANTISSA_BITS.get(dtype_b)
    if bits_a is None and bits_b is None:
        return "exact"
    if bits_b is None or (bits_a is not None and bits_a <= bits_b):
        chosen = dtype_a
    else:
        chosen = dtype_b
    return COMPONENT_DTYPE.get(chosen, chosen)


class Tolerances:
    """The tolerance table in force for one compare: defaults plus overrides. strict
    (``--strict``): the fixed tolerance decides alone; rounding envelopes are information only
    (rounding.py), and records without a partner fail a step."""

    def __init__(self, table: Mapping[str, Tolerance] | None = None, strict: bool = False):
        self.table = dict(DEFAULTS)
        if table:
            self.table.update(table)
        self.strict = strict

    def for_pair(self, dtype_a: str, dtype_b: str) -> tuple[str, Tolerance]:
        name = tolerance_dtype(dtype_a, dtype_b)
        return name, self.table[name]

    def to_dict(self) -> dict:
        return {name: tol.to_dict() for name, tol in self.table.items()}

    @classmethod
    def build(
        cls,
        rtol: float | None = None,
        atol: float | None = None,
        per_dtype: Iterable[str] = (),
        tol_file: str | None = None,
        overrides: Mapping[str, object] | None = None,
        strict: bool = False,
    ) -> "Tolerances":
        """Defaults < --rtol/--atol (every floating dtype) < tolerance file < --tol entries.

        ``overrides`` is the Python form: {"bfloat16": (rtol, atol) or {"rtol":..,"atol":..}}.
        """
        table = dict(DEFAULTS)
        for name, value in (("rtol", rtol), ("atol", atol)):
            if value is None:
                continue
            _check_number(value, f"--{name}")
            for dtype, tol in table.items():
                if dtype != "exact":
                    table[dtype] = Tolerance(
                        rtol=float(value) if name == "rtol" else tol.rtol,
                        atol=float(value) if name == "atol" else tol.atol,
                    )
        if tol_file is not None:
            table.update(load_tolerance_file(tol_file))
        if overrides:
            for dtype, value in overrides.items():
                table[_check_dtype(dtype, "tolerance override")] = _tolerance_from(
                    value, f"tolerance override {dtype!r}", table.get(dtype)
                )
        for entry in per_dtype:
            dtype, tol = parse_tol_option(entry)
            table[dtype] = tol
        return cls(table, strict)


def parse_tol_option(text: str) -> tuple[str, Tolerance]:
    """'bfloat16=1e-2,1e-5' -> ("bfloat16", Tolerance(0.01, 1e-05))."""
    name, sep, numbers = text.partition("=")
    parts = [p.strip() for p in numbers.split(",")]
    if not sep or len(parts) != 2 or not all(parts):
        raise ConfigError(
            f"--tol {text!r} is not DTYPE=RTOL,ATOL (for example --tol bfloat16=1e-2,1e-5)"
        )
    dtype = _check_dtype(name.strip(), "--tol")
    try:
        rtol, atol = float(parts[0]), float(parts[1])
    except ValueError:
        raise ConfigError(f"--tol {text!r}: RTOL and ATOL must be numbers") from None
    _check_number(rtol, f"--tol {text!r} rtol")
    _check_number(atol, f"--tol {text!r} atol")
    return dtype, Tolerance(rtol, atol)


def load_tolerance_file(path: str) -> dict[str, Tolerance]:
    """A YAML file ``{bfloat16: {rtol: 1e-2, atol: 1e-5}, float32: [1e-4, 1e-6]}``.

    A top-level ``tolerances:`` key holding that mapping is accepted too.
    """
    import yaml

    try:
        with open(path, encoding="utf-8") as handle:
            data = yaml.safe_load(handle)
    except FileNotFoundError:
        raise ConfigError(f"tolerance file {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"tolerance file {path} cannot be read: {error}") from None
    except yaml.YAMLError as error:
        line = getattr(getattr(error, "problem_mark", None), "line", None)
        where = f" (line {line + 1})" if line is not None else ""
        raise ConfigError(f"tolerance file {path} is not valid YAML{where}") from None
    if isinstance(data, dict) and set(data) == {"tolerances"}:
        data = data["tolerances"]
    if not isinstance(data, dict) or not data:
        raise ConfigError(
            f"tolerance file {path} must map dtype names to {{rtol: R, atol: A}}, "
            f"found {type(data).__name__}"
        )
    table = {}
    for dtype, value in data.items():
        where = f"tolerance file {os.fspath(path)} entry {dtype!r}"
        table[_check_dtype(str(dtype), where)] = _tolerance_from(value, where, DEFAULTS.get(str(dtype)))
    return table


def _tolerance_from(value, where: str, default: Tolerance | None) -> Tolerance:
    if isinstance(value, Tolerance):
        return value
    if isinstance(value, (list, tuple)) and len(value) == 2:
        rtol, atol = value
    elif isinstance(value, dict) and value and set(value) <= {"rtol", "atol"}:
        base = default or DEFAULTS["float32"]
        rtol, atol = value.get("rtol", base.rtol), value.get("atol", base.atol)
    else:
        raise ConfigError(f"{where} must be {{rtol: R, atol: A}} or [R, A], found {value!r}")
    _check_number(rtol, f"{where} rtol")
    _check_number(atol, f"{where} atol")
    return Tolerance(float(rtol), float(atol))


def _check_dtype(name: str, where: str) -> str:
    name = name.removeprefix("torch.")
    if name not in TOLERANCE_DTYPES:
        raise ConfigError(
            f"{where} names dtype {name!r}; allowed: {', '.join(TOLERANCE_DTYPES)}"
        )
    return name


def _check_number(value, where: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{where} must be a number >= 0, found {value!r}")
    if not math.isfinite(value) or value < 0:
        raise ConfigError(f"{where} must be a finite number >= 0, found {value!r}")
