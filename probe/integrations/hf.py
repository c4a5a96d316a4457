"""transformers ``Trainer``: ``Trainer(..., callbacks=[ProbeCallback("config.json")])``.

Each optimizer step is one step file ``{dump_path}/step{N}/rank{R}.h5``: capture starts
before the step's first micro-batch (``on_step_begin``) and the file is finished after the
optimizer and scheduler step (``on_step_end``), so with ``gradient_accumulation_steps`` it
holds every micro-batch. N is the optimizer step counted from 0 in this run, R the
Trainer's process index. Evaluation and checkpointing run after on_step_end and are not
captured. ``on_train_end`` writes the last file.

The model captured is the one the Trainer runs (``trainer.model_wrapped``): with
``torch_compile=True`` the Trainer compiles its model after the callbacks are built and
hands them the uncompiled one, whose hooks dynamo would then trace (graph breaks, eager
code where compiled code ran). Module names stay those of the unwrapped model.
"""

from __future__ import annotations

import sys
import weakref

from probe.capture import unwrap
from probe.integrations.core import CapturingCallback, missing

try:
    from transformers import Trainer, TrainerCallback
except ImportError as error:  # pragma: no cover - depends on the environment
    raise missing("transformers", "hf") from error

#: frames between the Trainer's loop and a callback's event (CallbackHandler.on_train_begin,
#: call_event): looked through with room to spare for a subclass's own layers
_FRAMES_TO_THE_TRAINER = 8


class ProbeCallback(CapturingCallback, TrainerCallback):
    """Capture every optimizer step of a transformers Trainer: ``ProbeCallback(config)``,
    ``config`` as for PrecisionDebugger. ``.debugger`` is the PrecisionDebugger it drives."""

    _trainer = None  # weakref to the Trainer running this callback, found at on_train_begin

    def on_train_begin(self, args, state, control, **kwargs):
        trainer = _calling_trainer(self)
        self._trainer = None if trainer is None else weakref.ref(trainer)

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        self.capture.begin(self._running_model(model), rank=args.process_index)

    def on_step_end(self, args, state, control, **kwargs):
        self.capture.end()

    def on_train_end(self, args, state, control, **kwargs):
        self.capture.close()

    def _running_model(self, model):
        """The Trainer's outermost model (compiled, DDP, FSDP) when probe sees through its
        wrappers to ``model`` (so names do not change), else ``model``: a wrapper probe
        does not know (a DeepSpeed engine) would put its own segments into every name."""
        trainer = None if self._trainer is None else self._trainer()
        wrapped = getattr(trainer, "model_wrapped", None)
        if wrapped is not None and model is not None and unwrap(wrapped) is unwrap(model):
            return wrapped
        return model


def _calling_trainer(callback) -> Trainer | None:
    """The Trainer whose event is calling ``callback``. transformers hands callbacks the
    model, the optimizer and the data loaders, never the Trainer, and the model it hands
    over is the one given to Trainer(...), not the compiled one ``train()`` runs."""
    frame = sys._getframe(1)
    for _ in range(_FRAMES_TO_THE_TRAINER):
        if frame is None:
            return None
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, Trainer) and any(
                known is callback for known in candidate.callback_handler.callbacks):
            return candidate
        frame = frame.f_back
    return None
