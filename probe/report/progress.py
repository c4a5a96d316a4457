"""A progress bar on stderr for long compares: only on a terminal, only after a second.

Hand-written (no dependency): one line redrawn with a carriage return, at most ten times a
second, erased by close(). When stderr is not a TTY (CI logs, pipes) it prints nothing.
Beside the bar: the units compared of all (``units() -> (done, total)``, where the caller
knows them), the tensor bytes read a second, and the time left at the pace so far, once there
is enough to go on (ETA_AFTER_S seconds and ETA_AFTER_FRACTION of the work).
"""

from __future__ import annotations

import sys
import time

DELAY_S = 1.0
INTERVAL_S = 0.1
WIDTH = 30
ETA_AFTER_S = 3.0
ETA_AFTER_FRACTION = 0.05


class Progress:
    def __init__(self, stream=None, label: str = "comparing", delay: float = DELAY_S, units=None):
        self.stream = stream if stream is not None else sys.stderr
        self.label = label
        self.units = units  # () -> (units done, units in all), or None
        self._width = 0
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
        parts = [f"{fraction * 100:5.1f}%"]
        done, total = self.units() if self.units is not None else (0, 0)
        if total > 1:
            parts.append(f"{done:,} of {total:,} units")
        if tensor_bytes:
            parts.append(f"{tensor_bytes / elapsed / 1e6:.0f} MB/s")
        if elapsed >= ETA_AFTER_S and ETA_AFTER_FRACTION <= fraction < 1:
            parts.append(f"{_clock(elapsed * (1 - fraction) / fraction)} left")
        line = f"{self.label} [{bar}] " + "  ".join(parts)
        # a shorter line than the last one would leave the end of that one on the screen
        self.stream.write(f"\r{line.ljust(self._width)} ")
        self._width = max(self._width, len(line))
        self.stream.flush()
        self._shown = True

    def close(self) -> None:
        if self._shown:
            self.stream.write("\r" + " " * (self._width + 1) + "\r")
            self.stream.flush()
            self._shown = False


def _clock(seconds: float) -> str:
    """1:05 or 2:03:10."""
    whole = int(seconds + 0.5)
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"
