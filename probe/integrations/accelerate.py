"""accelerate: a loop the user writes, with ``accelerator.accumulate``.

    capture = AcceleratorCapture(accelerator, "config.json")
    for batch in loader:
        with accelerator.accumulate(model), capture.batch(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()

Each optimizer step is one step file ``{dump_path}/step{N}/rank{R}.h5`` holding every
micro-batch: the file is finished after the batch where ``accelerator.sync_gradients`` is
true (the one whose optimizer.step() really steps). R is ``accelerator.process_index``;
module names are those of ``accelerator.unwrap_model(model)``. ``capture.close()`` (or the
end of the process) writes the last file.
"""

from __future__ import annotations

import contextlib

from probe.integrations.core import OptimizerStepCapture


class AcceleratorCapture:
    """Capture every optimizer step of an accelerate loop; ``config`` as for
    PrecisionDebugger (a path, a dict, a probe.Config or None)."""

    def __init__(self, accelerator, config=None) -> None:
        self.accelerator = accelerator
        self.capture = OptimizerStepCapture(config)
        self.debugger = self.capture.debugger

    @contextlib.contextmanager
    def batch(self, model):
        """Around one micro-batch's forward, backward and optimizer step."""
        accelerator = self.accelerator
        self.capture.begin(accelerator.unwrap_model(model), rank=accelerator.process_index)
        yield self.debugger
        if accelerator.sync_gradients:
            self.capture.end()

    def close(self) -> None:
        self.capture.close()
