"""Every place probe relies on torch behaviour that is private or changed between versions.

probe supports torch 2.4 to 2.15 (setup.cfg). What differs across that range, and what each
difference means for a user, is in docs/torch-versions.md; this package is the one place the
code deals with it, so a new torch release is checked here first (what a version lacks, and the
warning that says so, in version_gaps.py). Nothing here imports h5py.

Private torch API used (present, with the same meaning, in every supported version); no
other module of probe names a private torch attribute:
  * torch._C.DisableTorchFunction: run torch calls inside a hook without re-entering the mode;
  * torch._C._current_graph_task_id (2.1+): one id per backward pass; the autograd engine's
    queue_callback (run a function when the backward pass ends);
  * Node._sequence_nr(): autograd numbers nodes in creation order;
    torch.autograd._get_sequence_nr: the number the next node gets;
  * torch.overrides._get_current_function_mode_stack, torch._C._pop_torch_function_stack,
    torch._C._push_on_torch_function_stack: take one mode out of the middle of the stack;
  * torch.utils._device.DeviceContext and torch._GLOBAL_DEVICE_CONTEXT: where a factory call
    without ``device=`` allocates;
  * torch._C._is_any_autocast_enabled, torch._C._are_functorch_transforms_active: cheap
    checks on the hot path (absent: the slower public check, or "no transform");
  * Tensor._version (in-place writes bump it), torch._foreach_norm, torch._foreach_copy_,
    torch._C._to_dlpack, the sparse ``_values()``;
  * nn.Module._modules (children without the generator of named_children) and
    ``_compiled_call_impl`` (what ``module.compile()`` calls);
  * DTensor._local_tensor and ._spec, compute_local_shape_and_global_offset (the shard a
    rank holds and where it sits);
  * torch.autograd._make_grads, ._tensor_or_tensors_to_tuple, graph._engine_run_backward:
    a backward pass started the way torch.autograd.backward starts it;
  * a module's forward hook dicts (``_forward_hooks``, ...), to give a hook a shared key, and
    the global forward pre-hooks (``_global_forward_pre_hooks``), to run the hooks start()
    adds to a call already under way (zero-edit capture);
  * dynamo: ``_torchdynamo_orig_callable``, OptimizeContext, config, lookup_backend, torch._TorchCompileInductorWrapper
    and a graph input's ``_dynamo_source``; the ``callback`` cell of a torch.compile'd
    callable's closure and the ``_torchdynamo_orig_backend`` chain down to its backend
    (dynamo_callback_cell, dynamo_backend: swapped for graph taps while a capture is on),
    and the number of entries in dynamo's cache for a code object;
  * torch._C._nn: the module of F.* C functions (replay looks ops up there).
Used in place, with the same meaning on every supported version (the suite checks them on
each version CI runs): Node.next_functions and AccumulateGrad's ``variable`` (the composite
walk in capture/eager/api_mode.py), and the ``__module__`` of torch's C functions (torch._C._nn,
torch._C._linalg, ...), which capture/eager/naming.py turns into op names.

Behaviour that changed:
  * autograd node wrappers: up to 2.12 a C++ node does not keep its Python wrapper alive, so
    ``id(node)`` of a dropped wrapper is reused by the next one (capture/eager/api_backward.py's
    walk holds the nodes it has seen);
  * collectives and __torch_function__ (see uncaptured_collectives): none reach a
    TorchFunctionMode up to 2.6, some from 2.7, all from 2.12;
  * collective names (see COLLECTIVE_ALIASES): all_gather_into_tensor became all_gather_single
    and reduce_scatter_tensor became reduce_scatter_single in 2.13;
  * dtypes: float8_e8m0fnu exists from 2.7, float4_e2m1fn_x2 from 2.8 (see has_dtype);
  * graph inputs a dynamo backend adds (see added_input_source): AOTAutograd accepts a
    ``_dynamo_source`` of None from 2.8, and asserts every source unique before;
  * sharded training (see version_gaps.sharded_capture_gap): FSDP2 on CPU calls CUDA on 2.4, and up to
    2.11 the wait of a functional collective never reaches __torch_function__.
"""

