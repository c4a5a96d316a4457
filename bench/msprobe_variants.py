"""msprobe (mindstudio-probe) as variants of bench/dump_overhead.py, in the same process.

msprobe installs itself for good: constructing its PrecisionDebugger replaces ~700 torch
functions with wrappers (level L1), wraps BackwardHook.setup_input_hook/setup_output_hook,
BackwardHookFunction.apply, torch.jit.script and Work.wait (every level), and hooks every
submodule of the model it starts on (L0). Nothing of it is undone by stop(), and
PrecisionDebugger is a singleton. Timed as is, it would slow down every other variant of the
benchmark (their steps would run through msprobe's wrappers) and the L1 wrappers would
record inside L0's steps. So each msprobe variant:

* is constructed on unpatched torch; what the construction changed in torch's modules and in
  a few torch classes is recorded (TorchPatches) and then put back;
* puts its patches back in before each of its steps and takes them out after, both untimed:
  a timed msprobe step runs as in a process where msprobe is installed, every other
  variant's step on untouched torch;
* makes its own debugger the singleton for its steps;
* at L0 trains its own copy of the model (same architecture and initial weights) with its
  own optimizer, because its module hooks stay on the modules it was started on.

Configuration: task statistics (max, min, mean, L2 norm per tensor; probe records min, max,
mean, norm, NaN/Inf counts and a sketch), every step, all ranks, extra_info off (no call
stacks or construct tree: probe records neither), synchronous dump, msprobe's log level
WARNING unless MSPROBE_LOG_LEVEL is set. The step boundaries are probe's:
start(model), the training step, stop(), step().
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import json
import os
import shutil
import sys
import time
import types

INSTALL_HINT = "pip install mindstudio-probe==26.2.0 (or pip install -e '.[bench]' with torch held)"
LEVELS = {"msprobe L1": "L1", "msprobe L0": "L0"}


def available() -> bool:
    """Whether mindstudio-probe's PyTorch debugger can be imported here."""
    return importlib.util.find_spec("msprobe") is not None


def version() -> str | None:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed("mindstudio-probe")
    except PackageNotFoundError:
        return None


def config_for(level: str, dump_path: str) -> dict:
    """msprobe's config.json for a statistics dump at `level` (L1: APIs, L0: modules)."""
    return {
        "task": "statistics",
        "dump_path": dump_path,
        "rank": [],
        "step": [],
        "level": level,
        "extra_info": False,
        "async_dump": False,
        "statistics": {"scope": [], "list": [], "data_mode": ["all"], "summary_mode": "statistics"},
    }


def _torch_namespaces() -> list:
    """The objects whose attributes msprobe replaces: torch's loaded modules and the torch
    classes it patches methods of."""
    import torch
    import torch.nn.modules._functions as module_functions
    import torch.utils.hooks as hooks

    owners = [module for name, module in list(sys.modules.items())
              if module is not None and (name == "torch" or name.startswith("torch."))]
    owners += [torch.Tensor, hooks.BackwardHook, module_functions.BackwardHookFunction]
    if torch.distributed.is_available():
        from torch._C._distributed_c10d import Work

        owners.append(Work)
    return owners


class _New:
    def __repr__(self):
        return "<not set>"


_NEW = _New()  # a name a namespace did not have


def _patchable(value) -> bool:
    """A value a patch may set: a function or wrapper, never a submodule or a class (those
    appear in a package's namespace when torch imports something lazily)."""
    if isinstance(value, (types.ModuleType, type)):
        return False
    return callable(value) or isinstance(value, (staticmethod, classmethod, property))


def snapshot(owners) -> dict:
    """{id(owner): (owner, copy of its namespace)}."""
    return {id(owner): (owner, dict(vars(owner))) for owner in owners if hasattr(owner, "__dict__")}


