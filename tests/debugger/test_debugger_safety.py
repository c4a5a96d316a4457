"""The debugger refuses what can never work at construction, keeps two runs apart, and
warns when the selection matches nothing."""

import os
import subprocess
import sys
import time
import warnings

import h5py
import pytest
import torch
import torch.nn as nn

from probe.config import MAX_CONFIG_BYTES, Config, load
from probe.debugger.debugger import PrecisionDebugger
from probe.dump.reader import load as load_dump
from probe.errors import ConfigError, DumpError

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))


def _one_step(debugger, model):
    debugger.start(model)
    model(torch.randn(3, 4)).sum().backward()
    debugger.stop()
    debugger.step()


# ------------------------------------------------------------------ one live writer per dump_path

def test_a_second_live_debugger_on_the_same_dump_path_fails_at_start(tmp_path):
    first = PrecisionDebugger(Config(dump_path=str(tmp_path)))
    second = PrecisionDebugger(Config(dump_path=str(tmp_path)))
    model = _model()
    _one_step(first, model)
    with pytest.raises(DumpError, match=rf"dump_path {tmp_path} rank 0 is being written by another live run "
                                        rf"\(pid {os.getpid()}, run id {first.run_id}\)"):
        second.start(model)
    assert not second.started
    first.close()  # releases the lock: now the second run may write
    _one_step(second, model)
    second.close()
    assert not (tmp_path / ".rank0.lock").exists()


def test_a_killed_run_leaves_no_stuck_lock(tmp_path):
    script = ("import sys, time, torch; sys.path.insert(0, %r)\n"
              "from probe import PrecisionDebugger\n"
              "d = PrecisionDebugger({'dump_path': %r})\n"
              "m = torch.nn.Linear(2, 2); d.start(m); m(torch.ones(1, 2))\n"
              "print('locked', flush=True); time.sleep(60)\n") % (REPO, str(tmp_path))
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "locked"
        blocked = PrecisionDebugger(Config(dump_path=str(tmp_path)))
        with pytest.raises(DumpError, match=f"pid {child.pid}"):
            blocked.start(_model())
        child.kill()
        child.wait(timeout=20)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    after = PrecisionDebugger(Config(dump_path=str(tmp_path)))
    _one_step(after, _model())  # the kernel dropped the dead run's lock
    after.close()


def test_every_step_file_carries_the_run_id_and_runs_get_different_ids(tmp_path):
    runs = []
    for name in ("a", "b"):
        debugger = PrecisionDebugger(Config(dump_path=str(tmp_path / name)))
        for _ in range(2):
            _one_step(debugger, _model())
        debugger.close()
        dump = load_dump(tmp_path / name)
        ids = set()
        for step in dump.steps:
            with dump.open(step, 0) as step_file:
                ids.add(step_file.attrs["run_id"])
                assert step_file.schema_version == 2
        assert ids == {debugger.run_id}
        runs.append(debugger.run_id)
    assert runs[0] != runs[1]


def test_temporary_step_files_are_unique_per_writer(tmp_path):
    from probe.dump.writer import StepWriter
    from scripts_dump.dumpkit import root_attrs

    first = StepWriter(str(tmp_path), 0, 0, root_attrs())
    second = StepWriter(str(tmp_path), 0, 0, root_attrs())
    assert first.partial_path != second.partial_path
    first.add_tensor(torch.ones(3))
    second.add_tensor(torch.zeros(5))
    first.abort()
    with h5py.File(second.close(), "r") as handle:  # the other writer's abort did not touch it
        assert handle["tensors/0"].shape == (5,)


# ------------------------------------------------------------------ selections that select nothing

def test_a_scope_matching_no_module_warns_once_at_start_with_a_suggestion(tmp_path):
    model = nn.Sequential()
    model.add_module("encoder", nn.Linear(4, 4))
    debugger = PrecisionDebugger(Config(dump_path=str(tmp_path), scope=("encodr",)))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(3):
            debugger.start(model)
            model(torch.randn(2, 4))
            debugger.stop()
            debugger.step()
    messages = [str(w.message) for w in seen if "probe:" in str(w.message)]
    assert messages == ["probe: scope ['encodr'] selects no module of this Sequential (1 modules); "
                        "did you mean 'encoder'? the step files will hold no records of modules in scope"]


