"""Module level: per-module hooks, registered with handles at start() and removed at stop().

At level api, only the path of the running module is needed: two global module hooks
(torch.nn.modules.module.register_module_forward_pre_hook / register_module_forward_hook,
handles removed at stop()) keep a stack of paths, looked up by module identity in a table
built from ``model.named_modules()`` at start(); modules outside the model are ignored.
Paths and class names are the user's: wrapper segments (DDP's ``module``, torch.compile's
``_orig_mod``, activation checkpointing's) are left out (capture/eager/wrappers.py).

At level module/mix, every submodule of the model, the root included (path ""), gets

* a forward pre-hook: pushes the module path (so API records know their innermost module),
  and at level module/mix records the inputs (``input.N``, ``kwarg.name``) before the
  forward runs (an in-place op inside cannot change what was recorded) and the module's own
  parameters (kind "param", slot ``param.<name>``);
* a forward hook registered with ``always_call=True``: pops the path even when the forward
  raises, and records the outputs (``output.N``).

Backward, at level module/mix, uses tensor hooks instead of register_full_backward_hook:
torch's full backward hooks wrap inputs and outputs in a custom autograd Function, which
makes ``nn.ReLU(inplace=True)`` fail with "Output 0 of BackwardHookFunction is a view and
is being modified inplace" (torch 2.13), i.e. they would break ordinary models.

* ``grad_output.N``: a hook on each output tensor that requires grad: the gradient of the
  loss with respect to that output (what torch's grad_output is).
* ``grad_input.N``: the gradient that flowed through this call only, as torch's module
  grad_input (a residual input's other uses, or a rotary embedding reading the hidden
  states under no_grad, add nothing to it). The pre-hook notes each input tensor's autograd
  edge and the sequence number the next autograd node will get; the forward hook walks back
  from the outputs' nodes through the nodes made during the call and hooks those with an
  edge into an input (api_backward.hook_input_edges). Each hook reads the share its node
  sends to the input; an input read by several of them gets their sum. Nothing is put
  between a tensor and its readers: an alias of the input (or torch's full backward hooks,
  which wrap inputs in an identity Function) would make autograd sum the gradients of
  its readers in another order (a norm reading its input twice beside a residual moved 15
  of 21 gradients of a tiny Llama). A module that returns an input as it was
  (nn.Identity) made nothing: that output records no backward.
* parameter gradients: ``register_post_accumulate_grad_hook`` on every parameter, so
  ``param_grad.<name>`` is recorded when the gradient has landed in ``.grad``, in backward
  order.

Records of a call carry the call index from the pre-hook; the forward hook and the backward
hooks reuse it through closures, so backward records pair with the right forward call.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.modules.module as _module_hooks

from probe import compat
from probe.compat import version_gaps
from probe.capture.eager import compiled_functions, compiled_regions, wrappers
from probe.capture.eager.naming import grad_input_slot, input_slot
from probe.capture.eager.api_backward import hook_input_edges
from probe.capture.recorder import Recorder, charged

Tensor = torch.Tensor
_DisableTorchFunction = compat.DisableTorchFunction
_is_grad_enabled = torch.is_grad_enabled
_next_sequence_nr = compat.next_sequence_nr


class ModuleHooks:
    """Hooks on one model. ``record`` False: only track the module stack (API level)."""

    def __init__(self, model: torch.nn.Module, recorder: Recorder, record: bool,
                 gate: compiled_regions.Gate | None = None, region_params: bool = False,
                 targets: list | None = None) -> None:
        self.model = model
        self.recorder = recorder
        self.record = record
        #: record the parameters of the modules inside a compiled region at its boundary (level
        #: module; at level mix the graph taps record them with their module's call)
        self.region_params = region_params
        #: takes the API mode off while a compiled region runs (set by the debugger)
        self.gate = gate or compiled_regions.Gate()
        self._handles: list = []
        #: compiled_regions.targets of the model (walked by install() unless given)
        self.targets: list | None = targets
        self._open_calls: dict[str, list] = {}
        self._hooked_params: set[int] = set()
        #: modules whose registered parameters change during a step (FSDP2 swaps in the
        #: unsharded parameters before forward): their new parameters are hooked there
        self._swapping: set[int] = set()
        #: the gate around the @torch.compile functions the model's code reaches
        self._function_gates = compiled_functions.FunctionGates(self.gate)

    # ------------------------------------------------------------------ install / remove

    def install(self) -> None:
        try:
            # one walk of the model per start(): graph taps and the function gates reuse it
            targets = self.targets
            if targets is None:
                targets = self.targets = compiled_regions.targets(self.model)
            self._function_gates.install(self.model, [target.module for target in targets],
                                         compiled_regions.held_functions(targets))
            if any(target.region for target in targets):
                version_gaps.warn_compiled_capture_gap()
            if not self.record:
                if any(target.region for target in targets):
                    self._install_region_tracking(targets)
                else:
                    self._install_tracking(targets)
                return
            seen_params = self._hooked_params
            for position, target in enumerate(targets):
                path, module = target.path, target.module
                kind = wrappers.user_kind(module)
                if wrappers.is_fsdp2(module):
                    # fully_shard on a block or the root alone swaps its submodules'
                    # parameters too: each module holding some is hooked at its own call
                    self._swapping.update(id(sub) for sub in module.modules()
                                          if next(sub.parameters(recurse=False), None)
                                          is not None)
                if target.hook_on is not None or target.compiled_call:
                    pre = functools.partial(self._pre_record, path, kind, module)
                    if target.region and self.region_params:
                        pre = functools.partial(self._pre_region, pre,
                                                _inside(targets, position))
                    post = functools.partial(self._post, path, kind)
                    self._hook_forward(target, pre, post)
                for name, param in module.named_parameters(recurse=False):
                    if id(param) in seen_params or not param.requires_grad:
                        continue
                    self._hook_param(path, kind, name, param)
        except BaseException:
            self.remove()
            raise

    def _hook_forward(self, target, pre, post) -> None:
        """Forward hooks on a module, or around a compiled region taken off the mode stack."""
        gate = self.gate
        if target.compiled_call:

            def before(module, args, kwargs):
                pre(module, args, kwargs)
                gate.enter()

            def after(module, args, output):
                gate.leave()
                post(module, args, output)

            self._handles.append(compiled_regions.CallBoundary(target.module, before, after))
            return
        hook_on = target.hook_on
        self._handles.append(hook_on.register_forward_pre_hook(pre, with_kwargs=True))
        if target.region:
            self._handles.append(hook_on.register_forward_pre_hook(
                lambda module, args: gate.enter()))
            self._handles.append(hook_on.register_forward_hook(
                lambda module, args, output: gate.leave(), always_call=True))
        self._handles.append(hook_on.register_forward_hook(post, always_call=True))

    def _pre_region(self, pre, inside, module, args, kwargs):
        """A compiled region's pre-hook, then the parameters of each module inside it, named
        as that module's call would name them (``blocks.0.fc1/Linear#0/forward/param.weight``)."""
        pre(module, args, kwargs)
        rec = self.recorder
        if rec.filter.forward_in:
            with _DisableTorchFunction():
                for target in inside:
                    kind = wrappers.user_kind(target.module)
                    decision = rec.filter.call(target.path, kind)
                    if not decision:
                        continue
                    index = rec.namer.index(target.path, kind)
                    call = rec.call("param", target.path, kind, index, "forward", "", decision)
                    for name, param in target.module.named_parameters(recurse=False):
                        rec.add(call, "param." + name, "in", param)

    def _install_region_tracking(self, targets) -> None:
        """API level on a model with compiled regions: the module stack from hooks on the
        modules outside the regions (global hooks would be traced by dynamo)."""
        stack = self.recorder.module_stack

        def push(path, module, args, kwargs=None):
            stack.append(path)

        def pop(path, module, args, output):
            if stack and stack[-1] == path:
                stack.pop()

        for target in targets:
            if target.hook_on is None and not target.compiled_call:
                continue
            pre = functools.partial(push, target.path)
            self._hook_forward(target, lambda module, args, kwargs, pre=pre: pre(module, args),
                               functools.partial(pop, target.path))

    def _hook_param(self, path, kind, name, param) -> None:
        """param_grad.<name> when the gradient lands in param.grad. An FSDP2 module's
        unsharded parameter gets it too: the gradient this rank computed, before the
        reduce-scatter (what DDP's parameters show at the same moment); FSDP2 then calls the
        sharded parameter's hook with the reduced shard."""
        self._hooked_params.add(id(param))
        hook = functools.partial(self._param_grad, path, kind, "param_grad." + name)
        self._handles.append(param.register_post_accumulate_grad_hook(hook))

    def _install_tracking(self, targets) -> None:
        """API level only needs the module path: two global hooks instead of two per module.

        Registering and removing ~400 per-module hooks every step was measured at ~4 ms for a
        200-module model; a global hook is one registration, and modules outside the model
        (not in the path table) are ignored.
        """
        paths = {id(target.module): target.path for target in targets}
        stack = self.recorder.module_stack

        def pre(module, args):
            path = paths.get(id(module))
            if path is not None:
                stack.append(path)

        def post(module, args, output):
            path = paths.get(id(module))
            if path is not None and stack and stack[-1] == path:
                stack.pop()

        self._handles.append(_module_hooks.register_module_forward_pre_hook(pre))
        self._handles.append(_module_hooks.register_module_forward_hook(post, always_call=True))

    def remove(self) -> None:
        handles, self._handles = self._handles, []
        for handle in handles:
            handle.remove()
        self._function_gates.remove()
        self.gate.release()
        self._open_calls.clear()
        self._hooked_params.clear()
        self._swapping.clear()
        self.recorder.locate.forget()

    def enter_running_call(self, module, args, kwargs):
        """What the root's forward pre-hook does, for a call of the root that was already
        under way when install() ran (torch had read that call's hook list): the forward hook
        then closes it as usual. Returns None: the call runs with its own arguments."""
        position = next((i for i, target in enumerate(self.targets or ())
                         if target.hook_on is module), None)
        region = position is not None and self.targets[position].region
        if not self.record:
            self.recorder.module_stack.append("")
        else:
            user = wrappers.unwrap(module)
            pre = functools.partial(self._pre_record, "", wrappers.user_kind(user), user)
            if region and self.region_params:
                pre = functools.partial(self._pre_region, pre, _inside(self.targets, position))
            pre(module, args, kwargs)
        if region:  # a compiled root: the gate's pre-hook missed this call too
            self.gate.enter()
        return None

    # ------------------------------------------------------------------ forward

    @charged
    def _pre_record(self, path, kind, user_module, module, args, kwargs):
        rec = self.recorder
        rec.module_stack.append(path)
        if self._swapping and id(user_module) in self._swapping:
            for name, param in user_module.named_parameters(recurse=False):
                if id(param) not in self._hooked_params and param.requires_grad:
                    self._hook_param(path, kind, name, param)
        decision = rec.filter.call(path, kind)
        if not decision:
            self._open_calls.setdefault(path, []).append(None)
            return None
        with _DisableTorchFunction():
            index = rec.namer.index(path, kind)
            call = rec.call("module", path, kind, index, "forward", rec.locate(1), decision)
            rec.calls += 1
            filt = rec.filter
            if filt.forward_in:
                for position, arg in enumerate(args):
                    rec.add_tree(call, input_slot(position), "in", arg)
                for key, arg in kwargs.items():
                    rec.add_tree(call, "kwarg." + key, "in", arg)
                param_call = ("param",) + call[1:]
                for name, param in user_module.named_parameters(recurse=False):
                    rec.add(param_call, "param." + name, "in", param)
            inputs = None
            if filt.backward and _is_grad_enabled():
                # grad_input is read back from the outputs' nodes when the forward returns
                inputs = (_input_edges(args, kwargs), _next_sequence_nr())
        self._open_calls.setdefault(path, []).append((call, inputs))
        return None

    @charged
    def _post(self, path, kind, module, args, output):
        rec = self.recorder
        stack = rec.module_stack
        if stack and stack[-1] == path:
            stack.pop()
        calls = self._open_calls.get(path)
        opened = calls.pop() if calls else None
        if opened is None:
            return None
        forward_call, inputs = opened
        _, _, _, index, _, _, source, decision, _ = forward_call
        filt = rec.filter
        with _DisableTorchFunction():
            call = rec.call("module", path, kind, index, "forward", source, decision)
            if filt.forward_out:
                rec.add_output(call, "out", output)
            if inputs is not None and _is_grad_enabled():
                edges, floor = inputs
                outputs = _trained_outputs(output, edges)
                if filt.backward_in:
                    self._hook_outputs(outputs, forward_call)
                if filt.backward_out and edges and outputs:
                    hook_input_edges(rec, forward_call, _nodes_of(outputs), edges, floor)
        return None

    # ------------------------------------------------------------------ backward

    def _hook_outputs(self, outputs, forward_call):
        """grad_output.N: a hook on each output tensor (autograd runs it on the summed
        gradient of that tensor, before the node that made it; it adds no node)."""
        generation = self.recorder.generation
        for slot, tensor in outputs:
            tensor.register_hook(functools.partial(self._on_grad, generation, forward_call, slot))

    @charged
    def _on_grad(self, generation, forward_call, slot, grad):
        rec = self.recorder
        if not rec.active or rec.generation != generation:
            return None
        kind, module, op, index, _, _, source, decision, _ = forward_call
        with _DisableTorchFunction():
            call = rec.call(kind, module, op, index, "backward", source, decision)
            rec.add(call, slot, "in", grad)
        return None

    @charged
    def _param_grad(self, path, kind, slot, param):
        rec = self.recorder
        if not rec.active or not rec.filter.backward_out:
            return
        decision = rec.filter.call(path, kind)
        if not decision:
            return
        with _DisableTorchFunction():  # (the API mode would see the read of .grad)
            grad = param.grad
            if grad is None:
                return
            index = rec.namer.index(path, slot)
            call = rec.call("param", path, kind, index, "backward", "", decision)
            # DDP's reducer and later micro-batches write .grad where no hook sees it: the
            # device bucket reads it when this backward pass ends, before they do (recorder.py)
            rec.add(call, slot, "out", grad)


