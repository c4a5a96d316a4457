"""What the processes of a compare send each other: a unit's summary (comparison.result.Partial)
and what a chain of units hands on (comparison.api.Chain), as JSON bytes.

Plain data only: nothing is unpickled, and only the classes named in ``_CLASSES`` are made
from what arrives (each by its fields, in order), so reading a message never runs code.
Decoding gives back exactly what was encoded: tuples stay tuples, sets sets, dicts with
other keys than strings keep their keys and order, floats keep every bit (JSON's shortest
repr reads back to the same float; NaN and infinities are written as Python's json module
writes them), and a row held in several places arrives as one object held in those places
(the story's first divergence is also a kept row and a divergent one). So a compare gives
the same result, byte for byte, whichever process compared a unit.
"""

from __future__ import annotations

import dataclasses
import json
from collections import Counter

from probe.comparison.api import Chain
from probe.comparison.api import Partial
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
_FIELDS = {name: tuple(field.name for field in dataclasses.fields(cls)) for name, cls in _CLASSES.items()}
#: the types a message holds as they are, both ways (checked before any other, the common case)
_AS_IS = frozenset({type(None), bool, int, float, str})
#: the key that marks a tagged value: a tuple, set, dict with other keys, object or reference
TAG = "\x00"


def encode(value) -> bytes:
    """value (a Partial, a Chain, ...) as JSON bytes."""
    return json.dumps(_Encoder().plain(value), separators=(",", ":")).encode("utf-8")


def decode(data: bytes):
    """What encode() was given, rebuilt."""
    try:
        return _Decoder().value(json.loads(data))
    except (ValueError, KeyError, TypeError, IndexError) as error:
        raise CompareError(f"a compare process sent a summary this one cannot read ({error}); "
                           "are both running the same version of probe?") from None


class _Encoder:
    def __init__(self):
        self.seen: dict = {}  # id(object) -> its number, for objects met before

    def plain(self, value):
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        if isinstance(value, list):
            return [item if type(item) in _AS_IS else self.plain(item) for item in value]
        if isinstance(value, Counter):
            return {TAG: "counter", "v": [[self.plain(key), self.plain(item)] for key, item in value.items()]}
        if type(value) is dict:
            if all(type(key) is str for key in value):
                if TAG in value:
                    raise CompareError(f"cannot send a dict with the key {TAG!r}")
                return {key: self.plain(item) for key, item in value.items()}
            return {TAG: "map", "v": [[self.plain(key), self.plain(item)] for key, item in value.items()]}
        if isinstance(value, tuple):
            return {TAG: "tuple", "v": [self.plain(item) for item in value]}
        if isinstance(value, (set, frozenset)):
            return {TAG: "set", "v": [self.plain(item) for item in value]}
        name = type(value).__name__
        if _CLASSES.get(name) is not type(value):
            raise CompareError(f"cannot send a {type(value).__qualname__} between compare processes")
        number = self.seen.get(id(value))
        if number is not None:
            return {TAG: "ref", "v": number}
        self.seen[id(value)] = number = len(self.seen)
        items = [getattr(value, field) for field in _FIELDS[name]]
        return {TAG: name, "n": number, "v": [item if type(item) in _AS_IS else self.plain(item) for item in items]}


class _Decoder:
    def __init__(self):
        self.made: dict = {}  # number -> the object

    def value(self, data):
        if isinstance(data, list):
            return [item if type(item) in _AS_IS else self.value(item) for item in data]
        if not isinstance(data, dict):
            return data
        tag = data.get(TAG)
        if tag is None:
            return {key: self.value(item) for key, item in data.items()}
        if tag == "tuple":
            return tuple(self.value(item) for item in data["v"])
        if tag == "set":
            return {self.value(item) for item in data["v"]}
        if tag == "counter":
            return Counter({self.value(key): self.value(item) for key, item in data["v"]})
        if tag == "map":
            return {self.value(key): self.value(item) for key, item in data["v"]}
        if tag == "ref":
            return self.made[data["v"]]
        cls = _CLASSES[tag]
        # made before its fields, so that a field may refer back to it
        made = self.made[data["n"]] = object.__new__(cls)
        for field, item in zip(_FIELDS[tag], data["v"], strict=True):
            object.__setattr__(made, field, item if type(item) in _AS_IS else self.value(item))
        return made
