"""Ctrl-C during a compare is never lost: Python drops a KeyboardInterrupt raised inside a
weakref callback (h5py's and the standard library's clean-ups, while thousands of step files
are read), so probe raises it again (probe/parallel/ctrl_c.py)."""

import signal
import sys
import time
import weakref

import pytest

from probe.parallel.ctrl_c import AGAIN_S, RememberedCtrlC



@pytest.fixture(autouse=True)
def _ctrl_c_raises():
    """Ctrl-C as an interactive shell gives it: a shell that started the suite in the
    background (``cmd &`` without job control) made every process ignore SIGINT."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


class _Held:
    pass


def _ctrl_c_inside_a_weakref_callback() -> None:
    held = _Held()
    _ref = weakref.ref(held, lambda ref: signal.raise_signal(signal.SIGINT))  # noqa: F841
    del held  # the callback runs here, and the KeyboardInterrupt raised in it is dropped


@pytest.mark.skipif(not hasattr(signal, "pthread_kill"), reason="raising a dropped Ctrl-C again needs "
                    "signal.pthread_kill, which Windows lacks: there one Ctrl-C acts as Python's own")
def test_a_ctrl_c_dropped_in_a_weakref_callback_is_raised_again_without_a_message(capsys):
    raised_at = None
    began = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        with RememberedCtrlC():
            _ctrl_c_inside_a_weakref_callback()
            try:
                while time.monotonic() - began < 20 * AGAIN_S:
                    time.sleep(0.01)  # reading step files, comparing nothing yet
            except KeyboardInterrupt:
                raised_at = time.monotonic() - began
                raise
    assert raised_at is not None and raised_at < 10 * AGAIN_S
    assert "Exception ignored" not in capsys.readouterr().err  # said nothing of the dropped one
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # put back


def test_a_remembered_ctrl_c_is_raised_at_the_next_unit_and_forgotten_by_the_next_compare():
    with pytest.raises(KeyboardInterrupt):
        with RememberedCtrlC():
            _ctrl_c_inside_a_weakref_callback()
            RememberedCtrlC.caught()  # a caller that stops on its own: no second raise needed
            RememberedCtrlC.check()  # the next unit
    with RememberedCtrlC():
        RememberedCtrlC.check()  # a new compare starts without the old Ctrl-C
        time.sleep(2 * AGAIN_S)  # nothing is raised again
