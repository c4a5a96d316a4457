"""Values from inside compiled graphs: a dynamo backend that wraps the real one.

``probe.compile(model, backend="inductor", **kwargs)`` is ``torch.compile`` with the backend
wrapped by TapBackend. When dynamo hands it a graph, TapBackend

* plans what to record: every call of the graph that makes a tensor (an API call, named as the
  api level names the same call in eager code: ``functional.linear``, ``torch.relu``,
  ``Tensor.add``), and at level mix every submodule call the graph spans (its inputs, its
  parameters, its outputs);
* adds the values it needs as extra graph outputs (detached: no gradient flows through them;
  a value that a later in-place op of the graph overwrites is cloned first);
* compiles that graph with the real backend and returns a function that runs it, gives
  dynamo the real outputs and, while a capture at level api or mix is on, records the rest.

Every record is named as the eager run names it: the module path from the FX node's
``nn_module_stack`` (looked up by module identity, so torch.compile's ``_orig_mod`` never
shows; the path text when the module is unknown), the op from the node's target, a counter
per (module, op) in graph order, and the user's source line from ``stack_trace``.

The compiled graph is the one that runs in every step, captured or not: the extra outputs
must be written to memory, so inductor may fuse differently from the uninstrumented graph,
and a value computed inside a fused kernel may round differently (docs/howto.md).
Gradients inside a graph are not recorded: the backward runs as one compiled function.
"""

from __future__ import annotations

import operator
import re
import warnings

import torch
from torch.overrides import TorchFunctionMode

from probe import compat
from probe.capture import compiled_regions, naming, wrappers
from probe.capture.values import _display_name

Tensor = torch.Tensor
_DisableTorchFunction = compat.DisableTorchFunction

#: Python operators in a graph -> the Tensor method eager code reaches (``x + 1`` is Tensor.add)
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
_ROOT = re.compile(r"^[A-Za-z_]\w*\['[^']*'\]\.?")
_MODULES_ITEM = re.compile(r"\._modules\['([^']*)'\]|\[(\d+)\]|\['([^']*)'\]")

# event kinds of a plan
_OP, _OPEN, _CLOSE = 0, 1, 2


class _Active:
    __slots__ = ("recorder", "modules", "record_modules")

    def __init__(self, recorder, model, record_modules: bool) -> None:
        self.recorder = recorder
        self.record_modules = record_modules
        #: id(module) -> (path, module, kind, is a region root)
        self.modules = {}
        if model is not None:
            for target in compiled_regions.targets(model):
                self.modules[id(target.module)] = (target.path, target.module,
                                                   wrappers.user_kind(target.module),
                                                   target.region)


_active: _Active | None = None
_warned: set = set()


def activate(recorder, model, level: str) -> None:
    """Called by start(): graphs record into ``recorder`` until deactivate()."""
    global _active
    _active = _Active(recorder, model, level == "mix") if level in ("api", "mix") else None


def deactivate() -> None:
    global _active
    _active = None


def compile(model, *, backend="inductor", **kwargs):
    """``torch.compile(model, **kwargs)`` whose graphs record the value of every node while
    a capture at level api or mix is on. ``backend``: what torch.compile would take."""
    return torch.compile(model, backend=TapBackend(backend), **kwargs)


class TapBackend:
    """A dynamo backend: instruments the graph, then compiles it with ``backend``."""

    def __init__(self, backend="inductor") -> None:
        self.name = backend if isinstance(backend, str) else getattr(backend, "__name__", "")
        self.backend = backend

    def _inner(self):
        backend = self.backend
        if isinstance(backend, str):
            from torch._dynamo import lookup_backend

            return lookup_backend(backend)
        return backend

    def __call__(self, gm, example_inputs):
        inner = self._inner()
        try:
            plan, real = _instrument(gm, example_inputs)
        except Exception as error:  # never fail the user's compile over probe's plan
            _warn_once("plan", f"probe: cannot instrument a compiled graph ({error!r}); its "
                       "values are not recorded")
            return inner(gm, example_inputs)
        return _runner(inner(gm, example_inputs), plan, real)

    def __repr__(self) -> str:
        return f"probe.TapBackend({self.name!r})"


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


