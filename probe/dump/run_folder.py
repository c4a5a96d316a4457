"""One run per dump_path: a new run never writes its steps over another run's.

A run writes ``{dump_path}/step{N}/rank{R}.h5`` one step at a time, so a 2-step run started
over a finished 3-step run would replace steps 0 and 1 and leave the old step 2 beside them: a
folder that compares as one run but is two. ``PrecisionDebugger(...)`` calls ``claim`` at
construction, which refuses (RunExistsError) when the folder already holds another run's step
files, or, with config ``"overwrite": true``, removes them first, whole.

Which files belong to another run (the rule, docs/config.md):

* every process looks at the files of its own rank (``step*/rank{R}.h5`` and its
  ``rank{R}.*.h5.partial`` leftovers): a new run has written none of them yet when its
  debugger is constructed, so any that exist are another run's;
* rank 0 also looks at the files of every other rank that are older than its own process:
  files a run's other ranks write are always newer than the run's processes (a step trains
  before it is written), so rank 1 of the same run never trips rank 0, and a run with fewer
  ranks than the last one does not leave the old ranks' files beside its own.

So rank 1 never refuses because rank 0 of the same run created the folder or wrote its first
step. Only probe's own step files are ever removed (and step folders they leave empty); any
other file in dump_path is left alone. ``probe run -c config.json`` applies the same rule to
every rank before it launches anything. Imports neither torch nor, until a message needs a
run id, h5py.
"""

from __future__ import annotations

import datetime
import os
import time

from probe.dump import schema
from probe.errors import DumpError, RunExistsError

#: when this module was imported: the fallback for the process start time (it is imported when
#: probe.debugger.debugger is, before any debugger is constructed)
_IMPORTED_AT = time.time()


def process_start_time() -> float:
    """When this process started (seconds since the epoch): from /proc on Linux, else the time
    probe.dump.run_folder was imported."""
    try:
        with open("/proc/self/stat", encoding="ascii") as handle:
            fields = handle.read().rsplit(")", 1)[1].split()
        ticks = int(fields[19])  # field 22 of stat(5), counted after the ")" of the name
        with open("/proc/stat", encoding="ascii") as handle:
            boot = next(int(line.split()[1]) for line in handle if line.startswith("btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration, AttributeError):
        return _IMPORTED_AT


def step_files(dump_path: str) -> list[tuple[int, int, str]]:
    """(step, rank, path) of every step file and .h5.partial leftover under dump_path."""
    found = []
    try:
        names = os.listdir(dump_path)
    except OSError:
        return found
    for name in names:
        step = schema.parse_step_dir(name)
        folder = os.path.join(dump_path, name)
        if step is None or not os.path.isdir(folder):
            continue
        try:
            files = os.listdir(folder)
        except OSError:
            continue
        for file_name in files:
            rank = schema.parse_rank_file(file_name)
            if rank is None:
                rank = schema.parse_partial_file(file_name)
            if rank is not None:
                found.append((step, rank, os.path.join(folder, file_name)))
    return sorted(found)


def other_runs_files(dump_path: str, rank: int, started: float | None = None) -> list[tuple[int, int, str]]:
    """The step files under dump_path that another run wrote, by the rule above. ``started``:
    when this run started (None: this process's start; ``float("inf")`` for a launcher, to
    which every file already there is another run's)."""
    files = step_files(dump_path)
    if rank != 0:
        return [entry for entry in files if entry[1] == rank]
    if started is None:
        started = process_start_time()
    return [entry for entry in files if entry[1] == rank or _mtime(entry[2]) < started]


def _mtime(path: str) -> float:
    try:
        return os.stat(path).st_mtime
    except OSError:
        return float("inf")  # gone already: not another run's file to worry about


def claim(dump_path: str, rank: int, overwrite: bool, source: str = "the config",
          started: float | None = None) -> list[str]:
    """Make dump_path this run's: refuse when another run's step files are there, or remove
    them with ``overwrite``. Returns the paths removed. ``started=float("inf")`` counts every
    rank's files (a launcher, before any rank runs)."""
    dump_path = os.fspath(dump_path)
    if not os.path.isdir(dump_path):
        return []
    files = other_runs_files(dump_path, rank, started)
    if not files:
        return []
    if not overwrite:
        source = source if source and not source.startswith("<") else "the config"
        raise RunExistsError(
            f"dump_path {dump_path} already holds another run: {describe(files)}; a new run would "
            "replace its steps one by one and leave a mixture of both. Use another dump_path, or "
            f'set "overwrite": true in {source} to remove that run\'s step files first')
    _refuse_live(dump_path, {entry[1] for entry in files})
    removed = []
    for _, _, path in files:
        try:
            os.remove(path)
            removed.append(path)
        except FileNotFoundError:
            pass
        except OSError as error:
            raise DumpError(f'"overwrite": cannot remove {path} of the run in {dump_path}: '
                            f"{error.strerror or error}") from error
    for folder in sorted({os.path.dirname(path) for _, _, path in files}):
        try:
            os.rmdir(folder)  # only when it is empty: another rank's files or the user's stay
        except OSError:
            pass
    return removed


def _refuse_live(dump_path: str, ranks: set[int]) -> None:
    """A live run still holds the lock of one of these ranks: its files are not to be removed."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows: no locks to ask
        return
    for rank in sorted(ranks):
        lock = os.path.join(dump_path, f".rank{rank}.lock")
        try:
            fd = os.open(lock, os.O_RDONLY)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:
            raise RunExistsError(
                f'"overwrite": dump_path {dump_path} rank {rank} is being written by another live '
                "run; use another dump_path, or wait for that run to end") from None
        finally:
            os.close(fd)


def describe(files: list[tuple[int, int, str]]) -> str:
    """'steps 0-2 of rank 0 (run id 3f9c..., written 2026-11-25 17:40:03 UTC)'."""
    steps = sorted({step for step, _, _ in files})
    ranks = sorted({rank for _, rank, _ in files})
    newest = max(files, key=lambda entry: _mtime(entry[2]))[2]
    shown = (f"step {steps[0]}" if len(steps) == 1 else
             f"steps {steps[0]}-{steps[-1]}" if steps == list(range(steps[0], steps[-1] + 1))
             else "steps " + ", ".join(map(str, steps)))
    rank_text = f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))
    facts = []
    run_id = _run_id(newest)
    if run_id:
        facts.append(f"run id {run_id}")
    stamp = _mtime(newest)
    if stamp != float("inf"):
        when = datetime.datetime.fromtimestamp(stamp, datetime.timezone.utc)
        facts.append(f"written {when:%Y-%m-%d %H:%M:%S} UTC")
    partial = sum(1 for _, _, path in files if path.endswith(schema.PARTIAL_SUFFIX))
    if partial:
        facts.append(f"{partial} incomplete .h5.partial file(s)")
    return f"{shown} of {rank_text}" + (f" ({', '.join(facts)})" if facts else "")


def _run_id(path: str) -> str:
    """The run_id root attribute of a finished step file ("" when unreadable or absent)."""
    if path.endswith(schema.PARTIAL_SUFFIX):
        return ""
    from probe.dump.reader import open_step_file
    from probe.errors import ProbeError

    try:
        with open_step_file(path) as step_file:
            return str(step_file.attrs.get("run_id") or "")
    except (ProbeError, OSError, ImportError):
        return ""


__all__ = ["claim", "other_runs_files", "step_files", "describe", "process_start_time", "RunExistsError"]
