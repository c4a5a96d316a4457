"""The writer process: writes the step files one training process hands it.

Started by probe/dump/background.py as a fresh interpreter (``python -c ... REQUEST_FD
REPLY_FD``), never by fork: a process holding CUDA, or threads, must not fork. It imports
numpy, h5py and probe.dump.writer, never torch, and writes each file with writer.StepWriter
(the same file, the same .partial rule, the same disk-full safety as a write inside step()).

Protocol: multiprocessing.connection framing on two pipes.

    request   pickle of (ticket, job); job = {"dump_path", "step", "rank", "attrs", "extra",
              "rows"}, as the debugger would hand them to StepWriter(...).add_rows/close
    reply     pickle of (ticket, path, None) when the file is finished and renamed, or
              (ticket, None, message) when it could not be written (the message of the
              DumpError StepWriter raised, or of the unexpected error)

A reader thread takes requests off the pipe as they come, so the training process never
waits for a file in progress to hand over the next step; the main thread writes them in order.
The process ends when the request pipe reaches end of file (the parent closed it, or died)
after writing every request it had received whole; and, should a forked child of the parent
keep the pipe open, within a second of the parent's death. It ignores SIGINT: Ctrl-C in a
terminal reaches the whole process group, and the parent decides when writing stops.
"""

from __future__ import annotations

import io
import os
import pickle
import queue
import signal
import sys
import threading
import traceback

#: modules the request unpickler may load globals from: numpy scalars and arrays in rows
_ALLOWED_MODULES = ("numpy", "numpy.core.multiarray", "numpy._core.multiarray",
                    "numpy.core.numeric", "numpy._core.numeric")
#: seconds between checks that the parent is still alive while no request comes
PARENT_CHECK_SECONDS = 1.0


class _RowsUnpickler(pickle.Unpickler):
    """Plain Python values and numpy values only: a torch object in a request is refused
    (it would import torch here), and nothing else can run code."""

    def find_class(self, module, name):
        if module in _ALLOWED_MODULES or (module == "builtins" and name in ("complex", "bytearray")):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(
            f"a record value of type {module}.{name} cannot be written (expected str, int, "
            "float, None, tuples and numpy values)")


def _load(payload: bytes):
    return _RowsUnpickler(io.BytesIO(payload)).load()


def write_job(job: dict) -> str:
    """Write one step file; return its path or raise (DumpError for every expected failure)."""
    from probe.dump.writer import StepWriter

    writer = StepWriter(job["dump_path"], job["step"], job["rank"], job["attrs"])
    return writer.finish(job["rows"], job["extra"])


def _read_requests(requests, inbox: queue.Queue, parent: int) -> None:
    """Move whole requests from the pipe to inbox; None at the end."""
    try:
        while True:
            if not requests.poll(PARENT_CHECK_SECONDS):
                if os.getppid() != parent:  # orphaned: write what arrived whole, then end
                    while requests.poll(0):
                        inbox.put(requests.recv_bytes())
                    return
                continue
            inbox.put(requests.recv_bytes())
    except (EOFError, OSError):
        return
    finally:
        inbox.put(None)


def serve(request_fd: int, reply_fd: int, parent: int) -> None:
    from multiprocessing.connection import Connection

    requests = Connection(request_fd, writable=False)
    replies = Connection(reply_fd, readable=False)
    inbox: queue.Queue = queue.Queue()
    reader = threading.Thread(target=_read_requests, args=(requests, inbox, parent),
                              name="probe-writer-requests", daemon=True)
    reader.start()
    parent_gone = False
    while True:
        payload = inbox.get()
        if payload is None:
            return
        ticket = None
        try:
            ticket, job = _load(payload)
            del payload
            reply = (ticket, write_job(job), None)
        except Exception as error:
            from probe.errors import DumpError

            if not isinstance(error, DumpError):  # a bug, not a full disk: keep the traceback
                traceback.print_exc(file=sys.stderr)
            reply = (ticket, None, str(error) or type(error).__name__)
        if parent_gone:
            continue
        try:
            replies.send_bytes(pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL))
        except OSError:  # the parent is gone: finish what it handed over, tell nobody
            parent_gone = True


def _yield_to_training() -> None:
    """SCHED_BATCH: a request arriving never preempts the training process on its own CPU
    (measured: without it, the step() that handed over a step waited ~3 ms inside write()
    while this process, just woken, wrote the file on the training thread's core)."""
    try:
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
    except (AttributeError, OSError):  # not Linux
        pass


def main(argv=None) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _yield_to_training()
    argv = sys.argv[1:] if argv is None else argv
    request_fd, reply_fd, parent = (int(value) for value in argv[:3])
    import probe.dump.writer  # noqa: F401  (h5py now, not in the middle of the first step)

    serve(request_fd, reply_fd, parent)
    return 0


if __name__ == "__main__":
    sys.exit(main())
