"""Report files are written whole or not at all.

check_destination() runs before the compare, so an unwritable --csv/--html path fails in
a second instead of after a long compare; write_atomic() writes a temporary file next to
the destination and renames it over the destination only once it is complete.
write_report() does both, for CompareResult.write_html/write_csv/write_json.
"""

from __future__ import annotations

import os
import tempfile

from probe.errors import CompareError

#: a report destination that cannot be written is a compare-level user error (exit 2)
ReportError = CompareError


def check_destination(path: str, option: str) -> str:
    """Return the absolute path, or raise ReportError naming the option and the problem."""
    if not path:
        raise ReportError(f"{option} needs a file name")
    full = os.path.abspath(os.fspath(path))
    folder = os.path.dirname(full)
    if os.path.isdir(full):
        raise ReportError(f"{option} {path} is a folder, expected a file name")
    if not os.path.isdir(folder):
        raise ReportError(f"{option} {path}: folder {folder} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ReportError(f"{option} {path}: folder {folder} is not writable")
    if os.path.exists(full) and not os.access(full, os.W_OK):
        raise ReportError(f"{option} {path} exists and is not writable")
    return full


def write_atomic(path: str, text: str, option: str = "report") -> None:
    """Write text to path through a temporary file in the same folder and a rename."""
    full = os.path.abspath(path)
    folder = os.path.dirname(full)
    try:
        handle, temp = tempfile.mkstemp(prefix=f".{os.path.basename(full)}.", suffix=".tmp", dir=folder)
    except OSError as error:
        raise ReportError(f"{option} {path}: cannot write in {folder}: {error.strerror or error}") from None
    try:
        with os.fdopen(handle, "w", encoding="utf-8", newline="") as stream:
            stream.write(text)
        if os.path.exists(full):
            try:
                os.chmod(temp, os.stat(full).st_mode & 0o777)
            except OSError:
                pass
        else:
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(temp, 0o666 & ~umask)
        os.replace(temp, full)
    except OSError as error:
        try:
            os.remove(temp)
        except OSError:
            pass
        raise ReportError(f"{option} {path}: cannot write: {error.strerror or error}") from None
    except BaseException:
        try:
            os.remove(temp)
        except OSError:
            pass
        raise


def write_report(path, text: str, option: str) -> str:
    """Check the destination, write text to it atomically, return its absolute path."""
    full = check_destination(os.fspath(path), option)
    write_atomic(full, text, option)
    return full
