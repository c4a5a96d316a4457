"""Lightning ``Trainer``: ``Trainer(..., callbacks=[ProbeCallback("config.json")])``.

Each optimizer step is one step file ``{dump_path}/step{N}/rank{R}.h5``: capture starts
before the step's first batch (``on_train_batch_start``) and the file is finished after the
batch in which ``trainer.global_step`` advanced, so with ``accumulate_grad_batches`` it holds
every micro-batch. R is ``trainer.global_rank``. Module names are relative to the
LightningModule (an attribute ``model`` of it gives ``model.<...>``). Validation runs outside
the training batches and is not captured. With ``"fingerprint": true`` the loss
training_step returns goes into each step's fingerprint. The last file is written at the end of fit (or
when it fails).

A model compiled inside the module (``self.net = torch.compile(self.net)``) is captured
from inside its compiled graph at level api/mix, as any plain torch.compile is, and so is
``trainer.fit(torch.compile(module))``: Lightning then compiles the module's
``training_step`` and ``forward`` on that one instance, and capture treats the module as a
compiled region whose boundary is those functions (capture/eager/compiled_regions.py).

Works with the ``lightning`` package, else with ``pytorch_lightning``.
"""

from __future__ import annotations

from probe.integrations.core import CapturingCallback, missing

try:
    from lightning.pytorch import Callback
except ImportError:
    try:
        from pytorch_lightning import Callback
    except ImportError as error:  # pragma: no cover - depends on the environment
        raise missing("lightning", "lightning") from error


class ProbeCallback(CapturingCallback, Callback):
    """Capture every optimizer step of a Lightning Trainer: ``ProbeCallback(config)``,
    ``config`` as for PrecisionDebugger. ``.debugger`` is the PrecisionDebugger it drives."""

    _steps_at_begin: int | None = None  # trainer.global_step when the open step began

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self._steps_at_begin is None:
            self._steps_at_begin = trainer.global_step
        self.capture.begin(pl_module, rank=trainer.global_rank)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        # training_step's loss, for the fingerprints (a no-op without "fingerprint": true)
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if loss is not None:
            self.debugger.note_loss(loss)
        if self._steps_at_begin is not None and trainer.global_step != self._steps_at_begin:
            self._steps_at_begin = None
            self.capture.end()

    def on_train_end(self, trainer, pl_module):
        self.capture.close()

    def on_exception(self, trainer, pl_module, exception):
        self.capture.close()
