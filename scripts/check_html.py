#!/usr/bin/env python3
"""Render a ``probe compare --html`` report in headless Chromium and check what a person sees.

    python scripts/check_html.py report.html [--screenshot report.png]
    python scripts/check_html.py --make A B [--screenshot report.png]   # compare, then check

Checks, on the DOM *after* the page's inline JavaScript ran: the verdict heading, the error
chart (SVG with points and the tolerance line), the first-divergence marker when the verdict
is "diverged", the records table with rows, and the filter counter that only the script
fills in (so a page whose JS fails is caught). It never touches the network: the page must be
self-contained, and Chromium runs with networking features off.

Layout, measured in a 1400 x 900 window by a script this checker adds to a copy of the page:
the document is no wider than the viewport (no horizontal scrollbar), and no chart label
overlaps another label or a point. The page as written (what a browser without JavaScript
shows) must say that filtering needs JavaScript and list the diverged records first.

Needs Debian's chromium (``apt-get install -y chromium``); not part of the pytest suite.
Exit codes: 0 all checks pass, 1 a check failed, 2 chromium missing or unusable input.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from html.parser import HTMLParser

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--hide-scrollbars",
)


def find_browser() -> str | None:
    for name in BROWSERS:
        path = shutil.which(name)
        if path:
            return path
    return None


def run_browser(browser: str, url: str, extra: list[str], timeout: int = 120) -> subprocess.CompletedProcess:
    with tempfile.TemporaryDirectory(prefix="probe-chromium-") as profile:
        command = [browser, *FLAGS, f"--user-data-dir={profile}", *extra, url]
        return subprocess.run(command, capture_output=True, text=True, timeout=timeout)


class Dom(HTMLParser):
    """Just enough of the rendered DOM: ids, element counts and the text of some ids."""

    def __init__(self):
        super().__init__()
        self.ids: dict[str, dict] = {}
        self.counts: dict[str, int] = {}
        self.text: dict[str, str] = {}
        self.classes: dict[str, int] = {}
        self.record_rows = 0
        self.external: list[str] = []
        self._open: list[str | None] = []
        self._table = None

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self.counts[tag] = self.counts.get(tag, 0) + 1
        for name in (attrs.get("class") or "").split():
            self.classes[name] = self.classes.get(name, 0) + 1
        ident = attrs.get("id")
        if ident:
            self.ids[ident] = attrs
        for name in ("src", "href"):
            if attrs.get(name):
                self.external.append(attrs[name])
        if tag == "table":
            self._table = ident
        if tag == "tr" and self._table == "records" and "data-status" in attrs:
            self.record_rows += 1
        if tag not in ("circle", "line", "path", "rect", "input", "meta", "br", "img"):
            self._open.append(ident)

    def handle_endtag(self, tag):
        if tag not in ("circle", "line", "path", "rect", "input", "meta", "br", "img") and self._open:
            self._open.pop()

    def handle_data(self, data):
        for ident in self._open:
            if ident:
                self.text[ident] = self.text.get(ident, "") + data


VIEWPORT = (1400, 900)

#: added to a copy of the page: measures what the user's window shows, into #probe-check
_MEASURE = """
<script>
window.addEventListener('load', function(){
  var doc=document.documentElement, svg=document.getElementById('error-chart');
  function boxes(selector){return svg?Array.prototype.map.call(svg.querySelectorAll(selector),
    function(e){return e.getBoundingClientRect();}):[];}
  function hit(a,b){return a.left<b.right&&b.left<a.right&&a.top<b.bottom&&b.top<a.bottom;}
  var labels=boxes('text'), points=boxes('.pt'), clashes=0;
  for(var i=0;i<labels.length;i++){
    for(var j=i+1;j<labels.length;j++){if(hit(labels[i],labels[j])) clashes++;}
    for(var k=0;k<points.length;k++){if(hit(labels[i],points[k])) clashes++;}}
  var mark=document.createElement('div'); mark.id='probe-check';
  mark.setAttribute('data-doc-width', Math.max(doc.scrollWidth, document.body.scrollWidth));
  mark.setAttribute('data-viewport', window.innerWidth);
  mark.setAttribute('data-label-clashes', clashes);
  document.body.appendChild(mark);
});
</script>
"""


def measured_copy(page: str, work: str) -> str:
    """A copy of the page with the measuring script added before </body>."""
    with open(page, encoding="utf-8") as handle:
        text = handle.read()
    position = text.rfind("</body>")
    text = text[:position] + _MEASURE + text[position:] if position >= 0 else text + _MEASURE
    copy = os.path.join(work, "measured.html")
    with open(copy, "w", encoding="utf-8") as handle:
        handle.write(text)
    return copy


def check_layout(dom: Dom) -> list[str]:
    mark = dom.ids.get("probe-check")
    if mark is None:
        return ["the layout could not be measured (the measuring script did not run)"]
    problems = []
    width, viewport = int(mark["data-doc-width"]), int(mark["data-viewport"])
    if width > viewport:
        problems.append(f"the page is {width} px wide in a {viewport} px window: it scrolls sideways")
    clashes = int(mark["data-label-clashes"])
    if clashes:
        problems.append(f"{clashes} chart label(s) overlap another label or a point")
    return problems


class _RowOrder(HTMLParser):
    """data-status of the records table's rows, in page order, and whether the no-JS note is there."""

    def __init__(self):
        super().__init__()
        self.statuses: list[str] = []
        self.no_script_note = False

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "tr" and "data-status" in attrs:
            self.statuses.append(attrs["data-status"])
        if attrs.get("id") == "no-script":
            self.no_script_note = True


