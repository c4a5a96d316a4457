"""Report files are written whole or not at all.

check_destination() runs before the compare, so an unwritable --csv/--html path fails in
a second instead of after a long compare; write_atomic() writes a temporary file next to
the destination and renames it over the destination only once it is complete.
write_report() does both, for CompareResult.write_html/write_csv/write_json.
check_destinations() also refuses a report that would overwrite one of the compared inputs
(a dump file, or anything that would land among an input folder's step files) and two
reports sharing one path: exit 2 before anything is written.
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


def check_destinations(destinations: dict[str, str], inputs=()) -> dict[str, str]:
    """{option: path} -> {option: absolute path}, after check_destination() on each and
    refusing (ReportError, nothing written) a path given to two options, a path that is one
    of the inputs, and a path inside an input folder's step folders or named like a step file."""
    checked: dict[str, str] = {}
    seen: dict[str, str] = {}
    for option, path in destinations.items():
        full = check_destination(path, option)
        real = os.path.realpath(full)
        if real in seen:
            raise ReportError(f"{seen[real]} and {option} both name {path}: give each report its own file")
        seen[real] = option
        for source in inputs:
            problem = _overwrites_input(real, os.path.realpath(os.fspath(source)))
            if problem:
                raise ReportError(f"{option} {path} {problem} {source}: refusing to overwrite an input")
        checked[option] = full
    return checked


def _overwrites_input(target: str, source: str) -> str:
    """Why writing target would damage the input at source ("" when it would not)."""
    from probe.dump import schema

    if target == source or (os.path.exists(target) and os.path.exists(source)
                            and os.path.samefile(target, source)):
        return "is the input"
    if not os.path.isdir(source):
        return ""
    relative = os.path.relpath(target, source)
    if relative.startswith(os.pardir + os.sep) or relative == os.pardir:
        return ""
    parts = relative.split(os.sep)
    name = parts[-1]
    in_step_folder = any(schema.parse_step_dir(part) is not None for part in parts[:-1])
    looks_like_dump = schema.parse_rank_file(name) is not None or name.endswith(schema.PARTIAL_SUFFIX)
    if in_step_folder or looks_like_dump or schema.parse_step_dir(os.path.basename(source)) is not None:
        return "lies among the step files of the input"
    return ""


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


def write_report(path, text: str, option: str, inputs=()) -> str:
    """Check the destination (against the inputs too), write text to it atomically, return
    its absolute path."""
    full = check_destinations({option: os.fspath(path)}, inputs)[option]
    write_atomic(full, text, option)
    return full
