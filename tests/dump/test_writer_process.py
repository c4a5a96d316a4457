"""Step files written by the writer process (config writer "process"): complete files under
their final name only, errors that reach the user naming the step, a process that never
outlives its parent or hangs it, and writer "inline" as the synchronous fallback."""

import os
import pickle
import signal
import subprocess
import sys
import textwrap
import threading
import time

import h5py
import numpy as np
import pytest
import torch
import torch.nn as nn

import probe
from probe.config import Config
from probe.debugger.debugger import PrecisionDebugger
from probe.dump import background, schema, worker
from probe.errors import ConfigError, DumpError

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
#: the tests that freeze, interrupt or kill a process need POSIX signals; the rest run anywhere
needs_posix_signals = pytest.mark.skipif(
    not hasattr(signal, "SIGSTOP"),
    reason="freezes or kills the writer process with POSIX signals (SIGSTOP, SIGKILL, SIGALRM), "
           "which this platform does not have")


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def _one_step(debugger, model, seed=0):
    torch.manual_seed(seed)
    debugger.start(model)
    model(torch.randn(3, 4)).square().mean().backward()
    debugger.stop()
    debugger.step()


def _running_writer() -> int:
    """Pid of this process's writer process, started if none runs, idle."""
    return background.shared_process().pid


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as status:  # a zombie nobody reaps is gone too
            return any(line.split() == ["State:", "Z", "(zombie)"] for line in status)
    except FileNotFoundError:
        return True


def _wait_gone(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if _gone(pid):
            return True
        time.sleep(0.05)
    return False


def _file_layout(path):
    """Every dataset's name, dtype and shape, and the root attribute names."""
    layout = []
    with h5py.File(path, "r") as handle:
        handle.visititems(lambda name, item: layout.append((name, str(item.dtype), item.shape))
                          if isinstance(item, h5py.Dataset) else None)
        return sorted(layout), sorted(handle.attrs)


# ------------------------------------------------------------------ the files

def test_the_writer_process_writes_the_same_file_as_step_itself(tmp_path):
    files = {}
    for writer in ("process", "inline"):
        debugger = PrecisionDebugger(Config(dump_path=str(tmp_path / writer), writer=writer,
                                            level="mix"))
        model = _model()
        for step in range(3):
            _one_step(debugger, model, seed=step)
        files[writer] = debugger.last_file  # waits for the files in flight
        debugger.close()
    assert files["process"] == os.path.join(str(tmp_path / "process"), "step2", "rank0.h5")
    assert _file_layout(files["process"]) == _file_layout(files["inline"])
    process, inline = probe.load(tmp_path / "process"), probe.load(tmp_path / "inline")
    assert process.steps == inline.steps == [0, 1, 2] and process.incomplete == []
    for step in range(3):
        with process.open(step) as a, inline.open(step) as b:
            assert len(a.records) == len(b.records) > 10
            for name in schema.COLUMN_NAMES:  # NaN statistics compare equal here
                np.testing.assert_array_equal(a.records.column(name), b.records.column(name))
            np.testing.assert_array_equal(a.records.sketches(), b.records.sketches())
            assert a.attrs["schema_version"] == schema.SCHEMA_VERSION == 2
            own = ("run_id", "created", "config", "cost")  # config: dump_path and writer differ; cost: timing
            assert {k: v for k, v in a.attrs.items() if k not in own} == \
                   {k: v for k, v in b.attrs.items() if k not in own}


@needs_posix_signals
def test_step_returns_before_the_file_is_written_and_wait_makes_it_complete(tmp_path):
    pid = _running_writer()
    debugger = PrecisionDebugger(Config(dump_path=str(tmp_path), writer="process"))
    os.kill(pid, signal.SIGSTOP)  # the process holds the step and cannot write it yet
    try:
        _one_step(debugger, _model())
        folder = tmp_path / "step0"
        assert not folder.exists() or os.listdir(folder) == []
    finally:
        os.kill(pid, signal.SIGCONT)
    debugger.wait()
    assert os.listdir(tmp_path / "step0") == ["rank0.h5"]
    debugger.close()


@needs_posix_signals
def test_probe_load_in_the_writing_process_waits_for_files_in_flight(tmp_path):
    pid = _running_writer()
    debugger = PrecisionDebugger(Config(dump_path=str(tmp_path), writer="process"))
    os.kill(pid, signal.SIGSTOP)
    resume = threading.Timer(0.3, os.kill, (pid, signal.SIGCONT))
    try:
        _one_step(debugger, _model())
        resume.start()
        dump = probe.load(tmp_path)  # would find no step file without waiting
    finally:
        resume.cancel()
        os.kill(pid, signal.SIGCONT)
    assert dump.steps == [0] and len(dump.records(step=0)) > 0
    debugger.close()


def test_the_writer_process_never_imports_torch(tmp_path):
    debugger = PrecisionDebugger(Config(dump_path=str(tmp_path), writer="process"))
    _one_step(debugger, _model())
    debugger.wait()
    with open(f"/proc/{background.current_pid()}/maps") as maps:
        libraries = {line.split()[-1] for line in maps if ".so" in line}
    assert any("h5py" in name or "hdf5" in name for name in libraries)
    assert not any("torch" in os.path.basename(name) for name in libraries)
    debugger.close()


def test_a_torch_object_in_a_record_is_refused_by_name_not_unpickled():
    payload = pickle.dumps((0, {"rows": [(torch.float32,)]}))
    with pytest.raises(pickle.UnpicklingError, match="torch"):
        worker._load(payload)
    ticket, job = worker._load(pickle.dumps((1, {"rows": [(np.float64(2.5), np.int64(3))]})))
    assert job["rows"][0] == (2.5, 3)


# ------------------------------------------------------------------ errors

def _block_step_folder(tmp_path, step):
    """A file where the step's folder must go: that step cannot be written."""
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / f"step{step}").write_text("in the way")


