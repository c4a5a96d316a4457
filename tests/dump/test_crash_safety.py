"""A killed or failing writer never leaves a file that looks finished; finished steps stay readable."""

import json
import re
import os
import signal
import subprocess
import sys
import uuid

import numpy as np
import pytest
import torch

import probe
from probe.dump import reader, schema
from probe.dump.writer import StepWriter
from probe.errors import DumpError, DumpFormatError
from scripts_dump.dumpkit import root_attrs

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CHILD = os.path.join(REPO_ROOT, "tests", "scripts_dump", "writer_child.py")


def run_child(mode, dump_path, *args, timeout=120):
    return subprocess.run([sys.executable, CHILD, mode, str(dump_path), *map(str, args)], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=timeout)


def kill_when_it_says(command, marker, timeout=120):
    child = subprocess.Popen(command, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = child.stdout.readline()
        assert line.strip() == marker, f"child said {line!r}; stderr: {child.stderr.read()}"
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=timeout)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        child.stdout.close()
        child.stderr.close()
    assert child.returncode == -signal.SIGKILL


def test_process_killed_mid_step_keeps_finished_steps_and_marks_the_step_in_flight(tmp_path):
    dump_path = tmp_path / "dump"
    steps = 3
    kill_when_it_says([sys.executable, CHILD, "hang", str(dump_path), str(steps)], f"in step {steps}")

    partials = list((dump_path / f"step{steps}").glob("rank0.*" + schema.PARTIAL_SUFFIX))
    assert len(partials) == 1, "the step in flight should have left its .partial file"
    partial = partials[0]
    assert not (dump_path / f"step{steps}" / "rank0.h5").exists()

    dump = probe.load(dump_path)
    assert dump.steps == list(range(steps)) and dump.ranks == [0]
    assert dump.incomplete == [str(partial)]
    for step in range(steps):
        with dump.open(step, 0) as step_file:
            assert len(step_file.records) == 4 and step_file.tensor_count == 4
            for tensor_id in range(4):
                expected = np.arange(1024, dtype=np.float32) + 1000 * step + tensor_id
                assert np.array_equal(step_file.tensor(tensor_id), expected)

    inspected = subprocess.run([sys.executable, "-m", "probe.cli", "inspect", str(dump_path)], cwd=REPO_ROOT,
                               capture_output=True, text=True, timeout=60)
    assert inspected.returncode == 0
    assert f"step {steps} rank 0 is incomplete (process killed mid-step?)" in inspected.stderr
    assert f"steps {list(range(steps))}" in inspected.stdout

    with pytest.raises(DumpFormatError, match="is incomplete"):
        reader.open_step_file(partial)


def test_process_killed_in_its_first_step_leaves_no_readable_dump(tmp_path):
    dump_path = tmp_path / "dump"
    kill_when_it_says([sys.executable, CHILD, "hang", str(dump_path), "0"], "in step 0")
    with pytest.raises(DumpFormatError, match="found 1 incomplete .h5.partial") as raised:
        probe.load(dump_path)
    assert str(dump_path) in str(raised.value)


def test_write_failure_in_the_writer_thread_surfaces_as_dump_error_and_leaves_no_file(tmp_path):
    # RLIMIT_FSIZE makes the kernel refuse writes past 1 MiB (EFBIG): a real I/O failure in the
    # writer thread, reproducible without root or a full disk.
    result = run_child("file_limit", tmp_path / "dump")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["where"] in ("add_tensor", "close")
    assert re.fullmatch(rf"cannot write {re.escape(report['path'])}: no space for \d+ bytes \(File too large\)", report["message"])
    assert os.listdir(tmp_path / "dump" / "step0") == []


@pytest.fixture()
def tiny_tmpfs(tmp_path):
    """A 1 MiB tmpfs (needs CAP_SYS_ADMIN; skipped where mounting is not allowed)."""
    mount_point = tmp_path / f"tmpfs-{uuid.uuid4().hex[:8]}"
    mount_point.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount_point)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", str(mount_point)], check=False)


