"""Training with and without capture, for the bit-neutrality tests: one training runs every
capture (level x task) in turn, one per optimizer step, so that a few steps of one model cover
them all; the same training without capture is the reference. Every step's loss, gradients
and parameters must be bit-identical."""

import torch

from probe.config import Config
from probe.debugger.debugger import PrecisionDebugger

#: each level and each task at least once, one optimizer step each (a task only changes what
#: is computed from a recorded tensor; the level changes the hooks), and the commonest setting
CAPTURES = [("api", "statistics"), ("module", "checksum"), ("mix", "tensor"), ("mix", "statistics")]


def debuggers(folder, captures=CAPTURES) -> list:
    """One PrecisionDebugger per (level, task), writing in this process. Built before the model
    in both trainings: each seeds like the others."""
    return [PrecisionDebugger(Config(dump_path=str(folder / f"{level}-{task}"), level=level,
                                     task=task, writer="inline"))
            for level, task in captures]


class Trace:
    """What a training computed at each optimizer step: loss, gradients, parameters after."""

    def __init__(self) -> None:
        self.losses: list = []
        self.grads: list[dict] = []
        self.params: list[dict] = []

    def step(self, loss, named_parameters) -> None:
        """Called after backward, before optimizer.step()."""
        named = list(named_parameters)
        self.losses.append(None if loss is None else loss.detach().clone())
        self.grads.append({name: p.grad.clone() for name, p in named if p.grad is not None})

    def stepped(self, named_parameters) -> None:
        """Called after optimizer.step()."""
        self.params.append({name: p.detach().clone() for name, p in named_parameters})


def moved(plain: Trace, captured: Trace, labels=None) -> list[str]:
    """Every difference between two traces, as 'step N (label): what' (empty: bit-identical)."""
    found = []
    assert len(plain.grads) == len(captured.grads) and plain.grads, "the trainings differ in steps"
    for step in range(len(plain.grads)):
        label = f"step {step}" + (f" ({labels[step % len(labels)]})" if labels else "")
        loss_a, loss_b = plain.losses[step], captured.losses[step]
        if loss_a is not None and not torch.equal(loss_a, loss_b):
            found.append(f"{label}: loss {loss_a.item()!r} != {loss_b.item()!r}")
        for kind, a, b in (("grad", plain.grads[step], captured.grads[step]),
                           ("param", plain.params[step], captured.params[step])):
            assert a.keys() == b.keys(), f"{label}: {kind}s of other parameters"
            found += [f"{label}: {kind} {name}" for name in a if not torch.equal(a[name], b[name])]
    return found
