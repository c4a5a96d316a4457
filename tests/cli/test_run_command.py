import json
import os
import signal
import subprocess
import sys
import time

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PRINT_HASH = [sys.executable, "-c", "print(hash('x'))"]
PRINT_ENV = [sys.executable, "-c",
             "import json, os; print(json.dumps({k: os.environ.get(k) for k in "
             "('PYTHONHASHSEED', 'CUBLAS_WORKSPACE_CONFIG', 'HCCL_DETERMINISTIC', "
             "'PROBE_CONFIG', 'PROBE_SEED')}))"]


def _clean_env(**extra):
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONHASHSEED", "CUBLAS_WORKSPACE_CONFIG", "HCCL_DETERMINISTIC",
                        "PROBE_CONFIG", "PROBE_SEED")}
    env["PYTHONPATH"] = REPO_ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


def probe(*args, env=None, cwd=None):
    return subprocess.run([sys.executable, "-m", "probe", *args], capture_output=True, text=True,
                          env=env or _clean_env(), cwd=cwd or REPO_ROOT, timeout=60)


def test_probe_run_fixes_the_childs_str_hash_seed():
    plain = {subprocess.run(PRINT_HASH, capture_output=True, text=True, env=_clean_env()).stdout
             for _ in range(3)}
    assert len(plain) > 1, "control: without probe run, str hashes are randomized per process"
    first = probe("run", "--seed", "5", "--", *PRINT_HASH)
    second = probe("run", "--seed", "5", "--", *PRINT_HASH)
    other = probe("run", "--seed", "6", "--", *PRINT_HASH)
    assert first.returncode == second.returncode == other.returncode == 0
    assert first.stdout == second.stdout != other.stdout


def test_probe_run_passes_the_childs_exit_code_through():
    result = probe("run", "--", sys.executable, "-c", "import sys; sys.exit(3)")
    assert result.returncode == 3