def test_disk_full_surfaces_as_dump_error_naming_the_file_and_leaves_no_file(tiny_tmpfs):
    writer = StepWriter(str(tiny_tmpfs), 0, 0, root_attrs())
    with pytest.raises(DumpError) as raised:
        for _ in range(32):
            writer.add_tensor(torch.ones(64 * 1024))  # 256 KiB each: the 1 MiB tmpfs fills up
        writer.close()
    assert re.fullmatch(rf"cannot write {re.escape(writer.path)}: no space for \d+ bytes "
                        r"\(No space left on device\)", str(raised.value))
    assert os.listdir(tiny_tmpfs / "step0") == []
    # the writer is finished for good, and the next step on a drained disk works again
    with pytest.raises(DumpError, match="already failed"):
        writer.close()
    second = StepWriter(str(tiny_tmpfs), 1, 0, root_attrs())
    second.add_tensor(torch.ones(16))
    with reader.open_step_file(second.close()) as step_file:
        assert step_file.tensor(0).tolist() == [1.0] * 16


def test_writers_open_at_interpreter_exit_are_finished_or_aborted_as_their_hooks_say(tmp_path):
    # step 0: nobody closes it -> the writer module's own atexit hook finishes it
    # step 1: user hook registered before the writer was imported: it runs after h5py's exit
    #         hook (which breaks string writes); the writer's hook has finished the file by then
    #         and the user's close() returns the same path
    # step 2: user hook registered after the import runs first and closes with its attrs
    # step 3: user hook aborts -> no file at all
    result = run_child("exit_hooks", tmp_path / "dump")
    assert result.returncode == 0 and "Error" not in result.stderr, result.stderr
    final = tmp_path / "dump" / "step1" / "rank0.h5"
    assert result.stdout.strip() == f"user hook closed {final}"
    dump = probe.load(tmp_path / "dump")
    assert dump.steps == [0, 1, 2] and dump.incomplete == []
    assert os.listdir(tmp_path / "dump" / "step3") == []
    for step in (0, 1, 2):
        with dump.open(step, 0) as step_file:
            assert list(step_file.records.column("module")) == [f"left_open{step}"]
            assert step_file.tensor(0)[5] == 1000 * step + 5
            assert step_file.attrs.get("closed_by") == ("user" if step == 2 else None)


def test_debugger_process_killed_mid_step_keeps_finished_steps_readable(tmp_path):
    dump_path = tmp_path / "dump"
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"task": "tensor", "dump_path": str(dump_path), "level": "mix"}))
    script = os.path.join(REPO_ROOT, "tests", "scripts_dump", "debugger_child.py")
    kill_when_it_says([sys.executable, script, str(config), "2"], "in step 2")

    dump = probe.load(dump_path)
    assert dump.steps == [0, 1] and dump.ranks == [0]
    assert [os.path.dirname(path) for path in dump.incomplete] == [str(dump_path / "step2")]
    assert schema.parse_partial_file(os.path.basename(dump.incomplete[0])) == 0
    for step in dump.steps:
        with dump.open(step, 0) as step_file:
            table = step_file.records
            assert len(table) > 0 and step_file.tensor_count > 0
            ids = table.column("tensor_id")
            assert set(ids[ids >= 0].tolist()) == set(range(step_file.tensor_count))
            for tensor_id in range(step_file.tensor_count):
                step_file.tensor(tensor_id)  # every stored tensor reads back
    inspected = subprocess.run([sys.executable, "-m", "probe.cli", "inspect", str(dump_path)], cwd=REPO_ROOT,
                               capture_output=True, text=True, timeout=60)
    assert inspected.returncode == 0
    assert "step 2 rank 0 is incomplete (process killed mid-step?)" in inspected.stderr


DISK_FULL_CHILD = os.path.join(REPO_ROOT, "tests", "scripts_dump", "disk_full_child.py")


