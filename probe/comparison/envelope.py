"""The rounding envelope of one op: what rounding alone can make its output differ by.

Two correct runs of the same math (another device, thread count or kernel library) differ
because their kernels round in another order. How much depends on the op, and it can be
read from what a dump records, with no tensor needed:

* the **dtype** it computes in (the unit roundoff u: 2^-24 for float32, 2^-8 for bfloat16;
  a 16-bit op accumulates in float32 and rounds its result once to 16 bits; operands cast to
  a lower dtype on one side, autocast's casts, round once more);
* its **reduction length** K: a matmul's inner dimension, a convolution's C_in/groups x kh x kw,
  a normalization's or softmax's width, the number of values a sum adds up;
* its **conditioning**, from the recorded norms and extremes: for a product ||A|| ||B|| against
  ||AB||, for a sum sum|x| against |sum x| (the same when every value has one sign), for a
  division or square root the smallest denominator (eps included: Adam's sqrt(v) + eps).

Rounding alone (Higham and Mary, SIAM J. Sci. Comput. 41(5), 2019): a K-long dot product
computed in any order errs by at most about lambda sqrt(K) u sum|x_i y_i|, failing with
probability 2 exp(-lambda^2 / 2) = 3e-8 at lambda = 6. Over the elements of a matmul output,
by Cauchy-Schwarz row by row, the L2 norm of sum|x_i y_i| is at most ||x|| ||W||
(Frobenius). Two runs may err in opposite directions: the envelope of their difference is
twice one run's. An elementwise op (add, GELU, exp, division) is computed to within a few
ulps: ELEMENTWISE_ULPS u per element.

The envelope has two parts, both absolute L2 norms of the output's difference:

* ``rounding``: what the op's own arithmetic may add, in both runs (the bounds above);
* ``propagated``: what its inputs' recorded differences can make through it, from the
  sensitivity of the op to each input (||dy|| <= ||dx|| ||W|| + ||x|| ||dW|| for a product,
  ||dx|| / min|b| + max|a| ||db|| / min|b|^2 for a / b, sqrt(K) ||dx|| for a sum over K values),
  inf where the recorded values cannot bound it (a denominator whose sign the extremes do not fix).

The op's **own error** is what the inputs do not explain: measured - propagated. It is
"introduced" only when it exceeds FACTOR x rounding. docs/compare-rules.md derives the model
and gives its measured check. The formula of each op family is in op_envelopes.py; which
family an op is of, and which formula of it it takes, is its spec (ops.py). Torch-free and
numpy-free.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from probe.comparison.metrics import Best
from probe.comparison.structs import AMPLIFIED, EXPLAINED, FACTOR, PAIRED, RecordRow, sci

#: lambda of Higham and Mary's probabilistic bound: failure probability 2 exp(-lambda^2/2) = 3e-8
LAMBDA = 6.0
#: ulps an elementwise kernel may be off (libm erf/exp/tanh vectorised differently on two devices)
ELEMENTWISE_ULPS = 4.0
#: what the measured norms of a difference may be off by, relative: its own error must exceed this
#: share of what the inputs explain before it counts
MEASUREMENT_SLACK = 1e-3
#: two runs, each within its own envelope, differ by at most the sum of both
RUNS = 2.0

@dataclass
class Operand:
    """One recorded tensor of run A, with how much B's differs (abs L2; 0 when equal)."""

    numel: int
    norm: float
    min: float = math.nan
    max: float = math.nan
    mean: float = math.nan
    shape: tuple = ()
    dtype: str = ""
    err: float = 0.0

    @property
    def amax(self) -> float:
        """max |x| from the extremes (inf when not finite or unknown)."""
        values = [abs(v) for v in (self.min, self.max) if isinstance(v, (int, float))]
        return max(values) if values and all(math.isfinite(v) for v in values) else math.inf

    @property
    def amin(self) -> float:
        """A lower bound of min |x|: the extreme nearer 0 when every value has one sign, else 0."""
        if not (math.isfinite(self.min) and math.isfinite(self.max)):
            return 0.0
        if self.min > 0:
            return self.min
        if self.max < 0:
            return -self.max
        return 0.0

    @property
    def one_sign(self) -> bool:
        return math.isfinite(self.min) and math.isfinite(self.max) and (self.min >= 0 or self.max <= 0)


