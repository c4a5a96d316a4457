"""Read the next tensor pair on a background thread while the current one is measured.

Reading a pair from HDF5 and measuring it take similar time, so overlapping them raises
compare throughput. At most ``depth`` pairs wait ready (plus the one being measured), so
memory stays within a few tensor pairs whatever the dump size. Keys are taken in the
planned order; a key asked for out of order (or twice) is simply not served, and the
caller reads it itself.
"""

from __future__ import annotations

import threading
from typing import Callable, Sequence

import numpy as np

Fetch = Callable[[int], np.ndarray]


class Prefetcher:
    def __init__(self, keys: Sequence[tuple[int, int]], fetch_a: Fetch, fetch_b: Fetch, depth: int = 1):
        self._keys = list(keys)
        self._position = {key: index for index, key in enumerate(self._keys)}
        self._fetch_a, self._fetch_b = fetch_a, fetch_b
        self._depth = depth
        self._cond = threading.Condition()
        self._ready: dict = {}
        self._skip_below = 0  # keys planned before this index will not be asked for
        self._error: BaseException | None = None
        self._stopped = False
        self._done = False
        self._thread = threading.Thread(target=self._run, name="probe-compare-prefetch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for index, (id_a, id_b) in enumerate(self._keys):
                with self._cond:
                    while len(self._ready) >= self._depth and not self._stopped:
                        self._cond.wait()
                    if self._stopped:
                        return
                    if index < self._skip_below:
                        continue
                pair = (self._fetch_a(id_a), self._fetch_b(id_b))
                with self._cond:
                    if index >= self._skip_below:
                        self._ready[index] = pair
                    self._cond.notify_all()
                del pair
        except BaseException as error:  # handed to the measuring thread by take()
            with self._cond:
                self._error = error
                self._cond.notify_all()
        finally:
            with self._cond:
                self._done = True
                self._cond.notify_all()

    def take(self, key: tuple[int, int]):
        """(array_a, array_b) for key, or None when the caller must read it itself."""
        index = self._position.get(key)
        with self._cond:
            if index is None or index < self._skip_below:
                return None
            # everything planned before this key will not be asked for any more
            for stale in [i for i in self._ready if i < index]:
                del self._ready[stale]
            self._skip_below = index
            self._cond.notify_all()
            while index not in self._ready and self._error is None and not self._done:
                self._cond.wait()
            self._skip_below = index + 1
            self._cond.notify_all()
            if index in self._ready:
                return self._ready.pop(index)
            if self._error is not None:
                error, self._error = self._error, None
                raise error
            return None

    def close(self) -> None:
        with self._cond:
            self._stopped = True
            self._ready.clear()
            self._cond.notify_all()
        self._thread.join()
