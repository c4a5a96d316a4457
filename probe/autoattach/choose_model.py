"""Which module zero-edit capture takes as the model, decided at the first training forward.

The module whose forward runs first with gradients enabled and trainable parameters (the
*first module trained*) is the model when it owns every parameter of the optimizer that holds
its parameters, or when no optimizer holds them yet: the usual ``loss = model(batch)``.
Training code that calls a method of its model instead of its forward
(stable-baselines3's ``policy.evaluate_actions``, ``model.compute_loss(batch)``) runs the
forwards of its parts one by one: the first module trained is then one part
(``mlp_extractor``) while the optimizer holds the whole (the policy). The model is then
the smallest module alive that owns every parameter that optimizer holds (fewest
parameters, then fewest modules: a wrapper holding the same parameters is passed over),
found with one scan of the objects the garbage collector tracks, made once per process.

``--model CLASS`` (``$PROBE_MODEL``) chooses without editing the script: the model is the
smallest module of that class (its ``__name__``, or ``module.qualname``) holding the first
module trained; forwards outside every module of that class are passed over.
"""

from __future__ import annotations

import gc
import os
import weakref
from dataclasses import dataclass

import torch

from probe.autoattach import ENV_MODEL


@dataclass
class Choice:
    model: torch.nn.Module
    #: how it was chosen, for the note a user reads
    reason: str
    #: the optimizer holding the first module's parameters, when one exists yet
    optimizer: object = None
    #: how many of that optimizer's parameters the model does not own (none owns them all)
    outside: int = 0


def class_name(module) -> str:
    return type(module).__name__


def _is_class(module, wanted: str) -> bool:
    kind = type(module)
    return wanted in (kind.__name__, kind.__qualname__, f"{kind.__module__}.{kind.__qualname__}")


def _ids(module: torch.nn.Module) -> set[int]:
    try:
        return {id(param) for param in module.parameters()}
    except Exception:  # a module whose parameters() fails owns nothing we can count on
        return set()


def _size(module: torch.nn.Module) -> tuple[int, int]:
    return len(_ids(module)), sum(1 for _ in module.modules())


def _live() -> tuple[list, list]:
    """Every nn.Module and optimizer alive (one pass over the objects gc tracks)."""
    modules, optimizers = [], []
    module_type, optimizer_type = torch.nn.Module, torch.optim.Optimizer
    for thing in gc.get_objects():
        kind = type(thing)  # never isinstance: a proxy's __class__ can raise
        if issubclass(kind, module_type):
            modules.append(thing)
        elif issubclass(kind, optimizer_type):
            optimizers.append(thing)
    return modules, optimizers


def stepped_ids(optimizer) -> set[int]:
    return {id(param) for group in optimizer.param_groups for param in group["params"]}


def _holding_optimizer(first: torch.nn.Module, optimizers: list):
    """The optimizer holding the most of ``first``'s trainable parameters (None if none)."""
    trainable = {id(param) for param in first.parameters() if param.requires_grad}
    best, most = None, 0
    for optimizer in optimizers:
        try:
            held = len(trainable & stepped_ids(optimizer))
        except Exception:
            continue
        if held > most:
            best, most = optimizer, held
    return best


class ModelChooser:
    """Decides the model at the first training forward (``choose``), once per process."""

    def __init__(self, environ=None) -> None:
        environ = os.environ if environ is None else environ
        self.wanted = environ.get(ENV_MODEL, "").strip()
        #: the modules of the wanted class and the ids of every module inside each
        self._named: list[tuple[weakref.ref, set[int]]] | None = None
        #: the wanted class matched no module alive: say so once, then choose as without it
        self.unmatched: list[str] | None = None

    def choose(self, first: torch.nn.Module) -> Choice | None:
        """The model for a training forward of ``first``; None: pass this forward over (it
        runs outside every module of the wanted class)."""
        modules = optimizers = None
        if self.wanted and self.unmatched is None:
            if self._named is None:
                modules, optimizers = _live()
                self._named = [(weakref.ref(m), {id(sub) for sub in m.modules()})
                               for m in modules if _is_class(m, self.wanted)]
                if not self._named:
                    self.unmatched = sorted({class_name(m) for m in modules
                                             if any(True for _ in m.parameters(recurse=False))})
            if self._named:
                holding = [ref() for ref, inside in self._named if id(first) in inside]
                holding = [m for m in holding if m is not None]
                if not holding:
                    return None
                model = min(holding, key=_size)
                return Choice(model, f"the module of class {self.wanted} (--model) holding "
                                     f"the first module trained, {class_name(first)}")
        if modules is None:
            modules, optimizers = _live()
        optimizer = _holding_optimizer(first, optimizers)
        first_reason = "the first module trained"
        if optimizer is None:
            return Choice(first, first_reason)
        stepped = stepped_ids(optimizer)
        if stepped <= _ids(first):
            return Choice(first, first_reason, optimizer)
        owners = [m for m in modules if stepped <= _ids(m)]
        if not owners:
            return Choice(first, first_reason, optimizer, outside=len(stepped - _ids(first)))
        model = min(owners, key=_size)
        return Choice(model, f"the smallest module owning every parameter "
                             f"{type(optimizer).__name__} holds (the first module trained, "
                             f"{class_name(first)}, owns {len(stepped & _ids(first))} of "
                             f"{len(stepped)})", optimizer)


__all__ = ["ModelChooser", "Choice", "ENV_MODEL", "stepped_ids", "class_name"]
