"""The fingerprint of every optimizer step, written as the run goes (torch + the file).

``FingerprintRecorder`` registers one global optimizer step post-hook
(``torch.optim.optimizer.register_optimizer_step_post_hook``; nothing of torch is replaced)
and, at the end of every ``optimizer.step()``, takes the fingerprint of the optimizer's
parameters, gradients and state (take.py) under the step number its owner gives (the
debugger's step counter). That is the one moment each step where the three agree: the
gradients the update used are still there (zero_grad comes later) and the parameters and
state are the updated ones. So it works the same under a PrecisionDebugger, a trainer
callback and ``probe run`` (their optimizer steps are the step boundaries).

The loss is what ``note_loss`` was given during the step (the mean, with several
micro-batches): the debugger passes the model's output when it is a loss (a scalar, or an
output with a ``loss`` attribute or key, as transformers models return), and
``PrecisionDebugger.note_loss(value)`` takes one from the user or a trainer callback.

The dtype a step computed in is what autocast was set to during its training forwards
(``note_forward``, from the session's hooks on the model): its unit roundoff goes into the
step row, so a compare sizes the rounding allowed from it (envelope.py).

A step is written when its owner ends it (``end_step``, the debugger's step()): a CPU step
at once; a step with device tensors at the next end_step() (or close()), so its copy to the
host never makes training wait; ``immediate`` writes every step at once (the live
comparison needs its verdict before the step's full capture is kept or dropped).
"""

from __future__ import annotations

import math
import weakref

import numpy as np
import torch
import torch.optim.optimizer as _optimizer_hooks

from probe.capture import HostBatch
from probe.fingerprint import envelope, schema, take as take_module
from probe.fingerprint.file import FingerprintWriter


