"""transformers ``Trainer``: ``Trainer(..., callbacks=[ProbeCallback("config.json")])``.

Each optimizer step is one step file ``{dump_path}/step{N}/rank{R}.h5``: capture starts
before the step's first micro-batch (``on_step_begin``) and the file is finished after the
optimizer and scheduler step (``on_step_end``), so with ``gradient_accumulation_steps`` it
holds every micro-batch. N is the optimizer step counted from 0 in this run, R the
Trainer's process index. Evaluation and checkpointing run after on_step_end and are not
captured. ``on_train_end`` writes the last file.
"""

from __future__ import annotations

from probe.integrations.core import CapturingCallback, missing

try:
    from transformers import TrainerCallback
except ImportError as error:  # pragma: no cover - depends on the environment
    raise missing("transformers", "hf") from error


class ProbeCallback(CapturingCallback, TrainerCallback):
    """Capture every optimizer step of a transformers Trainer: ``ProbeCallback(config)``,
    ``config`` as for PrecisionDebugger. ``.debugger`` is the PrecisionDebugger it drives."""

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        self.capture.begin(model, rank=args.process_index)

    def on_step_end(self, args, state, control, **kwargs):
        self.capture.end()

    def on_train_end(self, args, state, control, **kwargs):
        self.capture.close()
