"""Step files written by a writer process while the training thread goes on (config writer).

Writing a step file is HDF5 work that holds the GIL from start to end (h5py takes it for every
HDF5 call): ~2.2 ms for a file of 30 records, ~8 ms for 2,000 (docs/performance.md). A thread
would still take that time from the training thread; a process does not. So the debugger
hands a finished step's records to one writer process per training process (probe/dump/
worker.py: numpy and h5py, no torch) and returns; the process writes step N while step N+1
trains. What the training thread still pays is pickling the rows (~0.5 us per record) and
one write to a pipe.

* WriterProcess: one child process and its two pipes. Started with subprocess (fork + exec of
  a fresh interpreter, never a bare fork), shared by every debugger of this process, started
  again if it died. Its death is noticed on the reply pipe (end of file), so nothing waits
  for a dead process.
* PendingSteps: one debugger's steps in flight, in order; at most MAX_IN_FLIGHT of them
  (step() waits for the oldest beyond that, which bounds memory and how late an error is
  reported).
* wait_for_path(path): probe.load and friends, in this process, wait for pending files under
  a path before they list it (probe/dump/reader.py calls it when this module is loaded).
"""

from __future__ import annotations

import collections
import json
import os
import pickle
import signal
import subprocess
import sys
import threading
import weakref

from probe.errors import DumpError

#: steps of one debugger handed to the writer process and not yet confirmed written
MAX_IN_FLIGHT = 4
#: ask the kernel for pipes this large (the default is 64 KiB; Linux allows 1 MiB unprivileged)
PIPE_BYTES = 1 << 20
_F_SETPIPE_SZ = 1031  # fcntl.F_SETPIPE_SZ (Linux), absent from the fcntl module before 3.10
#: seconds interpreter exit waits for the writer process after handing it its last step
EXIT_WAIT_SECONDS = 600

#: the child imports what this process would: this process's sys.path comes first
_BOOT = ("import json, sys; sys.path[:0] = json.loads(sys.argv[1]); "
         "from probe.dump.worker import main; sys.exit(main(sys.argv[2:]))")