class FingerprintRecorder:
    """Fingerprints of every optimizer step into one file.

    ``path_of()`` gives the file's path (asked at the first write: a trainer sets the rank
    after construction); ``step_of()`` the current step number; ``names_of()`` the model's
    {id(parameter): name} (empty when no model is known); ``on_step(step, loss, rows,
    described, compute_unit)`` is called with each resolved step (the live comparison),
    after it is written."""

    def __init__(self, path_of, attrs: dict, k: int, step_of, names_of, on_step=None,
                 immediate: bool = False) -> None:
        self._path_of = path_of
        self.path: str | None = None  # known once the first step is written
        self.k = k
        self._attrs = attrs
        self._step_of = step_of
        self._names_of = names_of
        self._on_step = on_step
        self._immediate = immediate
        #: CPU tensors' numbers, a step at a time (its arenas and layouts live as long as the run)
        self._batch = HostBatch(k)
        self._writer: FingerprintWriter | None = None
        self._index: dict[str, int] = {}
        self._new: list[dict] = []  # descriptions not written yet
        #: name -> description of every tensor seen
        self.described: dict[str, dict] = {}
        #: optimizer -> its number in unnamed tensors' names (weak: a dropped optimizer is freed)
        self._optimizers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._optimizer_count = 0
        self._open: dict = {}  # id(optimizer) -> PendingPrint taken in the step not ended yet
        self._open_step: int | None = None
        #: ended, waiting for its device copy: (the step's fingerprint, its compute unit)
        self._pending: tuple[take_module.PendingPrint, float] | None = None
        #: the unit roundoff autocast computed this step's forwards in (0: off; None: no
        #: forward seen, the step row says NaN: not known)
        self._compute: float | None = None
        self._loss_sum = None
        self._loss_count = 0
        self.steps_written = 0
        self._handle = _optimizer_hooks.register_optimizer_step_post_hook(self._after_optimizer_step)

    # ------------------------------------------------------------------ inputs

    def note_loss(self, loss) -> None:
        """A loss of the current step (a tensor stays on its device; no synchronisation)."""
        if isinstance(loss, torch.Tensor):
            if loss.numel() != 1:
                return
            value = loss.detach().reshape(()).to(torch.float64)
        else:
            try:
                value = float(loss)
            except (TypeError, ValueError):
                return
        self._loss_sum = value if self._loss_sum is None else self._loss_sum + value
        self._loss_count += 1

    def note_forward(self, autocast_dtype: str) -> None:
        """A training forward of the model ran with autocast computing in this dtype ("": off)."""
        unit = envelope.unit_roundoff(autocast_dtype) if autocast_dtype else 0.0
        self._compute = unit if self._compute is None else max(self._compute, unit)

    def _after_optimizer_step(self, optimizer, args, kwargs) -> None:
        names = self._names_of()
        if names and not any(id(param) in names for group in optimizer.param_groups for param in group["params"]):
            return  # an optimizer of another model than the debugger's: not this run's training
        step = self._step_of()
        number = self._optimizers.get(optimizer)
        if number is None:
            number = self._optimizers[optimizer] = self._optimizer_count
            self._optimizer_count += 1
        tensors = take_module.optimizer_tensors(optimizer, names, f"opt{number}")
        self._describe(tensors)
        taken = take_module.take(step, [(name, tensor) for name, *_, tensor in tensors], self.k, self._batch)
        if self._open and self._open_step != step:
            self.end_step()  # an earlier step nobody ended (no step() call): it is finished now
        self._open_step = step
        # one part per optimizer (GAN-style loops step two); an optimizer that steps again in
        # the same step replaces its part: the step ends with its last state
        self._open[id(optimizer)] = taken

    def end_step(self) -> None:
        """The step is over (the debugger's step()): write its fingerprint, now on the CPU or
        when asked to be immediate, else at the next end_step() (its device copy is done by
        then)."""
        parts, self._open = list(self._open.values()), {}
        if not parts:
            return
        taken = parts[0]
        for part in parts[1:]:
            taken.extend(part)
        if self._loss_count:
            taken.loss = self._loss_sum / self._loss_count
        self._loss_sum, self._loss_count = None, 0
        compute, self._compute = (math.nan if self._compute is None else self._compute), None
        self.flush()
        if self._immediate or not taken.on_device:
            self._write(taken, compute)
        else:
            self._pending = (taken, compute)

    # ------------------------------------------------------------------ output

    def _describe(self, tensors) -> None:
        for name, kind, param, state, tensor in tensors:
            if name not in self._index:
                self._index[name] = len(self._index)
                entry = take_module.describe(name, kind, param, state, tensor)
                self.described[name] = entry
                self._new.append(entry)

    def flush(self) -> None:
        """Write the step still waiting for its device copy, if any."""
        pending, self._pending = self._pending, None
        if pending is not None:
            self._write(*pending)

    def _write(self, pending: take_module.PendingPrint, compute: float) -> None:
        loss, names, numbers, sketches = pending.resolve()
        if self._writer is None:
            self.path = self._path_of()
            self._writer = FingerprintWriter(self.path, self._attrs, self.k)
        described, self._new = self._new, []
        count = len(names)
        table = np.empty((count + 1, schema.ROW_FIXED + self.k))  # + the step row
        table[:count, 1] = [self._index[name] for name in names]
        table[:count, 2:schema.ROW_FIXED] = numbers
        table[:count, schema.ROW_FIXED:] = sketches
        loss = float(loss) if loss is not None else math.nan
        self._writer.append(pending.step, loss, described, table, compute)
        self.steps_written += 1
        if self._on_step is not None:
            self._on_step(pending.step, loss, list(zip(names, numbers, sketches)), self.described, compute)

    def close(self) -> None:
        """Write what waits, close the file and remove the hook (idempotent)."""
        handle, self._handle = self._handle, None
        if handle is not None:
            handle.remove()
        try:
            self.end_step()
            self.flush()
        finally:
            writer, self._writer = self._writer, None
            if writer is not None:
                writer.close()


__all__ = ["FingerprintRecorder"]
