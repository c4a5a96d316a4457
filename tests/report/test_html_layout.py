"""The HTML report's layout promises: fits a 1400 px window, labels apart, infinite scores
drawn as such, true "not in this page" counts per filter, a useful page without JavaScript."""

import json
import math
import os
import re
import shutil
import subprocess
import sys
from html.parser import HTMLParser

import pytest

from probe.comparison import result as R
from probe.report import html_report
from test_report_formats import _result
from tests.compare.test_compare_support import mlp_run

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture()
def diverged():
    return _result(mlp_run(), mlp_run(weight_noise=1e-3, extra_call=True))


class _Page(HTMLParser):
    def __init__(self):
        super().__init__()
        self.statuses, self.labels, self.ids, self.inf_points, self.cells = [], [], {}, 0, []
        self._label = None

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if attrs.get("id"):
            self.ids[attrs["id"]] = attrs
        if tag == "tr" and "data-status" in attrs:
            self.statuses.append(attrs["data-status"])
        if tag == "td" and "title" in attrs:
            self.cells.append(attrs["title"])
        if tag == "path" and "inf" in (attrs.get("class") or "").split():
            self.inf_points += 1
        if tag == "text" and "chart-label" in (attrs.get("class") or ""):
            self._label = attrs
        else:
            self._label = None

    def handle_data(self, data):
        if self._label is not None:
            self.labels.append((float(self._label["x"]), float(self._label["y"]), self._label["text-anchor"], data))
            self._label = None


def _parse(page: str) -> _Page:
    parsed = _Page()
    parsed.feed(page)
    return parsed


def test_long_names_wrap_in_a_fixed_layout_with_the_full_text_on_hover(diverged):
    long_name = "encoder." + ".".join(f"layers.{i}.attention.self_attention_block" for i in range(12))
    diverged.rows[0].module = long_name
    page = html_report.render(diverged)
    assert re.search(r"#records\{table-layout:fixed\}", page)
    assert "overflow-wrap:anywhere" in page and "min-width:280px" not in page
    assert long_name in _parse(page).cells  # the title holds the whole name


def test_chart_labels_of_close_step_boundaries_never_overlap(diverged):
    # 40 step files in one chart: their boundary labels cannot all fit; none may overlap
    for number, row in enumerate(diverged.rows):
        row.step = number * 40 // len(diverged.rows)
    labels = _parse(html_report.chart_svg(diverged)).labels
    assert len(labels) >= 2
    spans = {}
    for x, y, anchor, text in labels:
        width = len(text) * html_report.CHAR_WIDTH
        start = x if anchor == "start" else x - width
        for begin, end in spans.get(y, []):
            assert start >= end or start + width <= begin, f"label {text!r} overlaps another"
        spans.setdefault(y, []).append((start, start + width))
        assert y < html_report.INF_LANE  # above the plot and the inf lane: no point is there


def test_infinite_scores_are_drawn_in_their_own_lane(diverged):
    target = next(row for row in diverged.rows if row.status == R.DIVERGED and row.io == "out")
    target.score = math.inf
    svg = html_report.chart_svg(diverged)
    parsed = _parse(svg)
    assert parsed.inf_points == 1
    assert re.search(rf'<text x="[\d.]+" y="{html_report.INF_LANE + 4}" text-anchor="end" fill="#c62828">inf</text>', svg)


def test_not_in_page_counts_are_true_for_every_status_filter(monkeypatch, diverged):
    monkeypatch.setattr(html_report, "MAX_TABLE_ROWS", 5)
    page = html_report.render(diverged)
    parsed = _parse(page)
    left = json.loads(parsed.ids["not-shown"]["data-left"])
    in_page = parsed.statuses
    everything = [row.status for row in diverged.rows]

    def key(status):
        return "unmatched" if status.startswith("only_") else status

    assert left["all"] == len(everything) - len(in_page)
    for status in {key(s) for s in everything}:
        expected = sum(key(s) == status for s in everything) - sum(key(s) == status for s in in_page)
        assert left.get(status, 0) == expected, status
    assert f"{left['all']} records not in this page" in page


def test_without_javascript_diverged_records_come_first_and_the_page_says_filtering_needs_it(diverged):
    page = html_report.render(diverged)
    parsed = _parse(page)
    statuses = parsed.statuses
    diverged_count = statuses.count(R.DIVERGED)
    assert diverged_count and statuses[:diverged_count] == [R.DIVERGED] * diverged_count
    assert "<noscript>" in page and "need JavaScript" in page
    assert "hidden" in parsed.ids["controls"]  # the filter controls appear only when the script runs


@pytest.mark.skipif(not any(shutil.which(b) for b in ("chromium", "chromium-browser", "google-chrome")),
                    reason="needs a headless Chromium (apt-get install -y chromium)")
def test_a_real_browser_shows_no_horizontal_scrollbar_and_no_label_overlap(diverged, tmp_path):
    long_name = "encoder." + ".".join(f"layers.{i}.attention" for i in range(30))
    diverged.rows[0].module = long_name
    diverged.rows[1].reasons = ["x" * 400]
    for number, row in enumerate(diverged.rows):  # many step files: many boundary labels
        row.step = number * 40 // len(diverged.rows)
    target = next(row for row in diverged.rows if row.status == R.DIVERGED and row.io == "out")
    target.score = math.inf
    page = tmp_path / "report.html"
    page.write_text(html_report.render(diverged))
    checked = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "check_html.py"), str(page)],
                             capture_output=True, text=True, timeout=240)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "1400 px window" in checked.stdout
