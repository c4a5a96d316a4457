"""API level: one TorchFunctionMode that records every torch call made while it is active.

A TorchFunctionMode sees torch.*, torch.nn.functional.*, Tensor methods and operators, and
``from torch import relu`` references alike, because torch routes them all through
``__torch_function__``; no torch attribute is replaced. In torch >= 2.1 the collectives of
torch.distributed (all_reduce, broadcast, all_gather, all_gather_into_tensor,
reduce_scatter_tensor, all_to_all_single, send/recv, ...) also check for a mode and arrive
here as ``distributed.<name>`` (all_gather_into_tensor as ``distributed.all_gather_single``,
reduce_scatter_tensor as ``distributed.reduce_scatter_single``, on every torch version) --
from torch 2.12 on; older versions pass only some or none (probe.compat.uncaptured_collectives,
warned about at start()).

A collective writes into its tensor arguments without bumping their autograd version, so
its output (``output.0`` = the buffer it wrote, e.g. all_reduce's ``tensor``) is always
recomputed, never taken from the statistics cache. DDP's gradient all-reduce runs inside
its C++ reducer and is not an API call: parameter gradients recorded at module level are
the local gradients, before averaging. Collectives run during backward (FSDP2's
reduce-scatter, a gradient hook's all-reduce) are recorded because, with a process group up,
the mode starts backward passes itself with the mode back on the stack, and records only
collectives while they run (backward_collectives.py).

Per call: inputs are recorded before the call (so an in-place op's input is seen before it
is overwritten), outputs after it. Only the outermost torch call is recorded: torch disables
the mode while ``__torch_function__`` runs, so F.layer_norm's internal torch.layer_norm is
not a second record.

Backward: for outputs that require grad, one hook is registered on the autograd node that
produced them (``grad_fn.register_hook``). When it fires it records the gradient flowing
into each output (``grad_output.N``) and, when the call is exactly that one node (each of
the node's inputs is one of the call's tensor inputs; checked at forward time), the
gradient the node sends to each input (``grad_input.N``): the per-call contribution, not
the gradient accumulated over every use of the input. Composite calls (F.cross_entropy is
log_softmax + nll_loss) get grad_input too while COMPOSITE_GRAD_INPUT is on (the default): the
call's own autograd nodes are walked from its outputs to the edges into its inputs and
those nodes are hooked (api_backward.py, _composite_edges; an input reaching several of
them gets the sum, recorded as its own backward event when the last edge ran). Node hooks do not change
numerics, and they stay with the node that produced the value, so a later in-place op on
the output does not move them.
"""

from __future__ import annotations

import functools
import os
import sys
import time

import torch
from torch.overrides import TorchFunctionMode

from probe import compat
from probe.capture.eager import backward_collectives, naming
from probe.capture.eager.api_backward import hook_backward, hook_nodes
from probe.capture.eager.autocast import autocast_dtype as _autocast_dtype, note_call as _note_autocast
from probe.capture.eager.defaults import TABLE as _defaults_table, defaults_of as _defaults_of, bind_call as _bind_call
from probe.capture.recorder import Recorder
from probe.capture.eager.write_watch import may_write as _may_write, written_tensors as _written_tensors
from probe.capture.eager.unwritten import ALLOCATING as _ALLOCATING, allocate as _allocate, written as _note_written

Tensor = torch.Tensor
_DisableTorchFunction = compat.DisableTorchFunction
_is_grad_enabled = torch.is_grad_enabled
_graph_task_id = compat.graph_task_id
_sequence_nr = compat.sequence_nr
_names = naming.NAMES
_MISSING = naming.MISSING
_op_name = naming.op_name
_PLAIN = (int, float, bool, str, type(None))
_BACKWARD_ENTRIES = backward_collectives.ENTRIES
#: what is recorded during backward: torch.distributed's collectives and the functional ones
#: (DTensor's redistribution in tensor parallel)
_COLLECTIVE_NAMES = ("distributed.", "ops._c10d_functional.")
_partial = functools.partial
_INPUT_SLOTS = naming.INPUT_SLOTS
_GRAD_SLOTS = naming.GRAD_INPUT_SLOTS

#: record grad_input.N of composite calls (several autograd nodes) too. On: compare judges
#: a backward call against its grad_output and the records of the same call's forward, so a
#: loss whose grad_output agrees (1.0) but whose grad_input differs because its logits did
#: inherits that error. An escape hatch: set it False before start() to hook only the node
#: that made the outputs (fewer hooks; composite calls then record grad_output only).
COMPOSITE_GRAD_INPUT = True

