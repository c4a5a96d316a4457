"""From both sides' replay of one call to a verdict: which side is right, who made the error.

    introduced by B   B's own error is beyond what rounding in its dtype explains (more than
                      ROUNDING_EXCESS times the larger of its dtype's epsilon and the noise that
                      rounding the inputs causes, see execute.py) and FAR times A's error:
                      B's kernel computed wrongly.
    precision         neither side is beyond its dtype's rounding, the sides' dtypes differ,
                      and the lower-precision side's own rounding is what parts the outputs
                      (its error is at least half their difference): same math, lower dtype.
    rounding          neither side is beyond its dtype's rounding: the output difference came
                      in through the inputs. "inherited" when the op passes it on at most
                      INHERITED_MAX times larger, "amplified" (with the factor) when it grows it
                      (Adam's division by sqrt(v), a cancelling subtraction), "own" when the
                      inputs agree and both sides simply round differently (thread count,
                      summation order), "enters" when the inputs that differ most are not
                      made by recorded ops (a parameter, a buffer, the data, or a tensor made
                      by a call the other run does not have): both sides compute faithfully,
                      and this op is where the difference enters the computation.
    not replayable    with the reason.

An op whose two sides are both far off the truth by a similar amount (an ill-conditioned
reduction) is rounding too: neither kernel is wrong more than the other.
"""

from __future__ import annotations

import math

from probe.replay.arguments import arguments_text, differing_arguments
from probe.replay.calls import epsilon
from probe.replay.execute import SideResult, rel_error

#: an op's own error up to this many times max(eps, noise) is rounding (a correctly rounded
#: elementwise result scores <= 1, a float32 reduction over 10^4 terms typically 1-4)
ROUNDING_EXCESS = 16.0
#: "introduced by X" also needs X's own error this many times the other side's
FAR = 8.0
#: up to this output/input difference ratio an op passes its input difference on ("inherited")
INHERITED_MAX = 2.0
#: sides whose errors are within this factor of each other are a tie for "closer"
TIE = 2.0

INTRODUCED_A, INTRODUCED_B = "introduced by A", "introduced by B"
#: the rounding kind of an op whose differing inputs come from outside the recorded ops
ENTERS = "enters"
_SOURCE_WORDS = {"param": "parameter", "external": "input", "changed": "input", "unpaired": "input"}
ROUNDING, PRECISION, NOT_REPLAYABLE = "rounding", "precision", "not replayable"
#: the two calls' non-tensor arguments differ: each side computed its own function
ARGUMENTS = "arguments differ"


def not_replayable(reason: str) -> dict:
    return {"verdict": NOT_REPLAYABLE, "error_a": None, "error_b": None, "ulp_a": None, "ulp_b": None,
            "closer": None, "reason": reason, "summary": f"not replayable: {reason}"}


def judge(a: SideResult, b: SideResult, sources: dict | None = None) -> dict:
    """The verdict dict reports carry (see the module docstring).

    sources: input slot -> where it came from ("param", "external", ...), for the inputs
    compare found were not made by a recorded op of this step: a difference they carry
    enters here, it is not inherited."""
    sources = sources or {}
    input_rel = _max_difference(a.inputs, b.inputs)
    carried_rel = _max_difference(a.inputs, b.inputs, skip=sources)
    entering = _largest_source(a.inputs, b.inputs, sources)
    output_rel = _max_difference(a.outputs, b.outputs)
    closer = _closer(a.error, b.error)
    data = {
        "verdict": ROUNDING, "error_a": a.error, "error_b": b.error, "ulp_a": a.ulp, "ulp_b": b.ulp,
        "closer": closer, "dtype_a": a.dtype, "dtype_b": b.dtype, "slot": b.slot if b.excess >= a.excess else a.slot,
        "noise_a": a.noise, "noise_b": b.noise, "excess_a": a.excess, "excess_b": b.excess,
        "input_rel": input_rel, "output_rel": output_rel, "amplification": None, "rounding": None,
    }
    if b.excess > ROUNDING_EXCESS and b.error > FAR * a.error:
        data["verdict"] = INTRODUCED_B
    elif a.excess > ROUNDING_EXCESS and a.error > FAR * b.error:
        data["verdict"] = INTRODUCED_A
    elif differing_arguments(a.arguments, b.arguments):
        # each side replayed with its own arguments: two functions, not one rounded twice
        data["verdict"] = ARGUMENTS
        data["arguments"] = differing_arguments(a.arguments, b.arguments)
    else:
        low = _lower_precision(a, b)
        if low is not None and output_rel is not None and low.error >= 0.5 * output_rel:
            data["verdict"] = PRECISION
            data["lower"] = "B" if low is b else "A"
        elif entering is not None and entering[1] > 0 and entering[1] >= (carried_rel or 0.0):
            slot, rel = entering
            data["rounding"], data["amplification"] = ENTERS, (output_rel / rel if output_rel is not None else None)
            data["enters_through"] = {"slot": slot, "source": sources[slot], "rel": rel}
        else:
            data["rounding"], data["amplification"] = _rounding_kind(input_rel, output_rel)
    data["summary"] = summary(data)
    return data


