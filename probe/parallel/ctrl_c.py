"""A Ctrl-C that Python cannot drop, for the compare command.

Python raises a KeyboardInterrupt wherever the main thread is when Ctrl-C lands; inside a
weakref or garbage-collector callback (h5py's and the standard library's WeakValueDictionary
clean-ups, while the dumps are read) it is only printed as "Exception ignored in ..." and the
program goes on. While a RememberedCtrlC is entered, Ctrl-C is also remembered, and check()
(called at every unit) raises it again; and until the KeyboardInterrupt is seen caught (or the
compare ends), it is raised again every AGAIN_S seconds: one dropped where no unit is
being compared (reading the attributes of thousands of step files) comes back.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading

#: seconds after a Ctrl-C at which it is raised again, unless it was caught by then
AGAIN_S = 0.3
#: pressed: Ctrl-C since the outermost RememberedCtrlC began; active: one is entered;
#: caught: the last KeyboardInterrupt reached code that handles it; compare: which compare of
#: this process (a Ctrl-C is raised again only in the compare it was pressed in)
_STATE = {"pressed": False, "active": False, "caught": False, "compare": 0}


def _on_ctrl_c(signum, frame) -> None:
    _STATE["pressed"], _STATE["caught"] = True, False
    again = threading.Timer(AGAIN_S, _raise_again, (_STATE["compare"],))
    again.daemon = True
    again.start()
    raise KeyboardInterrupt


def _raise_again(compare: int) -> None:
    if _STATE["active"] and not _STATE["caught"] and _STATE["compare"] == compare:
        # the signal again, to the main thread (no pthread_kill on Windows: one Ctrl-C, as before)
        if hasattr(signal, "pthread_kill"):
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)


class RememberedCtrlC:
    """While a compare runs: Ctrl-C raises KeyboardInterrupt as usual and is remembered (module
    docstring). Nested, the outermost one handles the signal; every one checks the same flag.
    Only the main thread can handle signals; elsewhere nothing changes."""

    def __init__(self) -> None:
        self._previous = None
        self._unraisable = None

    def __enter__(self) -> "RememberedCtrlC":
        if threading.current_thread() is threading.main_thread() and \
                signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            _STATE.update(pressed=False, active=True, caught=False, compare=_STATE["compare"] + 1)
            self._previous = signal.signal(signal.SIGINT, _on_ctrl_c)
            self._unraisable = sys.unraisablehook
            sys.unraisablehook = self._quiet_interrupts
        return self

    def _quiet_interrupts(self, unraisable) -> None:
        """A KeyboardInterrupt Python drops is raised again here: no "Exception ignored" for it."""
        if not isinstance(unraisable.exc_value, KeyboardInterrupt):
            self._unraisable(unraisable)

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            _STATE.update(active=False, caught=True)
            signal.signal(signal.SIGINT, self._previous)
            sys.unraisablehook = self._unraisable

    @staticmethod
    def check() -> None:
        if _STATE["pressed"]:
            raise KeyboardInterrupt

    @staticmethod
    def caught() -> None:
        """The KeyboardInterrupt reached code that stops the compare: no need to raise it again."""
        _STATE["caught"] = True


@contextlib.contextmanager
def ctrl_c_held():
    """A Ctrl-C inside the block is raised as KeyboardInterrupt when the block ends, not where
    it lands: for a block that must finish (``pool = Pool()``: raised inside it, no one holds
    the workers it started). Only the main thread handles signals; elsewhere nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    asked = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: asked.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if asked:
        raise KeyboardInterrupt