def test_a_failed_write_raises_at_a_later_call_naming_the_step_that_failed(tmp_path):
    _block_step_folder(tmp_path, 1)
    debugger = PrecisionDebugger(Config(dump_path=str(tmp_path), writer="process"))
    model = _model()
    raised = []
    for step in range(4):
        try:
            _one_step(debugger, model, seed=step)
        except DumpError as error:
            raised.append(str(error))
    try:
        debugger.close()
    except DumpError as error:
        raised.append(str(error))
    assert len(raised) == 1
    assert raised[0].startswith("step 1 was not written: cannot create dump folder ")
    assert "a file is in the way" in raised[0]
    assert probe.load(tmp_path).steps == [0, 2, 3]
    assert debugger.current_step == 4


def test_on_write_error_warn_warns_once_and_keeps_the_error(tmp_path):
    _block_step_folder(tmp_path, 0)
    debugger = PrecisionDebugger(Config(dump_path=str(tmp_path), writer="process",
                                        on_write_error="warn"))
    model = _model()
    with pytest.warns(RuntimeWarning, match=r"probe: step 0 was not written: .*\"warn\""):
        for step in range(2):
            _one_step(debugger, model, seed=step)
        debugger.wait()
    assert len(debugger.write_errors) == 1 and "step0" in str(debugger.write_errors[0])
    assert debugger.last_file.endswith(os.path.join("step1", "rank0.h5"))
    debugger.close()


@needs_posix_signals
def test_a_killed_writer_process_is_a_dump_error_naming_the_step_not_a_hang(tmp_path):
    pid = _running_writer()
    debugger = PrecisionDebugger(Config(dump_path=str(tmp_path), writer="process"))
    model = _model()
    _one_step(debugger, model)
    debugger.wait()
    os.kill(pid, signal.SIGSTOP)
    _one_step(debugger, model, seed=1)  # handed over, never written
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(DumpError, match=rf"^step 1 was not written: the probe writer process "
                                        rf"\(pid {pid}\) was killed by SIGKILL"):
        debugger.wait()
    _one_step(debugger, model, seed=2)  # a new writer process takes over
    assert background.current_pid() not in (None, pid)
    debugger.close()
    dump = probe.load(tmp_path)
    assert dump.steps == [0, 2] and dump.incomplete == []  # stopped before it began step 1


@needs_posix_signals
def test_ctrl_c_while_handing_over_a_step_loses_only_that_step(tmp_path):
    from scripts_dump.dumpkit import root_attrs, rows_for

    process = background.shared_process()
    pending = background.PendingSteps()
    job = lambda step, rows: {"dump_path": str(tmp_path), "step": step, "rank": 0,  # noqa: E731
                              "attrs": root_attrs("statistics"), "extra": {}, "rows": rows}
    pending.submit(job(0, rows_for(3)), str(tmp_path / "step0" / "rank0.h5"))
    assert pending.pop_done(block=True)[2] is None

    def interrupt(_signal, frame):
        # Ctrl-C only once the hand-over blocks in the pipe: on a loaded machine pickling the
        # step can outlast any fixed delay, and a Ctrl-C there is another case (below)
        while frame is not None:
            if frame.f_code.co_filename.endswith(os.path.join("multiprocessing",
                                                              "connection.py")):
                raise KeyboardInterrupt
            frame = frame.f_back
        signal.setitimer(signal.ITIMER_REAL, 0.1)

    previous = signal.signal(signal.SIGALRM, interrupt)
    os.kill(process.pid, signal.SIGSTOP)  # the pipe fills up: the hand-over blocks half-way
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.1)
        with pytest.raises(KeyboardInterrupt):
            pending.submit(job(1, rows_for(30_000)), str(tmp_path / "step1" / "rank0.h5"))
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        os.kill(process.pid, signal.SIGCONT)
    step, path, error = pending.pop_done(block=True)
    assert step == 1 and path is None
    assert "interrupted while it was handed to the writer process" in str(error)
    assert _wait_gone(process.pid, 10)  # it saw end of file inside the half message
    pending.submit(job(2, rows_for(3)), str(tmp_path / "step2" / "rank0.h5"))  # a new process
    assert pending.pop_done(block=True) == (2, str(tmp_path / "step2" / "rank0.h5"), None)
    assert probe.load(tmp_path).steps == [0, 2]