def _inside(targets, position: int) -> list:
    """The targets inside the compiled region at targets[position] (they follow it)."""
    inside = []
    for target in targets[position + 1:]:
        if target.hook_on is not None or target.compiled_call:
            break
        inside.append(target)
    return inside


def _input_edges(args, kwargs) -> list:
    """(grad slot, grad_fn, output_nr, tensor) of each input tensor that requires grad, nested
    ones included (``grad_input.0.1`` for the second tensor of a list), read before the call."""
    edges = []
    for position, arg in enumerate(args):
        _add_edges(edges, arg, grad_input_slot(position))
    for key, arg in kwargs.items():
        _add_edges(edges, arg, "grad_input." + key)
    return edges


def _add_edges(edges: list, value, slot: str) -> None:
    if isinstance(value, Tensor):
        if value.requires_grad:
            edges.append((slot, value.grad_fn, value.output_nr, value))
        return
    if isinstance(value, (int, float, str, bool, type(None))):
        return
    for leaf_slot, tensor in _tensor_leaves(value, slot):
        if tensor.requires_grad:
            edges.append((leaf_slot, tensor.grad_fn, tensor.output_nr, tensor))


def _trained_outputs(output, edges) -> list:
    """(grad_output slot, tensor) of each output tensor that requires grad, except an input
    returned as it was (nn.Identity, a dropout in eval mode): its gradient is that of every
    use of the tensor, nothing this call made, so such an output records no backward."""
    if isinstance(output, Tensor):
        slots = [("grad_output.0", output)]
    elif isinstance(output, (tuple, list)):
        slots = [(f"grad_output.{p}", o) for p, o in enumerate(output)]
    elif isinstance(output, dict):
        slots = [("grad_output." + str(k), o) for k, o in output.items()]
    else:
        return []
    # an input written in place inside the call (nn.ReLU(inplace=True)) has a new node
    before = {id(tensor): grad_fn for _, grad_fn, _, tensor in edges}
    return [(slot, tensor) for name, value in slots for slot, tensor in _tensor_leaves(value, name)
            if tensor.requires_grad and before.get(id(tensor), False) is not tensor.grad_fn]


def _nodes_of(outputs) -> list:
    """The distinct autograd nodes that made the output tensors."""
    nodes = []
    for _, tensor in outputs:
        node = tensor.grad_fn
        if node is not None and all(node is not seen for seen in nodes):
            nodes.append(node)
    return nodes


def _tensor_leaves(value, slot):
    if isinstance(value, Tensor):
        return ((slot, value),)
    from probe.capture.eager.values import flatten

    return [(s, leaf) for s, leaf in flatten(value, slot, []) if isinstance(leaf, Tensor)]
