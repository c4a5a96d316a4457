"""Clean failure around compare and inspect: reports never overwrite an input, empty or mixed
dumps are never a silent pass, the runs' differences are said, usage errors are one line."""

import json
import os
import subprocess
import sys

import pytest
import torch

from probe.comparison import load
from probe.dump.writer import StepWriter
from scripts_dump.dumpkit import make_row, root_attrs
from tests.cli.test_compare_cli import REPO, _run


def _write(dump, step=0, task="statistics", rows=None, tensors=(), rank=0, **attrs):
    writer = StepWriter(str(dump), step, rank, root_attrs(task=task, step=step, rank=rank, **attrs))
    ids = [writer.add_tensor(t) for t in tensors]
    if rows is None:
        rows = [make_row(module="fc", seq=0, tensor_id=ids[0] if ids else -1,
                         checksum="ab" if ids else "")]
    writer.add_rows(rows)
    return writer.close()


@pytest.fixture()
def pair(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    for step in (0, 1):
        _write(a, step)
        _write(b, step)
    return a, b


def _assert_one_line_error(code, out, err, *fragments):
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("probe: error: "), err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


# ------------------------------------------------------------------ reports never overwrite an input

@pytest.mark.parametrize("option", ["--csv", "--html"])
@pytest.mark.parametrize("target", ["input_file", "inside_step_folder", "step_file_name"])
def test_a_report_aimed_at_an_input_exits_2_and_writes_nothing(pair, capsys, option, target):
    a, b = pair
    path = {"input_file": b / "step1" / "rank0.h5",
            "inside_step_folder": b / "step1" / "report.txt",
            "step_file_name": b / "step1" / "rank3.h5"}[target]
    before = {p: p.read_bytes() for p in b.rglob("*") if p.is_file()}
    code, out, err = _run(["compare", str(a), str(b), option, str(path)], capsys)
    _assert_one_line_error(code, out, err, option, "refusing to overwrite an input")
    assert {p: p.read_bytes() for p in b.rglob("*") if p.is_file()} == before


def test_a_report_aimed_at_an_input_file_given_directly_is_refused(pair, capsys):
    a, b = pair
    file_b = b / "step0" / "rank0.h5"
    before = file_b.read_bytes()
    code, out, err = _run(["compare", str(a / "step0" / "rank0.h5"), str(file_b), "--html", str(file_b)], capsys)
    _assert_one_line_error(code, out, err, "--html", "is the input")
    assert file_b.read_bytes() == before


def test_two_reports_on_one_path_exit_2_and_write_nothing(pair, tmp_path, capsys):
    a, b = pair
    target = tmp_path / "report.out"
    code, out, err = _run(["compare", str(a), str(b), "--csv", str(target), "--html", str(target)], capsys)
    _assert_one_line_error(code, out, err, "--csv and --html both name")
    assert not target.exists()


def test_a_report_next_to_the_step_folders_is_fine(pair, capsys):
    a, b = pair
    code, _, err = _run(["compare", str(a), str(b), "--html", str(b / "report.html")], capsys)
    assert code == 0 and (b / "report.html").exists(), err


def test_python_write_html_refuses_to_overwrite_an_input(pair):
    import probe
    from probe.errors import CompareError

    a, b = pair
    result = probe.compare(a, b)
    with pytest.raises(CompareError, match="refusing to overwrite an input"):
        result.write_html(b / "step0" / "rank0.h5")


# ------------------------------------------------------------------ empty dumps and evidence labels

def test_two_empty_dumps_are_not_a_pass(tmp_path, capsys):
    _write(tmp_path / "a", rows=[])
    _write(tmp_path / "b", rows=[])
    code, out, _ = _run(["compare", str(tmp_path / "a"), str(tmp_path / "b")], capsys)
    assert code == 1
    assert out.splitlines()[0] == "NOT A PASS: no record could be compared (0 records in A, 0 in B)"
    assert "nothing was compared" in out and "evidence: none" in out
    code, out, _ = _run(["compare", str(tmp_path / "a"), str(tmp_path / "b"), "--json"], capsys)
    data = json.loads(out)
    assert code == 1 and data["verdict"] == "diverged" and data["evidence"] == "none"


@pytest.mark.parametrize("tensor_side", ["a", "b"])
def test_a_statistics_and_tensor_pair_is_not_labelled_tensor_evidence(tmp_path, capsys, tensor_side):
    t = torch.arange(6.0).reshape(2, 3)
    for side in ("a", "b"):
        if side == tensor_side:
            _write(tmp_path / side, task="tensor", tensors=[t])
        else:
            _write(tmp_path / side, task="statistics")
    code, out, _ = _run(["compare", str(tmp_path / "a"), str(tmp_path / "b"), "--json"], capsys)
    data = json.loads(out)
    assert data["evidence"] == "statistics"
    code, out, _ = _run(["compare", str(tmp_path / "a"), str(tmp_path / "b")], capsys)
    assert "evidence: tensor" not in out and "evidence: statistics" in out


# ------------------------------------------------------------------ the runs differ in

def test_the_hash_seed_compared_is_the_one_each_interpreter_started_with_not_the_one_seed_all_set(tmp_path, capsys):
    _write(tmp_path / "a", determinism={"env": {"PYTHONHASHSEED": "1234"}, "hash_seed_at_start": "1234"})
    _write(tmp_path / "b", determinism={"env": {"PYTHONHASHSEED": "1234"}, "hash_seed_at_start": None})
    code, out, _ = _run(["compare", str(tmp_path / "a"), str(tmp_path / "b")], capsys)
    assert code == 0 and "  PYTHONHASHSEED: 1234 in A, random in B\n" in out


def test_compare_says_which_recorded_settings_differ_in_terminal_json_and_html(tmp_path, capsys):
    _write(tmp_path / "a", seed_report={"seed": 1, "mode": False},
           determinism={"num_threads": 1, "deterministic_algorithms": True})
    _write(tmp_path / "b", seed_report={"seed": 2, "mode": False}, torch_version="2.4.0",
           determinism={"num_threads": 16, "deterministic_algorithms": False}, probe_version="other")
    html = tmp_path / "r.html"
    code, out, _ = _run(["compare", str(tmp_path / "a"), str(tmp_path / "b"), "--html", str(html)], capsys)
    assert code == 0
    expected = ["seed: 1 in A, 2 in B", "threads: 1 in A, 16 in B", "torch version: 2.13.0+cpu in A, 2.4.0 in B",
                "probe version: test in A, other in B", "deterministic algorithms: true in A, false in B"]
    block = out[out.index("the runs differ in"):]
    for line in expected:
        assert f"  {line}\n" in block
    page = html.read_text()
    assert "the runs differ in" in page and all(line in page for line in expected)
    code, out, _ = _run(["compare", str(tmp_path / "a"), str(tmp_path / "b"), "--json"], capsys)
    differences = {d["setting"]: (d["a"], d["b"]) for d in json.loads(out)["run_differences"]}
    assert differences["seed"] == ("1", "2") and differences["threads"] == ("1", "16")
    assert "device" not in differences  # equal settings are not listed


def test_identical_settings_print_no_differences_block(pair, capsys):
    a, b = pair
    code, out, _ = _run(["compare", str(a), str(b)], capsys)
    assert code == 0 and "the runs differ in" not in out
    assert load.run_differences(root_attrs(), root_attrs()) == []


# ------------------------------------------------------------------ a folder mixing two runs

def test_inspect_and_compare_report_a_folder_mixing_two_runs(tmp_path, capsys):
    mixed, clean = tmp_path / "mixed", tmp_path / "clean"
    _write(mixed, 0, run_id="1111")
    _write(mixed, 1, run_id="2222")
    _write(clean, 0, run_id="3333")
    _write(clean, 1, run_id="3333")
    code, _, err = _run(["inspect", str(mixed)], capsys)
    assert code == 0
    assert "holds step files of 2 different runs (rank 0 run 1111: step 0; rank 0 run 2222: step 1)" in err
    code, out, _ = _run(["inspect", str(mixed), "--json"], capsys)
    assert "2 different runs" in json.loads(out)["mixed_runs"]
    code, out, _ = _run(["compare", str(clean), str(mixed)], capsys)
    assert f"note: B: {mixed} holds step files of 2 different runs" in out
    code, _, err = _run(["inspect", str(clean)], capsys)
    assert "different runs" not in err


def test_the_ranks_of_one_distributed_job_are_not_a_mix_of_runs(tmp_path, capsys):
    # every rank has a debugger, and a run id, of its own
    job = tmp_path / "job"
    for step in (0, 1):
        _write(job, step, rank=0, run_id="aaaa")
        _write(job, step, rank=1, run_id="bbbb")
    code, _, err = _run(["inspect", str(job)], capsys)
    assert code == 0 and "different runs" not in err
    _write(job, 2, rank=1, run_id="cccc")  # a second run appended to rank 1's steps
    code, _, err = _run(["inspect", str(job)], capsys)
    assert "2 different runs (rank 1 run bbbb: step 0, step 1; rank 1 run cccc: step 2)" in err


# ------------------------------------------------------------------ CLI consistency

@pytest.mark.parametrize("argv,fragments", [
    (["compare", "a", "b", "--top", "-1"], ["compare: Invalid value for '--top'"]),
    (["compare", "a", "b", "--tpo", "3"], ["No such option '--tpo'", "'--top'"]),
    (["inspect", "x", "--step", "one"], ["inspect: Invalid value for '--step'"]),
    (["compaer", "a", "b"], ["no such command 'compaer'; did you mean 'compare'?"]),
])
def test_usage_errors_are_one_probe_error_line_with_exit_2(argv, fragments, capsys):
    code, out, err = _run(argv, capsys)
    _assert_one_line_error(code, out, err, *fragments)


def test_disjoint_steps_hint_names_a_command_that_works(tmp_path, capsys):
    _write(tmp_path / "a", 0)
    _write(tmp_path / "b", 5)
    code, out, err = _run(["compare", str(tmp_path / "a"), str(tmp_path / "b")], capsys)
    _assert_one_line_error(code, out, err, "no step and rank in common")
    assert "--allow-missing" not in err
    suggested = err.strip().split("probe compare ", 1)[1].split()
    code, out, err = _run(["compare", *suggested], capsys)
    assert code == 0, err


def test_inspect_into_a_closed_pipe_exits_quietly(pair):
    a, _ = pair
    for step in range(2, 40):  # enough output to outlast the pipe buffer
        _write(a, step, rows=[make_row(module=f"m{i}", seq=i) for i in range(50)])
    command = f"{sys.executable} -m probe inspect {a} | head -n 1"
    result = subprocess.run(["bash", "-o", "pipefail", "-c", command], cwd=REPO, capture_output=True,
                            text=True, timeout=60)
    assert result.stdout.count("\n") == 1
    assert result.stderr == "", result.stderr
    assert result.returncode == 141