from __future__ import annotations

import operator
import warnings

import torch
from torch.overrides import TorchFunctionMode

#: the context manager that turns every TorchFunctionMode off (all supported versions)
DisableTorchFunction = torch._C.DisableTorchFunction
#: one id per backward pass; -1 (every pass looks the same) where torch lacks it
graph_task_id = getattr(torch._C, "_current_graph_task_id", lambda: -1)


def queue_backward_callback(callback) -> None:
    """Run callback() when the backward pass running now ends (after every node and hook of
    it; callbacks run in the order they were queued). Call it from inside a backward pass."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


#: sequence_nr(node): creation number of an autograd node (a node made later has a larger
#: one); a C-level call, as the module-level walks read it for every node they pass
sequence_nr = operator.methodcaller("_sequence_nr")


_peek_sequence_nr = getattr(torch.autograd, "_get_sequence_nr", None)


def next_sequence_nr() -> int:
    """The creation number the next autograd node made on this thread gets (every node made
    from now on has at least this one); -1 where torch cannot tell."""
    return -1 if _peek_sequence_nr is None else _peek_sequence_nr()


def function_mode_stack() -> list:
    """The active TorchFunctionModes, innermost last."""
    return list(torch.overrides._get_current_function_mode_stack())


def pop_function_mode() -> None:
    torch._C._pop_torch_function_stack()


def push_function_mode(mode) -> None:
    torch._C._push_on_torch_function_stack(mode)


def remove_function_mode(mode) -> None:
    """Take one mode out of the stack wherever it is: pop the modes above it, pop it, push
    the others back in their order."""
    above = []
    while True:
        stack = function_mode_stack()
        if not stack:
            return
        top = stack[-1]
        pop_function_mode()
        if top is mode:
            break
        above.append(top)
    for other in reversed(above):
        push_function_mode(other)


#: the active TorchFunctionModes, innermost last, as torch keeps them (no copy: the hot path)
current_function_modes = torch.overrides._get_current_function_mode_stack


def device_context_class():
    """The mode class of ``with torch.device(...)``."""
    from torch.utils._device import DeviceContext

    return DeviceContext


def global_device_context():
    """torch.set_default_device's DeviceContext, or None."""
    return getattr(getattr(torch, "_GLOBAL_DEVICE_CONTEXT", None), "device_context", None)


#: whether autocast is on for any device, in one call; None where torch lacks it
any_autocast_enabled = getattr(torch._C, "_is_any_autocast_enabled", None)
#: whether a functorch transform (vmap, grad) is active
functorch_transforms_active = getattr(torch._C, "_are_functorch_transforms_active", lambda: False)
#: a tensor's version counter: every in-place write bumps it
tensor_version = operator.attrgetter("_version")
#: C-level DLPack capsule of a tensor, without Tensor.__dlpack__'s Python checks; None if absent
to_dlpack = getattr(torch._C, "_to_dlpack", None)
#: the module of the C functions behind torch.nn.functional
C_NN = torch._C._nn


def foreach_norm(tensors, ord, dtype):
    """One multi-tensor norm call over a list of tensors."""
    return torch._foreach_norm(tensors, ord, dtype=dtype)


def sparse_values(tensor):
    """The stored values of a sparse COO tensor (coalesced or not)."""
    return tensor._values()


def child_modules(module) -> dict:
    """A module's direct children by attribute name (the dict itself: cheap, not a copy)."""
    return module._modules


def compiled_call(module):
    """What ``module.compile()`` made the module call instead of its forward, or None."""
    return getattr(module, "_compiled_call_impl", None)


def set_compiled_call(module, function) -> None:
    module._compiled_call_impl = function


def dtensor_local_and_spec(dtensor) -> tuple:
    """(the rank's local tensor, the DTensor's spec: mesh and placements)."""
    return dtensor._local_tensor, dtensor._spec