#: ops that return None but write into their first argument, which is then their output
#: (besides every in-place "..._" op that returns None, such as torch._foreach_add_)
_WRITES_ARG = frozenset({"Tensor.__setitem__"})
#: torch.distributed ops (names after compat.COLLECTIVE_ALIASES): the parameter holding what
#: the collective produced, spelled the same by every version's signature
_DIST_OUTPUT = {
    "all_reduce": "tensor", "broadcast": "tensor", "reduce": "tensor", "recv": "tensor",
    "scatter": "tensor", "all_gather": "tensor_list", "all_gather_single": "output_tensor",
    "all_gather_coalesced": "output_tensor_lists", "all_reduce_coalesced": "tensors",
    "reduce_scatter": "output", "reduce_scatter_single": "output", "all_to_all_single": "output",
    "all_to_all": "output_tensor_list", "gather": "gather_list",
}


class ApiCaptureMode(TorchFunctionMode):
    """Entered by PrecisionDebugger.start(), exited by stop(); records through a Recorder."""

    def __init__(self, recorder: Recorder, targets: list | None = None) -> None:
        super().__init__()
        self.recorder = recorder
        #: compiled_regions.targets of the model start() walked (its module paths)
        self.targets = targets
        self._paths: dict | None = None  # id(module) -> the user's module path
        #: start backward passes with this mode on the stack (backward_collectives.py)
        self.reenter_backward = backward_collectives.wanted()
        #: set while such a pass runs: only collectives are recorded then
        self.in_backward = False

    def module_path(self, module) -> str:
        """The user's path of one of the model's modules; "" (the root) for any other."""
        if self._paths is None:
            self._paths = {id(target.module): target.path for target in self.targets or ()}
        return self._paths.get(id(module), "")

    def __enter__(self):
        self.recorder.watch_optimizers()  # the device bucket's flushes around their steps
        return super().__enter__()

    def __exit__(self, exc_type, exc_value, traceback):
        self.recorder.locate.forget()  # the source walk may hold a frame of the user's code
        self.recorder.unwatch_optimizers()
        return super().__exit__(exc_type, exc_value, traceback)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        try:
            name = _names.get(func, _MISSING)
        except TypeError:
            name = _op_name(func)
        if name is _MISSING:
            name = _op_name(func)
        if name is None:  # attribute reads and metadata: most calls the mode sees
            if self.reenter_backward and func in _BACKWARD_ENTRIES:
                return backward_collectives.run_backward(self, func, args, kwargs or {})
            if id(func) in _ALLOCATING and not _from_framework(_getframe(1)):
                return _allocate(self.recorder.unwritten, func, args, kwargs)  # unwritten.py
            return func(*args, **kwargs) if kwargs else func(*args)
        if kwargs is None:
            kwargs = {}
        rec = self.recorder
        if self.in_backward:
            if not name.startswith(_COLLECTIVE_NAMES):
                # a checkpointed block's recomputation, FSDP2's copies, a user's hook
                _guard_writes(rec, func, name, args, kwargs)
                return func(*args, **kwargs)
            module = backward_collectives.owner_path(self)
        else:
            stack = rec.module_stack
            module = stack[-1] if stack else ""
        counter = (module, name)
        decision = rec.decisions.get(counter)
        if decision is None:
            decision = rec.filter.call(module, name)
        if not decision:
            _guard_writes(rec, func, name, args, kwargs)
            return func(*args, **kwargs)
        frame = _getframe(1)
        try:
            # the caller's code is known to be the user's (most calls): one lookup, no walk
            mine = _framework_code.get(frame.f_code) == _USER
        except TypeError:  # a code object holding a slice constant (dynamo's resume code)
            mine = True
        if not mine and _from_framework(frame) and not name.startswith("distributed."):
            _guard_writes(rec, func, name, args, kwargs)
            return func(*args, **kwargs)
        return _capture(rec, func, name, module, counter, decision, args, kwargs)


#: code called from these folders is a sharding framework's own plumbing, not the user's
#: computation: FSDP2 allocates, views and copies its all-gather buffers (whose memory is
#: unset until the collective) on every unshard. Its collectives are still recorded.
_FRAMEWORK_PATHS = ("torch/distributed/fsdp/", "torch/distributed/_composable/fsdp/")
#: torch's own relays between a caller and the op it asks for: ``torch.ops.fsdp.*(...)``
#: (FSDP2's copy out of its all-gather buffer) and ``autograd.Function.apply`` (the view
#: FSDP2's post-backward Function returns) are judged by the code that called them
_RELAY_PATHS = ("torch/_ops.py", "torch/autograd/function.py")
_FRAMEWORK, _USER, _RELAY = 1, 0, 2
_framework_code: dict = {}  # code object -> _FRAMEWORK, _USER or _RELAY
_getframe = sys._getframe


