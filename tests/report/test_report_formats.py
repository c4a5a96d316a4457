"""Report renderers: verdict line first, strict JSON, one CSV row per record, a
self-contained HTML page, atomic writes and a progress bar that only a terminal sees."""

import csv
import io
import json
import math
import os
import re
from html.parser import HTMLParser

import numpy as np
import pytest

from probe.comparison import result as R
from probe.comparison.api import assemble, compare_step
from probe.comparison.structs import StepInput
from probe.comparison.tolerances import Tolerances
from probe.errors import CompareError
from probe.report import csv_report, html_report, json_report, output, terminal
from probe.report.progress import Progress
from probe.report.rendered import RenderedResult
from tests.compare.test_compare_support import SyntheticRun, linear_checksum_run, mlp_run, square_weight


def _result(run_a, run_b, strict=False):
    table = Tolerances()
    outcome = compare_step(StepInput(run_a.records(), run_b.records(), run_a.fetch, run_b.fetch), table)
    info = [{"step": 0, "rank": 0, "verdict": "diverged" if outcome.diverged else "pass", "counts": outcome.counts()}]
    return RenderedResult.of(assemble([outcome], info, table, "a/", "b/", [], [], 10, strict))


@pytest.fixture()
def diverged():
    return _result(mlp_run(), mlp_run(weight_noise=1e-3, extra_call=True))


@pytest.fixture()
def passed():
    return _result(mlp_run(), mlp_run())


def test_terminal_report_starts_with_the_verdict_line(diverged, passed):
    text = terminal.render(diverged)
    assert text.splitlines()[0] == "DIVERGED at step 0 rank 0: fc1 functional.linear (forward, output.0) -- introduced"
    lines = text.splitlines()
    # the answer first: what caused it and which line of user code made the call
    assert lines[1] == "  cause    parameter fc1.weight differs (rel L2 3.78e-03)"
    assert lines[2] == "  source   model.py:10"
    for fragment in ("key      fc1/functional.linear#0/forward/output.0", "rel L2", "inputs of this call:",
                     "input.1", "a parameter (fc1/Linear#0/forward/param.weight)", "top ops by the error", "counts:",
                     "compared: A = a/ (the reference"):
        assert fragment in text
    assert terminal.render(passed).startswith("PASS: ")


def test_json_is_strict_and_carries_the_contract(diverged):
    diverged.rows[0].metrics.rel_l2 = math.inf  # non-finite values must not break strict JSON
    text = json_report.render(diverged)
    data = json.loads(text, parse_constant=lambda name: pytest.fail(f"non-standard JSON constant {name}"))
    assert text.count("\n{") == 0 and text.startswith("{")
    assert data["verdict"] == "diverged" and data["first_divergence"]["origin"] == "introduced"
    assert data["counts"]["only_b"] == 2 and data["divergences_total"] == len(data["divergences"]) > 0
    assert "rows" not in data and "rows" in json_report.to_dict(diverged, rows=True)


class _Writes(io.StringIO):
    """A stream that keeps the size of each write."""

    def __init__(self):
        super().__init__()
        self.sizes = []

    def write(self, text):
        self.sizes.append(len(text))
        return super().write(text)


def test_json_written_as_it_is_made_is_the_rendered_text_in_pieces_of_at_most_a_batch(diverged, monkeypatch):
    """--json writes its text in batches as the encoder makes it, never holding every piece of a
    large report at once, and the text is render()'s, byte for byte."""
    monkeypatch.setattr(json_report, "_BATCH", 256)
    stream = _Writes()
    json_report.write(diverged, stream, rows=True)
    assert stream.getvalue() == json_report.render(diverged, rows=True)
    assert len(stream.sizes) > 10 and max(stream.sizes) < 256 + 200, stream.sizes