class WriterProcess:
    """A writer process of this process and the two pipes to it. Thread-safe."""

    def __init__(self) -> None:
        from multiprocessing.connection import Connection

        request_read, request_write = os.pipe()
        reply_read, reply_write = os.pipe()
        try:
            _grow_pipe(request_write)
            root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
            self._process = subprocess.Popen(
                [sys.executable or "python", "-c", _BOOT, json.dumps([root, *sys.path]),
                 str(request_read),
                 str(reply_write), str(os.getpid())],
                pass_fds=(request_read, reply_write), stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL, close_fds=True)
        except BaseException:
            for fd in (request_read, request_write, reply_read, reply_write):
                os.close(fd)
            raise
        os.close(request_read)
        os.close(reply_write)
        self.pid = self._process.pid
        self._owner = os.getpid()
        self._requests = Connection(request_write, readable=False)
        self._replies = Connection(reply_read, writable=False)
        self._send_lock = threading.Lock()
        self._receive_lock = threading.Lock()
        self._next_ticket = 0
        self._results: dict[int, tuple[str | None, str | None]] = {}
        #: ticket -> absolute path of the file, for the steps the process has not answered
        self._unanswered: dict[int, str] = {}
        #: ticket -> step, for the steps whose debugger is gone: a failure is printed
        self._orphans: dict[int, int] = {}
        #: why the process is gone (None while it runs)
        self.failure: str | None = None
        #: why this handle sends no more steps (an interrupted hand-over), None while it does
        self._abandoned: str | None = None

    @property
    def usable(self) -> bool:
        return self.failure is None and self._abandoned is None and self._owner == os.getpid()

    def _abandon(self, why: str, ticket: int | None = None) -> None:
        """Send nothing more: the process writes what it received whole and ends; this
        handle still collects its replies. ticket: the step that is lost."""
        self._abandoned = why
        try:
            self._requests.close()
        except OSError:
            pass
        if ticket is not None:
            self._unanswered.pop(ticket, None)
            self._results[ticket] = (None, why)

    def ticket(self, path: str) -> int:
        """A new ticket for the file at path, to send() next."""
        with self._send_lock:
            ticket = self._next_ticket
            self._next_ticket += 1
            self._unanswered[ticket] = os.path.abspath(path)
        return ticket

    def send(self, ticket: int, job: dict) -> None:
        """Hand one step file to the process. Blocks only while the pipe is full (the
        process then holds several steps already)."""
        with self._send_lock:
            try:
                payload = pickle.dumps((ticket, job), protocol=pickle.HIGHEST_PROTOCOL)
            except Exception as error:  # nothing went out: only this step is lost
                self._unanswered.pop(ticket, None)
                self._results[ticket] = (None, f"could not be handed to the writer process "
                                               f"(pid {self.pid}): {error!r}")
                raise
            except BaseException:  # Ctrl-C before the hand-over began: no reply will come
                self._abandon(f"interrupted while it was handed to the writer process "
                              f"(pid {self.pid})", ticket)
                raise
            if self.failure is None:
                try:
                    self._requests.send_bytes(payload)
                except OSError:  # the process is gone: its reply pipe says how
                    self._read_replies(block_for=ticket)
                except BaseException:  # Ctrl-C half-way: the process gets end of file there
                    self._abandon(f"interrupted while it was handed to the writer process "
                                  f"(pid {self.pid})", ticket)
                    raise

    def result(self, ticket: int, block: bool) -> tuple[str | None, str | None] | None:
        """(path, None) or (None, error message) once the ticket's file is done, else None
        (block: wait for it). A result is handed out once."""
        if ticket not in self._results and ticket in self._unanswered:
            self._read_replies(block_for=ticket if block else None)
        with self._receive_lock:
            return self._results.pop(ticket, None)

    def wait(self, ticket: int) -> None:
        """Wait until the ticket's file is done, leaving its result for result()."""
        if ticket not in self._results and ticket in self._unanswered:
            self._read_replies(block_for=ticket)

    def _read_replies(self, block_for: int | None) -> None:
        with self._receive_lock:
            try:
                while self.failure is None and (
                        (block_for is not None and block_for in self._unanswered)
                        or self._replies.poll(0)):
                    ticket, path, error = pickle.loads(self._replies.recv_bytes())
                    self._answered(ticket, path, error)
            except (EOFError, OSError):
                self._died()
            except BaseException:  # Ctrl-C mid-reply: the replies that follow cannot be trusted
                self._abandon(f"interrupted while waiting for the writer process (pid "
                              f"{self.pid}); it may still have written this step's file: see "
                              "`probe inspect`")
                self.failure = self._abandoned
                raise
            finally:
                if self.failure is not None:  # no answer will come for the steps still out
                    for ticket in list(self._unanswered):
                        self._answered(ticket, None, self.failure)

    def _answered(self, ticket: int, path: str | None, error: str | None) -> None:
        self._unanswered.pop(ticket, None)
        step = self._orphans.pop(ticket, None)
        if step is None:
            self._results[ticket] = (path, error)
        elif error is not None:
            _report_orphan(step, error)

    def waiting_under(self, folder: str) -> list[int]:
        """Tickets of the files not yet answered at or below folder."""
        return [ticket for ticket, path in list(self._unanswered.items()) if _is_under(path, folder)]

    def orphan(self, ticket: int, step: int) -> None:
        """Nobody will ask for this ticket's result (its debugger is gone): should the step
        fail, say so on stderr rather than never."""
        with self._receive_lock:
            if ticket in self._results:
                _path, error = self._results.pop(ticket)
                if error is not None:
                    _report_orphan(step, error)
            elif ticket in self._unanswered:
                self._orphans[ticket] = step

    def _died(self) -> None:
        try:
            code = self._process.wait(timeout=10)
        except subprocess.TimeoutExpired:  # closed its pipe but lives on: end it
            self._process.kill()
            code = self._process.wait()
        how = f"exited with code {code}"
        if code < 0:
            try:
                how = f"was killed by {signal.Signals(-code).name}"
            except ValueError:
                how = f"was killed by signal {-code}"
        self.failure = (f"the probe writer process (pid {self.pid}) {how} before it finished "
                        "this step file (its own error, if it printed one, is on stderr)")
        self._close_pipes()

    def close(self, timeout: float | None = None) -> None:
        """No more steps: let the process write what it holds and end; wait for it."""
        if self._owner != os.getpid():
            return
        with self._send_lock:
            try:
                self._requests.close()
            except OSError:
                pass
        try:
            self._process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        self._read_replies(block_for=None)  # the replies already sent, then end of file
        if self.failure is None:
            self.failure = "the probe writer process was closed"
        self._close_pipes()

    def _close_pipes(self) -> None:
        for connection in (self._requests, self._replies):
            try:
                connection.close()
            except OSError:
                pass


