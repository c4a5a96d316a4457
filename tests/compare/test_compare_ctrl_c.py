"""Ctrl-C during a compare is never lost: Python drops a KeyboardInterrupt raised inside a
weakref callback (h5py's and the standard library's clean-ups, while thousands of step files
are read), so probe raises it again (probe/parallel/ctrl_c.py)."""

import os
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


def _children() -> set:
    with open(f"/proc/{os.getpid()}/task/{os.getpid()}/children", encoding="ascii") as handle:
        return set(handle.read().split())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="plants the Ctrl-C at the worker pool's "
                    "first fork and finds the workers left through /proc: the pool forks only on Linux "
                    "(spawn elsewhere), and only Linux has /proc")
def test_a_ctrl_c_while_the_worker_pool_starts_leaves_no_worker_running(tmp_path):
    """Ctrl-C lands right after the first worker is forked, inside multiprocessing's Pool():
    the compare stops with KeyboardInterrupt and stops every worker it started."""
    import probe
    from tests import rounding_pairs as P

    one = P.run(tmp_path / "one", lambda: P.DeepStack(depth=1), steps=1, task="statistics")
    a, b = (P.rank_files(one, str(tmp_path / side), 2) for side in "ab")
    armed = []

    def ctrl_c_at_the_next_call(frame, event, arg):
        sys.settrace(None)
        signal.raise_signal(signal.SIGINT)

    def ctrl_c_after_a_fork():
        # not in this hook itself: Python drops an exception raised in an at-fork hook
        if armed:
            armed.clear()
            sys.settrace(ctrl_c_at_the_next_call)

    os.register_at_fork(after_in_parent=ctrl_c_after_a_fork)  # cannot be undone: disarmed after
    before = _children()
    armed.append(True)
    try:
        with pytest.raises(KeyboardInterrupt):
            probe.compare(a, b, jobs=2)
    finally:
        armed.clear()
        sys.settrace(None)
    deadline = time.monotonic() + 10
    while _children() - before and time.monotonic() < deadline:
        time.sleep(0.05)  # a stopped worker may take a moment to be gone
    left = _children() - before
    for pid in left:  # without the fix: workers nobody stops, forked again as they end
        os.kill(int(pid), signal.SIGKILL)
    assert not left
