"""A CompareResult with its renderers: what ``probe.compare`` returns.

The result itself is data (comparison/result.py); the reports are written here, as
``probe compare`` writes them. Files are written through a temporary file and a rename
(report/output.py): whole or not at all; an unwritable path raises CompareError naming it.
"""

from __future__ import annotations

import dataclasses

from probe.comparison.result import CompareResult
from probe.report import csv_report, html_report, json_report, output, terminal


class RenderedResult(CompareResult):
    """CompareResult plus to_text/to_json/write_json/write_csv/write_html."""

    @classmethod
    def of(cls, result: CompareResult) -> "RenderedResult":
        """The same result (its fields shared, not copied), with the renderers."""
        return cls(**{f.name: getattr(result, f.name) for f in dataclasses.fields(result)})

    def to_text(self) -> str:
        """The terminal report ``probe compare A B`` prints."""
        return terminal.render(self)

    def to_json(self, rows: bool = False) -> str:
        """The JSON text ``probe compare --json`` prints (``rows=True``: ``--rows``)."""
        return json_report.render(self, rows=rows)

    def write_json(self, path, rows: bool = False) -> str:
        """Write to_json() to path; returns the absolute path."""
        return output.write_report(path, self.to_json(rows=rows), "write_json", (self.path_a, self.path_b))

    def write_csv(self, path) -> str:
        """Write one CSV row per aligned record (``--csv``); returns the absolute path."""
        return output.write_report(path, csv_report.render(self), "write_csv", (self.path_a, self.path_b))

    def write_html(self, path) -> str:
        """Write the self-contained HTML page (``--html``); returns the absolute path."""
        return output.write_report(path, html_report.render(self), "write_html", (self.path_a, self.path_b))