def local_shape_and_global_offset(shape, mesh, placements) -> tuple:
    try:
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    except ImportError:  # torch 2.4
        from torch.distributed._tensor._utils import compute_local_shape_and_global_offset
    return compute_local_shape_and_global_offset(shape, mesh, placements)


def dynamo_compiling_context_type():
    """dynamo's context of a function torch.compile compiles; () where there is none."""
    try:
        from torch._dynamo.eval_frame import OptimizeContext
    except ImportError:
        return ()
    return OptimizeContext


def dynamo_config():
    """torch._dynamo.config, or None where dynamo does not import."""
    try:
        import torch._dynamo.config as config
    except ImportError:
        return None
    return config


def dynamo_restart_exceptions() -> tuple:
    """The exceptions dynamo raises through a backend to compile the frame again another way
    (``TensorifyScalarRestartAnalysis`` under dynamic shapes, ...): control flow, not a
    failure; a backend must let them through. 2.4 to 2.15 define ``RestartAnalysis``."""
    try:
        from torch._dynamo.exc import RestartAnalysis
    except ImportError:  # pragma: no cover - a dynamo without it has nothing to pass on
        return ()
    return (RestartAnalysis,)


def lookup_backend(name: str):
    from torch._dynamo import lookup_backend as lookup

    return lookup(name)


def inductor_backend(mode, options, dynamic):
    """The backend torch.compile builds for ``backend="inductor"`` with a mode or options."""
    return torch._TorchCompileInductorWrapper(mode, options, dynamic)


#: what torch.autograd.backward does before it starts the engine, and the engine's entry
#: (backward_collectives.py runs them itself); None where this torch lacks one
engine_run_backward = getattr(getattr(torch.autograd, "graph", None), "_engine_run_backward", None)
make_grads = getattr(torch.autograd, "_make_grads", None)
tensor_or_tensors_to_tuple = getattr(torch.autograd, "_tensor_or_tensors_to_tuple", None)


def dynamo_inlines_nn_modules() -> bool:
    """dynamo traces into torch.nn modules by default (``inline_inbuilt_nn_modules``, 2.5+):
    a plain torch.compile graph then holds every call and parameter, which graph taps need."""
    config = dynamo_config()
    if config is None:
        return False
    with warnings.catch_warnings():  # newer torch: always on, and reading it is deprecated
        warnings.simplefilter("ignore", FutureWarning)
        return bool(getattr(config, "inline_inbuilt_nn_modules", False))


def dynamo_callback_cell(function):
    """(the closure cell holding the callback dynamo evaluates frames with, fullgraph) of a
    callable torch.compile made (an OptimizedModule's ``forward``, ``_compiled_call_impl``, a
    ``@torch.compile`` function), or None.

    torch.compile wraps the user's callable in a function that, on every call, installs the
    callback its context was built with, read from that function's closure (``callback``,
    beside ``self``, the context); 2.4 to 2.13 alike. Setting the cell's contents makes the
    same callable compile and run through another callback from its next call on."""
    code = getattr(function, "__code__", None)
    closure = getattr(function, "__closure__", None)
    if code is None or not closure:
        return None
    names = code.co_freevars
    if "callback" not in names or "self" not in names:
        return None
    try:
        context = closure[names.index("self")].cell_contents
    except ValueError:  # an empty cell
        return None
    kind = dynamo_compiling_context_type()
    if not kind or not isinstance(context, kind):
        return None
    cell = closure[names.index("callback")]
    fullgraph = getattr(context, "fullgraph", None)
    if fullgraph is None:  # 2.4: fullgraph is the kind of callback, not an attribute
        fullgraph = any(type(link).__name__ == "ConvertFrameAssert"
                        for link in _backend_chain(cell.cell_contents))
    return cell, bool(fullgraph)


def _backend_chain(callback) -> list:
    """The wrappers from a dynamo callback down to the backend it compiles with."""
    chain = [callback]
    for _ in range(16):
        inner = getattr(chain[-1], "_torchdynamo_orig_backend", None)
        if inner is None:  # 2.4 names the same link _torchdynamo_orig_callable
            inner = getattr(chain[-1], "_torchdynamo_orig_callable", None)
        if inner is None or not callable(inner):
            break
        chain.append(inner)
    return chain