def _train_on_a_full_disk(tmp_path, dump_path, task, steps=12, fsize_limit=None, policy="raise"):
    config = tmp_path / f"config-{task}-{policy}.json"
    config.write_text(json.dumps({"task": task, "dump_path": str(dump_path), "level": "mix",
                                  "on_write_error": policy}))
    command = [sys.executable, DISK_FULL_CHILD, str(config), str(steps)]
    if fsize_limit is not None:
        command.append(str(fsize_limit))
    result = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, f"the training process died (rc {result.returncode}): {result.stderr[-2000:]}"
    return json.loads(result.stdout)


def _assert_failed_cleanly(report, dump_path, steps, some_fit=True):
    # the disk filled up during the run: some steps were written (some_fit), then the rest failed
    assert report["errors"], "the disk never filled up: the scenario tests nothing"
    assert bool(report["steps_written"]) == some_fit
    # never inside forward/backward/optimizer.step(): only at step() (or, for the last steps
    # handed to the writer process, close()), one error per lost step
    assert {error["where"] for error in report["errors"]} <= {"step", "close"}
    assert all("was not written" in error["message"] for error in report["errors"])
    assert report["optimizer_ok"], "an optimizer step was left half-applied"
    assert report["open_h5"] == 0, "HDF5 objects leaked after the write errors"
    assert sorted(report["steps_written"] + [e["step"] for e in report["errors"]]) == list(range(steps))
    if not some_fit:
        assert not any(name.endswith(".h5") or name.endswith(".partial")
                       for _, _, names in os.walk(dump_path) for name in names)
        return
    dump = probe.load(dump_path)
    assert dump.steps == report["steps_written"] and dump.incomplete == []
    for step in dump.steps:  # every finished step is intact: all records and tensors read back
        with dump.open(step, 0) as step_file:
            assert len(step_file.records) > 0
            for tensor_id in range(step_file.tensor_count):
                step_file.tensor(tensor_id)


@pytest.mark.parametrize("task,filler_kb", [
    ("statistics", 990),  # ~34 KiB left: HDF5 ran out in the middle of step 0 (SIGSEGV 5 of 5 before)
    ("tensor", 0),        # step 0 fits, then the 1 MiB fills up (SIGSEGV 5 of 5 before)
])
def test_disk_full_on_a_real_tmpfs_fails_at_step_without_crashing_or_leaking(tmp_path, tiny_tmpfs, task, filler_kb):
    (tiny_tmpfs / "filler").write_bytes(b"\0" * (filler_kb << 10))
    steps = 6
    report = _train_on_a_full_disk(tmp_path, tiny_tmpfs / "dump", task, steps)
    _assert_failed_cleanly(report, tiny_tmpfs / "dump", steps, some_fit=task == "tensor")


def test_file_size_limit_fails_at_step_without_crashing_or_leaking(tmp_path):
    # the portable simulation: RLIMIT_FSIZE makes every write past the limit fail with EFBIG.
    # The child's batch grows with the step: the first step files fit, the later ones do not.
    steps = 6
    report = _train_on_a_full_disk(tmp_path, tmp_path / "dump", "tensor", steps, fsize_limit=800_000)
    _assert_failed_cleanly(report, tmp_path / "dump", steps)


def test_on_write_error_warn_warns_once_and_training_goes_on(tmp_path):
    steps = 4
    report = _train_on_a_full_disk(tmp_path, tmp_path / "dump", "tensor", steps,
                                   fsize_limit=800_000, policy="warn")
    assert report["errors"] == [] and report["optimizer_ok"] and report["open_h5"] == 0
    assert len(report["warnings"]) == 1
    assert re.match(r"probe: step \d+ was not written: cannot write .*rank0\.h5: no space for \d+ "
                    r"bytes \(File too large\) \(on_write_error is \"warn\"", report["warnings"][0])
    dump = probe.load(tmp_path / "dump")
    assert 0 < len(dump.steps) < steps and dump.steps == list(range(len(dump.steps)))