def test_json_with_a_nan_that_escaped_sanitizing_writes_nothing_and_raises(diverged, monkeypatch):
    """Strict JSON or nothing: the check runs before the first byte is written."""
    monkeypatch.setattr(json_report, "_BATCH", 256)  # the NaN comes after a batch's worth of text
    monkeypatch.setattr(json_report, "to_dict", lambda result, rows=False: {"notes": ["a note"] * 100, "gap": math.nan})
    stream = _Writes()
    with pytest.raises(ValueError):
        json_report.write(diverged, stream)
    assert stream.getvalue() == ""


@pytest.fixture()
def transposed():
    """Checksum evidence, a transposed square weight: statistics agree, the bytes do not."""
    weight = square_weight()
    return _result(linear_checksum_run(weight), linear_checksum_run(np.ascontiguousarray(weight.T)))


def test_every_report_names_a_checksum_change_of_unknown_size(transposed):
    text = terminal.render(transposed)
    assert "param     fc/Linear#0/forward/param.weight: changed (checksum differs; statistics agree, size unknown)" in text
    assert re.search(r"input\.1\s+diverged\s+unknown\s+unknown\s+a parameter .*\(checksum differs\)", text), text
    data = json.loads(json_report.render(transposed))
    assert data["changes"][0]["size_unknown"] is True
    weight = next(e for e in data["first_divergence"]["input_errors"] if e["slot"] == "input.1")
    assert weight["size_unknown"] is True and weight["status"] == "diverged"
    page = html_report.render(transposed)
    assert "changed (checksum differs; statistics agree, size unknown)" in page


def test_csv_has_one_row_per_aligned_record_in_execution_order(diverged):
    rows = list(csv.DictReader(io.StringIO(csv_report.render(diverged))))
    assert len(rows) == len(diverged.rows)
    assert tuple(rows[0]) == csv_report.COLUMNS
    seqs = [int(row["seq_a"]) for row in rows if row["seq_a"]]
    assert seqs == sorted(seqs)
    statuses = {row["status"] for row in rows}
    assert statuses == {"match", "diverged", "only_b"}


class _Collector(HTMLParser):
    def __init__(self):
        super().__init__()
        self.tags, self.ids, self.external = [], set(), []
        self.body_rows = 0
        self._in_records = False

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self.tags.append(tag)
        if "id" in attrs:
            self.ids.add(attrs["id"])
        for name in ("src", "href"):
            if name in attrs:
                self.external.append(attrs[name])
        if tag == "link":
            self.external.append(attrs)
        if tag == "table":
            self._in_records = attrs.get("id") == "records"
        if tag == "tr" and self._in_records and "data-status" in attrs:
            self.body_rows += 1


def test_html_is_self_contained_with_chart_marker_and_sortable_table(diverged):
    page = html_report.render(diverged)
    parser = _Collector()
    parser.feed(page)
    assert parser.external == []
    assert {"verdict", "error-chart", "tolerance-line", "first-divergence", "records", "top-ops"} <= parser.ids
    assert parser.body_rows == len(diverged.rows)
    assert "<script>" in page and "addEventListener('click'" in page
    charted = [r for r in diverged.rows if r.io == "out" or r.divergence in ("param", "argument")]
    assert page.count("<circle") == sum(1 for r in charted if r.status in ("match", "changed", "diverged"))
    assert page.count('class="pt unmatched"') == sum(1 for r in charted if r.status.startswith("only_"))


def test_html_escapes_names(diverged):
    diverged.rows[0].module = "<script>alert(1)</script>"
    assert "<script>alert(1)</script>" not in html_report.render(diverged)


def test_html_of_a_pass_has_no_divergence_marker(passed):
    page = html_report.render(passed)
    assert 'id="first-divergence"' not in page and 'class="pass"' in page


def test_html_chart_caps_points_for_huge_compares(monkeypatch, diverged):
    monkeypatch.setattr(html_report, "MAX_POINTS", 3)
    page = html_report.render(diverged)
    assert page.count("<circle") + page.count('class="pt unmatched"') <= 4  # 3 buckets + the kept marker


