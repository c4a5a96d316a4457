"""The OS's words for an error, for the one-line DumpError messages of the writer."""

from __future__ import annotations

import re

_ERROR_MESSAGE = re.compile(r"error message = '([^']*)'")


def reason(error: BaseException) -> str:
    """The OS's words for an error (h5py hides them inside a long message)."""
    match = _ERROR_MESSAGE.search(str(error))
    if match:
        return match.group(1)
    if isinstance(error, OSError) and error.strerror and "\n" not in error.strerror:
        return error.strerror
    text = str(error).strip().splitlines()
    return text[0] if text else type(error).__name__
