"""Automatic capture in a process ``probe run -c`` started: the model and the step boundary,
found with torch's global hooks (no torch function is replaced).

* **When torch is imported**, attach() builds ``PrecisionDebugger()`` from $PROBE_CONFIG (so
  the config's seed and mode apply before the script builds its model, as when a script
  constructs the debugger at its top) and registers two global hooks:
  ``torch.nn.modules.module.register_module_forward_pre_hook`` and
  ``torch.optim.optimizer.register_optimizer_step_post_hook``.
* **The model** is the first module whose forward runs with gradients enabled and that has
  trainable parameters: the outermost module of the first training forward (a module called
  inside another one runs after it). Forwards under ``torch.no_grad()``/inference mode
  (evaluation, a frozen reference model) and modules without trainable parameters (input
  transforms) are passed over. The global forward hook is then removed: afterwards the cost
  is one hook on the model and one on the optimizers.
* **A step begins** at the model's first forward with gradients enabled after the previous
  step ended, and **ends** at ``optimizer.step()``: the first optimizer that steps is the one
  that counts. With gradient accumulation the step holds every micro-batch. A step the
  optimizer skips (GradScaler on inf) is no boundary.
* **Several models or optimizers**: only the model found above is captured at module level
  (at level api/mix every torch call of the step is captured, whoever makes it); a step of
  another optimizer is ignored, with one warning; an optimizer holding none of the model's
  parameters gets one warning (the model found is then probably not the one it trains).
* **Opt out**: ``probe run --no-attach``, or PROBE_ATTACH=0 in the environment. A script that
  builds its own PrecisionDebugger (or a trainer callback) turns automatic capture off by
  doing so.

The model's first forward of the run is seen by a global hook, which torch gives no keyword
arguments: they are read from torch's calling frame (_running_call_kwargs), so step 0 records
them too; on a torch whose frame is laid out otherwise they are left out of step 0 only. From
step 1 on, a step starts in a pre-hook of the model that sees both, and the step file holds
what ``start(model)`` before the forward would record.
"""

from __future__ import annotations

import sys
import warnings

import torch
import torch.nn.modules.module as _module_hooks
import torch.optim.optimizer as _optimizer_hooks

from probe.debugger.debugger import PrecisionDebugger

_SESSION: "AutoCapture | None" = None


def attach() -> "AutoCapture | None":
    """Start automatic capture in this process (once); None when it is not wanted here."""
    global _SESSION
    from probe import autoattach

    if _SESSION is None and autoattach.wanted():
        _SESSION = AutoCapture()
    return _SESSION


def current() -> "AutoCapture | None":
    return _SESSION


def on_debugger_created(debugger: PrecisionDebugger) -> None:
    """Called by every PrecisionDebugger(): a script (or a trainer callback) that builds its
    own debugger captures by itself, so automatic capture stands down."""
    session = _SESSION
    if session is not None and debugger is not session.debugger and session.debugger is not None:
        session.stand_down(announce=True)


def _running_call_kwargs(module: torch.nn.Module) -> dict | None:
    """The keyword arguments of ``module``'s running call, for the global pre-hook that finds
    the model: torch hands global forward pre-hooks none, so they are looked up in the frame
    that calls the hook, ``Module._call_impl`` or its inner function, where they are the local
    dict ``kwargs`` that forward receives (the caller writes the capture's aliases of inputs
    that require grad into it, what a pre-hook with kwargs would return). None when that frame
    does not look so (another torch layout): the call's keyword inputs then go unrecorded."""
    try:
        frame = sys._getframe(2)  # 0: here, 1: _find_model, 2: torch's hook caller
        names = frame.f_locals
    except (AttributeError, ValueError):
        return None
    kwargs = names.get("kwargs")
    if names.get("self") is module and isinstance(kwargs, dict):
        return kwargs
    return None


def _trainable(module: torch.nn.Module) -> bool:
    return any(param.requires_grad for param in module.parameters())


class AutoCapture:
    """The debugger of this process and the hooks that drive it."""

    def __init__(self) -> None:
        self.debugger: PrecisionDebugger | None = None
        self.debugger = PrecisionDebugger()  # $PROBE_CONFIG (and $PROBE_SEED)
        self.model: torch.nn.Module | None = None
        self.optimizer = None
        self._warned: set[str] = set()
        self._find_handle = _module_hooks.register_module_forward_pre_hook(self._find_model)
        self._step_handle = _optimizer_hooks.register_optimizer_step_post_hook(self._end_step)
        self._begin_handle = None

    # ------------------------------------------------------------------ hooks

    def _find_model(self, module, args):
        if not torch.is_grad_enabled() or not _trainable(module):
            return None
        self._find_handle.remove()
        self._find_handle = None
        self.model = module
        self._begin_handle = module.register_forward_pre_hook(self._begin_step, with_kwargs=True)
        kwargs = _running_call_kwargs(module)
        replaced = self._begin(module, args, {} if kwargs is None else kwargs)
        if replaced is None:
            return None
        if kwargs is not None:
            kwargs.update(replaced[1])  # the very dict torch passes to forward
        return replaced[0]

    def _begin_step(self, module, args, kwargs):
        if self.debugger.started or not torch.is_grad_enabled():
            return None  # a later micro-batch of the open step, or an evaluation
        return self._begin(module, args, kwargs)

    def _begin(self, module, args, kwargs):
        return self.debugger.start_inside_forward(module, args, kwargs)

    def _end_step(self, optimizer, args, kwargs) -> None:
        if self.model is None:
            return  # no training forward yet: nothing to end
        if self.optimizer is None:
            self.optimizer = optimizer
            self._check_optimizer(optimizer)
        elif optimizer is not self.optimizer:
            self._warn_once("optimizer", f"a second optimizer ({type(optimizer).__name__}) "
                            f"stepped; only the first ({type(self.optimizer).__name__}) ends a "
                            "step of the automatic capture")
            return
        self.debugger.step()

    # ------------------------------------------------------------------ checks

    def _check_optimizer(self, optimizer) -> None:
        model_params = {id(param) for param in self.model.parameters()}
        stepped = [param for group in optimizer.param_groups for param in group["params"]]
        if stepped and not any(id(param) in model_params for param in stepped):
            self._warn_once("model", f"{type(optimizer).__name__} holds none of the parameters "
                            f"of the captured model ({type(self.model).__name__}, the first "
                            "module trained); build a PrecisionDebugger and call "
                            "start(model) to choose the model")

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(f"probe: automatic capture: {message}", RuntimeWarning, stacklevel=3)

    # ------------------------------------------------------------------ the end

    def remove_hooks(self) -> None:
        for name in ("_find_handle", "_step_handle", "_begin_handle"):
            handle = getattr(self, name)
            setattr(self, name, None)
            if handle is not None:
                handle.remove()

    def stand_down(self, announce: bool = False) -> None:
        """Remove the hooks and write what was captured (the script captures by itself, or
        a benchmark ends the session); ``announce``: say so on stderr if steps were taken."""
        global _SESSION
        if _SESSION is self:
            _SESSION = None
        self.remove_hooks()
        debugger, self.debugger = self.debugger, None
        captured = debugger.current_step > 0 or debugger.started
        debugger.hand_over_random_mode()  # the script's debugger installs its own
        debugger.close()
        if captured and announce:
            print(f"probe: automatic capture stopped after step {debugger.current_step}: the "
                  "script builds its own PrecisionDebugger", file=sys.stderr)