def dynamo_backend(callback):
    """The backend a dynamo callback compiles graphs with: what torch.compile made of the
    user's ``backend``, ``mode`` and ``options`` (``_TorchCompileInductorWrapper``,
    ``_TorchCompileWrapper``), called as ``backend(graph_module, example_inputs)``."""
    return _backend_chain(callback)[-1]


def dynamo_backend_links(callback) -> list:
    """Every wrapper from a dynamo callback down to the user's own backend function, the
    backend torch.compile's ``_TorchCompileWrapper`` holds (``compiler_fn``) included."""
    chain = _backend_chain(callback)
    inner = getattr(chain[-1], "compiler_fn", None)
    return chain + ([inner] if inner is not None else [])


def dynamo_callback(backend, fullgraph: bool):
    """The callback of ``torch._dynamo.optimize(backend, nopython=fullgraph)``: what a
    torch.compile'd callable evaluates its frames with, compiling graphs with ``backend``."""
    import torch._dynamo

    return torch._dynamo.optimize(backend=backend, nopython=fullgraph).callback


def dynamo_cache_entries(code) -> int | None:
    """How many compiled entries dynamo's cache holds for a code object; None where unknown."""
    try:
        from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list
        return len(_debug_get_cache_entry_list(code))
    except Exception:  # a torch without it, or not a code object
        return None


def dynamo_recompile_limit() -> int | None:
    """dynamo's limit of compiled entries per code object (``recompile_limit``, named
    ``cache_size_limit`` on older torch); None where unknown."""
    config = dynamo_config()
    limit = getattr(config, "recompile_limit", None)
    if limit is None:
        limit = getattr(config, "cache_size_limit", None)
    return limit if isinstance(limit, int) else None


def dynamo_original(function):
    """The function a torch.compile'd function wraps, or None: not compiled."""
    return getattr(function, "_torchdynamo_orig_callable", None)


#: a module's forward hook dicts by kind, with and without kwargs
_HOOK_DICTS = {"pre": ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs"),
               "post": ("_forward_hooks", "_forward_hooks_with_kwargs")}


def forward_hook_dicts(module, kind: str) -> list:
    """The dicts a module keeps its forward hooks of ``kind`` ("pre"/"post") in, by handle id."""
    return [hooks for hooks in (getattr(module, name, None) for name in _HOOK_DICTS[kind])
            if hooks is not None]


def forward_pre_hooks(module) -> list[tuple]:
    """The forward pre-hooks torch calls for ``module``'s next call, in its order: the global
    ones (``register_module_forward_pre_hook``), then the module's own; each as (hook, whether
    it takes the call's keyword arguments)."""
    import torch.nn.modules.module as module_file

    found = [(hook, False) for hook in module_file._global_forward_pre_hooks.values()]
    dicts = forward_hook_dicts(module, "pre")
    own = dicts[0] if dicts else {}
    with_kwargs = dicts[1] if len(dicts) > 1 else {}
    found += [(hook, key in with_kwargs) for key, hook in own.items()]
    return found


def has_input_source(node) -> bool:
    return hasattr(node, "_dynamo_source")


def input_source(node):
    """The ``_dynamo_source`` of a graph placeholder."""
    return node._dynamo_source


def set_input_source(node, source) -> None:
    node._dynamo_source = source


def has_dtype(name: str) -> bool:
    """Whether this torch has the dtype ``torch.<name>`` (float8_e8m0fnu: 2.7+,
    float4_e2m1fn_x2: 2.8+). Dumps holding such tensors still read on any version: the
    reader decodes them with numpy alone."""
    return isinstance(getattr(torch, name, None), torch.dtype)


# ---------------------------------------------------------------------------- collectives