def test_atomic_write_replaces_only_on_success(tmp_path):
    target = tmp_path / "report.csv"
    target.write_text("old")
    output.write_atomic(str(target), "new", "--csv")
    assert target.read_text() == "new"
    assert os.listdir(tmp_path) == ["report.csv"]


def test_destination_checks_name_the_option(tmp_path):
    with pytest.raises(CompareError, match="--html .* does not exist"):
        output.check_destination(str(tmp_path / "no" / "x.html"), "--html")
    with pytest.raises(CompareError, match="is a folder"):
        output.check_destination(str(tmp_path), "--csv")


class _Stream(io.StringIO):
    def __init__(self, tty):
        super().__init__()
        self._tty = tty

    def isatty(self):
        return self._tty


def test_progress_bar_only_on_a_terminal():
    quiet = _Stream(False)
    bar = Progress(quiet, delay=0)
    bar(0.5, 10)
    bar.close()
    assert quiet.getvalue() == ""
    loud = _Stream(True)
    bar = Progress(loud, delay=0)
    bar(0.5, 10)
    assert "50.0%" in loud.getvalue() and loud.getvalue().startswith("\r")
    bar.close()
    assert loud.getvalue().endswith("\r")


def test_progress_waits_before_showing_for_short_compares():
    loud = _Stream(True)
    bar = Progress(loud, delay=60)
    bar(0.9)
    assert loud.getvalue() == ""


def test_progress_counts_units_and_says_the_time_left_once_it_has_enough_to_go_on():
    loud = _Stream(True)
    counts = [3, 1024]
    bar = Progress(loud, delay=0, units=lambda: tuple(counts))
    bar(0.003)
    assert "3 of 1,024 units" in loud.getvalue() and "left" not in loud.getvalue()  # too early to tell
    bar.start -= 100.0  # 100 s in, a quarter done: 300 s to go
    bar._last = 0.0
    counts[0] = 256
    bar(0.25)
    last = loud.getvalue().split("\r")[-1]
    assert "256 of 1,024 units" in last and "5:00 left" in last
    bar.units = None  # a shorter line next: it must cover the last one, or its end stays on screen
    bar._last = 0.0
    bar(0.5)
    lengths = [len(line) for line in loud.getvalue().split("\r")[1:]]
    assert lengths == sorted(lengths) and "units" not in loud.getvalue().split("\r")[-1]
    bar.close()
    assert loud.getvalue().endswith("\r")


@pytest.mark.parametrize("seconds, shown", [(0.4, "0:00"), (65, "1:05"), (7390.2, "2:03:10")])
def test_progress_time_left_reads_as_a_clock(seconds, shown):
    from probe.report.progress import _clock

    assert _clock(seconds) == shown


def test_strict_mode_turns_unmatched_records_into_a_divergence():
    result = _result(mlp_run(), mlp_run(extra_call=True), strict=True)
    assert result.verdict == "diverged" and result.first_divergence.status == R.ONLY_B
    assert _result(mlp_run(), mlp_run(extra_call=True)).verdict == "pass"


def test_terminal_errors_are_in_scientific_notation_and_inputs_name_their_producer(diverged):
    text = terminal.render(diverged)
    assert re.search(r"rel L2 \d\.\d\de-0\d", text)
    assert not re.search(r"rel L2 0\.0", text), text  # never 0.000115 next to 9.26e-05
    assert "made by fc1/functional.linear#0/forward/output.0" in terminal.render(
        _result(mlp_run(), mlp_run(gelu_tanh=True)))


def test_terminal_counts_say_paired_within_and_diverged(diverged):
    c = diverged.counts
    line = next(line for line in terminal.render(diverged).splitlines() if line.startswith("counts:"))
    assert f"{c['matched']} records paired in 1 step file: {c['matched'] - c['diverged']} within tolerance" in line