def _from_framework(frame) -> bool:
    """The torch call was made by a sharding framework's code (through at most two relays)."""
    for _ in range(3):
        code = frame.f_code
        try:
            found = _framework_code.get(code)
        except TypeError:  # unhashable constants: not a framework's own code
            return False
        if found is None:
            path = code.co_filename.replace(os.sep, "/")
            found = (_FRAMEWORK if any(part in path for part in _FRAMEWORK_PATHS)
                     else _RELAY if path.endswith(_RELAY_PATHS) else _USER)
            _framework_code[code] = found
        if found != _RELAY:
            return found == _FRAMEWORK
        frame = frame.f_back
        if frame is None:
            return False
    return False


def _guard_writes(rec: Recorder, func, name: str, args, kwargs) -> None:
    """Before a call writes tensors in place: the device bucket keeps what it holds of them."""
    written = None
    if _may_write(name, func, args, kwargs):
        written = _written_tensors(name, args, kwargs)
        if written:
            rec.before_write(written)
    if rec.unwritten:  # memory nothing has written yet (unwritten.py)
        _note_written(rec.unwritten, name, args, kwargs, written)


_clock = time.perf_counter


def _capture(rec: Recorder, func, name, module, counter, decision, args, kwargs):
    began = _clock()
    filt = rec.filter
    namer = rec.namer
    counts = namer.counts
    index = counts.get(counter, 0)
    counts[counter] = index + 1
    seq = namer.seq
    namer.seq = seq + 1
    # frames 1 and 2 are this function and __torch_function__: start at the caller of torch
    call = ("api", module, name, index, "forward", seq, rec.locate(3), decision,
            f"{module}/{name}#{index}/forward/")
    rec.calls += 1
    add = rec.add
    autocast = _autocast_dtype()
    if autocast:  # a lower precision autocast chose is expected, one the model chose is not
        _note_autocast(rec.autocast_runs, seq, autocast, rec.autocast_last)
    rec.autocast_last[0] = seq
    distributed = name.startswith("distributed.")
    waited = name.startswith(_WAIT)  # a functional collective's result, where it is waited for
    collective_output = _collective_output(func, name, args, kwargs) if distributed else None
    if filt.forward_in:
        buffers = _output_buffers(kwargs, collective_output) if kwargs or distributed else None
        if waited:
            # the collective's pending buffer: what it holds before the wait is a race
            buffers = {id(arg) for arg in args if isinstance(arg, Tensor)}
        position = 0
        for arg in args:
            slot = _INPUT_SLOTS[position] if position < 64 else f"input.{position}"
            position += 1
            if buffers and id(arg) in buffers:
                continue
            if isinstance(arg, Tensor) or type(arg) in _PLAIN:
                add(call, slot, "in", arg)
            else:
                rec.add_tree(call, slot, "in", arg)
        if kwargs:
            for key, arg in kwargs.items():
                if buffers and id(arg) in buffers:
                    continue
                if isinstance(arg, Tensor) or type(arg) in _PLAIN:
                    add(call, "kwarg." + key, "in", arg)
                else:
                    rec.add_tree(call, "kwarg." + key, "in", arg)
        # the defaults that choose the function: F.gelu(x) against F.gelu(x, approximate="tanh")
        try:
            wanted = _defaults_table.get(func)
        except TypeError:  # an unhashable callable
            wanted = ()
        if wanted is None:
            wanted = _defaults_of(func)
        if wanted:
            given = len(args)
            for position, key, slot, arg in wanted:
                if (position is None or position >= given) and key not in kwargs:
                    add(call, slot, "in", arg)
    track = filt.backward and _is_grad_enabled()
    edges = _grad_edges(args, kwargs) if track else None
    _guard_writes(rec, func, name, args, kwargs)
    called = _clock()
    rec.busy_s += called - began
    out = func(*args, **kwargs)
    began = _clock()
    produced = out
    written = out is None or distributed or waited
    if written:
        produced = _written_argument(name, args, kwargs, out, collective_output)
    if kwargs and kwargs.get("out") is not None:
        # an out= buffer: a custom op (FSDP2's split_with_sizes_copy) may write it without a
        # version bump, and an alias of it read later must not hit the stale cache entry
        produced, written = kwargs["out"], True
    if not waited and name.startswith(_ASYNC_COLLECTIVES):
        # a functional collective (tensor parallel's all_reduce) returns before its result is
        # there: its values are recorded where they are waited for (_wrap_tensor_autograd)
        produced = None
    if filt.forward_out and produced is not None:
        if isinstance(produced, Tensor) and not written:
            add(call, "output.0", "out", produced)
        else:
            # collectives write their buffers without a version bump: never trust the cache
            rec.add_output(call, "out", produced, fresh=written)
    if track:
        if isinstance(produced, Tensor):
            # one tensor out (most calls): the common case without the structure walk
            if produced.requires_grad:
                node = produced.grad_fn
                if node is not None and not (edges and _returns_an_input(produced, node, edges)):
                    hook_nodes(rec, call, ((node, ((produced.output_nr, "grad_output.0"),)),),
                               edges if filt.backward_out else None, COMPOSITE_GRAD_INPUT)
        elif isinstance(produced, (tuple, list)):
            hook_backward(rec, call, produced, edges if filt.backward_out else None, COMPOSITE_GRAD_INPUT)
    rec.busy_s += _clock() - began
    return out


