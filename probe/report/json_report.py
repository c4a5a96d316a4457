"""``probe compare --json``: one JSON object on stdout (strict JSON: no NaN/Infinity).

Fields (docs/compare.md lists them all): verdict, headline, first_divergence, likely_cause,
counts, evidence, tolerances, top_ops, changes, steps, missing, notes, divergences (the first
MAX_DIVERGENCES divergent records in execution order), and with rows=True every aligned
record under "rows".
"""

from __future__ import annotations

import json

from probe.comparison import result as R

MAX_DIVERGENCES = 50


def to_dict(result: R.CompareResult, rows: bool = False) -> dict:
    from probe.report.terminal import verdict_line

    data = result.to_dict(rows=rows)
    # the terminal's first line, for logs and CI summaries
    data = {"verdict": data.pop("verdict"), "headline": verdict_line(result), **data}
    divergent = [row for row in result.rows if row.status == R.DIVERGED]
    data["divergences"] = [R.divergence_dict(row) for row in divergent[:MAX_DIVERGENCES]]
    data["divergences_total"] = len(divergent)
    return data


def render(result: R.CompareResult, rows: bool = False) -> str:
    """The JSON text, one object, newline-terminated."""
    return json.dumps(to_dict(result, rows=rows), indent=2, allow_nan=False) + "\n"
