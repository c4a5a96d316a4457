"""Automatic capture in a process ``probe run -c`` started: the model and the step boundary,
found with torch's global hooks (no torch function is replaced).

* **When torch is imported**, attach() builds ``PrecisionDebugger()`` from $PROBE_CONFIG (so
  the config's seed and mode apply before the script builds its model, as when a script
  constructs the debugger at its top) and registers two global hooks:
  ``torch.nn.modules.module.register_module_forward_pre_hook`` and
  ``torch.optim.optimizer.register_optimizer_step_post_hook``.
* **The model** is found at the first module whose forward runs with gradients enabled and
  that has trainable parameters (the *first module trained*: the outermost module of the
  first training forward; a module called inside another one runs after it). Forwards under
  ``torch.no_grad()``/inference mode (evaluation, a frozen reference model) and modules
  without trainable parameters (input transforms) are passed over. It is that module, or,
  when the optimizer holding its parameters holds more, the smallest module owning them all
  (choose_model.py; ``--model CLASS`` names it). The global forward hook is then removed:
  afterwards the cost is one hook on the module whose forward begins a step and one on the
  optimizers.
* **A step begins** at the first forward with gradients enabled, after the previous step
  ended, of the first module trained (the model itself, or the part of it the training code
  calls first when the model's own forward never runs), and **ends** at
  ``optimizer.step()``: the first optimizer that steps is the one that counts. With gradient
  accumulation the step holds every micro-batch. A step the optimizer skips (GradScaler on
  inf) is no boundary.
* **Several models or optimizers**: only the model found above is captured at module level
  (at level api/mix every torch call of the step is captured, whoever makes it); a step of
  another optimizer is ignored, with one warning; an optimizer holding none of the model's
  parameters gets one warning (the model found is then probably not the one it trains).
* **Opt out**: ``probe run --no-attach``, or PROBE_ATTACH=0 in the environment. A script that
  builds its own PrecisionDebugger (or a trainer callback) turns automatic capture off by
  doing so (its debugger then takes the command's config: probe/command_config.py).
* **torch.compile**: an ``OptimizedModule`` warns on every call while a global module hook
  exists ("... fire an extra time"); until the model is found that hook is this session's,
  which fires once (for the compiled module, which becomes the model), so that one warning
  is filtered out for exactly as long as the hook is registered.

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

from probe import compat
from probe import command_config
from probe.autoattach import choose_model
from probe.debugger.debugger import PrecisionDebugger

#: the warning torch.compile's modules give while any global module hook is registered
_COMPILED_WITH_GLOBAL_HOOKS = r"Using `torch\.compile\(module\)` when there are global hooks"

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


#: how to choose the model without editing the script
_CHOOSE = ("to choose the model without editing the script, name its class: `probe run "
           "--model CLASS` (or `probe determinism --model CLASS`)")


def _run_pre_hooks(hooks: list, module, args: tuple, kwargs: dict):
    """Call forward pre-hooks as torch calls them (a global or plain one may replace the
    positional inputs, one taking keyword arguments both); None when none replaced anything,
    else the (args, kwargs) to run the call with."""
    replaced = False
    for hook, with_kwargs in hooks:
        if with_kwargs:
            result = hook(module, args, kwargs)
            if result is not None:
                args, kwargs = result
                replaced = True
        else:
            result = hook(module, args)
            if result is not None:
                args = result if isinstance(result, tuple) else (result,)
                replaced = True
    return (args, kwargs) if replaced else None


def _filter_compile_warning():
    """Filter torch.compile's warning about global module hooks while this session's own
    is registered; returns the filter entry (for _unfilter)."""
    warnings.filterwarnings("ignore", message=_COMPILED_WITH_GLOBAL_HOOKS, category=UserWarning)
    return warnings.filters[0]


def _unfilter(entry) -> None:
    if entry is not None:
        try:
            warnings.filters.remove(entry)
        except ValueError:  # the program reset the filters itself
            pass


class AutoCapture:
    """The debugger of this process and the hooks that drive it."""

    def __init__(self) -> None:
        self.debugger: PrecisionDebugger | None = None
        self.debugger = PrecisionDebugger()  # $PROBE_CONFIG (and $PROBE_SEED)
        #: the module captured (names are relative to it)
        self.model: torch.nn.Module | None = None
        #: the module whose training forward begins a step: the model, or the part of it
        #: the training code calls first (when the model's own forward never runs)
        self.entry: torch.nn.Module | None = None
        self.optimizer = None
        self._choice: choose_model.Choice | None = None
        self._chooser = choose_model.ModelChooser()
        self._warned: set[str] = set()
        self._quiet_compile = _filter_compile_warning()
        self._find_handle = _module_hooks.register_module_forward_pre_hook(self._find_model)
        self._step_handle = _optimizer_hooks.register_optimizer_step_post_hook(self._end_step)
        self._begin_handle = None

    # ------------------------------------------------------------------ hooks

    def _find_model(self, module, args):
        if not torch.is_grad_enabled() or not _trainable(module):
            return None
        choice = self._chooser.choose(module)
        if choice is None:
            return None  # a forward outside the model named with --model
        self._stop_finding()
        self._found(choice, module)
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
        if module is self.model:
            return self.debugger.start_inside_forward(module, args, kwargs)
        # the step begins in a call of a part of the model: torch read that call's hook lists
        # before start() hooked the model, so the pre-hooks start() added for it run here
        before = compat.forward_pre_hooks(module)
        self.debugger.start(self.model)
        added = [entry for entry in compat.forward_pre_hooks(module)
                 if not any(entry[0] is known for known, _ in before)]
        return _run_pre_hooks(added, module, args, kwargs)

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

    # ------------------------------------------------------------------ the model

    def _found(self, choice: choose_model.Choice, module: torch.nn.Module) -> None:
        self._choice = choice
        self.model, self.entry = choice.model, module
        model = choice.model
        count = sum(1 for _ in model.parameters())
        command_config.note("model", f"automatic capture: the model is {type(model).__name__} "
                                     f"({count} parameter tensors): {choice.reason}",
                            model=type(model).__name__)
        if self._chooser.unmatched is not None:
            self._warn_once("class", f"--model {self._chooser.wanted}: no module of that class "
                            f"exists at the first training forward; modules with parameters of "
                            f"their own: {', '.join(self._chooser.unmatched[:12]) or 'none'}")
        if choice.outside:
            self._warn_outside(choice.optimizer, choice.outside)  # known before the first step

    def _check_optimizer(self, optimizer) -> None:
        model_params = {id(param) for param in self.model.parameters()}
        stepped = choose_model.stepped_ids(optimizer)
        if stepped and not stepped & model_params:
            self._warn_once("model", f"{type(optimizer).__name__} holds none of the parameters "
                            f"of the captured model ({type(self.model).__name__}, the first "
                            f"module trained); {_CHOOSE}")
        elif stepped - model_params:
            self._warn_outside(optimizer, len(stepped - model_params))

    def _warn_outside(self, optimizer, outside: int) -> None:
        if self._chooser.wanted and self._chooser.unmatched is None:
            why = f"it is the module of class {self._chooser.wanted} named with --model"
        elif self._choice is not None and self._choice.optimizer is optimizer:
            why = "no module alive at the first training forward owns them all"
        else:
            why = "the model was chosen at the first training forward, before this optimizer held them"
        self._warn_once("outside", f"{type(optimizer).__name__} holds {outside} parameters the "
                        f"captured model ({type(self.model).__name__}) does not own, and {why}: "
                        "their calls are recorded outside the model's modules and fingerprints "
                        f"name them by position (opt0.paramN); {_CHOOSE}")

    def _stop_finding(self) -> None:
        handle, self._find_handle = self._find_handle, None
        if handle is not None:
            handle.remove()
        quiet, self._quiet_compile = self._quiet_compile, None
        _unfilter(quiet)

    # ------------------------------------------------------------------ checks

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(f"probe: automatic capture: {message}", RuntimeWarning, stacklevel=3)

    # ------------------------------------------------------------------ the end

    def remove_hooks(self) -> None:
        self._stop_finding()
        for name in ("_step_handle", "_begin_handle"):
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
