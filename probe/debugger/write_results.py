"""What became of each step file a debugger handed on: delivered, in step order.

A step file is written by the writer process while training goes on, or inline by step().
WriteResults takes in the outcome of each, oldest first: the path of the last file written
(``PrecisionDebugger.last_file``), and for a step that could not be written the config's
``on_write_error``: raise DumpError naming the step ("raise", the default), or warn once and
keep the error in ``write_errors`` ("warn"). A failure never surfaces inside the user's
forward, backward or optimizer step: only at step(), wait(), close() or a read of last_file.
"""

from __future__ import annotations

import warnings

from probe.errors import DumpError


class WriteResults:
    def __init__(self, on_write_error: str):
        self.on_write_error = on_write_error
        self.last_file: str | None = None
        #: DumpErrors of steps that could not be written (with on_write_error "warn")
        self.errors: list[DumpError] = []
        #: steps handed to the writer process and not yet confirmed (dump/background.py)
        self.pending = None
        self._warned = False

    def deliver(self, block: bool) -> None:
        """Take in the results of the steps the writer process finished (all of them when
        block), oldest first: last_file, and on_write_error for a step that failed."""
        while self._deliver_one(block):
            pass

    def _deliver_one(self, block: bool) -> bool:
        pending = self.pending
        done = pending.pop_done(block) if pending is not None else None
        if done is None:
            return False
        step, path, error = done
        if error is None:
            self.last_file = path
        else:
            self.failed(error, step)
        return True

    def written_inline(self, step: int, path: str | None, error: DumpError | None) -> None:
        """The outcome of a step file step() wrote itself, reported after the steps still
        with the writer process, in order."""
        if self.pending is not None and len(self.pending):
            self.pending.add_done(step, path, error)
            self.deliver(block=True)
        elif error is not None:
            self.failed(error, step)
        else:
            self.last_file = path

    def failed(self, error: DumpError, step: int) -> None:
        """Apply on_write_error to a step that could not be written (its file is gone;
        the steps finished before it are intact)."""
        self.last_file = None
        message = f"step {step} was not written: {error}"
        if self.on_write_error == "raise":
            raise DumpError(message) from error
        self.errors.append(error)
        if not self._warned:
            self._warned = True
            warnings.warn(f"probe: {message} (on_write_error is \"warn\": training goes on; "
                          "later steps that cannot be written are skipped without another "
                          "warning, see PrecisionDebugger.write_errors)",
                          RuntimeWarning, stacklevel=5)
