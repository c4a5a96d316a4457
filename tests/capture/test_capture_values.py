"""Non-tensor values on the per-call path: the remembered JSON text and value_type of a value
are exactly what encoding it afresh gives."""

import enum
import os
import sys

import torch

from probe.capture.eager import values
from probe.capture.eager.values import SourceLocator, describe_value, encode_value, value_type


class Color(enum.IntEnum):
    RED = 1


LOOK_ALIKES = [
    0.0, -0.0, 1.0, 1, True, 1.5, float("nan"), float("inf"), -float("inf"),
    (1,), (1.0,), (True,), (0.0,), (-0.0,), (1, "a"), (None,), ((1,), (2,)),
    torch.Size([4, 3]), (4, 3), [4, 3], "none", "", None, Color.RED,
    torch.float32, torch.bfloat16, torch.device("cpu"), slice(1, 2), Ellipsis,
]


def test_remembered_value_texts_equal_a_fresh_encoding_for_look_alike_values():
    values._described.clear()
    for _ in range(2):  # the first round fills the memo, the second reads it
        for value in LOOK_ALIKES + LOOK_ALIKES[::-1]:
            text = encode_value(value)
            want = None if text is None else (text, value_type(value))
            assert describe_value(value) == want, value
    assert describe_value(-0.0)[0] == "-0.0" and describe_value(0.0)[0] == "0.0"
    assert describe_value((1.0,))[0] == "[1.0]" and describe_value((1,))[0] == "[1]"
    assert describe_value(float("nan"))[0] == '"nan"'
    assert len(values._described) < len(LOOK_ALIKES)  # floats in tuples, NaN: never kept


def test_the_value_memo_is_bounded(monkeypatch):
    monkeypatch.setattr(values, "_MEMO_LIMIT", 3)
    values._described.clear()
    for number in range(10):
        assert describe_value(number) == (str(number), "")
    assert len(values._described) == 3


INTERNAL_CODE = '''
def loop(locate, times):
    return [locate(1) for _ in range(times)]  # a loop inside "torch"

def resumable(locate):
    while True:
        yield locate(1)  # a generator: resumed from wherever next() is called
'''


def test_remembered_source_walk_follows_each_caller_of_internal_loops_and_generators(
        tmp_path, monkeypatch):
    (tmp_path / "fake_internal.py").write_text(INTERNAL_CODE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(values, "_INTERNAL_ROOTS", values._INTERNAL_ROOTS + (str(tmp_path),))
    # this file's code, not one an earlier run of the test imported from its own tmp_path
    monkeypatch.delitem(sys.modules, "fake_internal", raising=False)
    import fake_internal

    locate = SourceLocator()
    here = os.path.relpath(__file__)
    first = fake_internal.loop(locate, 3); line_first = _line()
    second = fake_internal.loop(locate, 2); line_second = _line()
    assert first == [f"{here}:{line_first}"] * 3
    assert second == [f"{here}:{line_second}"] * 2
    generator = fake_internal.resumable(locate)
    a = next(generator); line_a = _line()
    b = next(generator); line_b = _line()
    assert (a, b) == (f"{here}:{line_a}", f"{here}:{line_b}")
    locate.forget()
    assert locate._start is None


def _line() -> int:
    """The caller's line number."""
    return sys._getframe(1).f_lineno
