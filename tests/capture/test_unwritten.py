"""Memory nothing has written yet is never a value: a record of an empty-family allocation, or
a view of one, read before its first write, is listed as uninitialized, carries no numbers,
and nothing compares it; the record after the write is a value.

trl's chunked log-probabilities (``buf = torch.empty(...)``, ``tile = buf[:n, :w]``,
``torch.mm(..., out=tile)``) made the same float32 run twice DIVERGED at the slice, with
values near 1e38 (tests/unwritten_model.py does the same, with the leftovers chosen).
"""

import json
import math

import pytest
import torch

import probe
from probe.capture.eager import unwritten
from probe.cli import main
from unwritten_model import capture

FIRST_SLICE = "/Tensor.__getitem__#0/forward/output.0"
#: the slices, the whole buffer while all or part of it is unwritten
UNWRITTEN = ["/Tensor.__getitem__#0/forward/input.0", FIRST_SLICE, "/Tensor.__getitem__#2/forward/input.0"]


@pytest.mark.parametrize("level, task", [("api", "checksum"), ("mix", "tensor")])
def test_a_slice_read_before_its_write_is_uninitialized_and_the_same_memory_after_it_a_value(tmp_path, level,
                                                                                             task):
    with probe.load(capture(tmp_path, level=level, task=task)).open(0) as step:
        assert step.attrs["uninitialized"] == UNWRITTEN
        rows = {row["key"]: row for row in step.records}
        sketches = step.records.sketches()
        for key in UNWRITTEN:
            row = rows[key]
            assert row["uninitialized"] and row["dtype"] == "float32" and row["numel"] > 0
            assert all(math.isnan(row[name]) for name in ("min", "max", "mean", "norm"))
            assert (row["nan_count"], row["inf_count"], row["checksum"], row["tensor_id"]) == (-1, -1, "", -1)
            assert sketches is None or all(map(math.isnan, sketches[step.records.index_of(key)]))
        written = rows["/torch.mm#0/forward/output.0"]  # the first slice, once mm wrote it
        assert not written["uninitialized"] and written["checksum"] and abs(written["max"]) < 10
        assert rows["/Tensor.logsumexp#0/forward/input.0"]["checksum"] == written["checksum"]
        # the second slice is memory mm#0 wrote: a value, though part of buf is still unwritten
        assert not rows["/Tensor.__getitem__#2/forward/output.0"]["uninitialized"]


def test_the_same_run_with_other_leftovers_compares_as_a_pass_and_says_how_many_were_not_compared(tmp_path):
    a = capture(tmp_path / "a", leftover=1e38, level="mix", steps=2)
    b = capture(tmp_path / "b", leftover=-3.0, level="mix", steps=2)
    result = probe.compare(a, b)
    assert result.verdict == "pass", result.to_text()[:2000]
    text = result.to_text()
    assert "6 records hold memory nothing had written yet" in text and "not compared" in text
    row = next(row for row in result.rows if row.key == FIRST_SLICE)
    assert row.stale == "AB" and row.status == "match"


def test_determinism_does_not_compare_leftovers_and_says_how_many(tmp_path):
    from probe.analysis.determinism import bit_compare, format_report

    a = capture(tmp_path / "a", leftover=1e38, task="checksum")
    b = capture(tmp_path / "b", leftover=7.0, task="checksum")
    [report] = bit_compare(a, b)
    assert report.identical and report.uninitialized == 3
    assert "bit-identical" in format_report(report)[0]
    assert "3 of memory nothing had written yet not compared" in format_report(report)[0]


def test_leftover_nan_is_not_the_first_nonfinite_value(tmp_path):
    dump = capture(tmp_path, leftover=float("nan"))
    assert probe.first_nonfinite(dump) is None


def test_inspect_counts_the_uninitialized_records(tmp_path, capsys):
    dump = capture(tmp_path)
    with pytest.raises(SystemExit):
        main(["inspect", dump, "--key", "__getitem__#0/forward/output"])
    out = capsys.readouterr().out
    assert "uninitialized: 3 record(s) of memory nothing had written yet" in out
    assert "uninitialized" in out.splitlines()[-1]  # the slice's row says so instead of numbers
    with pytest.raises(SystemExit):
        main(["inspect", dump, "--json"])
    payload = json.loads(capsys.readouterr().out)
    assert payload["files"][0]["uninitialized"] == 3
    assert sum(record["uninitialized"] for record in payload["records"]) == 3


# ---------------------------------------------------------------------- the tracking itself


def _allocate(tracked, *shape):
    return unwritten.allocate(tracked, torch.empty, shape, {})


def test_a_part_written_through_setitem_or_out_is_a_value_and_the_rest_stays_unwritten():
    tracked = {}
    buf = _allocate(tracked, 4, 6)
    assert unwritten.holds(tracked, buf) and unwritten.holds(tracked, buf[1])
    unwritten.written(tracked, "Tensor.__setitem__", (buf, (slice(0, 2),)), {}, [buf])  # buf[:2] = ...
    assert not unwritten.holds(tracked, buf[:2]) and not unwritten.holds(tracked, buf[1, 3:])
    assert unwritten.holds(tracked, buf) and unwritten.holds(tracked, buf[:, 0].view(-1)[2:])
    unwritten.written(tracked, "torch.mm", (), {}, [buf[2:]])  # torch.mm(..., out=buf[2:])
    assert not unwritten.holds(tracked, buf) and not unwritten.holds(tracked, buf.t())


def test_a_whole_write_or_an_advanced_index_write_ends_the_tracking():
    tracked = {}
    copied, scattered = _allocate(tracked, 3, 3), _allocate(tracked, 5)
    unwritten.written(tracked, "Tensor.copy_", (copied,), {}, [copied])
    unwritten.written(tracked, "Tensor.__setitem__", (scattered, torch.tensor([0, 2])), {}, [scattered])
    assert not tracked


def test_a_custom_op_given_the_memory_may_fill_it_and_a_plain_read_does_not():
    tracked = {}
    out = _allocate(tracked, 2, 3)
    unwritten.written(tracked, "torch.matmul", (out, out), {}, None)  # reads it: still unwritten
    assert unwritten.holds(tracked, out)
    unwritten.written(tracked, "ops.mylib.attention", (torch.ones(2, 3),), {"out": [out]}, None)
    assert not tracked


def test_a_freed_allocation_is_forgotten():
    tracked = {}
    _allocate(tracked, 8, 8)  # dropped at once: its memory may come back as another tensor
    assert not tracked
