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
* ``grad_input.N``: the pre-hook hands the module an alias of each input tensor that
  requires grad (``x.view_as(x)``, made once per distinct tensor: same values and storage)
  and hooks the alias: the gradient that flowed through this call only, as torch's module
  grad_input (a residual input's other uses, or a rotary embedding reading the hidden
  states under no_grad, add nothing to it). Nested inputs (a tensor inside a list) keep a
  hook on the tensor itself: the gradient over all its uses.
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
from probe.capture.recorder import Recorder, charged

Tensor = torch.Tensor
_DisableTorchFunction = compat.DisableTorchFunction
_is_grad_enabled = torch.is_grad_enabled


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
                replaced = pre(module, args, kwargs)
                gate.enter()
                return replaced

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
        replaced = pre(module, args, kwargs)
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
        return replaced

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
        hook = functools.partial(self._param_grad, path, kind, name)
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
        then closes it as usual. Returns None or the (args, kwargs) to run the call with."""
        position = next((i for i, target in enumerate(self.targets or ())
                         if target.hook_on is module), None)
        region = position is not None and self.targets[position].region
        if not self.record:
            self.recorder.module_stack.append("")
            replaced = None
        else:
            user = wrappers.unwrap(module)
            pre = functools.partial(self._pre_record, "", wrappers.user_kind(user), user)
            if region and self.region_params:
                pre = functools.partial(self._pre_region, pre, _inside(self.targets, position))
            replaced = pre(module, args, kwargs)
        if region:  # a compiled root: the gate's pre-hook missed this call too
            self.gate.enter()
        return replaced

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
                    rec.add_tree(call, f"input.{position}", "in", arg)
                for key, arg in kwargs.items():
                    rec.add_tree(call, "kwarg." + key, "in", arg)
                param_call = ("param",) + call[1:]
                for name, param in user_module.named_parameters(recurse=False):
                    rec.add(param_call, "param." + name, "in", param)
            replaced = None
            if filt.backward_out and _is_grad_enabled():
                replaced = _own_inputs(args, kwargs)
                own_args, own_kwargs = replaced or (args, kwargs)
                inputs = [(f"grad_input.{p}", a) for p, a in enumerate(own_args)]
                inputs += [("grad_input." + k, a) for k, a in own_kwargs.items()]
                self._hook_tensors(inputs, call, "out")
        self._open_calls.setdefault(path, []).append(call)
        return replaced

    @charged
    def _post(self, path, kind, module, args, output):
        rec = self.recorder
        stack = rec.module_stack
        if stack and stack[-1] == path:
            stack.pop()
        calls = self._open_calls.get(path)
        forward_call = calls.pop() if calls else None
        if forward_call is None:
            return None
        _, _, _, index, _, _, source, decision, _ = forward_call
        filt = rec.filter
        with _DisableTorchFunction():
            call = rec.call("module", path, kind, index, "forward", source, decision)
            if filt.forward_out:
                rec.add_output(call, "out", output)
            if filt.backward_in and _is_grad_enabled():
                if isinstance(output, Tensor):
                    outputs = [("grad_output.0", output)]
                elif isinstance(output, (tuple, list)):
                    outputs = [(f"grad_output.{p}", o) for p, o in enumerate(output)]
                elif isinstance(output, dict):
                    outputs = [("grad_output." + str(k), o) for k, o in output.items()]
                else:
                    outputs = []
                self._hook_tensors(outputs, call, "in")
        return None

    # ------------------------------------------------------------------ backward

    def _hook_tensors(self, slots, forward_call, io):
        generation = self.recorder.generation
        for slot, value in slots:
            for leaf_slot, tensor in _tensor_leaves(value, slot):
                if tensor.requires_grad:
                    tensor.register_hook(functools.partial(
                        self._on_grad, generation, forward_call, leaf_slot, io))

    @charged
    def _on_grad(self, generation, forward_call, slot, io, grad):
        rec = self.recorder
        if not rec.active or rec.generation != generation:
            return None
        kind, module, op, index, _, _, source, decision, _ = forward_call
        with _DisableTorchFunction():
            call = rec.call(kind, module, op, index, "backward", source, decision)
            rec.add(call, slot, io, grad)
        return None

    @charged
    def _param_grad(self, path, kind, name, param):
        rec = self.recorder
        if not rec.active or not rec.filter.backward_out or param.grad is None:
            return
        decision = rec.filter.call(path, kind)
        if not decision:
            return
        with _DisableTorchFunction():
            index = rec.namer.index(path, "param_grad." + name)
            call = rec.call("param", path, kind, index, "backward", "", decision)
            # DDP's reducer and later micro-batches write .grad where no hook sees it: the
            # device bucket reads it when this backward pass ends, before they do (recorder.py)
            rec.add(call, "param_grad." + name, "out", param.grad)


def _inside(targets, position: int) -> list:
    """The targets inside the compiled region at targets[position] (they follow it)."""
    inside = []
    for target in targets[position + 1:]:
        if target.hook_on is not None or target.compiled_call:
            break
        inside.append(target)
    return inside


def _own_inputs(args, kwargs):
    """(args, kwargs) with each distinct top-level input tensor that requires grad replaced by
    an alias of it (``x.view_as(x)``: same values, same storage and version counter), or None
    when there is none. The module computes from the alias, so a hook on the alias gets the
    gradient that flowed through this call only, however many other ops use x (a residual
    input, the hidden states a rotary embedding also reads). The same tensor passed twice
    gets one alias, so identity checks (``query is key``) still hold."""
    aliases: dict[int, Tensor] = {}

    def own(value):
        if not isinstance(value, Tensor) or not value.requires_grad:
            return value
        alias = aliases.get(id(value))
        if alias is None:
            try:
                alias = value.view_as(value)
            except RuntimeError:  # a layout without views (sparse, nested): keep the tensor
                return value
            aliases[id(value)] = alias
        return alias

    new_args = tuple(own(arg) for arg in args)
    new_kwargs = {key: own(arg) for key, arg in kwargs.items()}
    return (new_args, new_kwargs) if aliases else None


def _tensor_leaves(value, slot):
    if isinstance(value, Tensor):
        return ((slot, value),)
    from probe.capture.eager.values import flatten

    return [(s, leaf) for s, leaf in flatten(value, slot, []) if isinstance(leaf, Tensor)]
