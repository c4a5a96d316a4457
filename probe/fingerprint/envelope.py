"""What rounding allows a tensor's gap between two runs, step by step (torch-free).

The gap of tensor t at step s is ||a - b|| / ||a||, a the reference run's tensor, measured
from the two fingerprints' sketches (comparison/sketch.py: an estimate with a chi-square
band, +-52% at k = 16, and a rounding floor below which the sketches see no difference).
||a|| is the largest norm of the reference's tensor over the last WINDOW steps and this one
(recent_norms): a gradient whose sum nearly cancels has a tiny norm for a step, but its
rounding stays the size of its usual terms, so what rounding allows is sized from that norm
too (measured on PPO: a new rollout's first step cut the policy's bias gradients to a seventh
of their norm, their gap rose to 6e-6 of the recent norm, under half of one step's rounding at
that size, and was called a jump while the floor was sized from the small norm).

Two questions, two rules:

* **Has t left its rounding envelope?** Yes when the gap's low end (the estimate times the
  band's lower factor) is above what one step of rounding can make on its own, the *fresh
  floor*: the sketch's own rounding floor, and never less than FRESH_ULPS units of the
  dtype's rounding (u * sqrt(n), n the tensor's size: a sum of n rounded terms), nor less
  than COMPUTE_ULPS units of the dtype the step *computed* in when that one is coarser (a
  float32 weight whose gradient bf16 autocast computed carries bf16's rounding). Two runs
  that only order their sums differently part this way sooner or later: training amplifies
  the last bits step after step.
* **Did t jump?** Yes when the gap's low end is above GROWTH times the largest high end
  (estimate times the band's upper factor) of t's gap over the WINDOW steps before, and
  above the fresh floor. Rounding grows a gap gradually (the runs drift apart by a factor
  per step set by the training's own sensitivity); a bug, a different formula or a
  changed value makes the gap appear or grow many times over in a single step. The sketch's
  uncertainty is counted against the claim: the low end now against the high end before.

GROWTH, WINDOW and COMPUTE_ULPS were measured (docs/fingerprints.md): pairs that differ only in summation
order (another thread count, emulated other-device rounding) never grew a tensor's gap by
more than a few times its recent maximum in one step; an injected change of one parameter
grows it from nothing (within the floor) to 1e-4 and more.

A NaN or Inf count that differs between the runs is a jump at once (the gap is infinite).
Once the runs' weights have parted, growth a tensor inherits from what it read is no jump
(inherit.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from probe.comparison import op_envelopes
from probe.comparison import sketch as sketch_estimate

#: a jump: the gap's low end above GROWTH x the high end of its recent maximum
GROWTH = 10.0
#: how many steps back "recent" reaches
WINDOW = 8
#: the fresh floor, in units of u * sqrt(numel)
FRESH_ULPS = 4.0
#: the fresh floor of a step computed in a coarser dtype (autocast), in units of that dtype's u:
#: rounding alone (sdpa vs eager attention, another device's summation order) stayed under 4 in
#: bf16 Llama training, an RMSNorm eps 10x larger reached 16 and more (docs/fingerprints.md)
COMPUTE_ULPS = 8.0

#: the dtypes a fingerprint names by their unit roundoff (op_envelopes holds every dtype's)
_NAMED = ("float64", "float32", "float16", "bfloat16")


def unit_roundoff(dtype: str) -> float:
    """A dtype's unit roundoff; float32's for a float dtype no table knows, 0 for integers."""
    found = op_envelopes.unit_roundoff(dtype)
    if found is not None:
        return found
    return 2.0 ** -24 if dtype.startswith("float") else 0.0


@dataclass
class Gaps:
    """One tensor's measured gap over steps (numpy arrays, one entry per step), relative to
    the reference's norm."""

    estimate: np.ndarray  # ||a - b|| / ||a|| (the sketch's raw estimate)
    low: np.ndarray  # the band's low end: what a claim of leaving or jumping uses
    high: np.ndarray  # the band's high end: what later steps are allowed to grow from
    fresh: np.ndarray  # the fresh floor: what one step of rounding makes on its own
    nonfinite: np.ndarray  # NaN/Inf counts differ: an infinite gap

    @property
    def outside(self) -> np.ndarray:
        return self.nonfinite | (self.low > self.fresh)