def _returns_an_input(produced, node, edges) -> bool:
    """The call computed nothing: it returned one of its inputs as it was (``x.to(x.dtype)``,
    ``x.contiguous()`` on a contiguous x). Its output's autograd node is the input's producer,
    so a hook there would record the gradient summed over every use of that tensor, not
    this call's: such a call records no backward (an in-place op returns its input too, but
    with a new node, and keeps its backward)."""
    for _, grad_fn, _, tensor in edges:
        if tensor is produced and grad_fn is node:
            return True
    return False


def _written_argument(name, args, kwargs, out, collective_output):
    if name in _WRITES_ARG or (name.endswith("_") and out is None):
        # Tensor.__setitem__, torch._foreach_add_ and friends return None: their first
        # argument, after the call, is what they produced
        return args[0] if args else None
    if not name.startswith("distributed."):
        return out
    if collective_output is None or kwargs.get("async_op"):
        return None  # send/isend produce nothing; an async op's buffer is not ready yet
    return collective_output[1]


def _collective_output(func, name, args, kwargs) -> tuple | None:
    """(parameter, argument) holding what a torch.distributed collective produces; None for
    other calls, for send/isend, or when the arguments do not bind."""
    if not name.startswith("distributed."):
        return None
    parameter = _DIST_OUTPUT.get(name[len("distributed."):])
    if parameter is None:
        return None
    bound = _bind_call(func, args, kwargs)
    if bound is None:
        return None
    return parameter, bound.arguments.get(parameter)


def _output_buffers(kwargs, collective_output) -> set | None:
    """ids of the arguments a call only writes: an ``out=`` buffer, a collective's separate
    output (all_gather's output_tensor, ...). Their values before the call are whatever the
    memory held (FSDP2 allocates its all-gather buffers every step), not an input: they are
    recorded as the call's outputs only."""
    found = None
    if kwargs and kwargs.get("out") is not None:
        found = {id(kwargs["out"])}
    if collective_output is not None and collective_output[0] in _SEPARATE_OUTPUTS:
        if collective_output[1] is not None:
            found = (found or set()) | {id(collective_output[1])}
    return found


_ASYNC_COLLECTIVES = "ops._c10d_functional."
_WAIT = ("ops._c10d_functional.wait_tensor", "ops._c10d_functional._wrap_tensor_autograd")
#: collective parameters that hold only the result (all_reduce's ``tensor`` is also its input)
_SEPARATE_OUTPUTS = frozenset({"output_tensor", "output", "tensor_list", "output_tensor_list",
                               "output_tensor_lists", "gather_list"})


def _grad_edges(args, kwargs):
    """(grad slot, grad_fn, output_nr, tensor) of each input requiring grad, taken before the
    call; None when there is none. The grad slot is "grad_input.N" ("grad_input.N.M" inside a
    list, "grad_input.<name>" for a keyword)."""
    edges = None
    position = 0
    for arg in args:
        if isinstance(arg, Tensor):
            if arg.requires_grad:
                if edges is None:
                    edges = []
                edges.append((_GRAD_SLOTS[position] if position < 64
                              else f"grad_input.{position}", arg.grad_fn, arg.output_nr, arg))
        elif isinstance(arg, (list, tuple)):
            inner = 0
            for item in arg:
                if isinstance(item, Tensor) and item.requires_grad:
                    if edges is None:
                        edges = []
                    edges.append((f"grad_input.{position}.{inner}", item.grad_fn,
                                  item.output_nr, item))
                inner += 1
        position += 1
    if kwargs:
        for key, arg in kwargs.items():
            if isinstance(arg, Tensor) and arg.requires_grad:
                if edges is None:
                    edges = []
                edges.append(("grad_input." + key, arg.grad_fn, arg.output_nr, arg))
    return edges