def summary(data: dict) -> str:
    """One line: the verdict and the numbers behind it."""
    verdict = data["verdict"]
    if verdict == NOT_REPLAYABLE:
        return f"not replayable: {data['reason']}"
    sides = f"off float64, A {_side(data, 'a')}, B {_side(data, 'b')}"
    closer = {"A": "A is closer to the truth", "B": "B is closer to the truth", "tie": "both equally close"}[data["closer"]]
    if verdict in (INTRODUCED_A, INTRODUCED_B):
        return f"{verdict}: {sides}; {closer}"
    if verdict == ARGUMENTS:
        return f"{arguments_text(data['arguments'])} (each side replayed with its own): {sides}"
    if verdict == PRECISION:
        low = data["lower"]
        dtype = data[f"dtype_{low.lower()}"]
        return f"precision: {low} rounds to {dtype}, within its rounding: {sides}; {closer}"
    kind = data["rounding"]
    if kind == "amplified":
        how = f"amplified x{data['amplification']:.3g} (inputs differ by {data['input_rel']:.1e}, outputs by {data['output_rel']:.1e})"
    elif kind == ENTERS:
        entry = data["enters_through"]
        what = _SOURCE_WORDS.get(entry["source"], entry["source"])
        how = (f"the difference enters here through {what} {entry['slot']} (differs by {entry['rel']:.1e}, "
               f"outputs by {data['output_rel']:.1e}); both sides compute faithfully")
    elif kind == "inherited":
        how = f"inherited x{data['amplification']:.3g} (inputs differ by {data['input_rel']:.1e}, outputs by {data['output_rel']:.1e})"
    else:
        how = "own: the inputs agree and the two sides round differently"
    return f"rounding, {how}: {sides}"


def _side(data: dict, side: str) -> str:
    text = f"{_ulps(data['ulp_' + side])} of {data['dtype_' + side]} (rel {data['error_' + side]:.1e}"
    noise = data.get("noise_" + side)
    if noise and noise > 2 * epsilon(data["dtype_" + side]):
        text += f"; rounding its inputs alone moves it {noise:.1e}"  # an ill-conditioned op
    return text + ")"


def _ulps(value: float) -> str:
    if value is None or math.isnan(value):
        return "? ulps"
    if math.isinf(value):
        return "inf ulps"
    return f"{value:.3g} ulps" if value < 1e4 else f"{value:.3e} ulps"


def _closer(error_a: float, error_b: float) -> str:
    if math.isnan(error_a) or math.isnan(error_b):
        return "tie"
    if error_a * TIE < error_b:
        return "A"
    if error_b * TIE < error_a:
        return "B"
    return "tie"


def _lower_precision(a: SideResult, b: SideResult) -> SideResult | None:
    eps_a, eps_b = epsilon(a.dtype), epsilon(b.dtype)
    if eps_a == eps_b:
        return None
    return b if eps_b > eps_a else a


def _rounding_kind(input_rel, output_rel) -> tuple[str, float | None]:
    if not input_rel or output_rel is None:
        return "own", None
    factor = output_rel / input_rel
    return ("amplified" if factor > INHERITED_MAX else "inherited"), factor


def _largest_source(side_a: dict, side_b: dict, sources: dict) -> tuple | None:
    """(slot, rel L2) of the source input that differs most, or None."""
    found = None
    for slot in sources:
        rel = _max_difference({slot: side_a[slot]}, side_b) if slot in side_a else None
        if rel is not None and (found is None or rel > found[1]):
            found = (slot, rel)
    return found


def _max_difference(side_a: dict, side_b: dict, skip=()) -> float | None:
    """Largest rel L2 of B against A over the slots both sides hold (same shape), or None."""
    worst = None
    for slot, tensor_a in side_a.items():
        if slot in skip:
            continue
        tensor_b = side_b.get(slot)
        if tensor_b is None or tensor_b.shape != tensor_a.shape:
            continue
        difference = rel_error(tensor_b, tensor_a)
        if worst is None or difference > worst:
            worst = difference
    return worst
