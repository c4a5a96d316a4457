"""Graph nodes named as the eager run names the same calls (for capture/compiled/graph_taps.py).

A node's op name and arguments are what probe's api level would receive for the same call in
eager code (``x + 1`` is ``Tensor.add``; F.layer_norm passes weight, bias and eps by keyword),
its module is the innermost entry of its ``nn_module_stack`` and its source line the last
user frame of its ``stack_trace``.
"""

from __future__ import annotations

import operator
import re

import torch
from torch.overrides import TorchFunctionMode

from probe.capture.eager import naming
from probe.capture.eager.values import display_name

Tensor = torch.Tensor

_OPERATORS = {
    operator.add: "Tensor.add", operator.iadd: "Tensor.add_", operator.sub: "Tensor.sub",
    operator.isub: "Tensor.sub_", operator.mul: "Tensor.mul", operator.imul: "Tensor.mul_",
    operator.truediv: "Tensor.div", operator.itruediv: "Tensor.div_",
    operator.floordiv: "Tensor.floor_divide", operator.mod: "Tensor.remainder",
    operator.pow: "Tensor.pow", operator.matmul: "Tensor.matmul", operator.neg: "Tensor.neg",
    operator.pos: "Tensor.positive", operator.abs: "Tensor.abs", operator.invert:
    "Tensor.bitwise_not", operator.getitem: "Tensor.__getitem__", operator.setitem:
    "Tensor.__setitem__", operator.gt: "Tensor.gt", operator.ge: "Tensor.ge",
    operator.lt: "Tensor.lt", operator.le: "Tensor.le", operator.eq: "Tensor.eq",
    operator.ne: "Tensor.ne", operator.and_: "Tensor.__and__", operator.or_: "Tensor.__or__",
    operator.xor: "Tensor.__xor__",
}
#: with a number first (``2 - x``), eager code reaches the reflected method
_REFLECTED = {operator.sub: "Tensor.__rsub__", operator.truediv: "Tensor.__rdiv__",
              operator.pow: "Tensor.__rpow__"}
_FRAME = re.compile(r'File "([^"]+)", line (\d+)')
_ROOT = re.compile(r"^[A-Za-z_]\w*\['[^']*'\](\[\d+\]|\.__self__)*")
_MODULES_ITEM = re.compile(r"\._modules\['([^']*)'\]|\[(\d+)\]|\['([^']*)'\]")


def example(node):
    return node.meta.get("example_value", node.meta.get("val"))


def op_name(node) -> str | None:
    target = node.target
    if node.op == "call_method":
        return naming.op_name(getattr(Tensor, target, None)) if hasattr(Tensor, target) \
            else f"Tensor.{target}"
    if target in _OPERATORS:
        first = node.args[0] if node.args else None
        if target in _REFLECTED and not hasattr(first, "op"):
            return _REFLECTED[target]
        if target is operator.getitem and not isinstance(example(first), Tensor):
            return None  # unpacking a tuple the graph made, not an op on a tensor
        return _OPERATORS[target]
    if getattr(target, "__module__", "") == "_operator":
        return None
    try:
        return naming.op_name(target)
    except Exception:
        return None


class _Seen(Exception):
    pass


class _FirstCall(TorchFunctionMode):
    """Stops at the first torch call and keeps what __torch_function__ received."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.seen = (func, args, kwargs or {})
        raise _Seen


def as_eager_sees_it(node, where):
    """(op name, [(slot, ref)]) of a graph call as probe's api level records it in eager code.

    The node's target is called on the graph's example values under a mode that stops at the
    first ``__torch_function__``: the function and arguments it receives are what the api
    level sees for the same call (F.layer_norm passes weight, bias and eps by keyword, for
    instance, whatever the user wrote), and each tensor among them is one of the node's
    arguments, found by identity."""
    by_identity = {}

    def stand_in(value):
        if hasattr(value, "op"):
            found = example(value)
            if isinstance(found, Tensor):
                by_identity[id(found)] = value
            return found
        if isinstance(value, (list, tuple)):
            return type(value)(stand_in(item) for item in value)
        return value

    try:
        args = [stand_in(arg) for arg in node.args]
        kwargs = {key: stand_in(arg) for key, arg in node.kwargs.items()}
        if node.op == "call_method":
            target = getattr(args[0], node.target)
            args = args[1:]
        else:
            target = node.target
        mode = _FirstCall()
        mode.seen = None
        with mode:
            try:
                target(*args, **kwargs)
            except _Seen:
                pass
        func, seen_args, seen_kwargs = mode.seen
    except Exception:
        return op_name(node), _node_slots(node, where)
    name = naming.op_name(func)
    if name is None:
        return None, []

    def ref(value):
        if isinstance(value, Tensor):
            source = by_identity.get(id(value))
            return None if source is None else ref_of(source, where)
        if isinstance(value, (list, tuple)) and any(isinstance(v, Tensor) for v in value):
            return ("list", [ref(item) for item in value])
        return ("const", list(value) if isinstance(value, tuple) else value)

    slots = [(f"input.{i}", ref(arg)) for i, arg in enumerate(seen_args)]
    slots += [("kwarg." + key, ref(arg)) for key, arg in seen_kwargs.items()]
    return name, slots


def _node_slots(node, where) -> list:
    slots = [(f"input.{i}", ref_of(a, where)) for i, a in enumerate(node.args)]
    return slots + [("kwarg." + k, ref_of(a, where)) for k, a in node.kwargs.items()]


def ref_of(value, where):
    """How to find an argument at run time: ("env", i), ("const", v), ("list", [...])."""
    if hasattr(value, "op"):
        index = where.get(value)
        return None if index is None else ("env", index)
    if isinstance(value, (list, tuple)):
        if any(hasattr(item, "op") for item in value):
            return ("list", [ref_of(item, where) for item in value])
        return ("const", list(value))
    return ("const", value)


def module_chain(node) -> tuple:
    """((module id, fallback path, class name), ...) outermost first."""
    stack = node.meta.get("nn_module_stack") or {}
    chain = []
    for key, value in stack.items():
        text, cls = value[0], value[1]
        ident = key if str(key).isdigit() else None
        chain.append((int(ident) if ident else None, _path_text(str(text)),
                      getattr(cls, "__name__", str(cls))))
    return tuple(chain)


def _path_text(text: str) -> str:
    """``L['self'].blocks[0]._orig_mod.fc`` -> ``blocks.0.fc`` (relative to the region)."""
    text = _ROOT.sub("", text)
    if text.startswith("self."):
        text = text[len("self."):]  # older torch: the path text starts at "self"
    text = _MODULES_ITEM.sub(lambda m: "." + next(g for g in m.groups() if g is not None), text)
    parts = [part for part in text.split(".") if part and part != "_orig_mod"]
    return ".".join(parts)


def source(node, depth: int = 0) -> str:
    """``file:line`` of the user's frame ``depth`` frames out from the innermost."""
    frames = _FRAME.findall(node.meta.get("stack_trace") or "")
    user = [(name, line) for name, line in ((display_name(f), l) for f, l in frames) if name]
    if not user:
        return ""
    name, line = user[max(0, len(user) - 1 - depth)]
    return f"{name}:{line}"
