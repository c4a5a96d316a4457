"""Renderers of a fingerprint compare (FingerprintResult): terminal text, JSON, HTML.

They only read the result (torch-free). The HTML is one self-contained file: per tensor that
matters (those that jumped first, then the largest gaps), the relative gap per step on a log
scale against its envelope band (what rounding allowed that step), as inline SVG.
"""

from __future__ import annotations

import html
import json
import math

from probe.comparison.structs import json_safe
from probe.fingerprint import envelope
from probe.fingerprint.compare import FingerprintResult, config_text

_SHOWN = 8


def _g(value) -> str:
    if value is None:
        return "-"
    if value == math.inf:
        return "inf"
    return f"{value:.2e}" if value else "0"


def _compute_line(result: FingerprintResult) -> list[str]:
    """How the steps computed, when autocast made some coarser than their tensors' dtype."""
    sides = [result.compute.get(side, []) for side in ("a", "b")]
    coarse = [name for name in dict.fromkeys(sides[0] + sides[1]) if name]
    if not coarse:
        return []

    def said(names: list) -> str:
        return ", ".join(name or "off" for name in names) or "not recorded"

    unit = max(envelope.unit_roundoff(name) for name in coarse)
    return [f"autocast: A {said(sides[0])}, B {said(sides[1])}; a tensor of a finer dtype is "
            f"allowed the rounding of {envelope.dtype_of_unit(unit)} "
            f"({envelope.COMPUTE_ULPS:g} x {unit:.1e})"]


def terminal(result: FingerprintResult) -> str:
    lines = [f"fingerprints of rank {result.rank}: A {result.a}", f"{' ' * (16 + len(str(result.rank)))}B {result.b}",
             f"{len(result.steps)} common steps ({result.steps[0]}-{result.steps[-1]}), "
             f"{len(result.series)} tensors compared", *_compute_line(result), ""]
    if result.parting_step is None:
        lines.append("PASS: every parameter, gradient and optimizer-state tensor stays within rounding "
                     "at every common step")
    elif result.parting_kind == "drift":
        first = result.parting_tensors[0]
        lines.append(f"The runs part at step {result.parting_step} by DRIFT: accumulated rounding, no "
                     "tensor grew by more than rounding allows in one step.")
        lines.append(f"  first outside its envelope: {first.name} (gap {_g(first.gap)}, one step of "
                     f"rounding makes {_g(first.fresh)})")
    if result.jump_step is not None:
        if result.parting_kind == "jump":
            lines.append(f"The runs part at step {result.jump_step} with a JUMP: the gap grew by more "
                         "than rounding allows in one step.")
        else:
            lines.append(f"Then a JUMP at step {result.jump_step}: the gap grew by more than rounding "
                         "allows in one step.")
        lines.append("Jumped first (largest jump first):")
        width = max(len(t.name) for t in result.jumped[:_SHOWN])
        for t in result.jumped[:_SHOWN]:
            times = "inf" if t.ratio == math.inf else f"{t.ratio:.0f}"
            lines.append(f"  {t.name:<{width}}  gap {_g(t.gap)}  rounding allowed {_g(t.allowed)}  (x{times})")
        if len(result.jumped) > _SHOWN:
            lines.append(f"  ... and {len(result.jumped) - _SHOWN} more")
        step = result.jump_step
        position = result.steps.index(step)
        lines.append(f"loss at step {step}: A {_g(result.loss_a[position])}  B {_g(result.loss_b[position])}")
    elif result.parting_step is not None:
        lines.append("No jump: this is what summing in another order does to a training run (verdict pass).")
    lines += _inherited_lines(result)
    configs = result.dump_configs()
    if configs is not None:
        step = result.jump_step if result.jump_step is not None else result.parting_step
        lines += ["", f"To name the op, dump step {step} in full in both runs (for deterministic runs "
                  "this reproduces the step):",
                  f"  run A with: {json.dumps(configs[0])}",
                  f"  run B with: {json.dumps(configs[1])}",
                  f"  then: probe compare {configs[0]['dump_path']} {configs[1]['dump_path']}"]
    notes = []
    if result.only_a_steps or result.only_b_steps:
        notes.append(f"steps only in A: {len(result.only_a_steps)}, only in B: {len(result.only_b_steps)} "
                     "(not compared)")
    if result.only_a_tensors or result.only_b_tensors:
        notes.append(f"tensors only in A: {', '.join(result.only_a_tensors[:5]) or '-'}; only in B: "
                     f"{', '.join(result.only_b_tensors[:5]) or '-'} (not compared)")
    if notes:
        lines += [""] + [f"note: {note}" for note in notes]
    lines.append(f"verdict: {result.verdict}")
    return "\n".join(lines) + "\n"