def _report_orphan(step: int, error: str) -> None:
    print(f"probe: error: step {step} was not written: {error}", file=sys.stderr)


def _grow_pipe(fd: int) -> None:
    try:
        import fcntl

        fcntl.fcntl(fd, _F_SETPIPE_SZ, PIPE_BYTES)
    except (ImportError, OSError):  # not Linux, or a lower limit: the default pipe works too
        pass


_SHARED: WriterProcess | None = None
_SHARED_LOCK = threading.Lock()


def shared_process() -> WriterProcess:
    """This process's writer process, started (again) if there is none or it died.
    Raises OSError when no process can be started."""
    global _SHARED
    with _SHARED_LOCK:
        if _SHARED is None or not _SHARED.usable:
            _SHARED = WriterProcess()
        return _SHARED


def current_pid() -> int | None:
    """Pid of this process's writer process, if one is running."""
    process = _SHARED
    return process.pid if process is not None and process.usable else None


class PendingSteps:
    """One debugger's step files handed to the writer process, oldest first."""

    def __init__(self, max_in_flight: int = MAX_IN_FLIGHT) -> None:
        self.max_in_flight = max_in_flight
        #: (process, ticket, step, path); process None for a step written inline (add_done)
        self._items: collections.deque = collections.deque()
        # not at interpreter exit: the debugger's exit handler delivers them (close())
        weakref.finalize(self, _orphan_all, self._items).atexit = False

    def __len__(self) -> int:
        return len(self._items)

    def submit(self, job: dict, path: str) -> None:
        """Hand over one step (job as worker.write_job takes it); path: where it will be."""
        job = dict(job, attrs=_plain(job["attrs"]), extra=_plain(job["extra"]))
        process = shared_process()
        ticket = process.ticket(path)
        self._items.append((process, ticket, job["step"], path))  # even if send() is interrupted
        process.send(ticket, job)

    def full(self) -> bool:
        return len(self._items) >= self.max_in_flight

    def wait_oldest(self) -> None:
        """Wait until the oldest step is done (its result stays for pop_done)."""
        if self._items and self._items[0][0] is not None:
            process, ticket = self._items[0][:2]
            process.wait(ticket)

    def add_done(self, step: int, path: str | None, error: DumpError | None) -> None:
        """A step written some other way (inline), to be delivered after the ones before it."""
        self._items.append((None, (path, error), step, path))

    def pop_done(self, block: bool) -> tuple[int, str | None, DumpError | None] | None:
        """The oldest step once written or failed: (step, path, None) or (step, None,
        DumpError); None when it is still being written (and not block) or nothing is
        pending."""
        if not self._items:
            return None
        process, ticket, step, path = self._items[0]
        if process is None:  # add_done
            self._items.popleft()
            return (step, *ticket)
        result = process.result(ticket, block)
        if result is None:
            return None
        self._items.popleft()
        problem = result[1]
        return (step, path, None) if problem is None else (step, None, DumpError(problem))


def _orphan_all(items: collections.deque) -> None:
    for process, ticket, step, _ in items:
        if process is not None:
            process.orphan(ticket, step)


def wait_for_path(path) -> None:
    """Reading a dump in the process that writes it: wait for this process's step files
    still being written at or below path."""
    process = _SHARED
    if process is None or not process.usable:
        return
    for ticket in process.waiting_under(os.path.abspath(os.fspath(path))):
        process.wait(ticket)


def _is_under(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def shutdown(timeout: float = EXIT_WAIT_SECONDS) -> None:
    """End this process's writer process after it wrote what it holds (interpreter exit)."""
    global _SHARED
    with _SHARED_LOCK:
        process, _SHARED = _SHARED, None
    if process is not None:
        process.close(timeout)


def _plain(value):
    """A copy of attrs with every str/int/float subclass (torch.__version__ is one) made a
    plain one, so that the writer process never needs the module defining it."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, dict):
        return {_plain(key): _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    for kind in (bool, str, int, float):
        if isinstance(value, kind):
            return kind(value) if kind is not str else str.__str__(value)
    return str(value)  # what the writer would store for it anyway (json.dumps default=str)