def test_json_headline_is_the_terminal_verdict_line(diverged):
    data = json.loads(json_report.render(diverged))
    assert list(data)[:2] == ["verdict", "headline"]
    assert data["headline"] == terminal.render(diverged).splitlines()[0]


def test_html_lists_changes_and_top_ops_with_where_and_source_and_opens_on_divergences(diverged):
    page = html_report.render(diverged)
    parser = _Collector()
    parser.feed(page)
    assert "changes" in parser.ids
    top = page[page.index('id="top-ops"'):page.index("</table>", page.index('id="top-ops"'))]
    assert "<th>where</th>" in top and "<th>source</th>" in top and "model.py:10" in top
    assert '<option value="diverged" selected>' in page
    assert '<option value="diverged" selected>' not in html_report.render(_result(mlp_run(), mlp_run()))


def test_an_inherited_first_divergence_without_an_introducing_op_says_the_error_grew():
    a, b = SyntheticRun(), SyntheticRun()
    x = np.linspace(1, 2, 64).astype(np.float32) * 1e-3
    for run, noise in ((a, 0.0), (b, 1e-4)):  # within tolerance only under the absolute floor, then scaled up
        xx = (x * (1 + noise)).astype(np.float32)
        run.call("m", "torch.exp", {"output.0": xx})
        run.call("m", "torch.mul", {"input.0": xx, "input.1": 1000.0, "output.0": (xx * 1000).astype(np.float32)})
    result = _result(a, b)
    assert result.first_divergence.origin == R.INHERITED and result.likely_cause is result.first_divergence
    assert "no single op introduced an error beyond tolerance" in terminal.render(result)


def test_an_error_within_tolerance_that_an_op_amplifies_is_explained_not_a_divergence():
    a, b = SyntheticRun(), SyntheticRun()
    x = np.linspace(1, 2, 64).astype(np.float32)
    for run, noise in ((a, 0.0), (b, 1.5e-5)):  # within float32 tolerance (rounding), then amplified 2x
        xx = (x * (1 + noise)).astype(np.float32)
        run.call("m", "torch.exp", {"output.0": xx})
        run.call("m", "torch.square", {"input.0": xx, "output.0": (xx * xx).astype(np.float32)})
    result = _result(a, b)
    square = next(row for row in result.rows if row.key == "m/torch.square#0/forward/output.0")
    assert result.verdict == "pass" and square.status == R.EXPLAINED and square.origin == R.AMPLIFIED
    assert result.counts["explained"] == 1 and "explained" in terminal.render(result)


def test_the_result_writes_every_report_from_python_atomically(diverged, tmp_path):
    """result.write_html/write_csv/write_json write what --html/--csv/--json give, through a
    temporary file and a rename, and return the absolute path."""
    written = {
        "html": diverged.write_html(tmp_path / "report.html"),
        "csv": diverged.write_csv(tmp_path / "rows.csv"),
        "json": diverged.write_json(tmp_path / "result.json", rows=True),
    }
    assert written["html"] == str(tmp_path / "report.html") and os.path.isabs(written["csv"])
    with open(written["html"], encoding="utf-8") as handle:
        assert handle.read() == html_report.render(diverged)
    with open(written["csv"], encoding="utf-8", newline="") as handle:
        assert handle.read() == csv_report.render(diverged)
    with open(written["json"], encoding="utf-8") as handle:
        assert json.load(handle) == json.loads(diverged.to_json(rows=True)) == json_report.to_dict(diverged, rows=True)
    assert diverged.to_text() == terminal.render(diverged)
    assert sorted(os.listdir(tmp_path)) == ["report.html", "result.json", "rows.csv"]  # no temporary left


def test_writing_a_report_into_a_missing_folder_names_the_path(diverged, tmp_path):
    with pytest.raises(CompareError, match=r"write_html .*missing.*does not exist"):
        diverged.write_html(tmp_path / "missing" / "report.html")