# ---------------------------------------------------------------------- planning


class _Plan:
    __slots__ = ("events", "inputs")

    def __init__(self) -> None:
        self.events: list = []
        self.inputs = 0  # graph inputs: env[0:inputs]; extra outputs follow


def _example(node):
    return node.meta.get("example_value", node.meta.get("val"))


def _instrument(gm, example_inputs):
    """Add the values to record as extra outputs of ``gm``; (plan, number of real outputs)."""
    graph = gm.graph
    nodes = list(graph.nodes)
    output = next(node for node in reversed(nodes) if node.op == "output")
    placeholders = [node for node in nodes if node.op == "placeholder"]
    plan = _Plan()
    plan.inputs = len(placeholders)
    where: dict = {node: index for index, node in enumerate(placeholders)}
    params = {node for node, value in zip(placeholders, example_inputs)
              if isinstance(value, torch.nn.Parameter)}
    mutated = _mutated_later(nodes)
    calls = [node for node in nodes if node.op in ("call_function", "call_method")]
    extra = []
    for node in calls:
        if isinstance(_example(node), Tensor):
            where[node] = plan.inputs + len(extra)
            extra.append(_tap(graph, node, node in mutated))
    taps = {tap for tap in graph.nodes if tap not in where and tap.op != "output"
            and tap not in calls}
    plan.events = _events(calls, where, params, output, taps)
    real = output.args[0]
    single = not isinstance(real, (tuple, list))
    outputs = (real,) if single else tuple(real)
    output.args = (outputs + tuple(extra),)
    gm.recompile()
    return plan, (len(outputs), single)


def _mutated_later(nodes) -> set:
    """Nodes whose tensor a later in-place call of the graph overwrites."""
    mutated = set()
    for node in nodes:
        if not node.args:
            continue
        target = node.target
        in_place = (node.op == "call_method" and target.endswith("_")
                    and not target.endswith("__")) or target in (operator.setitem,
                                                                  operator.iadd, operator.isub,
                                                                  operator.imul,
                                                                  operator.itruediv)
        if not in_place and node.op == "call_function":
            name = getattr(target, "__name__", "")
            in_place = name.endswith("_") and not name.endswith("__")
        if in_place and hasattr(node.args[0], "op"):
            mutated.add(node.args[0])
    return mutated


def _tap(graph, node, copy: bool):
    """A detached (and, when the graph later overwrites it, cloned) alias of node's value."""
    value = node.meta.get("example_value")
    with graph.inserting_after(node):
        source = node
        if copy:
            source = graph.call_function(torch.clone, (node,))
            if value is not None:
                source.meta["example_value"] = value
        with graph.inserting_after(source):
            tapped = graph.call_method("detach", (source,))
    if value is not None:
        tapped.meta["example_value"] = value
    return tapped


def _op_name(node) -> str | None:
    target = node.target
    if node.op == "call_method":
        return naming.op_name(getattr(Tensor, target, None)) if hasattr(Tensor, target) \
            else f"Tensor.{target}"
    if target in _OPERATORS:
        first = node.args[0] if node.args else None
        if target in _REFLECTED and not hasattr(first, "op"):
            return _REFLECTED[target]
        if target is operator.getitem and not isinstance(_example(first), Tensor):
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