def test_a_list_matching_no_call_warns_once_at_the_step(tmp_path):
    debugger = PrecisionDebugger(Config(dump_path=str(tmp_path), list=("functional.linaer",)))
    model = _model()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(2):
            _one_step(debugger, model)
    messages = [str(w.message) for w in seen if "probe:" in str(w.message)]
    assert len(messages) == 1 and "step 0 recorded nothing" in messages[0]
    assert "functional.linaer" in messages[0]


def test_a_matching_scope_does_not_warn(tmp_path):
    debugger = PrecisionDebugger(Config(dump_path=str(tmp_path), scope=("0",)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _one_step(debugger, _model())


# ------------------------------------------------------------------ config problems surface at construction

def test_a_dump_path_that_is_a_file_fails_at_construction(tmp_path):
    existing = tmp_path / "taken"
    existing.write_text("x")
    with pytest.raises(ConfigError, match=r'dump_path ".*taken" is an existing file, expected a folder'):
        PrecisionDebugger(Config(dump_path=str(existing)))
    with pytest.raises(ConfigError, match=r"cannot be created: .*taken is a file"):
        PrecisionDebugger(Config(dump_path=str(existing / "below")))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="uses /proc, where nobody can create files")
def test_a_read_only_dump_path_fails_at_construction():
    with pytest.raises(ConfigError, match=r'dump_path "/proc/probe_dump" is not writable: cannot create a file in /proc'):
        PrecisionDebugger(Config(dump_path="/proc/probe_dump"))


def test_probe_run_checks_the_dump_path_before_starting_the_command(tmp_path):
    existing = tmp_path / "taken"
    existing.write_text("x")
    config = tmp_path / "config.json"
    config.write_text('{"dump_path": "%s"}' % existing)
    marker = tmp_path / "ran"
    result = subprocess.run([sys.executable, "-m", "probe", "run", "-c", str(config), "--", sys.executable, "-c",
                             f"open({str(marker)!r}, 'w')"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and not marker.exists()
    assert result.stderr.strip().splitlines() == [
        f'probe: error: {config}: dump_path "{existing}" is an existing file, expected a folder (or a path to create)']


def test_an_oversized_config_file_is_refused_quickly(tmp_path):
    big = tmp_path / "big.json"
    big.write_text('{"seed": 1, "scope": ["' + "x" * (MAX_CONFIG_BYTES + 10) + '"]}')
    started = time.perf_counter()
    with pytest.raises(ConfigError, match=rf"big.json: the config file is \d+ bytes, expected at most {MAX_CONFIG_BYTES}"):
        load(big)
    assert time.perf_counter() - started < 1.0


@pytest.mark.parametrize("word", ["yes", "on", "On", "no", "off", "y"])
def test_yaml_yes_and_on_are_not_booleans(tmp_path, word):
    path = tmp_path / "config.yaml"
    path.write_text(f"mode: {word}\n")
    with pytest.raises(ConfigError, match=rf'mode is "{word}" \(string\), expected false, true or "warn".*write true or false'):
        load(path)
    path.write_text(f"remove_dropout: {word}\n")
    with pytest.raises(ConfigError, match="remove_dropout .*expected true or false"):
        load(path)
    path.write_text("mode: true\nremove_dropout: false\n")
    assert load(path).mode is True


def test_on_write_error_accepts_only_raise_or_warn(tmp_path):
    assert Config().on_write_error == "raise"
    assert Config(on_write_error="warn").on_write_error == "warn"
    with pytest.raises(ConfigError, match=r'on_write_error is "ignore" \(string\), expected one of "raise" \| "warn"'):
        Config(on_write_error="ignore")
