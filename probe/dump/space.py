"""Disk space for a step file, reserved before HDF5 may need it.

HDF5 must never see ENOSPC (or EFBIG). After a failed write HDF5 1.14 can free memory it
still uses, and h5py's flush()/close() then crashes the process (measured: SIGSEGV in 24 of
25 statistics runs on a full tmpfs). So before every HDF5 call that can grow the file, the
writer reserves the bytes it is about to need (SpaceReservation.ensure); when that fails,
HDF5 has not been asked to write anything, and the writer removes the file cleanly.
"""

from __future__ import annotations

import errno
import os

#: bytes kept reserved beyond what the writer knows it will write next: HDF5's own metadata
#: (object headers, B-tree nodes, heaps; ~0.5-1 KiB per dataset) is allocated as it goes
RESERVE_SLACK = 32 << 10
#: estimated HDF5 metadata per dataset and per attribute, on top of their data bytes
#: (tests/dump/test_dump_writer.py checks HDF5 never outgrows the reservation)
DATASET_OVERHEAD = 1024
ATTR_OVERHEAD = 128
_NO_SPACE = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)


#: with more free space than this left after a write, and no file size limit near, a
#: free-space check is the reservation: allocating ahead costs ~15 ms per step file on ext4
#: (the rename and truncate of allocated blocks), and another process would have to fill
#: this much of the disk within milliseconds to make HDF5 see ENOSPC
PLENTY_FREE_BYTES = 1 << 30


class SpaceReservation:
    """Keeps the file's allocated size ahead of what HDF5 will write.

    ``ensure(size)`` makes sure the bytes [0, size) of the file can be written. With plenty
    of free space left (PLENTY_FREE_BYTES) and no file size limit (RLIMIT_FSIZE) near, a
    statvfs check says so; otherwise posix_fallocate allocates them on disk (it also extends
    the file, which HDF5 tolerates: it tracks its own end of file; ``extended`` tells the
    writer to cut the file back). Where posix_fallocate is missing or unsupported, the
    free-space check stands in. Raises OSError saying how many bytes it could not get.
    """

    def __init__(self, fd: int, path: str):
        self.fd = fd
        self.path = path
        self.reserved = 0
        self.extended = False
        #: most bytes HDF5 ever held beyond the reservation (seen at ensure()): must stay 0
        self.overshoot = 0

    def ensure(self, size: int) -> None:
        if size <= self.reserved:
            return
        if _plenty_of_space(self.path, size, size - self.reserved):
            self.reserved = size
            return
        # grow by an eighth more than asked: one call covers the next few small tensors
        for target in (size + size // 8, size):
            try:
                _allocate(self.fd, self.path, target - self.reserved, self.reserved)
            except OSError as error:
                if error.errno in _NO_SPACE and target != size:
                    continue
                raise OSError(error.errno, f"no space for {size} bytes ({error.strerror})") from None
            self.reserved = target
            self.extended = True
            return


def _plenty_of_space(path: str, size: int, extra: int) -> bool:
    try:
        stats = os.statvfs(os.path.dirname(path) or ".")
    except (OSError, AttributeError):  # no statvfs (Windows): allocate
        return False
    if stats.f_bavail * stats.f_frsize - extra < PLENTY_FREE_BYTES:
        return False
    try:
        import resource
    except ImportError:  # pragma: no cover - Windows
        return True
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    return limit == resource.RLIM_INFINITY or size + PLENTY_FREE_BYTES <= limit


def _allocate(fd: int, path: str, length: int, offset: int) -> None:
    if hasattr(os, "posix_fallocate"):
        try:
            os.posix_fallocate(fd, offset, length)
            return
        except OSError as error:
            if error.errno not in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                raise
    stats = os.statvfs(os.path.dirname(path) or ".")  # no fallocate here: check free space
    if stats.f_bavail * stats.f_frsize < length:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
