"""While a step is captured, Python's garbage collector looks at its youngest objects less often.

A captured step keeps a few container objects per record alive until ``step()`` hands its file
over: the record, its tensor's cache entry, the hooks' bound arguments. With Python's default first threshold
(700 more allocations than frees) they set off a young collection every couple of hundred
records, and every tenth of those a middle one over what the earlier ones kept: on the project's
GPT at level api, 56 young and 5 middle collections over 20 captured steps, 0.7 ms a step of
the training thread's time (1 ms on a busy machine), against 1-3 collections in all with a
threshold of 5,000. A captured step leaves no reference cycle of probe's (reference counts free
what it made once the step is handed over); only cyclic garbage the program's own step makes
waits a few thousand allocations longer.

``relax()`` (at a captured ``start()``) raises the first threshold to CAPTURE_THRESHOLD;
``restore()`` (at the end of ``step()``, and at ``close()``) puts back what it found, unless the
program set other thresholds in between (then those stay). Not at ``stop()``: the step's records
are still alive there, and the first allocation after a lower threshold would collect them
all once more (0.3-0.5 ms a GPT step). A threshold already at least as high, or 0 (automatic
collection off), is left alone.
"""

from __future__ import annotations

import gc

#: the first threshold while a step is captured (Python's default is 700)
CAPTURE_THRESHOLD = 5000


class RelaxedCollector:
    """The thresholds one debugger raised, to put back."""

    __slots__ = ("_found", "_set")

    def __init__(self) -> None:
        self._found: tuple | None = None  # the thresholds relax() found
        self._set: tuple | None = None  # the ones it set

    def relax(self) -> None:
        if self._found is not None:
            return
        found = gc.get_threshold()
        if found[0] == 0 or found[0] >= CAPTURE_THRESHOLD:
            return
        self._found, self._set = found, (CAPTURE_THRESHOLD, *found[1:])
        gc.set_threshold(*self._set)

    def restore(self) -> None:
        found, self._found = self._found, None
        if found is not None and gc.get_threshold() == self._set:
            gc.set_threshold(*found)
