"""probe compare on step files: exit codes, one-line errors for bad input, nothing half-written."""

import json
import os
import subprocess
import sys

import h5py
import pytest

from probe.cli import main
from tests.compare.test_compare_support import mlp_run, write_step

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(argv, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    out, err = capsys.readouterr()
    return info.value.code, out, err


@pytest.fixture()
def dumps(tmp_path):
    a, b, bad = tmp_path / "a", tmp_path / "b", tmp_path / "noise"
    for step in (0, 1):
        write_step(mlp_run(), a, step=step)
        write_step(mlp_run(), b, step=step)
        write_step(mlp_run(weight_noise=1e-3 if step == 1 else 0.0), bad, step=step)
    return a, b, bad


def test_identical_dumps_pass_with_exit_0(dumps, capsys):
    a, b, _ = dumps
    code, out, err = _run(["compare", str(a), str(b)], capsys)
    assert code == 0 and out.startswith("PASS: ") and err == ""


def test_divergence_exits_1_and_names_the_first_step_op_and_origin(dumps, capsys):
    a, _, bad = dumps
    code, out, _ = _run(["compare", str(a), str(bad)], capsys)
    assert code == 1
    assert out.splitlines()[0] == "DIVERGED at step 1 rank 0: fc1 functional.linear (forward, output.0) -- introduced"
    assert "source   model.py:10" in out


def test_json_output_is_one_object_with_the_contract_fields(dumps, capsys):
    a, _, bad = dumps
    code, out, _ = _run(["compare", str(a), str(bad), "--json"], capsys)
    data = json.loads(out)
    assert code == 1 and data["verdict"] == "diverged"
    first = data["first_divergence"]
    for field in ("step", "rank", "key", "module", "op", "phase", "slot", "origin", "source", "rel_l2", "max_abs", "cosine"):
        assert field in first
    assert (first["step"], first["module"], first["origin"]) == (1, "fc1", "introduced")
    assert set(data["counts"]) >= {"matched", "only_a", "only_b", "diverged"}
    assert data["evidence"] == "tensor" and data["likely_cause"]["key"] == first["key"]
    assert [s["step"] for s in data["steps"]] == [0, 1] and "float32" in data["tolerances"]["by_dtype"]
    assert isinstance(data["top_ops"], list) and data["top_ops"][0]["module"] == "fc1"


def test_two_files_compare_whatever_their_step_numbers(dumps, capsys):
    a, _, bad = dumps
    code, out, _ = _run(["compare", str(a / "step0" / "rank0.h5"), str(bad / "step1" / "rank0.h5"), "--json"], capsys)
    assert code == 1 and json.loads(out)["first_divergence"]["module"] == "fc1"


def test_step_option_limits_the_compare(dumps, capsys):
    a, _, bad = dumps
    code, out, _ = _run(["compare", str(a), str(bad), "--step", "0"], capsys)
    assert code == 0


def test_reports_are_written_and_csv_has_one_row_per_record(dumps, capsys, tmp_path):
    a, _, bad = dumps
    csv_path, html_path = tmp_path / "rows.csv", tmp_path / "report.html"
    code, _, err = _run(["compare", str(a), str(bad), "--csv", str(csv_path), "--html", str(html_path)], capsys)
    # where the reports went goes to stderr (stdout stays the report itself)
    assert f"wrote the HTML report to {html_path}" in err and f"CSV rows to {csv_path}" in err
    assert code == 1
    lines = csv_path.read_text().splitlines()
    assert len(lines) == 1 + 2 * len(mlp_run().rows)
    page = html_path.read_text()
    assert page.startswith("<!DOCTYPE html>") and 'id="error-chart"' in page and 'id="first-divergence"' in page
    assert [p for p in os.listdir(tmp_path) if p.endswith(".tmp")] == []


def _one_line_error(code, out, err, fragment):
    assert code == 2, err
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("probe: error: ") and fragment in lines[0], err
    assert "Traceback" not in err


def test_missing_path_is_one_line_exit_2(dumps, capsys, tmp_path):
    a, _, _ = dumps
    _one_line_error(*_run(["compare", str(a), str(tmp_path / "nope")], capsys), "does not exist")


def test_file_that_is_not_hdf5_is_one_line_exit_2(dumps, capsys, tmp_path):
    a, _, _ = dumps
    text = tmp_path / "rank0.h5"
    text.write_text("hello")
    _one_line_error(*_run(["compare", str(a / "step0" / "rank0.h5"), str(text)], capsys), "not an HDF5 file")


def test_hdf5_that_is_not_a_probe_dump_is_one_line_exit_2(dumps, capsys, tmp_path):
    a, _, _ = dumps
    other = tmp_path / "other.h5"
    with h5py.File(other, "w") as handle:
        handle["x"] = [1, 2, 3]
    _one_line_error(*_run(["compare", str(a / "step0" / "rank0.h5"), str(other)], capsys), "not a probe dump")


def test_newer_schema_is_one_line_exit_2(dumps, capsys, tmp_path):
    a, b, _ = dumps
    path = b / "step0" / "rank0.h5"
    with h5py.File(path, "r+") as handle:
        handle.attrs["schema_version"] = 99
    _one_line_error(*_run(["compare", str(a / "step0" / "rank0.h5"), str(path)], capsys), "newer probe")


def test_truncated_file_is_one_line_exit_2(dumps, capsys):
    a, b, _ = dumps
    path = b / "step0" / "rank0.h5"
    size = os.path.getsize(path)
    with open(path, "r+b") as handle:
        handle.truncate(size // 2)
    _one_line_error(*_run(["compare", str(a / "step0" / "rank0.h5"), str(path)], capsys), str(path))


def test_empty_dump_folder_is_one_line_exit_2(dumps, capsys, tmp_path):
    a, _, _ = dumps
    empty = tmp_path / "empty"
    empty.mkdir()
    _one_line_error(*_run(["compare", str(a), str(empty)], capsys), "holds no step files")


def test_folders_with_different_steps_fail_unless_allow_missing(dumps, capsys, tmp_path):
    a, _, _ = dumps
    short = tmp_path / "short"
    write_step(mlp_run(), short, step=0)
    _one_line_error(*_run(["compare", str(a), str(short)], capsys), "step 1 rank 0 only in A")
    code, out, _ = _run(["compare", str(a), str(short), "--allow-missing", "--json"], capsys)
    data = json.loads(out)
    assert code == 0 and data["missing"] == ["step 1 rank 0 only in A"] and len(data["steps"]) == 1


def test_a_partial_step_file_is_reported_as_incomplete_not_as_a_missing_step(dumps, capsys):
    """The run died while writing B's step 1: its file is still rank0.<token>.h5.partial."""
    a, b, _ = dumps
    partial = b / "step1" / "rank0.1f2e.h5.partial"
    os.rename(b / "step1" / "rank0.h5", partial)
    code, out, err = _run(["compare", str(a), str(b)], capsys)
    _one_line_error(code, out, err, f"step 1 rank 0 is incomplete in B: its run died while writing it ({partial})")
    assert "only in A" not in err
    code, out, _ = _run(["compare", str(a), str(b), "--allow-missing", "--json"], capsys)
    data = json.loads(out)
    assert code == 0 and data["missing"] == [f"step 1 rank 0 is incomplete in B: its run died while writing it ({partial})"]


def test_folders_with_different_ranks_fail(dumps, capsys, tmp_path):
    a, _, _ = dumps
    ranks = tmp_path / "ranks"
    for step in (0, 1):
        write_step(mlp_run(), ranks, step=step, rank=1)
    _one_line_error(*_run(["compare", str(a), str(ranks)], capsys), "only in A")


@pytest.mark.parametrize("option", ["--csv", "--html"])
def test_unwritable_report_destination_is_one_line_exit_2_and_nothing_is_written(dumps, capsys, tmp_path, option):
    a, b, _ = dumps
    target = tmp_path / "missing_folder" / "out.file"
    _one_line_error(*_run(["compare", str(a), str(b), option, str(target)], capsys), "does not exist")
    folder = tmp_path / "is_a_folder"
    folder.mkdir()
    _one_line_error(*_run(["compare", str(a), str(b), option, str(folder)], capsys), "is a folder")
    assert not target.parent.exists() and os.listdir(folder) == []


def test_bad_mapping_and_tolerance_options_are_one_line_exit_2(dumps, capsys, tmp_path):
    a, b, _ = dumps
    mapping = tmp_path / "map.yaml"
    mapping.write_text("modules: [1]\n")
    _one_line_error(*_run(["compare", str(a), str(b), "--mapping", str(mapping)], capsys), "map.yaml")
    _one_line_error(*_run(["compare", str(a), str(b), "--tol", "bf16=1,2"], capsys), "bf16")


def test_mapping_file_lets_renamed_modules_pair(tmp_path, capsys):
    a, b = tmp_path / "a", tmp_path / "b"
    write_step(mlp_run(), a)
    renamed = mlp_run()
    for row in renamed.rows:
        row["module"] = row["module"].replace("fc1", "encoder.proj")
        row["key"] = row["key"].replace("fc1/", "encoder.proj/")
    write_step(renamed, b)
    code, out, _ = _run(["compare", str(a), str(b), "--json"], capsys)
    assert json.loads(out)["counts"]["only_a"] > 0
    mapping = tmp_path / "map.yaml"
    mapping.write_text("modules:\n  fc1: encoder.proj\n")
    code, out, _ = _run(["compare", str(a), str(b), "--json", "--mapping", str(mapping)], capsys)
    counts = json.loads(out)["counts"]
    assert code == 0 and counts["only_a"] == counts["only_b"] == 0


def test_compare_help_and_run_never_import_torch(dumps):
    a, b, _ = dumps
    code = (
        "import sys, probe.cli\n"
        "try:\n"
        f"    probe.cli.main(['compare', {str(a)!r}, {str(b)!r}, '--json'])\n"
        "except SystemExit as e:\n"
        "    assert e.code == 0, e.code\n"
        "print('torch' in sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "False"


def test_python_api_returns_the_same_result_object(dumps):
    import probe

    a, _, bad = dumps
    result = probe.compare(str(a), str(bad))
    assert result.verdict == "diverged" and result.first_divergence.module == "fc1"
    assert result.to_dict()["counts"] == result.counts and result.rows


def test_a_step_with_no_pairable_record_never_passes(tmp_path, capsys):
    from tests.compare.test_compare_support import SyntheticRun

    a, b = tmp_path / "a", tmp_path / "b"
    write_step(SyntheticRun(), a)
    write_step(mlp_run(), b)
    code, out, _ = _run(["compare", str(a), str(b), "--json"], capsys)
    data = json.loads(out)
    assert code == 1 and data["verdict"] == "diverged"
    assert data["counts"]["matched"] == 0 and data["counts"]["only_b"] == len(mlp_run().rows)
    assert any("no record could be paired" in note for note in data["notes"])
