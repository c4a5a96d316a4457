"""What every trainer integration does: one step file per optimizer step, micro-batches and
all, the rank given by the trainer. The framework modules only map their events onto
begin()/end()/close()."""

from __future__ import annotations

import torch

from probe.debugger.debugger import PrecisionDebugger


class OptimizerStepCapture:
    """A PrecisionDebugger driven by a trainer's events.

    ``config``: a path to a .json/.yaml config, a dict of config keys, a probe.Config, or
    None (the config ``probe run -c`` handed down, else the defaults), as for
    PrecisionDebugger.
    """

    def __init__(self, config=None) -> None:
        self.debugger = PrecisionDebugger(config)

    def begin(self, model: torch.nn.Module, rank: int | None = None) -> None:
        """Before a micro-batch: start the step's capture unless it is already running (a
        later micro-batch of the same optimizer step)."""
        debugger = self.debugger
        if rank is not None:
            debugger.rank = rank
        if not debugger.started:
            debugger.start(model)

    def end(self) -> None:
        """After the optimizer step: the step file is finished, the next step begins."""
        self.debugger.step()

    def close(self) -> None:
        """At the end of training: the open step (if any) written, every file on disk."""
        self.debugger.close()


class CapturingCallback:
    """The part every trainer callback shares: ``config`` as for PrecisionDebugger (a path,
    a dict, a probe.Config or None); ``.debugger`` is the PrecisionDebugger it drives."""

    def __init__(self, config=None) -> None:
        self.capture = OptimizerStepCapture(config)
        self.debugger = self.capture.debugger


def missing(package: str, extra: str) -> ImportError:
    """The ImportError of an integration whose framework is not installed."""
    return ImportError(f"probe.integrations needs {package}: pip install {package} "
                       f"(or: pip install 'precision-probe[{extra}]')")
