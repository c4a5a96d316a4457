"""Result stage: is the whole gap between the runs what rounding alone makes?

Every output the judge gave a rounding envelope (rounding.py) says how its measured
difference compares with what rounding alone can make it differ by (``gap``: seen over
expected). A compare that passes while the runs differ at all differs by rounding only, and
its headline says so with the largest gap; the outputs judged rounding or uncertain are
counted, and each uncertain one is named in a note with the config line that decides it.
Torch-free.
"""

from __future__ import annotations

import math

from probe.comparison import result as R
from probe.comparison.envelope import FACTOR

#: how many uncertain outputs the note names by key
NAMED = 3


def summarize(rows, notes: list, strict: bool = False, baseline=None) -> dict | None:
    """{largest_gap, at, step, rank, differ, outputs, rounding, uncertain, beyond, strict,
    rounding_only, baseline}; None when no output has an envelope (ops the model does not
    know, dumps of values only)."""
    judged = [row for row in rows if row.envelope is not None and row.status in R.PAIRED]
    if not judged:
        return None
    # outputs the judge explained by their inputs' accepted differences through the op's
    # conditioning (amplified) are settled by that rule, not by their envelope's gap
    gapped = [row for row in judged if math.isfinite(row.envelope["gap"])
              and not (row.status == R.EXPLAINED and row.origin == R.AMPLIFIED)]
    worst = max(gapped, key=lambda row: row.envelope["gap"], default=None)
    differ = any(row.envelope["seen"] > 0 for row in judged) or any(
        row.metrics is not None and row.metrics.bit_equal is False for row in rows if row.status in R.PAIRED)
    uncertain = [row for row in judged if row.status == R.EXPLAINED and row.origin == "uncertain"]
    beyond = [row for row in judged if row.envelope["verdict"] == "beyond"]
    # the claim "rounding only" needs every size known from above (a statistics lower bound
    # without a sketch is not) and every gap within FACTOR x what rounding makes
    measured = all(row.envelope["high"] is not None for row in judged if row.envelope["seen"] > 0)
    settled = all(row.envelope["seen"] == 0 or row.envelope["gap"] <= FACTOR or row.status == R.EXPLAINED
                  for row in judged)
    summary = {
        "largest_gap": worst.envelope["gap"] if worst is not None else None,
        "at": worst.key if worst is not None else None,
        "step": worst.step if worst is not None else None,
        "rank": worst.rank if worst is not None else None,
        "differ": differ,
        "outputs": len(judged),
        "rounding": sum(1 for row in judged if row.status == R.EXPLAINED and row.origin == "rounding"),
        "uncertain": len(uncertain),
        "beyond": len(beyond),
        "strict": strict,
        "rounding_only": differ and not beyond and measured and settled and not strict,
        "baseline": str(baseline) if baseline is not None else None,
    }
    if uncertain:
        shown = "; ".join(f"{row.key} at step {row.step} rank {row.rank} ({row.envelope['text']})"
                          for row in uncertain[:NAMED])
        more = f" and {len(uncertain) - NAMED} more" if len(uncertain) > NAMED else ""
        notes.append(
            f"{len(uncertain)} output{'s are' if len(uncertain) != 1 else ' is'} uncertain: beyond the fixed "
            f"tolerance, and the sketch's band straddles {'their' if len(uncertain) != 1 else 'its'} rounding "
            f"envelope (not counted as divergences): {shown}{more}; the cause of each names the config line "
            "that dumps it as a tensor")
    return summary


def headline(summary: dict | None) -> str:
    """"the runs differ by rounding only (largest gap 0.4x its envelope)", or "" unless the runs
    differ, every output's size is known from above (tensors, sketches), none is beyond its
    envelope (a pass only by the fixed tolerance) or more than FACTOR x it without another
    explanation, and --strict did not ask for the fixed tolerance alone."""
    if not summary or not summary["rounding_only"] or summary["largest_gap"] is None:
        return ""
    uncertain = f"; {summary['uncertain']} uncertain" if summary["uncertain"] else ""
    measured = " measured by the baseline" if summary.get("baseline") else ""
    return (f"the runs differ by rounding only (largest gap {summary['largest_gap']:.2g}x its envelope{measured}"
            f"{uncertain})")
