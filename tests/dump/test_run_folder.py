"""One run per dump_path: a second run is refused at construction, or, with "overwrite": true,
removes the first run's step files whole before it writes; rank 1 of the same run is never
refused because of what rank 0 wrote."""

import json
import os
import subprocess
import sys
import time

import pytest
import torch
import torch.nn as nn

import probe
from probe import Config, PrecisionDebugger, RunExistsError
from probe.dump import run_folder

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(path, steps, **config):
    """A finished run of a tiny model: ``steps`` captured steps into path; its run id."""
    debugger = PrecisionDebugger(Config(dump_path=str(path), writer="inline", **config))
    model = nn.Linear(3, 2)
    for _ in range(steps):
        with debugger.capture(model):
            model(torch.ones(2, 3)).sum().backward()
    debugger.close()
    return debugger.run_id


def _run_ids(path):
    dump = probe.load(str(path))
    ids = {}
    for step, rank in dump.files:
        with dump.open(step, rank) as step_file:
            ids[(step, rank)] = step_file.attrs["run_id"]
    return ids


def test_a_second_run_into_the_same_dump_path_is_refused_at_construction_naming_the_run(tmp_path):
    first = _run(tmp_path / "dump", 3)
    before = _run_ids(tmp_path / "dump")
    with pytest.raises(RunExistsError) as refused:
        PrecisionDebugger(Config(dump_path=str(tmp_path / "dump")))
    message = str(refused.value)
    assert f"dump_path {tmp_path / 'dump'} already holds another run: steps 0-2 of rank 0 (run id {first}, written " \
        in message
    assert "Use another dump_path, or set \"overwrite\": true in the config to remove that run's step files first" \
        in message
    assert isinstance(refused.value, probe.DumpError) and "\n" not in message
    assert _run_ids(tmp_path / "dump") == before  # nothing touched


def test_overwrite_removes_the_old_run_whole_so_a_shorter_run_leaves_no_mixture(tmp_path):
    dump = tmp_path / "dump"
    _run(dump, 3)
    (dump / "notes.txt").write_text("mine")  # the user's files are not probe's to remove
    (dump / "plots").mkdir()
    (dump / "step2" / "keep.txt").write_text("mine too")
    second = _run(dump, 2, overwrite=True)
    ids = _run_ids(dump)
    assert sorted(ids) == [(0, 0), (1, 0)] and set(ids.values()) == {second}
    assert (dump / "notes.txt").read_text() == "mine" and (dump / "plots").is_dir()
    assert (dump / "step2" / "keep.txt").exists() and not (dump / "step2" / "rank0.h5").exists()


def test_rank_1_of_the_same_run_is_not_refused_by_the_folder_rank_0_made_and_wrote(tmp_path, monkeypatch):
    dump = tmp_path / "dump"
    monkeypatch.setenv("RANK", "0")
    _run(dump, 1)
    monkeypatch.setenv("RANK", "1")
    _run(dump, 1)  # no error: rank 1 has no files of its own here
    assert sorted(probe.load(str(dump)).files) == [(0, 0), (0, 1)]
    with pytest.raises(RunExistsError, match="step 0 of rank 1"):
        PrecisionDebugger(Config(dump_path=str(dump)))  # rank 1 again: its own old file


def test_rank_0_counts_other_ranks_files_only_when_they_are_older_than_its_run(tmp_path, monkeypatch):
    """A finished 2-rank run, then a 1-rank run: rank 0 must see the old rank 1 file (or the
    folder would mix runs); files of this run's other ranks are newer than its processes."""
    dump = tmp_path / "dump"
    monkeypatch.setenv("RANK", "1")
    _run(dump, 1)
    rank1 = dump / "step0" / "rank1.h5"
    now = time.time()
    os.utime(rank1, (now - 3600, now - 3600))
    assert run_folder.other_runs_files(str(dump), 0, started=now - 60) == [(0, 1, str(rank1))]
    assert run_folder.other_runs_files(str(dump), 0, started=now - 7200) == []  # written by this run
    with pytest.raises(RunExistsError, match="step 0 of rank 1"):
        run_folder.claim(str(dump), 0, False, started=now - 60)
    run_folder.claim(str(dump), 0, True, started=now - 60)
    assert not dump.joinpath("step0").exists()


def test_overwrite_never_removes_the_files_of_a_live_run(tmp_path):
    dump = tmp_path / "dump"
    live = PrecisionDebugger(Config(dump_path=str(dump), writer="inline"))
    model = nn.Linear(3, 2)
    with live.capture(model):  # holds dump_path's rank 0 lock until close()
        model(torch.ones(1, 3))
    try:
        with pytest.raises(RunExistsError, match="rank 0 is being written by another live run"):
            PrecisionDebugger(Config(dump_path=str(dump), overwrite=True))
        assert (dump / "step0" / "rank0.h5").exists()
    finally:
        live.close()


def test_overwrite_must_be_a_bool_in_the_config_file(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"overwrite": "yes"}))
    with pytest.raises(probe.ConfigError, match=r"config.json.*overwrite.*true or false"):
        probe.load_config(str(path))


def test_probe_run_refuses_before_launching_and_with_overwrite_removes_the_old_run(tmp_path):
    dump = tmp_path / "dump"
    _run(dump, 2)
    config, marker = tmp_path / "config.json", tmp_path / "ran"
    command = [sys.executable, "-m", "probe", "run", "-c", str(config), "--", sys.executable, "-c",
               f"open({str(marker)!r}, 'w')"]
    config.write_text(json.dumps({"dump_path": str(dump)}))
    refused = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and not marker.exists()
    assert "already holds another run: steps 0-1 of rank 0" in refused.stderr
    config.write_text(json.dumps({"dump_path": str(dump), "overwrite": True}))
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and marker.exists(), done.stderr
    assert run_folder.step_files(str(dump)) == []
