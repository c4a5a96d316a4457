"""Which tensor was which argument of a submodule call inside a compiled graph.

Dynamo inlines a submodule's forward into the graph of its region: the graph keeps which
nodes ran inside the submodule (``nn_module_stack``) but not which tensor was ``input.1`` or
``kwarg.position_ids``, nor which of several returned tensors is ``output.1``. Guessing from
the graph's shape can pair two different tensors (a rotary embedding's cos and sin), so
probe.compile puts the names into the graph instead: a forward pre-hook and a forward hook on
every submodule call ``probe::mark(tensors, names)`` while dynamo traces them (and do nothing
in eager code). The mark nodes reach probe's backend with the argument and output tensors
bound to the names the eager run records (``input.N``, ``kwarg.name``, ``output.N``, a
structure's leaves as values.flatten names them; plain values such as ``use_cache=True`` in
the names' text); the backend reads them and removes them
before the real backend compiles the graph.

The hooks are registered once, by probe.compile, before the first compile: dynamo guards on
a module's hooks, so adding them later would recompile. A plain torch.compile'd region gets
them only while a capture runs it through graph taps (add() and remove(); region_taps.py):
there the graphs with and without the marks are two sets of graphs, each found again by its
own guards.
"""

from __future__ import annotations

import torch

from probe import compat
from probe.compat import VERSION

_NAMESPACE = "probe_graph"
_SEPARATOR = "|"
_MAX_DEPTH = 4

_op = None


def _mark_op():
    """The ``probe_graph::mark`` custom op, defined on first use; None where this torch has
    no ``torch.library.custom_op``."""
    global _op
    if _op is None:
        custom_op = getattr(torch.library, "custom_op", None)
        if custom_op is None:
            return None

        def mark(tensors, names):
            return None

        try:  # the schema spelled out: torch 2.4 cannot read this module's string annotations
            mark = custom_op(f"{_NAMESPACE}::mark", mark, mutates_args=(),
                             schema="(Tensor[] tensors, str names) -> ()")
            mark.register_fake(lambda tensors, names: None)
        except (TypeError, ValueError, RuntimeError):
            return None

        _op = getattr(torch.ops, _NAMESPACE).mark.default
    return _op


def _leaves(obj, prefix: str, names: list, tensors: list, depth: int) -> None:
    """The tensor leaves of obj, named as values.flatten names them (kept simple: dynamo
    traces this)."""
    if isinstance(obj, torch.Tensor):
        names.append(prefix)
        tensors.append(obj)
        return
    if obj is None or type(obj) in (bool, int, float):  # a plain value: in the text
        kind = "n" if obj is None else type(obj).__name__[0]
        names.append(prefix + "=" + kind + str(obj))
        return
    if depth >= _MAX_DEPTH:
        return
    if isinstance(obj, (tuple, list)):
        fields = getattr(type(obj), "_fields", None)
        if fields and len(fields) == len(obj):
            for name, item in zip(fields, obj):
                _leaves(item, prefix + "." + name, names, tensors, depth + 1)
        else:
            for position, item in enumerate(obj):
                _leaves(item, prefix + "." + str(position), names, tensors, depth + 1)
    elif isinstance(obj, dict):
        for name, item in obj.items():
            _leaves(item, prefix + "." + str(name), names, tensors, depth + 1)


def _before(module, args, kwargs):
    if torch.compiler.is_compiling():
        names, tensors = [], []
        for position, arg in enumerate(args):
            _leaves(arg, "input." + str(position), names, tensors, 0)
        for key, arg in kwargs.items():
            _leaves(arg, "kwarg." + key, names, tensors, 0)
        _op(tensors, "in" + _SEPARATOR + _SEPARATOR.join(names))
    return None


