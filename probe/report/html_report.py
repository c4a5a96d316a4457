"""``probe compare --html FILE``: one self-contained page (inline SVG, CSS and JS; no assets).

The page shows the verdict, a chart of the error score of every compared output record
along A's execution order (forward and backward as they ran; score > 1 is beyond
tolerance) with the first divergence marked, the ops that introduce the most error, and a
sortable, filterable table of the records.

Layout rules (scripts/check_html.py checks them in a real browser): the page never scrolls
sideways in a 1400 px window (the tables have a fixed layout; long names wrap, the full text
is in each cell's title); chart labels sit outside the plot area, in their own rows, and a
label that would overlap its neighbour is left out (its line keeps a tooltip); infinite
scores are drawn in their own "inf" lane above the plot; without JavaScript the diverged
records come first and the page says that filtering needs JavaScript.
"""

from __future__ import annotations

import html
import json
import math

from probe.comparison import result as R
from probe.comparison.result import where_text
from probe.report import replay_html, terminal
from probe.report.fmt import err, num

MAX_POINTS = 4000  # chart points; more rows are bucketed (the worst of each bucket is kept)
MAX_TABLE_ROWS = 3000  # table rows: divergent and unmatched first, then the rest in order
WIDTH, HEIGHT = 1000, 360
LEFT, RIGHT, TOP, BOTTOM = 60, 20, 64, 40
#: y of the lane for infinite scores (above the plot), and of the two label rows above it
INF_LANE = TOP - 18
LABEL_ROWS = (14, 30)
CHAR_WIDTH = 6.2  # px per character of an 11 px label, to keep labels apart
Y_FLOOR = 1e-4