@dataclass
class Envelope:
    """What rounding alone can make one output differ by (absolute L2 norms)."""

    family: str
    k: int  # reduction length
    u: float  # unit roundoff of the output's dtype
    conditioning: float  # the factor the recorded values put on rounding (1 = well conditioned)
    rounding: float  # the op's own arithmetic, both runs
    propagated: float  # what the inputs' recorded differences make through the op
    parts: list = field(default_factory=list)  # (input slot, its share of propagated)

    @property
    def expected(self) -> float:
        return self.rounding + self.propagated

    def expected_without(self, slots) -> float:
        """What rounding alone makes when the inputs at these slots (divergent: not rounding)
        are left out of the propagated part."""
        dropped = sum(share for slot, share in self.parts if slot in slots)
        return self.rounding + max(0.0, self.propagated - dropped)

    def own_error(self, err: float) -> float:
        """The part of a measured difference its inputs' differences do not explain."""
        if not math.isfinite(self.propagated):
            return 0.0
        return max(0.0, err - self.propagated)

    def judge(self, low: float, high: float) -> str:
        """"within", "beyond", "uncertain" or "unbounded" (what the inputs make is unknown): the own error of a measured difference whose true
        size lies in [low, high] (an exact measurement: low == high) against FACTOR x rounding."""
        limit = FACTOR * self.rounding
        if not math.isfinite(self.propagated):  # the inputs' share is unknown: only a small gap is clear
            return "within" if high <= limit else "unbounded"
        # the norms are measured in floating point too: an exact op (a cat, rounding 0) whose
        # output differs by its inputs' difference plus a hair is not evidence of anything
        limit += MEASUREMENT_SLACK * self.propagated
        if low - self.propagated > limit:
            return "beyond"
        if high - self.propagated <= limit:
            return "within"
        return "uncertain"

    def gap(self, err: float, expected: float | None = None) -> float:
        """The measured difference in units of the expected one."""
        expected = self.expected if expected is None else expected
        if err == 0:
            return 0.0
        return err / expected if expected > 0 else math.inf

    def describe(self) -> str:
        """dot product, K=256, cond 12 (u 6.0e-08)."""
        bits = [self.family]
        if self.k > 1:
            bits.append(f"K={self.k}")
        if self.conditioning > 1.5:
            bits.append(f"cond {self.conditioning:.3g}")
        return ", ".join(bits)

    def to_dict(self) -> dict:
        return {"family": self.family, "k": self.k, "u": self.u, "conditioning": self.conditioning,
                "rounding": self.rounding, "propagated": self.propagated, "expected": self.expected}

    def report(self, band: tuple, divergent) -> dict:
        """What a row reports of its envelope (RecordRow.envelope): band, the (low, seen, high)
        of its measured difference, against what rounding alone makes here and upstream
        (divergent: the input slots whose difference is no rounding)."""
        low, seen, high = band
        expected = self.expected_without(divergent)
        return dict(self.to_dict(), expected=expected, seen=seen, low=low, high=high if math.isfinite(high) else None,
                    gap=self.gap(seen, expected), verdict=self.judge(low, high), text=expected_text(expected, seen),
                    divergent_inputs=sorted(divergent))


def with_baseline(env: Envelope | None, measured: float) -> Envelope:
    """The envelope a trusted second run measured: C - A at this output is what rounding made
    there, the op's own rounding and its inputs' together. It stands for the op's rounding
    (never below the model's); the model's part through the inputs is kept where it is bounded."""
    if env is None or not math.isfinite(env.propagated):
        family = env.family if env is not None else "measured"
        return Envelope(f"{family} (measured by the baseline)", env.k if env else 1, env.u if env else 0.0,
                        1.0, measured, 0.0, [])
    return Envelope(f"{env.family} (measured by the baseline)", env.k, env.u, env.conditioning,
                    max(env.rounding, measured), env.propagated, env.parts)


