"""probe determinism: identical runs compared bit for bit, the nondeterministic op named.

The nondeterminism is real: tests/scripts/determinism_train.py --unseeded-noise draws from a
torch.Generator seeded from os.urandom, so two runs differ there on every machine.
"""

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn as nn

from probe import Config, PrecisionDebugger
from probe.cli import main
from probe.analysis.determinism import bit_compare, format_report

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO_ROOT, "tests", "scripts", "determinism_train.py")


def noise_line() -> int:
    with open(SCRIPT, encoding="utf-8") as handle:
        return next(n for n, line in enumerate(handle, 1) if "unseeded on purpose" in line)


def determinism(*args, timeout=240):
    """probe determinism in a fresh process, as a user runs it."""
    env = dict(os.environ, PYTHONPATH=REPO_ROOT, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "probe.cli", "determinism", *map(str, args)],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout, env=env)


def test_an_unedited_loop_that_repeats_is_bit_identical_as_probe_run_captures_it(tmp_path):
    """No probe code in the script: the model and the steps are found as under probe run -c."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"writer": "inline"}))  # no writer process to start
    done = determinism("-c", config, "--", sys.executable, SCRIPT, "--unedited", timeout=180)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == ("note (run 1): automatic capture: the model is Sequential (6 parameter "
                        "tensors): the first module trained")
    assert lines[1].startswith("rank 0, run 1 vs run 2: bit-identical (")
    assert "over steps 0, 1)" in lines[1]


def test_an_unseeded_draw_in_an_unedited_script_is_named_with_its_source_line(tmp_path):
    """Level "mix" from the config, task forced to checksum; the modules around the draw
    (Block "1", the root Sequential) also change outputs from identical inputs, but the op
    named and listed is the draw inside them. The script has no probe code."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"task": "statistics", "level": "mix", "seed": 7, "writer": "inline"}))
    dumps = tmp_path / "dumps"
    done = determinism("-c", config, "--dump", dumps, "--", sys.executable, SCRIPT, "--unseeded-noise",
                       "--unedited")
    assert done.returncode == 1, done.stderr
    out = done.stdout
    assert "rank 0, run 1 vs run 2: NOT bit-identical" in out
    assert "nondeterministic op: 1 torch.randn#0 (forward) at step 0" in out
    assert f"source: tests/scripts/determinism_train.py:{noise_line()}" in out
    ranked = [line.strip() for line in out.splitlines() if line.strip()[:3] in ("1. ", "2. ")]
    # only the draw introduced differences; everything after it (forward, backward of ops whose
    # forward differed, the optimizer) inherited them and is not listed
    assert len(ranked) == 1 and ranked[0].startswith("1. 1 torch.randn (forward): 2 calls"), out
    assert "determinism settings in force:" in out and "seed 7, mode false" in out
    assert "deterministic_algorithms false" in out
    assert 'set "mode": true in the config' in out
    assert "torch.randn drew different numbers in identical runs" in out
    assert out.rstrip().endswith(f"dumps: {dumps / 'run1'} {dumps / 'run2'}")
    assert "verdict: the runs differ: the script is not deterministic (2 runs)" in out
    assert "loss " not in out and "loss " in done.stderr  # the script's output stays off stdout
    import probe

    for run in (1, 2):
        with probe.load(str(dumps / f"run{run}")).open(0) as step:
            assert step.attrs["task"] == "checksum" and step.attrs["level"] == "mix"
            assert all(step.records.column("checksum")[step.records.column("dtype") != ""])


def test_no_command_after_the_dashes_is_one_line_and_exit_2(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["determinism"])
    err = capsys.readouterr().err
    assert exited.value.code == 2
    assert err.count("\n") == 1 and "no command given after --" in err


def test_a_script_failing_on_its_own_reports_its_exit_code_and_exit_2():
    done = determinism("--", sys.executable, SCRIPT, "--fail", "3", timeout=120)
    assert done.returncode == 2
    last = done.stderr.strip().splitlines()[-1]
    assert "run 1 of" in last and "failed on its own with exit code 3" in last
    assert "Traceback" not in done.stderr


def test_a_script_that_never_trains_is_told_what_no_capture_saw():
    done = determinism("--", sys.executable, SCRIPT, "--no-debugger", timeout=120)
    assert done.returncode == 2
    assert "wrote no dump" in done.stderr and "no training step was seen" in done.stderr


