"""A progress bar on stderr for long compares: only on a terminal, only after a second.

Hand-written (no dependency): one line redrawn with a carriage return, at most ten times a
second, erased by close(). When stderr is not a TTY (CI logs, pipes) it prints nothing.
"""

from __future__ import annotations

import sys
import time

DELAY_S = 1.0
INTERVAL_S = 0.1
WIDTH = 30


class Progress:
    def __init__(self, stream=None, label: str = "comparing", delay: float = DELAY_S):
        self.stream = stream if stream is not None else sys.stderr
        self.label = label
        self.enabled = bool(getattr(self.stream, "isatty", lambda: False)())
        self.start = time.monotonic()
        self.delay = delay
        self._last = 0.0
        self._shown = False

    def __call__(self, fraction: float, tensor_bytes: int = 0) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if now - self.start < self.delay or now - self._last < INTERVAL_S:
            return
        self._last = now
        fraction = min(max(fraction, 0.0), 1.0)
        filled = int(fraction * WIDTH)
        bar = "#" * filled + "." * (WIDTH - filled)
        elapsed = now - self.start
        rate = f"  {tensor_bytes / elapsed / 1e6:.0f} MB/s" if tensor_bytes else ""
        self.stream.write(f"\r{self.label} [{bar}] {fraction * 100:5.1f}%{rate} ")
        self.stream.flush()
        self._shown = True

    def close(self) -> None:
        if self._shown:
            self.stream.write("\r" + " " * (len(self.label) + WIDTH + 30) + "\r")
            self.stream.flush()
            self._shown = False