def _as_eager_sees_it(node, where):
    """(op name, [(slot, ref)]) of a graph call as probe's api level records it in eager code.

    The node's target is called on the graph's example values under a mode that stops at the
    first ``__torch_function__``: the function and arguments it receives are what the api
    level sees for the same call (F.layer_norm passes weight, bias and eps by keyword, for
    instance, whatever the user wrote), and each tensor among them is one of the node's
    arguments, found by identity."""
    by_identity = {}

    def example(value):
        if hasattr(value, "op"):
            found = _example(value)
            if isinstance(found, Tensor):
                by_identity[id(found)] = value
            return found
        if isinstance(value, (list, tuple)):
            return type(value)(example(item) for item in value)
        return value

    try:
        args = [example(arg) for arg in node.args]
        kwargs = {key: example(arg) for key, arg in node.kwargs.items()}
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
        return _op_name(node), _node_slots(node, where)
    name = naming.op_name(func)
    if name is None:
        return None, []

    def ref(value):
        if isinstance(value, Tensor):
            source = by_identity.get(id(value))
            return None if source is None else _ref(source, where)
        if isinstance(value, (list, tuple)) and any(isinstance(v, Tensor) for v in value):
            return ("list", [ref(item) for item in value])
        return ("const", list(value) if isinstance(value, tuple) else value)

    slots = [(f"input.{i}", ref(arg)) for i, arg in enumerate(seen_args)]
    slots += [("kwarg." + key, ref(arg)) for key, arg in seen_kwargs.items()]
    return name, slots


def _node_slots(node, where) -> list:
    slots = [(f"input.{i}", _ref(a, where)) for i, a in enumerate(node.args)]
    return slots + [("kwarg." + k, _ref(a, where)) for k, a in node.kwargs.items()]


def _ref(value, where):
    """How to find an argument at run time: ("env", i), ("const", v), ("list", [...])."""
    if hasattr(value, "op"):
        index = where.get(value)
        return None if index is None else ("env", index)
    if isinstance(value, (list, tuple)):
        if any(hasattr(item, "op") for item in value):
            return ("list", [_ref(item, where) for item in value])
        return ("const", list(value))
    return ("const", value)


def _module_chain(node) -> tuple:
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
        text = text[len("self."):]
    text = _MODULES_ITEM.sub(lambda m: "." + next(g for g in m.groups() if g is not None), text)
    parts = [part for part in text.split(".") if part and part != "_orig_mod"]
    return ".".join(parts)


def _source(node, depth: int = 0) -> str:
    """``file:line`` of the user's frame ``depth`` frames out from the innermost."""
    frames = _FRAME.findall(node.meta.get("stack_trace") or "")
    user = [(name, line) for name, line in ((_display_name(f), l) for f, l in frames) if name]
    if not user:
        return ""
    name, line = user[max(0, len(user) - 1 - depth)]
    return f"{name}:{line}"


def _events(calls, where, params, output, taps) -> list:
    events = []
    opened: list = []  # module chain entries currently open
    runs: dict = {}  # open event index -> set of nodes
    for node in calls:
        chain = _module_chain(node)
        keep = 0
        while keep < min(len(opened), len(chain)) and opened[keep][0] == chain[keep]:
            keep += 1
        while len(opened) > keep:
            entry, start = opened.pop()
            events.append([_CLOSE, start])
        for entry in chain[keep:]:
            start = len(events)
            events.append([_OPEN, entry, _source(node, 1), [], []])
            runs[start] = set()
            opened.append((entry, start))
        for _, start in opened:
            runs[start].add(node)
        op, args = _as_eager_sees_it(node, where)
        if op is not None:
            outs = _outputs(node, where)
            if outs:
                events.append([_OP, op, chain, _source(node), args, outs])
    while opened:
        entry, start = opened.pop()
        events.append([_CLOSE, start])
    for start, members in runs.items():
        events[start][3] = _run_inputs(members, where, params)
        events[start][4] = _run_outputs(members, where, taps)
    return events


def _outputs(node, where) -> list:
    if node in where:
        return [("output.0", ("env", where[node]))]
    if isinstance(_example(node), (tuple, list)):
        found = []
        for user in node.users:
            if user.target is operator.getitem and user in where:
                found.append((f"output.{user.args[1]}", ("env", where[user])))
        return sorted(found)
    return []


def _run_inputs(members, where, params) -> list:
    seen = []
    for node in members:
        for arg in node.all_input_nodes:
            if arg in members or arg in params or arg in seen or arg not in where:
                continue
            if not isinstance(_example(arg), Tensor) and arg.op == "placeholder":
                continue
            seen.append(arg)
    # which argument each tensor was (input.N, a keyword) is not in the graph: only a call
    # with one tensor input is named (input.0)
    return [("input.0", ("env", where[seen[0]]))] if len(seen) == 1 else []


