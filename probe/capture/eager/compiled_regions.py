"""Compiled regions: the parts of a model that torch.compile runs, and how capture stays out.

A compiled region is a module whose calls run through TorchDynamo:

* ``torch.compile(model)`` or ``model.blocks[i] = torch.compile(block)``: an
  ``OptimizedModule`` holding the user's module as ``_orig_mod``;
* ``block.compile()``: the module itself, called through its ``_compiled_call_impl``;
* a module holding compiled functions as its own attributes: Lightning's
  ``trainer.fit(torch.compile(module))`` compiles the instance's ``training_step`` and
  ``forward``, and users write ``module.forward = torch.compile(module.forward)``. A
  compiled forward alone has its hooks on the module, as an OptimizedModule has; with other
  compiled methods, which a trainer calls directly and which may call the module from inside
  their frame, it gets no forward hooks, and compiled_functions gates those methods.

Dynamo traces every Python function the region's forward reaches, probe's hooks and its
TorchFunctionMode included: they would be traced into the graph or break it, and the step
would then run as eager code, so a difference that exists only in compiled code would go
unseen. So capture records a region at its boundary, from outside the compiled frame:

* the forward hooks of a region go on the ``OptimizedModule`` (its hooks run before dynamo
  takes the frame) or, for ``module.compile()``, around ``_compiled_call_impl`` (put back
  at stop());
* modules inside a region get no forward hooks (their parameters still get gradient hooks:
  those run in the autograd engine, outside the compiled code);
* while a region runs, probe's TorchFunctionMode is taken off the mode stack (Gate) and put
  back when it returns, so dynamo sees the stack it compiled for: no recompile.

Values computed inside the graph come from the graph itself (capture/compiled/graph_taps.py).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from probe import compat
from probe.capture.eager import compiled_functions, wrappers

_OPTIMIZED = "OptimizedModule"


class Target(NamedTuple):
    """One user module of the model and where capture attaches to it."""

    path: str  #: the user's module path (wrapper segments left out)
    module: torch.nn.Module  #: the user's module: its parameters, its class name
    hook_on: torch.nn.Module | None  #: gets the forward hooks; None inside a region
    region: bool  #: a compiled region's root: the mode is taken off while it runs
    compiled_call: bool  #: ``module.compile()``: the boundary is its _compiled_call_impl
    #: the compiled functions the module holds as its own attributes (found once per start())
    held: tuple = ()


def is_optimized(module: torch.nn.Module) -> bool:
    return any(cls.__name__ == _OPTIMIZED for cls in type(module).__mro__)


def targets(model: torch.nn.Module) -> list[Target]:
    """Every user module of ``model`` once, in ``named_modules()`` order."""
    found: list[Target] = []
    seen: set[int] = set()

    def visit(module, path, inside, boundary):
        if id(module) in seen:
            return
        seen.add(id(module))
        attribute = wrappers.wrapped_attribute(module)
        if attribute is not None:
            if boundary is None and not inside and is_optimized(module):
                boundary = module
            visit(compat.child_modules(module)[attribute], path, inside, boundary)
            return
        compiled_call = (boundary is None and not inside
                         and compat.compiled_call(module) is not None)
        held = compiled_functions.instance_functions(module)
        methods = compiled_functions.compiled_methods(module, held) if held and not inside else ()
        if boundary is not None or compiled_call:
            found.append(Target(path, module, boundary, True, compiled_call, held))
            inside = True
        elif methods:
            # a compiled forward alone is entered through Module.__call__, whose hooks run
            # outside its frame; a compiled training_step may call the module from inside
            alone = methods == [vars(module).get("forward")]
            found.append(Target(path, module, module if alone else None, True, False, held))
            inside = True
        elif inside:
            found.append(Target(path, module, None, False, False, held))
        else:
            found.append(Target(path, module, module, False, False, held))
        for name, child in compat.child_modules(module).items():
            if child is not None:
                visit(child, f"{path}.{name}" if path else name, inside, None)

    visit(model, "", False, None)
    # visit refers to itself through its closure: emptying that cell frees it now, not at the
    # garbage collector's next pass (with what it holds)
    del visit
    return found


def held_functions(targets: list[Target]) -> list:
    """The compiled functions all the targets' modules hold (compiled_functions.find's ``held``)."""
    return [function for target in targets for function in target.held]


def has_regions(model: torch.nn.Module) -> bool:
    return any(target.region for target in targets(model))


def region_paths(model: torch.nn.Module) -> list[str]:
    return [target.path for target in targets(model) if target.region]


class Gate:
    """Takes probe's TorchFunctionMode off the mode stack while a compiled region runs.

    ``mode`` is set once the mode is entered (start() installs hooks first). Regions nest
    (a compiled block inside a compiled model is one region: only the outermost is gated),
    but the same region may call itself; each enter() is matched by one leave()."""

    def __init__(self) -> None:
        self.mode = None
        self._held: list = []

    def enter(self) -> None:
        mode = self.mode
        stack = compat.function_mode_stack() if mode is not None else []
        position = next((i for i, m in enumerate(stack) if m is mode), None)
        if position is None:
            self._held.append(None)
            return
        above = stack[position + 1:]  # modes the user entered after start(): kept, in order
        for _ in range(len(above) + 1):
            compat.pop_function_mode()
        for other in above:
            compat.push_function_mode(other)
        self._held.append((mode, len(above)))

    def leave(self) -> None:
        held = self._held.pop() if self._held else None
        if held is None:
            return
        mode, depth = held
        above = []
        for _ in range(min(depth, len(compat.function_mode_stack()))):
            above.append(compat.function_mode_stack()[-1])
            compat.pop_function_mode()
        compat.push_function_mode(mode)
        for other in reversed(above):
            compat.push_function_mode(other)

    def release(self) -> None:
        """At stop(), after the mode is gone: forget regions whose leave() never ran."""
        self._held.clear()


class CallBoundary:
    """``module.compile()``'s boundary: ``_compiled_call_impl`` replaced by a function that
    runs ``before`` and ``after`` outside the compiled call; remove() puts it back."""

    def __init__(self, module: torch.nn.Module, before, after) -> None:
        self.module = module
        compiled = compat.compiled_call(module)
        self._compiled = compiled

        def boundary(*args, **kwargs):
            replaced = before(module, args, kwargs)
            if replaced is not None:
                args, kwargs = replaced
            try:
                output = compiled(*args, **kwargs)
            except BaseException:
                after(module, args, None)
                raise
            after(module, args, output)
            return output

        compat.set_compiled_call(module, boundary)

    def remove(self) -> None:
        module, compiled = self.module, self._compiled
        if compiled is not None:
            self._compiled = None
            compat.set_compiled_call(module, compiled)