def expected_text(expected: float, seen: float) -> str:
    """expected from rounding: 3.1e-06, seen: 2.0e-06 (0.64x); never a ratio to 0 ("infx")."""
    if expected <= 0:  # an exact op (a copy): a ratio to nothing says nothing
        return f"expected from rounding: none (it rounds nothing), seen: {sci(seen)}"
    return f"expected from rounding: {sci(expected)}, seen: {sci(seen)} ({seen / expected:.2g}x)"


#: the uncertain outputs a note names
NAMED = 3


@dataclass
class EnvelopeFold:
    """The rounding envelopes over every output (assemble's summary), folded row by row."""

    outputs: int = 0
    rounding: int = 0
    uncertain: int = 0
    beyond: int = 0
    named: list = field(default_factory=list)  # [(ordinal, row)]: the first NAMED uncertain outputs
    worst: Best = field(default_factory=Best)  # the largest finite gap (amplified outputs aside)
    differ: bool = False
    measured: bool = True  # every size known from above
    settled: bool = True  # every gap within FACTOR x its envelope, or explained

    def add(self, row: RecordRow, ordinal: tuple) -> None:
        if row.status not in PAIRED:
            return
        if row.metrics is not None and row.metrics.bit_equal is False:
            self.differ = True
        envelope = row.envelope
        if envelope is None:
            return
        self.outputs += 1
        explained = row.status == EXPLAINED
        if math.isfinite(envelope["gap"]) and not (explained and row.origin == AMPLIFIED):
            self.worst.offer(envelope["gap"], ordinal, row)
        if envelope["seen"] > 0:
            self.differ = True
            self.measured = self.measured and envelope["high"] is not None
            self.settled = self.settled and (envelope["gap"] <= FACTOR or explained)
        if explained and row.origin == "uncertain":
            self.uncertain += 1
            self.named = sorted(self.named + [(ordinal, row)], key=lambda item: item[0])[:NAMED]
        self.beyond += envelope["verdict"] == "beyond"
        self.rounding += explained and row.origin == "rounding"

    def merge(self, other: "EnvelopeFold") -> None:
        for name in ("outputs", "rounding", "uncertain", "beyond"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.named = sorted(self.named + other.named, key=lambda item: item[0])[:NAMED]
        self.worst.merge(other.worst)
        self.differ, self.measured = self.differ or other.differ, self.measured and other.measured
        self.settled = self.settled and other.settled

    def summary(self, notes: list, strict: bool = False, baseline=None) -> dict | None:
        """{largest_gap, at, step, rank, differ, outputs, rounding, uncertain, beyond, strict,
        rounding_only, baseline}; None when no output has an envelope (ops the model does not
        know, dumps of values only). The note naming the uncertain outputs goes to notes."""
        if not self.outputs:
            return None
        worst = self.worst.item
        beyond = self.beyond
        summary = {
            "largest_gap": worst.envelope["gap"] if worst is not None else None,
            "at": worst.key if worst is not None else None,
            "step": worst.step if worst is not None else None,
            "rank": worst.rank if worst is not None else None,
            "differ": self.differ,
            "outputs": self.outputs,
            "rounding": self.rounding,
            "uncertain": self.uncertain,
            "beyond": beyond,
            "strict": strict,
            # the claim "rounding only" needs every size known from above (a statistics lower
            # bound without a sketch is not) and every gap within FACTOR x what rounding makes
            "rounding_only": self.differ and not beyond and self.measured and self.settled and not strict,
            "baseline": str(baseline) if baseline is not None else None,
        }
        if self.uncertain:
            count = self.uncertain
            shown = "; ".join(f"{row.key} at step {row.step} rank {row.rank} ({row.envelope['text']})"
                              for _, row in self.named)
            more = f" and {count - NAMED} more" if count > NAMED else ""
            notes.append(
                f"{count} output{'s are' if count != 1 else ' is'} uncertain: beyond the fixed "
                f"tolerance, and the sketch's band straddles {'their' if count != 1 else 'its'} rounding "
                f"envelope (not counted as divergences): {shown}{more}; the cause of each names the config line "
                "that dumps it as a tensor")
        return summary
