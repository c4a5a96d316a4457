"""What the processes of a compare send each other: a unit's summary (comparison.summary.Partial)
and what a chain of units hands on (comparison.api.Chain), as bytes.

A message is a pickle that only a restricted reader opens: its ``find_class`` makes the
classes named in ``_CLASSES``, ``collections.Counter`` and numpy's scalars, and refuses every
other name a message could hold, so reading one constructs those data classes and runs no
other code (the restriction the pickle module's documentation gives for data from elsewhere).
Decoding gives back exactly what was encoded: tuples stay tuples, sets sets, dicts keep their
keys and order, floats every bit, and a row held in several places arrives as one object
held in those places (the story's first divergence is also a kept row and a divergent one).
So a compare gives the same result, byte for byte, whichever process compared a unit.

Each message starts with a header: the wire's version and a digest of every class's fields.
A process of another probe (torchrun ranks on machines set up apart) is told so, not
misread: a pickle names fields by position.

Why a pickle and not JSON of the same objects, which this module wrote before: making the
plain tree and reading it back cost a worker and the merging process as much CPU as a third of
the unit's compare (0.30 s for the first units' 4.5 MB of rows, 0.055 s for a 0.6 MB summary,
against 0.2 s to compare a 3,468-record unit); pickle takes 0.07 and 0.009 s. The merging
process reads every worker's messages, so that cost also capped how many workers it could keep
busy.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import pickle
from collections import Counter

from probe.comparison.api import Chain
from probe.comparison.summary import Partial
from probe.comparison.assemble import ChangeFold, FileFacts, KeptFile, Tally
from probe.comparison.envelope import EnvelopeFold
from probe.comparison.metrics import Metrics
from probe.comparison.metrics import Best
from probe.comparison.result import OpGroup, OpSummary, PrecisionTally, RecordRow
from probe.comparison.structs import Carry
from probe.errors import CompareError

_CLASSES = {cls.__name__: cls for cls in (
    Best, Carry, Chain, ChangeFold, EnvelopeFold, FileFacts, KeptFile, Metrics, OpGroup, OpSummary, Partial,
    PrecisionTally, RecordRow, Tally)}
#: (module, name) -> what a message may make: the summary's classes, a Counter, numpy's scalars
_ALLOWED = {(cls.__module__, cls.__qualname__): cls for cls in (*_CLASSES.values(), Counter)}
_NUMPY_SCALARS = {("numpy._core.multiarray", "scalar"), ("numpy.core.multiarray", "scalar"), ("numpy", "dtype")}
_FIELDS = {name: tuple(field.name for field in dataclasses.fields(cls)) for name, cls in _CLASSES.items()}
#: the wire's version and every class's fields: what both ends must share
HEADER = b"probe-wire 2 " + hashlib.sha256(repr(sorted(_FIELDS.items())).encode("utf-8")).hexdigest()[:16].encode(
    "ascii") + b"\n"
_PROTOCOL = 5


def encode(value) -> bytes:
    """value (a Partial, a Chain, ...) as bytes."""
    return HEADER + pickle.dumps(value, protocol=_PROTOCOL)


def decode(data: bytes):
    """What encode() was given, rebuilt."""
    if not data.startswith(HEADER):
        raise CompareError("a compare process sent a summary this one cannot read (another wire format); "
                           "are both running the same version of probe?")
    stream = io.BytesIO(data)  # shares data's buffer: no copy of a message of megabytes
    stream.seek(len(HEADER))
    try:
        return _Reader(stream).load()
    except CompareError:
        raise
    except (pickle.UnpicklingError, EOFError, ValueError, KeyError, TypeError, IndexError, AttributeError) as error:
        raise CompareError(f"a compare process sent a summary this one cannot read ({error}); "
                           "are both running the same version of probe?") from None


class _Reader(pickle.Unpickler):
    """An unpickler that makes only what a summary holds."""

    def find_class(self, module: str, name: str):
        found = _ALLOWED.get((module, name))
        if found is not None:
            return found
        if (module, name) in _NUMPY_SCALARS:
            return super().find_class(module, name)
        raise CompareError(f"a compare process sent a {module}.{name}, which no summary holds; "
                           "are both running the same version of probe?")
