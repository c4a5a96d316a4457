"""bench/record_cost.py (host time per record) and bench/building_blocks.py run and say what
docs/performance.md quotes them for."""

import contextlib
import io
import json

import torch

from bench import building_blocks, record_cost


def test_record_cost_prints_microseconds_per_record_for_every_path():
    out = io.StringIO()
    threads = torch.get_num_threads()
    try:
        with contextlib.redirect_stdout(out):
            assert record_cost.main(["--models", "tiny", "--levels", "api", "--paths", "device,records",
                                     "--repeats", "1", "--writer", "inline", "--json"]) == 0
    finally:
        torch.set_num_threads(threads)
    rows = json.loads(out.getvalue())["rows"]
    assert {(row["level"], row["path"]) for row in rows} == {("api", "device"), ("api", "records")}
    numbers = {(row["level"], row["path"]): row["numbers_ms"] for row in rows}
    for row in rows:
        assert row["records"] > 0 and row["us_per_record"] == row["us_per_record"]
        # start(), stop() and step() take some of the captured step, never all of it
        assert 0 < row["fixed_ms"] < row["captured_ms"]
        assert row["in_step_us_per_record"] == row["in_step_us_per_record"]
        # only the device path computes numbers in the bucket's flushes
        level = row["level"]
        assert numbers[level, "device"] > numbers[level, "records"]


def test_every_building_block_runs_and_agrees_with_float64_without_reading_the_host():
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert building_blocks.main([]) == 0
    rows = [line.split("|")[1:-1] for line in out.getvalue().splitlines()[2:] if line.startswith("| ")]
    assert len(rows) == len(building_blocks.blocks(None))
    for name, ops, reads, error in ([cell.strip() for cell in row] for row in rows):
        assert reads == "0", name
        if error != "-":
            assert float(error) <= 1e-12, (name, error)