class TorchPatches:
    """What some code (a debugger's construction) changed in torch's namespaces: apply()
    puts those values in, revert() puts every namespace it touched back as it was before."""

    def __init__(self, before: dict, after: dict, always=()):
        #: id(owner) -> (owner, {name: value after}), the patched functions
        self.changes = {}
        for key, (owner, old) in before.items():
            if key in after:
                changed = {name: value for name, value in after[key][1].items()
                           if old.get(name, _NEW) is not value and _patchable(value)}
                if changed:
                    self.changes[key] = (owner, changed)
        kept = set(self.changes) | {id(owner) for owner in always}
        #: the touched namespaces as they were before
        self._before = {key: value for key, value in before.items() if key in kept}

    def __len__(self) -> int:
        return sum(len(changed) for _, changed in self.changes.values())

    def names(self) -> list[str]:
        return sorted(f"{getattr(owner, '__name__', owner)}.{name}"
                      for owner, changed in self.changes.values() for name in changed)

    def apply(self) -> None:
        for owner, changed in self.changes.values():
            for name, value in changed.items():
                setattr(owner, name, value)

    def revert(self) -> None:
        """Every function of a touched namespace back to its value before, including those
        the patched code changed since (msprobe swaps Tensor.view_as in and out inside
        backward hooks): functions set since are deleted, replaced ones restored."""
        for owner, old in self._before.values():
            for name, value in list(vars(owner).items()):
                previous = old.get(name, _NEW)
                if previous is value or not (_patchable(value) or _patchable(previous)):
                    continue
                if previous is _NEW:
                    delattr(owner, name)
                else:
                    setattr(owner, name, previous)


def construct(level: str, config_path: str):
    """A new msprobe PrecisionDebugger for `config_path`, with an API registry of its own,
    and the TorchPatches its construction made; torch is left as it was before, and
    msprobe's singleton slots empty."""
    import torch

    os.environ.setdefault("MSPROBE_LOG_LEVEL", "2")  # warnings and errors only
    with contextlib.redirect_stdout(sys.stderr):  # msprobe prints its log to stdout
        from msprobe.pytorch import PrecisionDebugger
        from msprobe.pytorch.dump.api_dump import api_register

        PrecisionDebugger._instance = None
        api_register.api_register = None  # a new registry: its wrappers call this debugger
        before = snapshot(_torch_namespaces())
        try:
            debugger = PrecisionDebugger(config_path=config_path)
        finally:
            after = snapshot(_torch_namespaces())
            patches = TorchPatches(before, after, always=[torch.Tensor])
            patches.revert()
            PrecisionDebugger._instance = None
            api_register.api_register = None
    return debugger, patches


class MsprobeVariant:
    """One msprobe configuration as a variant of dump_overhead.py: run() is one captured
    step (start, train_step, stop, step), timed like probe's variants."""

    def __init__(self, name, model, optimizer, batch, dump_root, synchronize=None):
        from examples.models import train_step

        self.name = name
        self.level = LEVELS[name]
        if self.level == "L0":  # its module hooks stay on the modules: give it its own
            model = copy.deepcopy(model)
            optimizer = type(optimizer)(model.parameters(), **optimizer.defaults)
        self.model = model
        self._train = lambda: train_step(model, optimizer, *batch)
        self._sync = synchronize or (lambda: None)
        self.calls = None  # records in one step's dump.json
        self.dump_ratio = None
        self.last_sketch = 0.0
        folder = os.path.join(dump_root, name.replace(" ", "_"))
        os.makedirs(folder, exist_ok=True)
        config_path = os.path.join(folder, "config.json")
        with open(config_path, "w") as handle:
            json.dump(config_for(self.level, os.path.join(folder, "dump")), handle)
        self.debugger, self.patches = construct(self.level, config_path)

    @contextlib.contextmanager
    def installed(self):
        """msprobe as a process that runs it sees it: its patches in, its debugger and its
        API registry the singletons, its log on stderr (stdout may be --json)."""
        from msprobe.pytorch import PrecisionDebugger
        from msprobe.pytorch.dump.api_dump import api_register

        PrecisionDebugger._instance = self.debugger
        api_register.api_register = self.debugger.service.api_register
        self.patches.apply()
        try:
            with contextlib.redirect_stdout(sys.stderr):
                yield PrecisionDebugger
        finally:
            self.patches.revert()
            PrecisionDebugger._instance = None
            api_register.api_register = None

    def run(self) -> float:
        """One step; returns seconds."""
        with self.installed() as debugger:
            thread_start = time.thread_time()
            start = time.perf_counter()
            debugger.start(model=self.model)
            self._train()
            debugger.stop()
            self._sync()
            debugger.step()
            self._sync()
            elapsed = time.perf_counter() - start
            self.last_thread = time.thread_time() - thread_start
        self.last_capture = elapsed
        self._clean_dump()  # not timed
        return elapsed

    def _clean_dump(self) -> None:
        """Count the step's records once, and delete the step's folder (keeps the disk small)."""
        step_dir = self.debugger.service.dump_iter_dir
        if not step_dir or not os.path.isdir(step_dir):
            return
        if self.calls is None:
            for folder, _, files in os.walk(step_dir):
                if "dump.json" in files:
                    with open(os.path.join(folder, "dump.json")) as handle:
                        self.calls = len(json.load(handle).get("data", {}))
        shutil.rmtree(step_dir, ignore_errors=True)
