"""Fingerprints inside a PrecisionDebugger: the recorder, the loss, the live reference.

The debugger builds one ``FingerprintSession`` when its config says ``"fingerprint": true``
and calls it at four points: ``watch(model)`` at start(), ``end_step()`` at step() (it
returns the live verdict of that step), ``note_loss`` for a loss the user or a trainer
callback hands over, and ``close()``.

With a ``reference``, every step is captured in full provisionally (the debugger keeps the
step's records until its fingerprint is judged): the first step that jumps keeps its full
capture, the others are dropped unwritten. The fingerprint of a step only exists once its
optimizer step has run, so this is the one way to have that very step in full; it costs
the full capture's time on every step until the jump (docs/fingerprints.md).
"""

from __future__ import annotations

import json
import os
import sys

import torch

from probe._version import __version__
from probe.capture import SKETCH_SIZE, autocast_dtype
from probe.errors import ConfigError, DivergenceError, DumpError, DumpFormatError, RunExistsError
from probe.fingerprint import schema
from probe.fingerprint.live import LiveReference, LiveStep
from probe.fingerprint.recorder import FingerprintRecorder


def say(message: str) -> None:
    print(f"probe: {message}", file=sys.stderr, flush=True)


def fingerprint_path(config, rank: int) -> str:
    return os.path.join(config.dump_path, schema.FOLDER, schema.file_name(rank))


class FingerprintSession:
    """``step_of()``: the debugger's step counter; ``rank_of()``: its rank."""

    def __init__(self, config, run_id: str, step_of, rank_of) -> None:
        self.config = config
        rank = rank_of()  # the rank at construction; the file takes the rank at its first step
        _claim(config, rank)
        self.live: LiveReference | None = None
        if config.reference:
            self.live = _open_reference(config, rank)
        self._names: dict = {}
        self._watched: set[int] = set()
        self._hooks = []
        self._verdict: LiveStep | None = None
        #: the first step that jumped (live), and the file its full capture went to
        self.diverged_at: int | None = None
        attrs = {"probe_version": __version__, "torch_version": str(torch.__version__), "run_id": run_id,
                 "rank": rank, "config": json.dumps(config.to_dict())}
        self.recorder = FingerprintRecorder(
            lambda: fingerprint_path(config, rank_of()), attrs, SKETCH_SIZE, step_of, lambda: self._names,
            on_step=self._judge if self.live is not None else None, immediate=self.live is not None)

    # ------------------------------------------------------------------ the debugger's calls

    @property
    def provisional(self) -> bool:
        """Capture every step in full until the first jump (a live reference)?"""
        return self.live is not None and self.diverged_at is None

    def watch(self, model: torch.nn.Module | None) -> None:
        """Name the parameters after the model, take its outputs that are losses, and note
        the dtype autocast computes its training forwards in: seen from the model and its
        children, as a wrapper of the model's forward (accelerate's) may hold the autocast
        inside the model's own call, or a training loop may call the model's parts."""
        if model is None or id(model) in self._watched:
            return
        self._watched.add(id(model))
        for name, param in model.named_parameters():
            self._names.setdefault(id(param), name)
        self._hooks.append(model.register_forward_hook(self._model_output))
        for module in (model, *model.children()):
            self._hooks.append(module.register_forward_pre_hook(self._forward_begins))

    def note_loss(self, loss) -> None:
        self.recorder.note_loss(loss)

    def end_step(self) -> LiveStep | None:
        """The step is over: its fingerprint written, its live verdict (None without a
        reference, or when the reference has no such step)."""
        self._verdict = None
        self.recorder.end_step()
        verdict, self._verdict = self._verdict, None
        return verdict

    def diverged(self, verdict: LiveStep | None, path: str | None) -> DivergenceError | None:
        """After the first jumping step's full capture was written to ``path``: say so once;
        the error to raise when the config says stop_on_divergence."""
        if verdict is None or not verdict.jumped or self.diverged_at is not None:
            return None
        self.diverged_at = verdict.step
        name, gap, allowed = verdict.jumped[0]
        more = f" and {len(verdict.jumped) - 1} more tensors" if len(verdict.jumped) > 1 else ""
        where = f"its full capture is {path}" if path else "its full capture could not be written"
        message = (f"step {verdict.step} jumped away from the reference {self.live.path}: {name}{more} "
                   f"(gap {gap:.2e}, rounding allows {allowed:.2e}); {where}")
        say(message + ("; stopping (stop_on_divergence)" if self.config.stop_on_divergence else ""))
        if self.config.stop_on_divergence:
            return DivergenceError(message)
        return None

    def close(self) -> None:
        hooks, self._hooks = self._hooks, []
        for handle in hooks:
            handle.remove()
        try:
            self.recorder.close()
        finally:
            if self.live is not None:
                self.live.close()

    # ------------------------------------------------------------------ internals

    def _forward_begins(self, module, args) -> None:
        if torch.is_grad_enabled():  # an evaluation does not say how the step trained
            self.recorder.note_forward(autocast_dtype())

    def _model_output(self, module, args, output) -> None:
        if not torch.is_grad_enabled():
            return  # an evaluation: not the training loss
        loss = _loss_of(output)
        if loss is not None:
            self.recorder.note_loss(loss)

    def _judge(self, step: int, loss: float, rows: list, described: dict, compute: float) -> None:
        self._verdict = self.live.check(step, rows, described, compute)


def _loss_of(output):
    """The loss in a model's output: a one-element floating tensor that requires grad, or an
    output's ``loss`` attribute or key (transformers models return one with labels)."""
    candidate = output
    if not isinstance(output, torch.Tensor):
        candidate = getattr(output, "loss", None)
        if candidate is None and isinstance(output, dict):
            candidate = output.get("loss")
    if (isinstance(candidate, torch.Tensor) and candidate.numel() == 1
            and candidate.is_floating_point() and candidate.requires_grad):
        return candidate
    return None


def _claim(config, rank: int) -> None:
    """A fingerprint file of another run in dump_path: refused, or removed with overwrite."""
    path = fingerprint_path(config, rank)
    if not os.path.exists(path):
        return
    if not config.overwrite:
        raise RunExistsError(
            f"dump_path {config.dump_path} already holds another run's fingerprints ({path}); a new "
            "run cannot append to them. Use another dump_path, or set \"overwrite\": true in "
            f"{config.source} to remove them first")
    try:
        os.remove(path)
    except OSError as error:
        raise DumpError(f"cannot remove the old fingerprint file {path}: {error.strerror}") from None


def _open_reference(config, rank: int) -> LiveReference:
    reference = config.reference
    try:
        return LiveReference(reference, rank, say)
    except (DumpError, DumpFormatError) as error:
        raise ConfigError(f"{config.source}: reference {json.dumps(reference)}: {error}") from None


__all__ = ["FingerprintSession", "fingerprint_path"]