def _run_outputs(members, where, taps) -> list:
    """Values made inside a module call and used after it: what the call returned."""
    made = []
    for node in members:
        if node not in where:
            continue
        if any(user not in members and user not in taps for user in node.users):
            made.append(node)
    # several values leave the call: which one is output.N is not in the graph; a guess could
    # pair two different tensors, so none is recorded
    return [("output.0", ("env", where[made[0]]))] if len(made) == 1 else []


# ---------------------------------------------------------------------- running


def _runner(compiled, plan: _Plan, real):
    count, single = real

    def finish(inputs, outs):
        active = _active
        if active is not None:
            try:
                with _DisableTorchFunction():
                    _record(active, plan, list(inputs) + list(outs[count:]))
            except Exception as error:  # capture never raises into training
                _warn_once("record", f"probe: recording a compiled graph failed ({error!r}); "
                           "its values are missing from this step")
        return outs[0] if single else outs[:count]

    def run(*args):
        return finish(args, compiled(*args))

    return run


def _value(ref, env):
    kind, what = ref
    if kind == "env":
        return env[what]
    if kind == "const":
        return what
    return [None if item is None else _value(item, env) for item in what]


def _record(active: _Active, plan: _Plan, env: list) -> None:
    rec = active.recorder
    if not rec.active:
        return
    filt = rec.filter
    stack = rec.module_stack
    base = stack[-1] if stack else ""
    modules = active.modules
    open_calls: dict = {}
    for event in plan.events:
        kind = event[0]
        if kind == _OP:
            _, op, chain, source, args, outs = event
            call = _open_call(rec, "api", _resolve(chain, modules, base)[0], op, source)
            if call is None:
                continue
            if filt.forward_in:
                _add_all(rec, call, args, env, "in")
            if filt.forward_out:
                _add_all(rec, call, outs, env, "out")
        elif not active.record_modules:
            continue
        elif kind == _OPEN:
            _, entry, source, inputs, outputs = event
            path, module, class_name, region = _resolve((entry,), modules, base)
            call = None if region else _open_call(rec, "module", path, class_name, source)
            if call is None:
                continue
            if filt.forward_in:
                _add_all(rec, call, inputs, env, "in")
                if module is not None:
                    param_call = ("param",) + call[1:]
                    for name, param in module.named_parameters(recurse=False):
                        rec.add(param_call, "param." + name, "in", param)
            open_calls[id(event)] = (call, outputs)
        else:
            opened = plan.events[event[1]]
            found = open_calls.pop(id(opened), None)
            if found is None:
                continue
            call, outputs = found
            _, module, op, index, _, _, source, decision, _ = call
            closing = rec.call("module", module, op, index, "forward", source, decision)
            if filt.forward_out:
                _add_all(rec, closing, outputs, env, "out")


def _open_call(rec, kind: str, module: str, op: str, source: str):
    """The forward event of one call, named as the eager run names it; None when the config
    does not select it."""
    decision = rec.decisions.get((module, op))
    if decision is None:
        decision = rec.filter.call(module, op)
    if not decision:
        return None
    index = rec.namer.index(module, op)
    rec.calls += 1
    return rec.call(kind, module, op, index, "forward", source, decision)


def _add_all(rec, call, slots, env, io) -> None:
    for slot, ref in slots:
        if ref is None:
            continue
        value = _value(ref, env)
        if isinstance(value, list):
            rec.add_tree(call, slot, io, value)
        else:
            rec.add(call, slot, io, value)


def _resolve(chain, modules, base: str) -> tuple:
    """(path, module or None, class name, is a region root) of a chain's innermost module."""
    if not chain:
        return (base, None, "", True)
    ident, text, class_name = chain[-1]
    known = modules.get(ident) if ident is not None else None
    if known is not None:
        return known
    path = f"{base}.{text}" if base and text else (text or base)
    return (path, None, class_name, False)
