"""The HTML report's replay section (``probe compare --replay --html``); never imports torch.

One table: each replayed call, its roles (first divergence, likely cause, top op N), the
verdict, both sides' own errors against float64 (rel L2 and ulps), which side is closer,
and the one-line explanation. Kept apart from html_report.py's layout: render() adds it.
"""

from __future__ import annotations

import html

from probe.comparison import result as R
from probe.report.fmt import err, num

_CLASS = {"introduced by A": "diverged", "introduced by B": "diverged", "precision": "changed"}


def section(result: R.CompareResult) -> str:
    report = getattr(result, "replay", None)
    if report is None:
        return ""
    rows = []
    for call in report.calls:
        verdict = call["replay"]
        css = _CLASS.get(verdict["verdict"], "match")
        rows.append(
            f'<tr class="status-{css}"><td>{_e(call["call"])}</td><td>{_e(", ".join(call["roles"]))}</td>'
            f'<td>{_e(verdict["verdict"])}</td>{_num(verdict.get("error_a"), err)}{_num(verdict.get("error_b"), err)}'
            f'{_num(verdict.get("ulp_a"), num)}{_num(verdict.get("ulp_b"), num)}<td>{_e(verdict.get("closer") or "-")}</td>'
            f'<td>{_e(verdict.get("summary") or "")}</td></tr>'
        )
    data = report.to_dict()
    speed = f"{data['calls_per_s']} calls/s, {data['mb_per_s']} MB/s" if data["calls_per_s"] is not None else ""
    left = f"; {len(report.left)} calls left at the {report.budget_s:g} s budget" if report.left else ""
    return (
        '<h2 id="replay">Which side is right? (replay against float64)</h2>'
        '<p class="muted">Each call re-run in float64 on each side\'s own dumped inputs: error = rel L2 of the '
        "side's output against that truth, ulps in the output's dtype. "
        f"Replayed {data['replayed']} of {len(report.calls)} calls in {report.elapsed_s:.2f} s ({_e(speed)}){_e(left)}.</p>"
        '<table id="replay-table"><thead><tr><th>call</th><th>role</th><th>verdict</th><th>error A</th><th>error B</th>'
        "<th>ulps A</th><th>ulps B</th><th>closer</th><th>why</th></tr></thead>"
        f'<tbody>{"".join(rows)}</tbody></table>'
    )


def _e(value) -> str:
    return html.escape(str(value), quote=True)


def _num(value, fmt) -> str:
    if value is None:
        return '<td class="num">-</td>'
    return f'<td class="num" data-v="{value!r}">{_e(fmt(value))}</td>'