_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:24px;color:#222}
h1{font-size:20px;margin:0 0 4px} h2{font-size:16px;margin:24px 0 8px}
.pass{color:#1a7f37}.diverged{color:#c62828} .muted{color:#666;font-size:13px}
table{border-collapse:collapse;font-size:12px;width:100%} #records{table-layout:fixed}
th,td{border-bottom:1px solid #e3e3e3;padding:3px 6px;text-align:left;vertical-align:top;overflow-wrap:anywhere;overflow:hidden}
dd{overflow-wrap:anywhere;margin:0} h1{overflow-wrap:anywhere}
.controls[hidden]{display:none} #run-differences li{font-size:13px}
th{background:#f6f8fa;cursor:pointer;position:sticky;top:0;user-select:none}
th.sorted-asc::after{content:" \\25B2"} th.sorted-desc::after{content:" \\25BC"}
tr.status-diverged td{background:#fdecea} tr.status-changed td{background:#fff8e1} tr.status-only_a td,tr.status-only_b td{background:#f3f3f3;color:#555}
tr.first td{outline:2px solid #c62828}
td.num{text-align:right;font-variant-numeric:tabular-nums}
#records col.n{width:3.8em} #records col.s{width:5.8em} #records col.m{width:7em} #records col.w{width:16%}
#records col.t{width:9%} #records col.x{width:6.5em}
.controls{margin:8px 0;font-size:13px} .controls input{width:240px}
.legend span{margin-right:14px;font-size:12px} .dot{display:inline-block;width:9px;height:9px;border-radius:50%}
dl{display:grid;grid-template-columns:max-content auto;gap:2px 12px;font-size:13px} dt{color:#555}
svg text{font-size:11px;fill:#444}
"""

_JS = """
(function(){
  var table=document.getElementById('records'); if(!table) return;
  var body=table.tBodies[0], heads=table.tHead.rows[0].cells;
  function key(row,i,num){var c=row.cells[i];var v=c.getAttribute('data-v');
    if(num){var x=parseFloat(v===null?c.textContent:v);return isNaN(x)?-Infinity:x;}
    return (v===null?c.textContent:v).toLowerCase();}
  for(var i=0;i<heads.length;i++){(function(i){heads[i].addEventListener('click',function(){
    var num=heads[i].getAttribute('data-type')==='num';
    var asc=!heads[i].classList.contains('sorted-asc');
    for(var j=0;j<heads.length;j++){heads[j].classList.remove('sorted-asc','sorted-desc');}
    heads[i].classList.add(asc?'sorted-asc':'sorted-desc');
    var rows=Array.prototype.slice.call(body.rows);
    rows.sort(function(a,b){var x=key(a,i,num),y=key(b,i,num);return (x<y?-1:x>y?1:0)*(asc?1:-1);});
    rows.forEach(function(r){body.appendChild(r);});});})(i);}
  var text=document.getElementById('filter-text'), status=document.getElementById('filter-status');
  var note=document.getElementById('not-shown'), left=JSON.parse(note.getAttribute('data-left'));
  document.getElementById('controls').hidden=false;
  // the page starts with the diverged records first (for readers without JS): back to execution order
  var ordered=Array.prototype.slice.call(body.rows);
  ordered.sort(function(a,b){return parseInt(a.cells[0].textContent)-parseInt(b.cells[0].textContent);});
  ordered.forEach(function(r){body.appendChild(r);});
  function apply(){var t=text.value.toLowerCase(), s=status.value, shown=0;
    Array.prototype.forEach.call(body.rows,function(r){
      var ok=(!t||r.textContent.toLowerCase().indexOf(t)>=0)&&(!s||r.getAttribute('data-status')===s||(s==='unmatched'&&/^only_/.test(r.getAttribute('data-status'))));
      r.style.display=ok?'':'none'; if(ok) shown++;});
    document.getElementById('shown').textContent=shown;
    var n=s?(left[s]||0):left.all, what=s?({unmatched:'records without partner'}[s]||s+' records'):'records';
    note.textContent=n?(n+' '+what+' not in this page'+(t?' (the text filter searches only the records in this page)':'')+'; probe compare --csv lists every record.'):'';
    note.hidden=!n;}
  text.addEventListener('input',apply); status.addEventListener('change',apply); apply();
})();
"""


def _e(value) -> str:
    return html.escape(str(value), quote=True)


def _fmt(value) -> str:
    return num(value)


def _chart_rows(result: R.CompareResult) -> list[R.RecordRow]:
    return [row for row in result.rows if row.io == "out" or row.divergence in (R.PARAM, R.ARGUMENT)]


def _bucket(points: list[tuple[int, R.RecordRow]], keep) -> list[tuple[int, R.RecordRow]]:
    if len(points) <= MAX_POINTS:
        return points
    size = math.ceil(len(points) / MAX_POINTS)
    chosen = []
    for start in range(0, len(points), size):
        bucket = points[start : start + size]
        chosen.append(max(bucket, key=lambda p: (p[1] is keep, _score(p[1]))))
    return chosen


def _score(row: R.RecordRow) -> float:
    if row.score is None or (isinstance(row.score, float) and math.isnan(row.score)):
        return -1.0
    return row.score


def chart_svg(result: R.CompareResult) -> str:
    rows = _chart_rows(result)
    first = result.first_divergence
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    finite = [r.score for r in rows if r.score is not None and math.isfinite(r.score) and r.score > 0]
    top = max([10.0] + [s * 2 for s in finite])
    y_max = 10 ** math.ceil(math.log10(top))
    lo, hi = math.log10(Y_FLOOR), math.log10(y_max)
    n = max(len(rows), 1)

    def x_of(i):
        return LEFT + (plot_w * (i + 0.5) / n)

    def y_of(score):
        if score is None or (isinstance(score, float) and math.isnan(score)):
            return TOP + plot_h
        if math.isinf(score):
            return INF_LANE
        value = math.log10(max(score, Y_FLOOR))
        return TOP + plot_h * (1 - (value - lo) / (hi - lo))

    labels = _LabelRows()

    parts = [
        f'<svg id="error-chart" xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {WIDTH} {HEIGHT}" '
        f'width="100%" role="img" aria-label="error score along execution order">',
        f'<rect x="{LEFT}" y="{TOP}" width="{plot_w}" height="{plot_h}" fill="#fff" stroke="#ccc"/>',
    ]
    exponent = int(lo)
    while exponent <= hi:
        y = y_of(10.0**exponent)
        parts.append(f'<line x1="{LEFT}" x2="{LEFT + plot_w}" y1="{y:.1f}" y2="{y:.1f}" stroke="#eee"/>')
        label = f"1e{exponent}" if exponent > lo else f"\u22641e{exponent}"
        if exponent == 0:  # the tolerance: labelled on the axis, where no point can cover it
            parts.append(f'<text x="{LEFT - 6}" y="{y + 4:.1f}" text-anchor="end" fill="#c62828">tol 1</text>')
        else:
            parts.append(f'<text x="{LEFT - 6}" y="{y + 4:.1f}" text-anchor="end">{label}</text>')
        exponent += 1
    if any(r.score is not None and isinstance(r.score, float) and math.isinf(r.score) for r in rows):
        parts.append(f'<line class="inf-lane" x1="{LEFT}" x2="{LEFT + plot_w}" y1="{INF_LANE}" y2="{INF_LANE}" '
                     'stroke="#c62828" stroke-dasharray="1,3"/>')
        parts.append(f'<text x="{LEFT - 6}" y="{INF_LANE + 4}" text-anchor="end" fill="#c62828">inf</text>')
    # the first divergence's label first: it wins its row over step labels
    if first is not None and first in rows:
        x = x_of(rows.index(first))
        parts.append(f'<line id="first-divergence" x1="{x:.1f}" x2="{x:.1f}" y1="{TOP}" y2="{TOP + plot_h}" stroke="#c62828" stroke-width="1.5"/>')
        text = f"first divergence: {first.module or '<root>'} {first.op} ({first.phase}, {first.slot})"
        parts.append(labels.place(text, x, row=1, fill="#c62828", ident="first-divergence-label"))
    # step-file boundaries
    previous = None
    for i, row in enumerate(rows):
        if (row.step, row.rank) != previous and previous is not None:
            x = x_of(i) - plot_w / n / 2
            text = f"step {row.step} rank {row.rank}"
            parts.append(f'<line class="step-boundary" x1="{x:.1f}" x2="{x:.1f}" y1="{TOP}" y2="{TOP + plot_h}" '
                         f'stroke="#999" stroke-dasharray="2,3"><title>{_e(text)}</title></line>')
            parts.append(labels.place(text, x, row=0, anchor="start"))
        previous = (row.step, row.rank)
    tol_y = y_of(1.0)
    parts.append(f'<line id="tolerance-line" x1="{LEFT}" x2="{LEFT + plot_w}" y1="{tol_y:.1f}" y2="{tol_y:.1f}" stroke="#c62828" stroke-dasharray="6,4"><title>tolerance (score 1)</title></line>')
    points = _bucket(list(enumerate(rows)), first)
    for i, row in points:
        x, y = x_of(i), y_of(row.score)
        label = _e(f"{row.key} [{row.status}] score {_fmt(row.score)}" + (f" {row.origin}" if row.origin else ""))
        if row.status in (R.ONLY_A, R.ONLY_B):
            parts.append(f'<path class="pt unmatched" d="M{x:.1f},{TOP + plot_h - 1:.1f} l-3,-6 l6,0 z" fill="#999"><title>{label}</title></path>')
            continue
        color = "#1f6feb" if row.phase == "forward" else "#e36209"
        if isinstance(row.score, float) and math.isinf(row.score):  # in the inf lane, as a triangle
            parts.append(f'<path class="pt {row.phase} diverged inf" d="M{x:.1f},{y - 4:.1f} l-4,7 l8,0 z" '
                         f'fill="{color}" stroke="#8b0000"><title>{label}</title></path>')
            continue
        if row.status == R.DIVERGED:  # beyond tolerance: bigger, with a dark red ring
            parts.append(f'<circle class="pt {row.phase} diverged" cx="{x:.1f}" cy="{y:.1f}" r="3.4" fill="{color}" '
                         f'stroke="#8b0000" stroke-width="1.2"><title>{label}</title></circle>')
        else:
            parts.append(f'<circle class="pt {row.phase}" cx="{x:.1f}" cy="{y:.1f}" r="2.4" fill="{color}"><title>{label}</title></circle>')
    parts.append(f'<text x="{LEFT + plot_w / 2:.0f}" y="{HEIGHT - 8}" text-anchor="middle">records in execution order of A (outputs; forward blue, backward orange, no partner grey)</text>')
    parts.append(f'<text transform="translate(14,{TOP + plot_h / 2:.0f}) rotate(-90)" text-anchor="middle">error score (log)</text>')
    parts.append("</svg>")
    return "\n".join(parts)


class _LabelRows:
    """Places chart labels in the rows above the plot; a label that would overlap one already
    in its row is left out (returns "")."""

    def __init__(self):
        self.taken: dict[int, list[tuple[float, float]]] = {}

    def place(self, text: str, x: float, row: int, anchor: str | None = None, fill: str = "#444",
              ident: str = "") -> str:
        width = len(text) * CHAR_WIDTH
        if anchor is None:  # near the right edge, the label grows to the left
            anchor = "start" if x + 4 + width <= WIDTH - RIGHT else "end"
        start = x + 4 if anchor == "start" else x - 4 - width
        start = max(start, 0.0)
        span = (start, start + width)
        if any(span[0] < end + 8 and begin < span[1] + 8 for begin, end in self.taken.get(row, [])):
            return ""
        self.taken.setdefault(row, []).append(span)
        x_text = x + 4 if anchor == "start" else x - 4
        attribute = f' id="{ident}"' if ident else ""
        return (f'<text{attribute} class="chart-label" x="{max(x_text, 0):.1f}" y="{LABEL_ROWS[row]}" '
                f'text-anchor="{anchor}" fill="{fill}">{_e(text)}</text>')


#: table order without JavaScript: the records a reader looks for first
_STATUS_ORDER = {R.DIVERGED: 0, "changed": 1, R.ONLY_A: 2, R.ONLY_B: 2}


def _filter_key(status: str) -> str:
    return "unmatched" if status in (R.ONLY_A, R.ONLY_B) else status


def _table_rows(result: R.CompareResult) -> tuple[list[tuple[int, R.RecordRow]], dict]:
    """(rows in the page, diverged first then in execution order; records left out of the
    page: {"all": n, status filter value: n})."""
    numbered = list(enumerate(result.rows, 1))
    ranked = sorted(numbered, key=lambda p: (_STATUS_ORDER.get(p[1].status, 3), p[0]))
    chosen = ranked[:MAX_TABLE_ROWS]
    left: dict[str, int] = {"all": len(numbered) - len(chosen)}
    for _, row in ranked[MAX_TABLE_ROWS:]:
        key = _filter_key(row.status)
        left[key] = left.get(key, 0) + 1
    return chosen, left


_HEAD = (
    ("#", "num"), ("step", "num"), ("rank", "num"), ("status", "text"), ("module", "text"), ("op", "text"),
    ("phase", "text"), ("slot", "text"), ("dtype A/B", "text"), ("score", "num"), ("rel L2", "num"),
    ("max abs", "num"), ("cosine", "num"), ("within", "num"), ("origin", "text"), ("why", "text"),
    ("source", "text"),
)


def _num_cell(value, text=None) -> str:
    if value is None:
        return '<td class="num" data-v="">-</td>'
    raw = value if not (isinstance(value, float) and math.isinf(value)) else (1e308 if value > 0 else -1e308)
    return f'<td class="num" data-v="{_e(raw)}">{_e(text if text is not None else _fmt(value))}</td>'


def _err_cell(value) -> str:
    return _num_cell(value, err(value) if value is not None else None)


def table_html(result: R.CompareResult) -> str:
    chosen, left = _table_rows(result)
    first = result.first_divergence
    head = "".join(f'<th data-type="{kind}" title="{_e(name)}">{_e(name)}</th>' for name, kind in _HEAD)
    columns = "".join(f'<col class="{width}">' for width in _COL_WIDTHS)
    body = []
    for number, row in chosen:
        m = row.metrics
        dtype = row.dtype_a if row.dtype_a == row.dtype_b else f"{row.dtype_a or '-'}/{row.dtype_b or '-'}"
        why = row.cause or "; ".join(row.reasons + row.notes)
        classes = f"status-{row.status}" + (" first" if row is first else "")
        cells = [
            f'<td class="num">{number}</td>', f'<td class="num">{row.step}</td>', f'<td class="num">{row.rank}</td>',
            _text_cell(row.status), _text_cell(row.module or "<root>"), _text_cell(f"{row.op}#{row.index}"),
            _text_cell(row.phase), _text_cell(row.slot), _text_cell(dtype),
            _num_cell(row.score), _err_cell(m.rel_l2 if m else None), _err_cell(m.max_abs if m else None),
            _num_cell(m.cosine if m else None), _num_cell(m.within if m else None),
            _text_cell(row.origin), _text_cell(why), _text_cell(row.source or "-"),
        ]
        body.append(f'<tr class="{classes}" data-status="{_e(row.status)}">{"".join(cells)}</tr>')
    # true without JavaScript too (all records, no filter); the script rewrites it per filter
    text = (f"{left['all']} records not in this page; probe compare --csv lists every record."
            if left["all"] else "")
    note = (f'<p class="muted" id="not-shown" data-left="{_e(json.dumps(left))}"'
            f'{"" if left["all"] else " hidden"}>{_e(text)}</p>')
    # a diverged compare opens on its divergent records; "all records" is one click away
    selected = " selected" if any(row.status == R.DIVERGED for _, row in chosen) else ""
    return (
        '<noscript><p class="muted" id="no-script">Filtering and sorting this table need JavaScript; '
        "without it the diverged records are listed first, then the rest in execution order.</p></noscript>"
        '<div class="controls" id="controls" hidden>filter <input id="filter-text" type="search" placeholder="module, op, slot...">'
        ' <select id="filter-status"><option value="">all records</option>'
        f'<option value="diverged"{selected}>diverged</option>'
        '<option value="changed">changed (checksum differs)</option>'
        '<option value="unmatched">no partner</option><option value="match">match</option></select>'
        ' <span class="muted"><span id="shown"></span> shown; click a column to sort</span></div>'
        f'<table id="records"><colgroup>{columns}</colgroup><thead><tr>{head}</tr></thead>'
        f'<tbody>{"".join(body)}</tbody></table>{note}'
    )


#: column width classes of the records table, in _HEAD order (CSS: #records col.*)
_COL_WIDTHS = ("n", "n", "n", "m", "w", "t", "s", "t", "m", "x", "x", "x", "x", "x", "m", "w", "t")


def _text_cell(text) -> str:
    """A text cell that wraps; its title holds the full text for hovering."""
    shown = _e(text)
    return f'<td title="{shown}">{shown}</td>'


def _run_differences_html(result: R.CompareResult) -> str:
    differences = getattr(result, "run_differences", [])
    if not differences:
        return ""
    from probe.comparison.load import difference_lines

    items = "".join(f"<li>{_e(line)}</li>" for line in difference_lines(differences))
    return ('<div id="run-differences"><h2>The runs differ in</h2><p class="muted">the runs differ in these '
            f"recorded settings; expect numbers to differ for these reasons too</p><ul>{items}</ul></div>")


def _top_ops_html(result: R.CompareResult) -> str:
    if not result.top_ops:
        return "<p class=\"muted\">No op adds error.</p>"
    rows = []
    for number, op in enumerate(result.top_ops, 1):
        judged = op.origin if op.diverged and op.origin else ("beyond tolerance" if op.diverged else "within tolerance")
        rows.append(
            f"<tr><td class=\"num\">{number}</td><td>{_e(op.module or '<root>')}</td><td>{_e(op.op)}#{op.index}</td>"
            f"<td>{_e(op.phase)}</td>{_num_cell(op.introduced)}{_err_cell(op.output_rel_l2)}{_err_cell(op.input_rel_l2)}"
            f"{_num_cell(op.ratio)}<td>{_e(judged)}</td><td>{_e(where_text(op.where or [(op.step, op.rank)]))}</td>"
            f"<td>{_e(where_text([(op.step, op.rank)]))}</td><td>{_e(op.source or '-')}</td></tr>"
        )
    return (
        '<p class="muted">added: the part of an op\'s output error that its inputs do not explain, in units of the '
        "tolerance (1 = the whole tolerance). Each op once, with the step files where it adds error and its worst.</p>"
        '<table id="top-ops"><thead><tr><th>#</th><th>module</th><th>op</th><th>phase</th><th>added (x tolerance)</th>'
        "<th>output rel L2</th><th>input rel L2</th><th>ratio</th><th>judged</th><th>where</th><th>worst at</th>"
        f'<th>source</th></tr></thead><tbody>{"".join(rows)}</tbody></table>'
    )


def _changes_html(result: R.CompareResult) -> str:
    if not result.changes:
        return ""
    rows = []
    for change in result.changes:
        if change.kind == R.ARGUMENT:
            what = f"{change.value_a} in A, {change.value_b} in B"
        elif change.size_unknown:
            what = f"{R.SIZE_UNKNOWN} at {where_text([change.worst])}"
        else:
            what = f"worst rel L2 {err(change.rel_l2)} (score {num(change.score)}) at {where_text([change.worst])}"
        rows.append(f"<tr><td>{_e(change.kind)}</td><td>{_e(change.key)}</td><td>{_e(what)}</td>"
                    f"<td>{_e(where_text(change.where))}</td><td>{_e(change.source or '-')}</td></tr>")
    return (
        "<h2>Changed parameters and arguments</h2>"
        '<table id="changes"><thead><tr><th>kind</th><th>key</th><th>change</th><th>where</th><th>source</th></tr>'
        f'</thead><tbody>{"".join(rows)}</tbody></table>'
    )


def _summary_html(result: R.CompareResult) -> str:
    c = result.counts
    items = []
    first, cause = result.first_divergence, result.likely_cause
    if first is not None:
        if first.cause:
            items.append(("cause", first.cause))
        items.append(("source", first.source or "unknown"))
        items.append(("first divergence", f"{first.key} ({first.origin or first.status}); {terminal.metrics_line(first)}"))
    if cause is not None and cause is not first:
        items.append(("likely cause", f"{cause.key}: {cause.cause or '; '.join(cause.reasons)}"))
    diverged = [(s["step"], s["rank"]) for s in result.steps if s["verdict"] != "pass"]
    passed = [(s["step"], s["rank"]) for s in result.steps if s["verdict"] == "pass"]
    files = "; ".join(([f"diverged in {where_text(diverged)}"] if diverged else [])
                      + ([f"pass in {where_text(passed)}"] if passed else []))
    items += [
        ("A (reference)", result.path_a), ("B", result.path_b), ("evidence", result.evidence),
        ("counts", f"{c['matched']} records paired: {c['matched'] - c['diverged']} within tolerance"
                   + (f" ({c['changed']} of them not bit-equal: checksums differ, size unknown)" if c.get("changed") else "")
                   + f", {c['diverged']} diverged; {c['only_a']} only in A, {c['only_b']} only in B"),
        ("step files", files),
    ]
    items += [("missing", item) for item in result.missing] + [("note", note) for note in result.notes]
    return "<dl>" + "".join(f"<dt>{_e(k)}</dt><dd>{_e(v)}</dd>" for k, v in items) + "</dl>"


def render(result: R.CompareResult) -> str:
    line = terminal.verdict_line(result)
    css_class = "pass" if result.verdict == "pass" else "diverged"
    return (
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
        f"<title>probe compare: {_e(result.verdict)}</title><style>{_CSS}</style></head><body>"
        f'<h1 id="verdict" class="{css_class}">{_e(line)}</h1>'
        f"{_summary_html(result)}"
        f"{replay_html.section(result)}"  # replay verdicts (empty without --replay)
        f"{_run_differences_html(result)}"
        "<h2>Error along execution order</h2>"
        '<div class="legend"><span><i class="dot" style="background:#1f6feb"></i> forward</span>'
        '<span><i class="dot" style="background:#e36209"></i> backward</span>'
        '<span><i class="dot" style="background:#999"></i> no partner</span>'
        '<span style="color:#c62828">--- tolerance / first divergence</span></div>'
        f"{chart_svg(result)}"
        f"{_changes_html(result)}"
        f"<h2>Ops that add the most error</h2>{_top_ops_html(result)}"
        f"<h2>Records</h2>{table_html(result)}"
        f"<script>{_JS}</script></body></html>\n"
    )
