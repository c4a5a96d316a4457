"""What compare processes send each other (--jobs, torchrun) reads back exactly as it was
sent, and a message that holds anything else is refused without running it."""

from __future__ import annotations

import math
import os
import pickle
from collections import Counter

import numpy as np
import pytest

from probe.comparison.api import Chain
from probe.comparison.structs import Carry, RecordRow
from probe.errors import CompareError
from probe.parallel import wire


def _row(slot: str) -> RecordRow:
    return RecordRow(step=0, rank=1, status="diverged", module="fc", op="functional.linear", index=0,
                     phase="forward", slot=slot, io="out", kind="api", order=(3, 7, 0, 0), scale_norm=-0.0,
                     reasons=["beyond tolerance"], envelope={"verdict": "within", "seen": 2.5e-7})


def test_a_message_reads_back_with_its_types_every_float_bit_and_shared_objects():
    shared = _row("output.0")
    sent = {
        "rows": [shared, _row("output.1"), shared],
        "ordinals": {(0, 3): shared, (1, 2): None},  # keys that are not strings, in their order
        "sets": ({"a", "b"}, frozenset({1, 2})),
        "counts": Counter({"float32": 3}),
        "floats": [math.nan, -0.0, math.inf, 5e-324, 0.1 + 0.2],
        "numpy": np.float64(1.5),
        "chain": Chain(carried={0: Carry({11, 12}, {"fc.weight": 1e-9})}),
    }
    back = wire.decode(wire.encode(sent))
    assert list(back) == list(sent) and list(back["ordinals"]) == [(0, 3), (1, 2)]
    rows = back["rows"]
    assert rows[0] is rows[2] is back["ordinals"][(0, 3)] and rows[0] is not rows[1]
    assert rows[0] == sent["rows"][0] and rows[0].order == (3, 7, 0, 0)
    assert math.copysign(1.0, rows[0].scale_norm) == -1.0
    assert type(back["sets"][0]) is set and type(back["sets"][1]) is frozenset and back["sets"] == sent["sets"]
    assert type(back["counts"]) is Counter and back["counts"] == sent["counts"]
    assert [value.hex() for value in back["floats"][1:]] == [value.hex() for value in sent["floats"][1:]]
    assert math.isnan(back["floats"][0])
    assert type(back["numpy"]) is np.float64 and back["numpy"] == 1.5
    assert back["chain"].carried[0].content_keys == {11, 12}


class _Runs:
    """What a message must never make: reading it would run a shell command."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return os.system, (f"touch {self.path}",)


def test_a_message_that_holds_anything_a_summary_does_not_is_refused_without_running_it(tmp_path):
    witness = tmp_path / "ran"
    message = wire.HEADER + pickle.dumps({"rows": [_Runs(str(witness))]}, protocol=5)
    with pytest.raises(CompareError, match="system, which no summary holds"):
        wire.decode(message)
    assert not witness.exists()


@pytest.mark.parametrize("message", [
    b"",
    b"{\"rows\": []}",  # the JSON messages of earlier versions
    b"probe-wire 1 0000000000000000\n" + pickle.dumps([], protocol=5),
])
def test_a_message_of_another_version_is_refused_with_a_clear_error(message):
    with pytest.raises(CompareError, match="same version of probe"):
        wire.decode(message)


def test_a_truncated_message_is_a_clear_error():
    whole = wire.encode([_row("output.0")])
    with pytest.raises(CompareError, match="cannot read"):
        wire.decode(whole[:-20])
