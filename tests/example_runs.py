"""An example script run as its user runs it, from a temporary working directory: in a fresh
interpreter, or in the test's own process (``python script.py ARGS`` minus the interpreter's
start, which costs more than most examples' smoke size: importing torch and, with the first
optimizer, dynamo). An example that starts processes of its own (probe run, probe determinism,
torchrun, fresh training jobs) still starts them; their output is read with the script's."""

import contextlib
import os
import runpy
import subprocess
import sys
import tempfile

import process_state


def fresh_interpreter(script, cwd, *args, timeout=300):
    """(exit code, stdout, stderr) of ``python script ARGS`` in a new process, one intra-op
    thread (tiny models gain nothing from more, and idle OpenMP threads spin against the
    other test processes)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, script, *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)
    return done.returncode, done.stdout, done.stderr


def this_process(script, cwd, *args):
    """(exit code, stdout, stderr) of the script run as ``__main__`` in this process, its
    standard streams caught at the file descriptors, so that what the processes it starts
    print is read too (line-buffered: the lines keep their order). The process state the
    script may change (environment, working directory, warning filters, torch's global
    settings, sys.argv and sys.path) is put back after. What earlier test modules left alive
    is out of the garbage collector's sight already (conftest.py freezes it)."""
    saved, argv, path = process_state.save(), sys.argv, list(sys.path)
    with tempfile.TemporaryFile("w+", buffering=1) as out, tempfile.TemporaryFile("w+", buffering=1) as err:
        with _streams_to(out, err):
            sys.argv = [script, *args]
            os.chdir(cwd)
            try:
                runpy.run_path(script, run_name="__main__")
                code = 0
            except SystemExit as exited:
                code = _exit_code(exited.code)
            finally:
                sys.argv, sys.path[:] = argv, path
                process_state.restore(saved)
        out.seek(0)
        err.seek(0)
        return code, out.read(), err.read()


def _exit_code(code) -> int:
    """The status ``sys.exit(code)`` gives the interpreter: None is 0, a message is 1."""
    if code is None:
        return 0
    return code if isinstance(code, int) else 1


@contextlib.contextmanager
def _streams_to(out, err):
    """sys.stdout/sys.stderr and file descriptors 1/2 write to ``out``/``err`` (a child process
    inherits the descriptors; Python's own writes go through sys.stdout, which pytest's capture
    has replaced)."""
    sys.stdout.flush()
    sys.stderr.flush()
    kept = os.dup(1), os.dup(2)
    os.dup2(out.fileno(), 1)
    os.dup2(err.fileno(), 2)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                yield
            finally:
                out.flush()
                err.flush()
    finally:
        os.dup2(kept[0], 1)
        os.dup2(kept[1], 2)
        os.close(kept[0])
        os.close(kept[1])
