"""While a step is captured, Python's garbage collector looks at its youngest objects less often.

A captured step keeps a few container objects per record alive until ``step()`` hands its file
over: the record, its tensor's cache entry, the hooks' bound arguments. With Python's default
first threshold (700 more allocations than frees) they set off a young collection every couple
of hundred records, and every tenth of those a middle one over what the earlier ones kept: on
the project's GPT at level api, 56 young and 5 middle collections over 20 captured steps,
0.5-0.7 ms a step of the training thread's time, against 1-3 collections in all with a
threshold of 5,000. A captured step leaves no reference cycle of probe's (reference counts free
what it made once the step is handed over); only cyclic garbage the program's own step makes
waits a few thousand allocations longer.

``relax()`` (at a captured ``start()``) raises the first threshold to CAPTURE_THRESHOLD, or to
PER_CALL allocations for each call the previous captured step made when that is more (up to
THRESHOLD_CAP): a step's objects then fit under it and no young collection runs while it is
captured. ``restore(calls)`` (at the end of ``step()``, and at ``close()``) puts back what it
found, unless the program set other thresholds in between (then those stay). Not at
``stop()``: the step's records are still alive there, and the first allocation after a lower
threshold would collect them all once more (0.3-0.5 ms a GPT step). A threshold already at
least as high, or 0 (automatic collection off), is left alone.

Measured (net allocations of tracked objects between ``start()`` and ``stop()``, records path):
25-30 a call at levels api and mix, 45-53 at module, on the project's GPT, GPT-2 small's layers,
a transformers Llama and litgpt's GPT. GPT-2 small's layers at T 16 (410-560 calls at api and
mix) still spent 2.3 ms a step in collections at 5,000, none at 20,000.
"""

from __future__ import annotations

import gc

#: the first threshold while a step is captured, at least (Python's default is 700)
CAPTURE_THRESHOLD = 5000
#: allocations allowed for each call of the previous captured step (measured: 25-53)
PER_CALL = 64
#: the most a step raises the threshold to: the bound on how long the program's own cyclic
#: garbage may wait
THRESHOLD_CAP = 100_000


class RelaxedCollector:
    """The thresholds one debugger raised, to put back."""

    __slots__ = ("_found", "_set", "_calls")

    def __init__(self) -> None:
        self._found: tuple | None = None  # the thresholds relax() found
        self._set: tuple | None = None  # the ones it set
        self._calls = 0  # calls of the last captured step

    def threshold(self) -> int:
        """The first threshold the next captured step gets."""
        return max(CAPTURE_THRESHOLD, min(PER_CALL * self._calls, THRESHOLD_CAP))

    def relax(self) -> None:
        if self._found is not None:
            return
        found, wanted = gc.get_threshold(), self.threshold()
        if found[0] == 0 or found[0] >= wanted:
            return
        self._found, self._set = found, (wanted, *found[1:])
        gc.set_threshold(*self._set)

    def restore(self, calls: int = 0) -> None:
        """Put the thresholds back; calls: the step's captured calls, which size the next."""
        if calls > 0:
            self._calls = calls
        found, self._found = self._found, None
        if found is not None and gc.get_threshold() == self._set:
            gc.set_threshold(*found)