def test_a_dump_folder_holding_runs_is_not_written_over(tmp_path, capsys):
    (tmp_path / "run1").mkdir()
    (tmp_path / "run1" / "keep.txt").write_text("x")
    with pytest.raises(SystemExit) as exited:
        main(["determinism", "--dump", str(tmp_path), "--", sys.executable, SCRIPT])
    assert exited.value.code == 2 and "already holds files" in capsys.readouterr().err
    assert (tmp_path / "run1" / "keep.txt").read_text() == "x"


class MaybeNoisy(nn.Module):
    def __init__(self, noisy):
        super().__init__()
        self.fc = nn.Linear(3, 3)
        self.noisy = noisy

    def forward(self, x):
        y = self.fc(x)
        if self.noisy:
            y = y + torch.rand(y.shape, generator=torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little")))
        return y.sum()


def test_one_report_per_rank_from_folders_with_two_rank_files(tmp_path, monkeypatch):
    """What torchrun leaves: rank0.h5 and rank1.h5 per step; only rank 1 is nondeterministic."""
    for run in (1, 2):
        for rank in (0, 1):
            monkeypatch.setenv("RANK", str(rank))
            debugger = PrecisionDebugger(Config(task="checksum", dump_path=str(tmp_path / f"run{run}")))
            model = MaybeNoisy(noisy=rank == 1)
            with debugger.capture(model):
                model(torch.ones(2, 3)).backward()
    reports = bit_compare(tmp_path / "run1", tmp_path / "run2")
    assert [(r.rank, r.identical) for r in reports] == [(0, True), (1, False)]
    assert reports[1].first.op == "torch.rand" and reports[1].first.origin == "introduced"
    assert [op.op for op in reports[1].ops] == ["torch.rand"]
    text = "\n".join(format_report(reports[1]))
    assert text.startswith("rank 1, run 1 vs run 2: NOT bit-identical")
    assert "\n".join(format_report(reports[0])).startswith("rank 0, run 1 vs run 2: bit-identical")


def test_a_call_present_in_one_run_only_is_reported_as_a_different_path(tmp_path):
    for run, extra in ((1, False), (2, True)):
        debugger = PrecisionDebugger(Config(task="checksum", dump_path=str(tmp_path / f"run{run}")))
        model = nn.Linear(3, 2)
        with debugger.capture(model):
            y = model(torch.ones(1, 3))
            if extra:
                torch.relu(y)
    (report,) = bit_compare(tmp_path / "run1", tmp_path / "run2")
    assert not report.identical and report.differing == 0
    assert report.only_b and all("torch.relu#0" in key for key in report.only_b) and not report.only_a
    assert "the runs took different paths: 0 records only in run 1" in "\n".join(format_report(report))


@pytest.mark.parametrize("mode, tip_expected", [(False, True), ("warn", True), (True, False)])
def test_the_mode_tip_follows_the_deterministic_setting_in_force(mode, tip_expected):
    from probe.analysis.determinism import DiffCall, RankReport, advice

    first = DiffCall(step=0, rank=0, order=3, module="", op="Tensor.index_add_", index=0,
                     phase="forward", kind="api", source="train.py:9", origin="introduced")
    settings = {"deterministic_algorithms": mode is not False,
                "deterministic_algorithms_warn_only": mode == "warn", "num_threads": 1}
    report = RankReport(rank=0, run_a=1, run_b=2, steps=[0], differing=1, first=first,
                        settings=settings, device="cuda:0")
    tips = advice(report)
    assert any('set "mode": true' in tip or '"mode" is "warn"' in tip for tip in tips) == tip_expected
    assert any("CUBLAS_WORKSPACE_CONFIG is unset" in tip for tip in tips)
    assert not any("drew different numbers" in tip for tip in tips)  # index_add_ is no draw


class NoisyBlock(nn.Module):
    def __init__(self, noisy):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.noisy = noisy

    def forward(self, x):
        x = torch.tanh(self.fc(x))
        if self.noisy:
            seed = int.from_bytes(os.urandom(4), "little")
            x = x + torch.rand(x.shape, generator=torch.Generator().manual_seed(seed))
        return x


@pytest.mark.parametrize("level, named", [("module", ("1", "NoisyBlock")), ("mix", ("1", "torch.rand")),
                                          ("api", ("1", "torch.rand"))])
def test_the_innermost_recorded_call_is_named_at_every_level(tmp_path, level, named):
    """Module level: the block holding the draw (its parent's and the next steps' blocks only
    inherit, through the updated parameters of their children); api/mix: the draw itself."""
    for run in (1, 2):
        debugger = PrecisionDebugger(Config(task="checksum", level=level, dump_path=str(tmp_path / f"run{run}")))
        model = nn.Sequential(NoisyBlock(False), NoisyBlock(True), nn.Linear(4, 1))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(2):
            with debugger.capture(model):
                optimizer.zero_grad()
                model(torch.ones(2, 4)).sum().backward()
                optimizer.step()
    (report,) = bit_compare(tmp_path / "run1", tmp_path / "run2")
    assert (report.first.module, report.first.op) == named and report.first.origin == "introduced"
    assert [(op.module, op.op) for op in report.ops] == [named]


def test_a_scope_that_matches_nothing_exits_2_after_one_run_saying_nothing_was_recorded(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"scope": ["no_such_module"], "writer": "inline"}))
    done = determinism("-c", config, "--", sys.executable, SCRIPT, "--steps", "1", timeout=180)
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert "bit-identical" not in done.stdout
    last = done.stderr.strip().splitlines()[-1]
    assert "nothing was recorded: run 1's step files hold 0 records (run 2 was not started)" in last
    assert "run 2 of 2" not in done.stderr  # the second run would only have cost its time