def _inherited_lines(result: FingerprintResult) -> list[str]:
    """Where tensors grew faster than rounding from what had already parted (no jump)."""
    if result.inherited_step is None or (result.jump_step is not None and result.jump_step <= result.inherited_step):
        return []
    first = result.inherited[0]
    times = "inf" if first.ratio == math.inf else f"{first.ratio:.0f}"
    return [f"From step {result.inherited_step} some tensors grow by more than rounding allows in one step "
            f"({first.name} x{times}, {len(result.inherited)} in all), each from what it read that had "
            "already parted: a gradient from parted weights (and the data a parted model made), a state "
            "from such a gradient, a parameter from such a state. Inherited, not a jump."]


def as_json(result: FingerprintResult) -> str:
    # an infinite gap (NaN/Inf on one side) is "inf", a NaN null
    return json.dumps(json_safe(result.to_dict(), nan=None), indent=2, allow_nan=False) + "\n"


def _shown_series(result: FingerprintResult) -> list:
    by_name = {s.name: s for s in result.series}
    picked = [by_name[t.name] for t in result.jumped[:_SHOWN] if t.name in by_name]
    rest = sorted(result.series, key=lambda s: max((g for g in s.gap if g is not None), default=0), reverse=True)
    for series in rest:
        if len(picked) >= _SHOWN:
            break
        if series not in picked:
            picked.append(series)
    return picked


def _chart(series, steps: list, mark: int | None) -> str:
    width, height, pad = 640, 160, 40
    stride = max(1, len(steps) // 800)
    points = list(range(0, len(steps), stride))
    values = [v for v in series.gap + series.allowed if v and v > 0 and v != math.inf]
    top = math.log10(max(values)) + 0.5 if values else 0.0
    bottom = math.log10(min(values)) - 0.5 if values else -8.0
    bottom = min(bottom, top - 1)

    def x(i):
        return pad + (width - 2 * pad) * (i / max(len(steps) - 1, 1))

    def y(v):
        if v is None or v <= 0:
            return height - pad
        v = min(math.log10(v) if v != math.inf else top, top)
        return pad / 2 + (height - 1.5 * pad) * (top - v) / (top - bottom)

    band = " ".join(f"{x(i):.1f},{y(series.allowed[i]):.1f}" for i in points)
    band = f"{x(points[0]):.1f},{height - pad} {band} {x(points[-1]):.1f},{height - pad}"
    line = " ".join(f"{x(i):.1f},{y(series.gap[i]):.1f}" for i in points)
    parts = [f'<svg width="{width}" height="{height}" xmlns="http://www.w3.org/2000/svg">',
             f'<polygon points="{band}" fill="#cde" stroke="none"><title>rounding envelope</title></polygon>',
             f'<polyline points="{line}" fill="none" stroke="#c33" stroke-width="1.2"><title>gap</title></polyline>',
             f'<line x1="{pad}" y1="{height - pad}" x2="{width - pad}" y2="{height - pad}" stroke="#888"/>']
    for exponent in range(math.ceil(bottom), math.floor(top) + 1):
        parts.append(f'<text x="2" y="{y(10.0 ** exponent) + 4:.1f}" font-size="10">1e{exponent}</text>')
    parts.append(f'<text x="{pad}" y="{height - pad + 14}" font-size="10">step {steps[0]}</text>')
    parts.append(f'<text x="{width - pad - 60}" y="{height - pad + 14}" font-size="10">step {steps[-1]}</text>')
    if mark is not None and mark in steps:
        at = x(steps.index(mark))
        parts.append(f'<line x1="{at:.1f}" y1="0" x2="{at:.1f}" y2="{height - pad}" stroke="#333" '
                     f'stroke-dasharray="3,3"/><text x="{at + 3:.1f}" y="10" font-size="10">step {mark}</text>')
    parts.append("</svg>")
    return "".join(parts)


def render_html(result: FingerprintResult) -> str:
    mark = result.jump_step if result.jump_step is not None else result.parting_step
    body = [f"<h1>Where the runs part: {html.escape(result.verdict)}</h1>",
            f"<pre>{html.escape(terminal(result))}</pre>",
            "<p>Each chart: a tensor's relative gap ||a-b||/||a|| per step (red, log scale) against its "
            "rounding envelope (blue band: what rounding allowed that step).</p>"]
    for series in _shown_series(result):
        body.append(f"<h3>{html.escape(series.name)} ({html.escape(series.kind)})</h3>")
        body.append(_chart(series, result.steps, mark))
    configs = result.dump_configs()
    if configs is not None:
        body.append("<h2>Dump that step in full</h2>")
        body.append(f"<pre>A: {html.escape(config_text(configs[0]))}\nB: {html.escape(config_text(configs[1]))}</pre>")
    return ("<!DOCTYPE html><html><head><meta charset=\"utf-8\"><title>probe fingerprints</title>"
            "<style>body{font-family:sans-serif;margin:2em}pre{background:#f6f6f6;padding:1em}</style>"
            "</head><body>" + "\n".join(body) + "</body></html>\n")


__all__ = ["terminal", "as_json", "render_html"]
