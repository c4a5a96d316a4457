"""Functions compiled with ``@torch.compile`` that an eager model calls.

Such a function is a compiled region too: dynamo evaluates its frame under the
TorchFunctionMode stack of the moment, so probe's api mode on that stack would be traced (a
graph break, or worse) and its coming and going would fail the compiled code's guard on the
stack (a recompile). A model's ``forward`` reaches these functions through the globals of the
file that defines it, or as methods of its class: probe finds them there and, while a capture
is on, has each one's dynamo context take probe's modes off the stack around the call, the way
compiled_regions.Gate does around a compiled module.

A module may also hold compiled functions of its own, as instance attributes: Lightning's
``trainer.fit(torch.compile(module))`` sets ``module.training_step`` and ``module.forward`` to
the compiled versions, and ``module.forward = torch.compile(module.forward)`` is a common
idiom. Such a module is a compiled region (compiled_regions.targets) whose boundary is those
functions: instance_functions() finds them, and find() gates them with the rest.

The gate is an entry of the context's ``enter_exit_hooks``: dynamo runs them before it
evaluates the function's frame and runs what they return after the call, exceptions included.
"""

from __future__ import annotations

import types

import torch

from probe import compat

_FUNCTION = types.FunctionType
_MAX_CLASSES = 4096  # module classes looked at per model: a bound on a pathological model


def _compiling_context_type():
    """dynamo's context of a function that torch.compile compiles (not of one that
    torch.compiler.disable keeps eager: that one's ops run eagerly and are recorded)."""
    return compat.dynamo_compiling_context_type()


#: the module classes of a model -> ((context, function) pairs, ((namespace, value ids), ...)):
#: start() runs every step, and a model's classes and the files defining them seldom change;
#: a global added or rebound since (a function compiled later) changes the ids
_found: dict = {}
_FOUND_LIMIT = 64


def find(model: torch.nn.Module, modules=None, held=None) -> list:
    """The dynamo contexts of the compiled functions that ``model``'s modules hold and its
    classes reach: the globals of the files defining their ``forward`` and the functions in
    the classes. ``modules``: the model's modules, and ``held``: the compiled functions they
    hold (instance_functions of each), when the caller has walked them already."""
    return [context for context, _ in _find(model, modules, held)]


def functions(model: torch.nn.Module, modules=None, held=None) -> list:
    """The compiled functions themselves, one per context find() returns (graph taps swap
    what they compile with: capture/compiled/region_taps.py)."""
    return [function for _, function in _find(model, modules, held)]


def instance_functions(module: torch.nn.Module) -> tuple:
    """The torch.compile'd functions ``module`` holds as its own attributes (not its class's),
    e.g. the ``training_step`` Lightning compiles on the instance. start() asks this of every
    module: the test for a plain function among the attributes runs in C first, as almost
    no module holds one."""
    values = vars(module).values()
    if _FUNCTION not in set(map(type, values)):
        return ()
    return tuple(value for value in values
                 if type(value) is _FUNCTION and compat.dynamo_original(value) is not None)


def compiled_methods(module: torch.nn.Module, held=None) -> list:
    """The functions ``module`` holds (``held``: its instance_functions, when known) that
    compile one of its own methods (Lightning's ``training_step``, ``module.forward =
    torch.compile(module.forward)``): they make the module a compiled region. A compiled free
    function kept as an attribute does not."""
    return [function for function in (instance_functions(module) if held is None else held)
            if getattr(compat.dynamo_original(function), "__self__", None) is module]


def _find(model, modules, held) -> list:
    """(dynamo context, compiled function) of each compiled function ``model`` reaches."""
    kind = _compiling_context_type()
    if not kind:
        return []
    modules = list(model.modules() if modules is None else modules)
    if held is None:  # not cached: an instance's attributes change without its class
        held = [function for module in modules for function in instance_functions(module)]
    own: dict = {}
    for function in held:
        _collect(function, own, kind)
    return list(own.values()) + [found for found in _find_in_classes(modules, kind)
                                 if id(found[0]) not in own]


def _find_in_classes(modules, kind) -> list:
    """(dynamo context, compiled function) of each compiled function the classes of
    ``modules`` reach: class attributes and the globals of their forward's file."""
    key = frozenset(type(module) for module in modules)
    known = _found.get(key)
    if known is not None and all(_ids(namespace) == ids for namespace, ids in known[1]):
        return known[0]
    contexts: dict = {}
    classes: set = set()
    namespaces: dict = {}
    for module_class in key:
        for cls in module_class.__mro__:
            if cls in classes or cls is torch.nn.Module or cls is object:
                continue
            classes.add(cls)
            if len(classes) > _MAX_CLASSES:
                return list(contexts.values())
            for value in list(vars(cls).values()):
                _collect(value, contexts, kind)
            forward = getattr(vars(cls).get("forward"), "__globals__", None)
            if forward is not None and id(forward) not in namespaces:
                namespaces[id(forward)] = forward
                for value in list(forward.values()):
                    _collect(value, contexts, kind)
    found = list(contexts.values())
    if len(_found) < _FOUND_LIMIT:
        _found[key] = (found, tuple((namespace, _ids(namespace)) for namespace in namespaces.values()))
    return found


def _ids(namespace: dict) -> tuple:
    return tuple(map(id, namespace.values()))


def _collect(value, contexts: dict, kind) -> None:
    if isinstance(value, (staticmethod, classmethod)):
        value = value.__func__
    if isinstance(value, torch.nn.Module) or not callable(value):
        return
    try:
        if compat.dynamo_original(value) is None:
            return
        cells = getattr(value, "__closure__", None) or ()
    except Exception:  # an object whose attribute lookup raises: not a compiled function
        return
    for cell in cells:
        try:
            context = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if isinstance(context, kind) \
                and isinstance(getattr(context, "enter_exit_hooks", None), list):
            contexts[id(context)] = (context, value)


class FunctionGates:
    """The gate on every compiled function a model reaches, from install() to remove()."""

    def __init__(self, gate) -> None:
        self.gate = gate
        self._hooked: list = []

    def install(self, model: torch.nn.Module, modules=None, held=None) -> None:
        gate = self.gate

        def around_call():
            gate.enter()
            return gate.leave

        for context in find(model, modules, held):
            context.enter_exit_hooks.append(around_call)
            self._hooked.append((context, around_call))

    def remove(self) -> None:
        hooked, self._hooked = self._hooked, []
        for context, hook in hooked:
            try:
                context.enter_exit_hooks.remove(hook)
            except ValueError:
                pass