def test_runs_sharing_one_hash_seed_are_told_hash_order_cannot_show():
    from probe.analysis.determinism import RankReport

    report = RankReport(rank=0, run_a=1, run_b=2, steps=[0], records=5, hash_seeds=("1234", "1234"))
    text = "\n".join(format_report(report))
    assert "PYTHONHASHSEED 1234 in both runs: nondeterminism from str hash order" in text
    assert "`probe determinism --hash-seed vary` gives each run its own" in text
    assert report.to_dict()["hash_seeds"] == ("1234", "1234") and report.to_dict()["recorded"]


def test_hash_seed_vary_gives_each_run_its_own_and_shows_hash_order_nondeterminism(tmp_path):
    """A set of str iterated: with --hash-seed vary its order differs between the runs, and the
    report names the differing input with its values."""
    vary = determinism("--hash-seed", "vary", "--", sys.executable, SCRIPT, "--steps", "1", "--hash-order",
                       timeout=180)
    assert vary.returncode == 1, vary.stderr
    assert "PYTHONHASHSEED 1234 in run 1, 1235 in run 2" in vary.stdout
    assert "first difference (inherited: its inputs already differed)" in vary.stdout
    assert "input input.0 differs: min " in vary.stdout and " in run 1, min " in vary.stdout


def test_a_command_that_is_not_found_is_named_and_exits_2(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["determinism", "--", "pythonx-no-such-program"])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and err.count("\n") == 1
    assert "determinism: command not found: 'pythonx-no-such-program' is not on PATH" in err
    assert "run:" not in err


def test_an_inherited_first_difference_says_which_input_differed_and_its_values(tmp_path):
    """An argument that differs between runs (gelu's approximate) and a tensor that does (the
    data): the text names each slot with both runs' values, as the JSON does."""
    for run, (approximate, shift) in enumerate((("none", 0.0), ("tanh", 0.5)), 1):
        debugger = PrecisionDebugger(Config(task="checksum", level="api", dump_path=str(tmp_path / f"run{run}")))
        x = torch.ones(2, 3) + shift  # made before the capture: not recorded
        with debugger.capture():
            torch.nn.functional.gelu(x, approximate=approximate)
    (report,) = bit_compare(tmp_path / "run1", tmp_path / "run2")
    assert report.first.origin == "inherited" and report.first.op == "functional.gelu"
    text = "\n".join(format_report(report))
    assert "input input.0 differs: min 1, max 1, mean 1, norm " in text
    assert " in run 1, min 1.5, max 1.5, mean 1.5, norm " in text
    assert "input kwarg.approximate differs: \"none\" in run 1, \"tanh\" in run 2" in text
    slots = {d["slot"]: (d["a"], d["b"]) for d in report.to_dict()["first"]["differences"]}
    assert slots["kwarg.approximate"] == ('"none"', '"tanh"')
