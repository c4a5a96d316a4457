"""Assemble stage, drift rule: drift that stays within every op's rounding envelope passes.

Two correct runs that round differently (another device, thread count or attention kernel)
part over the optimizer's steps: AdamW turns rounding-noise gradients into lr-sized updates,
and a step later the parameters and what is computed from them differ beyond the fixed
tolerance. ``assemble.find_drift`` recognises that pattern (every divergence enters through
parameters the previous update wrote; nothing else enters). Such a pair exits 0 as rounding
only when, besides, every divergent output is within its rounding envelope: its own error
(what its inputs' differences do not explain) is no more than what its arithmetic may add
(verdict "within"), or its inputs' share is unbounded by what was recorded while no op of the
compare introduced an error ("unbounded"). A divergent output without an envelope (an op the
model does not know), a divergent record that is not inherited, or ``--strict`` keeps the
verdict diverged.

The settled rows are explained, origin ``rounding``, with the drift named in their cause, so
that counts, step verdicts, the headline ("PASS: the runs differ by rounding only") and
``--json`` all tell the same. Torch-free.
"""

from __future__ import annotations

from probe.comparison import result as R
from probe.comparison.result import count_rows
from probe.comparison.rounding import ROUNDING

#: envelope verdicts a drifting output may have (rounding.py, envelope.Envelope.judge)
_SETTLED = ("within", "unbounded")


def within_envelopes(rows) -> bool:
    """Every divergent record is an inherited input or an output within its envelope."""
    diverged = [row for row in rows if row.status == R.DIVERGED]
    if not diverged:
        return False
    for row in diverged:
        if row.io == "out":
            if row.envelope is None or row.envelope.get("verdict") not in _SETTLED:
                return False
        elif row.origin != R.INHERITED:
            return False
    return True


def settle(drift: dict, rows, steps_info: list[dict], strict: bool) -> str | None:
    """Explain the divergent rows of a drift that stays within the envelopes, and restate the
    step files' counts and verdicts; the note saying so, or None (nothing changed)."""
    if strict or drift is None or not within_envelopes(rows):
        return None
    settled = [row for row in rows if row.status == R.DIVERGED]
    for row in settled:
        envelope = row.envelope
        within = f"; {envelope['text']}" if envelope else ""
        row.explain(f"drift within its rounding envelope: grown over the earlier steps' optimizer updates from "
                     f"rounding{within}", ROUNDING)
    by_file: dict = {}
    for row in rows:
        by_file.setdefault((row.step, row.rank), []).append(row)
    for info in steps_info:
        info["counts"] = count_rows(by_file.get((info["step"], info["rank"]), []))
        info["verdict"] = None
    return (f"drift within rounding: the runs part through accumulated rounding from step {drift['step']} on "
            f"({len(settled)} records beyond the fixed tolerance, each within its rounding envelope, grown over the "
            "optimizer's updates); no op introduced an error. --strict judges by the fixed tolerance alone")