def measure(numbers_a: np.ndarray, sketch_a: np.ndarray, numbers_b: np.ndarray, sketch_b: np.ndarray,
            dtype: str, numel: int, recent: np.ndarray | None = None,
            compute_unit: np.ndarray | float | None = None) -> Gaps:
    """The gaps between two runs' fingerprints of one tensor over S steps: numbers (S, 6) as
    min, max, mean, norm, NaN count, Inf count; sketches (S, k), NaN where none. ``recent``:
    the norm the gap is relative to where it is larger than the step's own (recent_norms).
    ``compute_unit``: per step (or for all), the unit roundoff of the dtype the step computed
    in (compute_units; 0 or NaN: the tensor's own dtype)."""
    numbers_a, numbers_b = np.atleast_2d(numbers_a), np.atleast_2d(numbers_b)
    sketch_a, sketch_b = np.atleast_2d(sketch_a), np.atleast_2d(sketch_b)
    norm_a, norm_b = numbers_a[:, 3], numbers_b[:, 3]
    nonfinite = np.any(numbers_a[:, 4:6] != numbers_b[:, 4:6], axis=1)
    with np.errstate(all="ignore"):
        scale = np.where(np.isfinite(norm_a) & (norm_a != 0), np.abs(norm_a), np.abs(norm_b))
        if recent is not None:
            scale = np.maximum(scale, np.nan_to_num(np.abs(recent)))
        usable = np.isfinite(scale) & (scale > 0)
        scale = np.where(usable, scale, 1.0)
        k = sketch_a.shape[1]
        diff = sketch_a - sketch_b
        sketched = np.all(np.isfinite(diff), axis=1) & (k > 0)
        raw = np.sqrt(np.mean(np.where(np.isfinite(diff), diff, 0.0) ** 2, axis=1)) if k else np.zeros(len(scale))
        size_a, size_b = np.abs(np.nan_to_num(norm_a)), np.abs(np.nan_to_num(norm_b))
        if recent is not None:  # a sum that cancelled still rounds at the size of its terms
            usual = np.nan_to_num(np.abs(recent))
            size_a, size_b = np.maximum(size_a, usual), np.maximum(size_b, usual)
        floor = sketch_estimate.rounding_floor(dtype, size_a, dtype, size_b, numel)
        fresh_ulps = FRESH_ULPS * unit_roundoff(dtype) * math.sqrt(max(numel, 1))
        # no sketch: the norms' difference bounds the gap from below
        bound = np.abs(norm_a - norm_b) / scale
        estimate = np.where(sketched, raw / scale, bound)
        fresh = np.maximum(np.where(sketched, floor / scale, 0.0), fresh_ulps)
        if compute_unit is not None:
            computed = np.nan_to_num(np.asarray(compute_unit, dtype=np.float64))
            coarser = computed > unit_roundoff(dtype)
            fresh = np.maximum(fresh, np.where(coarser, COMPUTE_ULPS * computed, 0.0))
        lower, upper = sketch_estimate.band(k) if k else (1.0, 1.0)
        low = np.where(sketched, estimate * lower, estimate)
        high = np.where(sketched, estimate * upper, estimate)
    zero = ~usable & ~nonfinite
    for values in (estimate, low, high):
        values[zero] = 0.0
        values[nonfinite] = math.inf
    return Gaps(estimate, low, high, fresh, nonfinite)


def compute_units(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Per step, the coarser of the two runs' compute units (NaN where neither knows it)."""
    with np.errstate(invalid="ignore"):
        return np.fmax(np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64))


def dtype_of_unit(unit: float) -> str:
    """The dtype name of a unit roundoff ("bfloat16"); "" for 0 (none) or NaN (not known)."""
    for name in _NAMED:
        if unit == op_envelopes.unit_roundoff(name):
            return name
    return "" if not unit or unit != unit else f"a dtype of unit roundoff {unit:.1e}"


def recent_norms(norms: np.ndarray, window: int = WINDOW) -> np.ndarray:
    """Entry s: the reference tensor's largest norm over steps s - window .. s, what its gap
    is relative to. A gradient whose sum nearly cancels at one step has a small norm there,
    but its rounding error is still the size of its usual terms: relative to that small norm
    the same absolute difference would look like a jump."""
    norms = np.nan_to_num(np.abs(np.asarray(norms, dtype=np.float64)))
    return np.maximum(norms, recent_max(norms, window))


def allowed(fresh: np.ndarray, recent_high: np.ndarray, growth: float = GROWTH) -> np.ndarray:
    """The most rounding allows: the fresh floor, or GROWTH x the recent high end."""
    return np.maximum(fresh, growth * recent_high)


def recent_max(high: np.ndarray, window: int = WINDOW) -> np.ndarray:
    """Entry s: the largest high end over steps s - window .. s - 1 (0 at the first step)."""
    out = np.zeros_like(high)
    for shift in range(1, window + 1):
        if shift < len(high):
            np.maximum(out[shift:], high[:-shift], out=out[shift:])
    return out


class Tracker:
    """The same rules one step at a time (the live comparison): each tensor's recent high
    ends and recent norms."""

    def __init__(self, growth: float = GROWTH, window: int = WINDOW) -> None:
        self.growth = growth
        self.window = window
        self._recent: dict[str, list[float]] = {}
        self._norms: dict[str, list[float]] = {}

    def recent_norm(self, name: str, norm: float) -> float:
        """recent_norms for this step of this tensor (call once per step, before measure)."""
        norms = self._norms.setdefault(name, [])
        norms.append(abs(norm) if math.isfinite(norm) else 0.0)
        if len(norms) > self.window + 1:
            del norms[0]
        return max(norms)

    def judge(self, name: str, gaps: Gaps) -> tuple[bool, bool, float]:
        """(outside, jumped, allowed) of a one-step Gaps."""
        recent = self._recent.setdefault(name, [])
        before = max(recent) if recent else 0.0
        limit = float(allowed(gaps.fresh, np.asarray([before]), self.growth)[0])
        jumped = bool(gaps.nonfinite[0] or gaps.low[0] > limit)
        recent.append(float(gaps.high[0]))  # within the floor too: drift crossing it is no jump
        if len(recent) > self.window:
            del recent[0]
        return bool(gaps.outside[0]), jumped, limit


__all__ = ["Gaps", "Tracker", "measure", "allowed", "recent_max", "recent_norms", "GROWTH", "WINDOW", "FRESH_ULPS",
           "COMPUTE_ULPS", "unit_roundoff", "compute_units", "dtype_of_unit"]
