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
``nn_module_stack`` (relative to the compiled frame's module, under the path of the region
running it, with torch.compile's ``_orig_mod`` left out), the op and its arguments as the api
level sees the same call (capture/compiled/graph_names.py), a counter per (module, op) in graph order,
and the user's source line from ``stack_trace``. Gradients: capture/compiled/grad_taps.py.

The compiled graph is the one that runs in every step, captured or not: the extra outputs
must be written to memory, so inductor may fuse differently from the uninstrumented graph,
and a value computed inside a fused kernel may round differently (docs/howto.md).
"""

from __future__ import annotations

import copy
import operator
import warnings

import torch

from probe import compat
from probe.errors import ProbeError
from probe.capture.eager import compiled_regions, wrappers
from probe.capture.compiled import grad_taps, graph_events, graph_marks, graph_names

Tensor = torch.Tensor
_DisableTorchFunction = compat.DisableTorchFunction

#: Python operators in a graph -> the Tensor method eager code reaches (``x + 1`` is Tensor.add)
_OP, _OPEN, _CLOSE = graph_events.OP, graph_events.OPEN, graph_events.CLOSE


class _Active:
    __slots__ = ("recorder", "modules", "record_modules")

    def __init__(self, recorder, model, record_modules: bool, targets=None) -> None:
        self.recorder = recorder
        self.record_modules = record_modules
        #: path and id(module) -> (path, module, kind, is a region root)
        self.modules = {}
        if model is not None:
            for target in targets if targets is not None else compiled_regions.targets(model):
                entry = (target.path, target.module, wrappers.user_kind(target.module),
                         target.region)
                self.modules[target.path] = self.modules[id(target.module)] = entry


_active: _Active | None = None
_warned: set = set()


def activate(recorder, model, level: str, targets=None) -> None:
    """Called by start(): graphs record into ``recorder`` until deactivate(). ``targets``:
    compiled_regions.targets(model) when start() has it already."""
    global _active
    _active = _Active(recorder, model, level == "mix", targets) if level in ("api", "mix") else None


def deactivate() -> None:
    global _active
    _active = None
    grad_taps.flush_all()


#: one TapBackend per wrapped backend: dynamo guards on the backend's identity, so blocks
#: compiled one by one share their compiled code only when they share the backend object
_backends: dict = {}


def compile(model, *, backend="inductor", mode=None, options=None, **kwargs):
    """``torch.compile(model, backend=backend, mode=mode, options=options, **kwargs)`` whose
    graphs record the value and the gradient of every node while a capture at level api or mix
    is on (capture/compiled/grad_taps.py)."""
    if mode is not None or options is not None:
        if backend != "inductor":
            raise ProbeError(f"probe.compile(mode=..., options=...) needs backend='inductor', "
                             f"got backend={backend!r}")
        inner = compat.inductor_backend(mode, options, kwargs.get("dynamic"))
        graph_marks.install(model)
        return _inlining_modules(torch.compile(model, backend=TapBackend(inner), **kwargs))
    key = backend if isinstance(backend, str) else id(backend)
    tap = _backends.get(key)
    if tap is None or tap.backend is not backend:
        tap = _backends[key] = TapBackend(backend)
    graph_marks.install(model)
    return _inlining_modules(torch.compile(model, backend=tap, **kwargs))


def _inlining_modules(compiled):
    """Make dynamo trace into torch.nn modules while ``compiled`` runs.

    Graph taps name every call by the modules dynamo traced it in, and need a module's
    parameters as graph inputs: dynamo does both only when it inlines torch.nn modules, its
    default from torch 2.5 (``inline_inbuilt_nn_modules``). torch 2.4 turns that off by default
    and puts each torch.nn module in the graph as one opaque call; there it is turned on for
    the calls of the module probe.compile returns, and only for those."""
    config = compat.dynamo_config()

    forward = getattr(compiled, "forward", None)
    if getattr(config, "inline_inbuilt_nn_modules", True) or not callable(forward):
        return compiled

    def inlined(*args, **kwargs):
        with config.patch(inline_inbuilt_nn_modules=True):
            return forward(*args, **kwargs)

    compiled.forward = inlined
    return compiled


class TapBackend:
    """A dynamo backend: instruments the graph, then compiles it with ``backend``."""

    def __init__(self, backend="inductor") -> None:
        # torch.compile's wrapper of the user's backend says which it is (compiler_name)
        self.name = backend if isinstance(backend, str) else (
            getattr(backend, "compiler_name", None) or getattr(backend, "__name__", "")
            or type(backend).__name__)
        self.backend = backend

    def _inner(self):
        backend = self.backend
        if isinstance(backend, str):
            return compat.lookup_backend(backend)
        return backend

    def __call__(self, gm, example_inputs):
        inner = self._inner()
        try:
            # dynamo reads its graph again after the backend returns: instrument a copy
            work = copy.deepcopy(gm)
            # what dynamo set on its graph module that deepcopy drops: AOTAutograd reads
            # _param_name_to_source where dynamo does not lift parameters to inputs (2.4)
            for name, value in vars(gm).items():
                if name not in vars(work):
                    setattr(work, name, value)
            for mine, theirs in zip(work.graph.find_nodes(op="placeholder"),
                                    gm.graph.find_nodes(op="placeholder")):
                if compat.has_input_source(theirs):
                    compat.set_input_source(mine, compat.input_source(theirs))
            plan, real, examples = _instrument(work, list(example_inputs))
        except compat.dynamo_restart_exceptions():
            raise
        except Exception as error:  # never fail the user's compile over probe's plan
            _warn_once("plan", f"probe: cannot instrument a compiled graph ({error!r}); its "
                       "values are not recorded")
            return inner(gm, example_inputs)
        try:
            compiled = inner(work, examples)
        except compat.dynamo_restart_exceptions():
            raise  # dynamo compiles the frame again, with this backend again
        except Exception as error:  # the user's graph compiles; probe's additions did not
            _warn_once("compile", f"probe: cannot compile a compiled graph with probe's taps "
                       f"({error!r}); it runs as compiled without them, its values are not "
                       "recorded")
            return inner(gm, example_inputs)
        if self.name not in _SAME_KERNELS:
            _warn_once("fusion", f"probe: a graph compiled by {self.name} is recorded through "
                       "values added to it as outputs (and zeros whose gradients are recorded): "
                       f"{self.name} may then fuse it differently, so training whose compiled "
                       "graphs probe records can differ from training without probe by rounding "
                       "(a tiny Llama, inductor on CPU: loss rel 1.1e-07 and gradients rel L2 up "
                       "to 2.3e-07 in float32, 5.8e-03 under bfloat16 autocast); level module "
                       "records a compiled model at its boundary and moves nothing "
                       "(docs/capture.md)")
        return _runner(compiled, plan, real)

    def __repr__(self) -> str:
        return f"probe.TapBackend({self.name!r})"


#: backends whose kernels do not depend on which values the graph outputs: probe's additions
#: leave what they compute bit-identical (checked on transformers' Llama, float32 and bfloat16)
_SAME_KERNELS = frozenset({"eager", "aot_eager"})


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


# ---------------------------------------------------------------------- planning


class _Plan:
    __slots__ = ("events", "inputs", "zeros")

    def __init__(self) -> None:
        self.events: list = []
        self.inputs = 0  # graph inputs: env[0:inputs]; extra outputs follow
        self.zeros = None  # grad_taps.Zeros of a graph that is trained


def _instrument(gm, example_inputs):
    """Add the values to record as extra outputs of ``gm``; (plan, number of real outputs)."""
    graph = gm.graph
    nodes = list(graph.nodes)
    if any(node.op == "call_module" for node in nodes):
        raise ProbeError("the graph calls torch.nn modules as opaque call_module nodes "
                         "(dynamo's inline_inbuilt_nn_modules is off)")
    output = next(node for node in reversed(nodes) if node.op == "output")
    placeholders = [node for node in nodes if node.op == "placeholder"]
    plan = _Plan()
    plan.inputs = len(placeholders)
    where: dict = {node: index for index, node in enumerate(placeholders)}
    params = {node for node, value in zip(placeholders, example_inputs)
              if isinstance(value, torch.nn.Parameter)}
    mutated = _mutated_later(nodes)
    marks = {node: graph_marks.read(node) for node in nodes}
    marks = {node: mark for node, mark in marks.items() if mark is not None}
    ordered = [node for node in nodes if node.op in ("call_function", "call_method")]
    calls = [node for node in ordered if node not in marks]
    extra = []
    for node in calls:
        if isinstance(graph_names.example(node), Tensor):
            where[node] = plan.inputs + len(extra)
            extra.append(_tap(graph, node, node in mutated))
    taps = {tap for tap in graph.nodes if tap not in where and tap.op != "output"
            and tap not in calls}
    plan.events = graph_events.events(ordered, marks, where, params, taps)
    for node in marks:
        graph.erase_node(node)
    if torch.is_grad_enabled() and any(getattr(value, "requires_grad", False)
                                       for value in example_inputs):
        plan.zeros, _ = grad_taps.add(graph, plan.events, where, _OP, _OPEN, taps)
        example_inputs = example_inputs + plan.zeros.make()
    real = output.args[0]
    single = not isinstance(real, (tuple, list))
    outputs = (real,) if single else tuple(real)
    output.args = (outputs + tuple(extra),)
    gm.recompile()
    return plan, (len(outputs), single), example_inputs


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


# ---------------------------------------------------------------------- running


def _runner(compiled, plan: _Plan, real):
    count, single = real

    def finish(inputs, outs, zeros):
        active = _active
        if active is not None:
            try:
                with _DisableTorchFunction():
                    _record(active, plan, list(inputs) + list(outs[count:]), zeros)
            except Exception as error:  # capture never raises into training
                _warn_once("record", f"probe: recording a compiled graph failed ({error!r}); "
                           "its values are missing from this step")
        return outs[0] if single else outs[:count]

    zeros = plan.zeros

    def run(*args):
        if zeros is None:
            return finish(args, compiled(*args), ())
        made = zeros.make()
        return finish(args, compiled(*args, *made), made)

    return run


def _value(ref, env):
    kind, what = ref
    if kind == "env":
        return env[what]
    if kind == "const":
        return what
    return [None if item is None else _value(item, env) for item in what]


def _record(active: _Active, plan: _Plan, env: list, zeros) -> None:
    rec = active.recorder
    if not rec.active:
        return
    filt = rec.filter
    stack = rec.module_stack
    base = stack[-1] if stack else ""
    modules = active.modules
    open_calls: dict = {}
    run = None  # grad_taps.RunGrads of this run, made on the first gradient hooked
    for position, event in enumerate(plan.events):
        kind = event[0]
        if kind == _OP:
            _, op, chain, source, args, outs, _, grads = event
            call = _open_call(rec, "api", _resolve(chain, modules, base)[0], op, source)
            if call is None:
                continue
            if filt.forward_in:
                _add_all(rec, call, args, env, "in")
            if filt.forward_out:
                _add_all(rec, call, outs, env, "out")
            if grads and zeros:
                run = run or grad_taps.RunGrads(rec)
                grad_taps.hook(run, call, _wanted(grads, filt), zeros, (position, position))
        elif not active.record_modules:
            continue
        elif kind == _OPEN:
            _, entry, source, inputs, outputs, _, grads = event[:7]
            path, module, class_name, region = _resolve((entry,), modules, base)
            call = None if region else _open_call(rec, "module", path, class_name, source)
            if call is None:
                continue
            if grads and zeros:
                run = run or grad_taps.RunGrads(rec)
                grad_taps.hook(run, call, _wanted(grads, filt), zeros, (position, event[7]))
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


def _wanted(grads, filt) -> list:
    """The gradients the config asks for: grad_output ("in") and/or grad_input ("out")."""
    return [grad for grad in grads
            if (filt.backward_in if grad[2] == "in" else filt.backward_out)]


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
    """(path, module or None, class name, is a region root) of a chain's innermost module.

    The module is found by identity when it lies inside the region running the graph
    (``base``); else by the node's module path relative to the compiled frame's module, under
    ``base``: blocks compiled one by one share one graph, and the module identities in its
    meta are those of the block it was traced with."""
    if not chain:
        return (base, None, "", True)
    ident, text, class_name = chain[-1]
    known = modules.get(ident) if ident is not None else None
    if known is not None and (not base or known[0] == base or known[0].startswith(base + ".")):
        return known
    path = f"{base}.{text}" if base and text else (text or base)
    known = modules.get(path)
    if known is not None:
        return known
    return (path, None, class_name, path == base)
