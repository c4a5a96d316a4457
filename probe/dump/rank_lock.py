"""One live writer per dump folder and rank."""

from __future__ import annotations

import errno
import os

from probe.dump.reasons import reason
from probe.errors import DumpError


class RankLock:
    """One live writer per dump folder and rank: an exclusive flock on
    ``{dump_path}/.rank{R}.lock``. The kernel drops it when the process dies, however it
    dies, so a killed run never leaves the folder locked (only an unlocked file, which the
    next run takes over). release() deletes the file. It holds the owner's pid and run id,
    for the message the next run gets. Without fcntl (Windows) there is no lock.
    """

    def __init__(self, dump_path: str, rank: int, run_id: str = ""):
        self.path = os.path.join(os.fspath(dump_path), f".rank{rank}.lock")
        self.rank = rank
        self._fd: int | None = None
        try:
            import fcntl
        except ImportError:  # pragma: no cover - Windows
            return
        while True:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
            except OSError as error:
                raise DumpError(f"cannot create the lock file {self.path}: {reason(error)}") from error
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as error:
                owner = _read_owner(fd)
                os.close(fd)
                if error.errno in (errno.EWOULDBLOCK, errno.EACCES):
                    raise DumpError(
                        f"dump_path {dump_path} rank {rank} is being written by another live "
                        f"run{owner}; use another dump_path, or wait for that run to end"
                    ) from None
                raise DumpError(f"cannot lock {self.path}: {reason(error)}") from error
            # the owner before us may have deleted the file between our open and our flock:
            # then we hold a lock nobody else can see, so take the file that is there now
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(self.path))
            except OSError:
                same = False
            if same:
                break
            os.close(fd)
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"pid {os.getpid()} run_id {run_id}\n".encode(), 0)
        except OSError:  # the lock itself is what matters, the text is a courtesy
            pass
        self._fd = fd

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            try:
                os.remove(self.path)  # still holding the lock: nobody else can own this file
            except OSError:
                pass
            os.close(fd)  # closing the descriptor drops the flock

    def __del__(self):
        self.release()


def _read_owner(fd: int) -> str:
    try:
        text = os.pread(fd, 200, 0).decode("ascii", "replace").split()
    except OSError:
        return ""
    if len(text) >= 2 and text[0] == "pid":
        return f" (pid {text[1]}" + (f", run id {text[3]})" if len(text) >= 4 else ")")
    return ""