#: torch.distributed functions whose tensors a TorchFunctionMode can see, by public name
COLLECTIVES = (
    "all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor",
    "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "gather",
    "scatter", "send", "recv", "isend", "irecv", "all_reduce_coalesced", "all_gather_coalesced",
)

#: One name per collective, whatever the torch version calls it, so that records of two runs
#: on different versions pair in a compare. torch 2.13 renamed all_gather_into_tensor to
#: all_gather_single and reduce_scatter_tensor to reduce_scatter_single (the old names still
#: work and dispatch under the new ones); up to 2.12 the mode sees the old names, and the
#: private _all_gather_base / _reduce_scatter_base are the same ops. The new names win.
COLLECTIVE_ALIASES = {
    "distributed.all_gather_into_tensor": "distributed.all_gather_single",
    "distributed._all_gather_base": "distributed.all_gather_single",
    "distributed.reduce_scatter_tensor": "distributed.reduce_scatter_single",
    "distributed._reduce_scatter_base": "distributed.reduce_scatter_single",
}


class _Reached(Exception):
    """Raised by _Sentinel: the collective checked for a TorchFunctionMode."""


class _Sentinel(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        raise _Reached


_UNCAPTURED: tuple | None = None


def uncaptured_collectives() -> tuple[str, ...]:
    """Public names of the torch.distributed collectives this torch runs without asking a
    TorchFunctionMode: the API level cannot record them (without monkey-patching torch).

    Measured: torch 2.4-2.6 none reach the mode; 2.7-2.11 only all_reduce, all_gather,
    all_gather_into_tensor, reduce_scatter_tensor and all_to_all_single do; 2.12+ all do.
    Decided here by asking torch itself, not by version number: each collective is called
    once, under a mode that raises as soon as it is consulted, with a string where the tensor
    goes. A collective that consults the mode raises at once; one that does not fails its
    own argument check on the string before it could communicate. Computed once per process.
    """
    global _UNCAPTURED
    if _UNCAPTURED is None:
        _UNCAPTURED = tuple(name for name in COLLECTIVES if not _reaches_mode(name))
    return _UNCAPTURED


def _reaches_mode(name: str) -> bool:
    distributed = torch.distributed
    if not distributed.is_available():
        return True  # nothing to miss
    function = getattr(distributed, name, None)
    if function is None:
        return True
    import inspect

    try:
        required = [p for p in inspect.signature(function).parameters.values()
                    if p.default is inspect.Parameter.empty
                    and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        return False
    with warnings.catch_warnings():  # deprecation notices of the old names
        warnings.simplefilter("ignore")
        try:
            with _Sentinel():
                function(*["not a tensor"] * len(required))
        except _Reached:
            return True
        except Exception:
            return False
    return False


VERSION = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])


def added_input_source(name: str):
    """The ``_dynamo_source`` of a graph input a backend adds (capture/compiled/grad_taps.py's zeros).

    AOTAutograd reads a source from every placeholder of a dynamo graph. From torch 2.8 it
    takes None for an input that no user frame holds; 2.4 asserts that all sources differ, so
    two None fail the compile (measured on 2.4.1 and 2.8.0). There each added input gets a
    source of its own, a local name no user frame has; AOTAutograd only reads it to guard
    duplicated inputs, and each zero is a new tensor."""
    if VERSION >= (2, 8):
        return None
    from torch._dynamo.source import LocalSource

    return LocalSource(f"__probe_{name}")


def flatten_dense_tensors(tensors: list):
    """One flat tensor of the tensors' values, one after another, in one dispatched call
    (the C++ helper DDP's bucketing uses: no Python-level view per tensor). All tensors
    must share a dtype and device."""
    return torch._C._nn.flatten_dense_tensors(tensors)


def local_tensor(tensor):
    """A DTensor's local shard (the tensor its in-place ops write), any other tensor itself."""
    local = getattr(tensor, "_local_tensor", None)
    return tensor if local is None else local


def foreach_copy(targets: list, sources: list) -> None:
    """targets[i].copy_(sources[i]) for every i, in one multi-tensor call."""
    torch._foreach_copy_(targets, sources)