def _after(module, args, kwargs, output):
    if torch.compiler.is_compiling():
        if isinstance(output, torch.Tensor) and any(output is arg for arg in args):
            # a module that returns its input (nn.Identity) made nothing: no output mark, so
            # no backward record, as in an eager capture (an alias would give the output a
            # gradient of its own, but it would also change the order autograd sums the
            # tensor's gradients in)
            _op([output], "out" + _SEPARATOR + "output.0")
            return None
        names, tensors = [], []
        if isinstance(output, torch.Tensor) or output is None \
                or type(output) in (bool, int, float):
            _leaves(output, "output.0", names, tensors, 0)  # as the recorder's add_output
        else:
            _leaves(output, "output", names, tensors, 0)
        _op(tensors, "out" + _SEPARATOR + _SEPARATOR.join(names))
    return None


def install(model) -> bool:
    """Mark every submodule call of ``model`` (not model itself: its call is the region's
    boundary, recorded outside the graph), for good. False where this torch cannot."""
    if not isinstance(model, torch.nn.Module) or not traces_module_hooks() \
            or _mark_op() is None:
        return False
    for module in model.modules():
        if module is model or getattr(module, "_probe_marked", False):
            continue
        _add_hooks(module)
        module._probe_marked = True
    return True


def add(region) -> list:
    """Mark every submodule call of ``region`` until remove(): while a capture runs a plain
    torch.compile'd region through graph taps (capture/compiled/region_taps.py). Nothing is
    set on the modules but the hooks, under the same keys every time, so the graphs traced
    with them are found again at the next captured step, and those traced without them (the
    user's own) at the steps between. Returns the modules marked; [] where this torch cannot."""
    if not isinstance(region, torch.nn.Module) or not traces_module_hooks() \
            or _mark_op() is None:
        return []
    marked = []
    for module in region.modules():
        if module is region or getattr(module, "_probe_marked", False) \
                or any(_keys.get(kind) in hooks for kind in ("pre", "post")
                       for hooks in compat.forward_hook_dicts(module, kind)):
            continue
        _add_hooks(module)
        marked.append(module)
    return marked


def remove(modules: list) -> None:
    """Take off the marks add() put on ``modules``."""
    for module in modules:
        for kind in ("pre", "post"):
            key = _keys.get(kind)
            for hooks in compat.forward_hook_dicts(module, kind):
                hooks.pop(key, None)


def _add_hooks(module) -> None:
    _shared_key(module, module.register_forward_pre_hook(_before, with_kwargs=True), "pre")
    _shared_key(module, module.register_forward_hook(_after, with_kwargs=True), "post")


#: the hook-dict key every module's mark hook gets, per kind ("pre"/"post"): the key of the
#: first one registered in this process, so no other hook anywhere has it
_keys: dict = {}


def _shared_key(module, handle, kind: str) -> None:
    """Give the mark hook the same key in every module's hook dicts. Dynamo (2.8 at least)
    guards on the key (``___dict_contains(id, module._forward_hooks_with_kwargs)``), so with a
    key of its own per instance, blocks compiled one by one would each get their own graph."""
    key = _keys.setdefault(kind, handle.id)
    if key == handle.id:
        return
    for hooks in compat.forward_hook_dicts(module, kind):
        if handle.id in hooks:
            hooks[key] = hooks.pop(handle.id)  # stays last: it was registered last


def traces_module_hooks() -> bool:
    """Dynamo inlines submodule calls with their hooks (else a hook breaks the graph)."""
    inlines = compat.dynamo_inlines_nn_modules()
    # torch 2.4's dynamo cuts the graph at the marks (one graph per submodule call), even
    # with inlining turned on: there the marks would cost what they name
    return inlines and VERSION >= (2, 5) \
        and hasattr(getattr(torch, "compiler", None), "is_compiling")


def read(node):
    """(io "in"/"out", [(slot name, tensor node or ("const", value))]) of a mark node; None
    for any other node."""
    if _op is None or node.op != "call_function" or node.target is not _op:
        return None
    tensors, text = node.args
    io, *names = text.split(_SEPARATOR)
    tensors = iter(tensors)
    slots = []
    for name in names:
        if "=" in name:
            name, value = name.split("=", 1)
            slots.append((name, ("const", _plain(value))))
        elif name:
            slots.append((name, next(tensors)))
    return io, slots


def _plain(text: str):
    kind, text = text[0], text[1:]
    if kind == "n":
        return None
    if kind == "b":
        return text == "True"
    return int(text) if kind == "i" else float(text)