def check_without_javascript(html_text: str) -> list[str]:
    order = _RowOrder()
    order.feed(html_text)
    problems = []
    if not order.no_script_note:
        problems.append("without JavaScript the page does not say that filtering needs it")
    diverged = [position for position, status in enumerate(order.statuses) if status == "diverged"]
    if diverged and diverged != list(range(len(diverged))):
        problems.append("without JavaScript the diverged records are not listed first")
    return problems


def check(dom: Dom) -> list[str]:
    problems = []
    verdict = dom.text.get("verdict", "").strip()
    if not verdict.startswith(("PASS:", "DIVERGED", "NOT A PASS")):
        problems.append(f"verdict heading missing or wrong: {verdict[:80]!r}")
    for ident in ("error-chart", "tolerance-line", "records", "filter-text", "filter-status"):
        if ident not in dom.ids:
            problems.append(f"element #{ident} is missing")
    points = dom.classes.get("pt", 0)
    if points == 0:
        problems.append("the chart has no points")
    if verdict.startswith("DIVERGED") and "first-divergence" not in dom.ids:
        problems.append("diverged, but the chart does not mark the first divergence")
    if dom.record_rows == 0:
        problems.append("the records table has no rows")
    shown = dom.text.get("shown", "").strip()
    if not shown.isdigit():
        problems.append("the inline script did not run (the row counter is empty)")
    if dom.external:
        problems.append(f"the page loads external resources: {dom.external[:3]}")
    return problems


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="+", help="report.html, or A B with --make")
    parser.add_argument("--make", action="store_true", help="run probe compare A B --html first")
    parser.add_argument("--screenshot", help="also save a PNG of the rendered page here")
    args = parser.parse_args(argv)

    browser = find_browser()
    if browser is None:
        print("check_html: chromium not found (apt-get install -y chromium)", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="probe-html-") as work:
        if args.make:
            if len(args.paths) != 2:
                print("check_html: --make needs two dumps A B", file=sys.stderr)
                return 2
            page = os.path.join(work, "report.html")
            repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
            made = subprocess.run(
                [sys.executable, "-m", "probe.cli", "compare", *args.paths, "--html", page],
                cwd=repo, capture_output=True, text=True,
            )
            if made.returncode not in (0, 1):
                print(f"check_html: probe compare failed: {made.stderr.strip()}", file=sys.stderr)
                return 2
        else:
            if len(args.paths) != 1:
                print("check_html: give one report.html (or --make A B)", file=sys.stderr)
                return 2
            page = args.paths[0]
        if not os.path.isfile(page):
            print(f"check_html: {page} does not exist", file=sys.stderr)
            return 2
        url = "file://" + os.path.abspath(measured_copy(page, work))
        window = f"--window-size={VIEWPORT[0]},{VIEWPORT[1]}"
        rendered = run_browser(browser, url, ["--dump-dom", "--virtual-time-budget=5000", window])
        if rendered.returncode != 0 or "<html" not in rendered.stdout:
            print(f"check_html: chromium failed ({rendered.returncode}): {rendered.stderr.strip()[-300:]}", file=sys.stderr)
            return 2
        dom = Dom()
        dom.feed(rendered.stdout)
        problems = check(dom) + check_layout(dom)
        # without JavaScript the browser shows the page as written (chromium's --dump-dom
        # needs scripts itself, so the page's own text is what is checked)
        with open(page, encoding="utf-8") as handle:
            problems += check_without_javascript(handle.read())
        if args.screenshot:
            shot = run_browser(browser, "file://" + os.path.abspath(page),
                               [f"--screenshot={os.path.abspath(args.screenshot)}", f"--window-size={VIEWPORT[0]},1400"])
            if shot.returncode != 0 or not os.path.isfile(args.screenshot):
                problems.append(f"screenshot failed: {shot.stderr.strip()[-200:]}")
    for problem in problems:
        print(f"FAIL: {problem}")
    if not problems:
        mark = dom.ids["probe-check"]
        print(f"OK: {page} renders: verdict, chart ({dom.classes.get('pt', 0)} points), "
              f"{dom.record_rows} table rows, script ran; {mark['data-doc-width']} px wide in a "
              f"{mark['data-viewport']} px window, no chart label overlaps; without JavaScript the "
              "diverged records come first and the page says so"
              + (f"; screenshot {args.screenshot}" if args.screenshot else ""))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