def test_probe_run_with_mode_on_sets_cublas_hccl_and_absolute_probe_config(tmp_path):
    (tmp_path / "cfg.json").write_text('{"seed": 77, "mode": true}')
    result = probe("run", "-c", "cfg.json", "--", *PRINT_ENV, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    env = json.loads(result.stdout)
    assert env == {"PYTHONHASHSEED": "77", "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
                   "HCCL_DETERMINISTIC": "true", "PROBE_CONFIG": str(tmp_path / "cfg.json"),
                   "PROBE_SEED": None}
    assert "PYTHONHASHSEED=77" in result.stderr  # the diagnostic line says what was set


def test_probe_run_with_mode_off_sets_only_the_hash_seed_and_config(tmp_path):
    (tmp_path / "cfg.yaml").write_text("seed: 9\n")
    env = json.loads(probe("run", "-q", "-c", str(tmp_path / "cfg.yaml"), "--", *PRINT_ENV).stdout)
    assert env["PYTHONHASHSEED"] == "9"
    assert env["CUBLAS_WORKSPACE_CONFIG"] is None and env["HCCL_DETERMINISTIC"] is None


def test_probe_run_keeps_a_users_cublas_setting_and_seed_flag_overrides_config(tmp_path):
    (tmp_path / "cfg.json").write_text('{"seed": 1, "mode": "warn"}')
    result = probe("run", "-q", "-c", str(tmp_path / "cfg.json"), "--seed", "4", "--", *PRINT_ENV,
                   env=_clean_env(CUBLAS_WORKSPACE_CONFIG=":16:8"))
    env = json.loads(result.stdout)
    assert env["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"
    assert env["PYTHONHASHSEED"] == "4" and env["PROBE_SEED"] == "4"
    assert result.stderr == ""


def _assert_one_line_error(result, *fragments):
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("probe: error: ")
    for fragment in fragments:
        assert fragment in lines[0]


def test_probe_run_with_a_bad_config_exits_2_with_one_line_and_does_not_run(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"seed": 1, "levl": "api"}')
    marker = tmp_path / "ran"
    result = probe("run", "-c", str(bad), "--", sys.executable, "-c",
                   f"open({str(marker)!r}, 'w').close()")
    _assert_one_line_error(result, "bad.json", "'levl'", "did you mean 'level'?")
    assert not marker.exists()


def test_probe_run_with_malformed_config_exits_2_naming_line_and_column(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"seed": 1,}')
    _assert_one_line_error(probe("run", "-c", str(bad), "--", "python", "-c", "pass"),
                           "bad.json", "line 1, column 12")


def test_probe_run_without_a_command_exits_2_with_usage():
    _assert_one_line_error(probe("run", "--seed", "1"), "no command given", "probe run [-c")


def test_probe_run_with_an_unknown_executable_exits_2():
    _assert_one_line_error(probe("run", "--", "no-such-program-xyz"),
                           "command not found: 'no-such-program-xyz'")


def test_probe_run_rejects_a_seed_out_of_range():
    result = probe("run", "--seed", str(2**32), "--", "python", "-c", "pass")
    assert result.returncode == 2
    assert "Traceback" not in result.stderr and "--seed" in result.stderr


def test_probe_run_help_teaches_with_examples():
    result = probe("run", "--help")
    assert result.returncode == 0
    assert "probe run -c config.json -- python train.py" in result.stdout
    assert "PYTHONHASHSEED" in result.stdout and "PROBE_CONFIG" in result.stdout


@pytest.mark.skipif(os.name != "posix", reason="POSIX signals")
@pytest.mark.parametrize("signum,handles_it,expected", [
    (signal.SIGTERM, True, 7),
    (signal.SIGTERM, False, 128 + signal.SIGTERM),
    (signal.SIGINT, True, 7),  # no terminal here, so the SIGINT must be forwarded
    (signal.SIGHUP, True, 7),
    (signal.SIGUSR1, True, 7),
    (signal.SIGUSR2, True, 7),
])
def test_probe_run_forwards_signals_to_the_child(signum, handles_it, expected):
    handler = f"signal.signal({int(signum)}, lambda *a: sys.exit(7)); " if handles_it else ""
    child = (f"import signal, sys, time; {handler}print('ready', flush=True); time.sleep(30); "
             "sys.exit(0)")
    process = subprocess.Popen([sys.executable, "-m", "probe", "run", "-q", "--",
                                sys.executable, "-c", child],
                               stdin=subprocess.DEVNULL,  # no terminal: as under a scheduler
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env=_clean_env(), cwd=REPO_ROOT)
    try:
        assert process.stdout.readline().strip() == "ready"
        process.send_signal(signum)
        assert process.wait(timeout=20) == expected
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def _alive(pid: int) -> bool:
    """True while pid runs (a zombie waiting for its new parent to reap it counts as dead)."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only")
def test_probe_run_killed_with_sigkill_takes_its_child_along():
    child = "import os, time; print(os.getpid(), flush=True); time.sleep(60)"
    process = subprocess.Popen([sys.executable, "-m", "probe", "run", "-q", "--",
                                sys.executable, "-c", child],
                               stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env=_clean_env(), cwd=REPO_ROOT)
    try:
        grandchild = int(process.stdout.readline())
        assert _alive(grandchild)
        process.kill()  # SIGKILL: no handler of probe run can forward anything
        process.wait(timeout=20)
        deadline = time.monotonic() + 10
        while _alive(grandchild) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(grandchild), "the training process outlived probe run (orphaned)"
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_probe_run_unknown_option_is_a_usage_error_with_a_suggestion():
    result = probe("run", "--sed", "42", "--", "python", "-c", "pass")
    _assert_one_line_error(result, "No such option '--sed'", "Did you mean '--seed'?")


def test_probe_run_model_without_a_config_is_a_usage_error(capsys):
    """--model names the model of the automatic capture, which only -c starts."""
    from probe.cli import main

    for options in (["--model", "Policy"], ["-c", "x.json", "--no-attach", "--model", "Policy"]):
        with pytest.raises(SystemExit) as exited:
            main(["run", *options, "--", sys.executable, "-c", "pass"])
        err = capsys.readouterr().err
        assert exited.value.code == 2 and "--model names the model of the automatic capture" in err