class _Unpicklable:
    def __init__(self, error):
        self.error = error

    def __reduce__(self):
        raise self.error


@pytest.mark.parametrize("error, said", [(KeyboardInterrupt(), "interrupted while it was handed"),
                                         (TypeError("no"), "could not be handed")])
def test_a_step_that_fails_before_its_hand_over_began_is_lost_without_a_hang(tmp_path, error,
                                                                             said):
    from scripts_dump.dumpkit import root_attrs, rows_for

    pending = background.PendingSteps()
    job = {"dump_path": str(tmp_path), "step": 0, "rank": 0, "attrs": root_attrs("statistics"),
           "extra": {}, "rows": rows_for(3) + [_Unpicklable(error)]}
    with pytest.raises(type(error)):  # Ctrl-C while the step is pickled, or a bad value
        pending.submit(job, str(tmp_path / "step0" / "rank0.h5"))
    step, path, problem = pending.pop_done(block=True)  # answered: no reply is awaited
    assert step == 0 and path is None and said in str(problem)


# ------------------------------------------------------------------ lifetime

def _script(tmp_path, body):
    return textwrap.dedent(f"""
        import os, sys, torch
        sys.path.insert(0, {REPO!r})
        from probe.config import Config
        from probe.debugger.debugger import PrecisionDebugger
        from probe.dump import background
        debugger = PrecisionDebugger(Config(dump_path={str(tmp_path)!r}, writer="process"))
        def one_step():
            debugger.start()
            torch.tanh(torch.ones(3))
            debugger.stop()
            debugger.step()
    """) + textwrap.dedent(body)


def test_interpreter_exit_waits_for_every_step_in_flight_and_ends_the_writer(tmp_path):
    script = _script(tmp_path, """
        for _ in range(3):
            one_step()
        print(background.current_pid(), flush=True)
        # no wait(), no close(): the exit handler waits for the three files
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert probe.load(tmp_path).steps == [0, 1, 2]
    assert _wait_gone(int(done.stdout.split()[0]), 5)


@needs_posix_signals
def test_the_writer_process_ends_when_its_parent_is_killed(tmp_path):
    script = _script(tmp_path, """
        one_step()
        debugger.wait()
        print(background.current_pid(), flush=True)
        import time
        time.sleep(120)
    """)
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        line = parent.stdout.readline()
        os.kill(parent.pid, signal.SIGKILL)
    finally:
        parent.kill()
        parent.wait()
        parent.stdout.close()
    pid = int(line)
    assert _wait_gone(pid, 10), f"writer process {pid} outlived its parent"
    assert probe.load(tmp_path).steps == [0]


# ------------------------------------------------------------------ choosing the writer

def test_writer_inline_writes_inside_step_and_starts_no_process(tmp_path):
    background.shutdown()
    debugger = PrecisionDebugger(Config(dump_path=str(tmp_path), writer="inline"))
    _one_step(debugger, _model())
    assert os.listdir(tmp_path / "step0") == ["rank0.h5"]  # no wait(): step() wrote it
    assert background.current_pid() is None
    debugger.close()


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"),
                    reason="pins this process to one CPU with os.sched_setaffinity, which only Linux has")
def test_writer_auto_uses_the_process_only_with_two_cpus(tmp_path):
    background.shutdown()
    cpus = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, {min(cpus)})
        debugger = PrecisionDebugger(Config(dump_path=str(tmp_path / "one")))
        _one_step(debugger, _model())
        assert background.current_pid() is None
        debugger.close()
    finally:
        os.sched_setaffinity(0, cpus)
    if len(cpus) >= 2:
        debugger = PrecisionDebugger(Config(dump_path=str(tmp_path / "two")))
        _one_step(debugger, _model())
        assert background.current_pid() is not None
        debugger.close()


def test_task_tensor_is_written_inline_whatever_the_writer(tmp_path):
    background.shutdown()
    debugger = PrecisionDebugger(Config(dump_path=str(tmp_path), writer="process", task="tensor"))
    _one_step(debugger, _model())
    assert os.listdir(tmp_path / "step0") == ["rank0.h5"]
    assert background.current_pid() is None
    debugger.close()


def test_writer_accepts_only_auto_process_or_inline():
    with pytest.raises(ConfigError, match=r'writer is "thread" \(string\), expected one of '
                                          r'"auto" \| "process" \| "inline"'):
        Config(writer="thread")
