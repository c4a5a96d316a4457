"""Stable op names and per-step counters.

A record's key is ``{module}/{op}#{index}/{phase}/{slot}`` (probe.dump.schema.make_key).
``index`` counts calls of one ``op`` inside one ``module`` within one step, so one extra call
in one module renames nothing outside that (module, op) pair. A global ``seq`` counts events
(a forward call, a backward hook firing) and records execution order only.

``op_name(func)`` turns whatever a TorchFunctionMode receives into a short, stable name:

    torch.relu, from torch import relu      -> "torch.relu"
    F.linear (torch._C._nn.linear)          -> "functional.linear"
    F.layer_norm (torch.nn.functional)      -> "functional.layer_norm"
    x.add_(y), x + y, x * 2                 -> "Tensor.add_", "Tensor.add", "Tensor.mul"
    x[0], x[0] = 1                          -> "Tensor.__getitem__", "Tensor.__setitem__"
    torch.linalg.vector_norm                -> "linalg.vector_norm"
    dist.all_reduce                         -> "distributed.all_reduce"

Python operators reach the mode as the Tensor method torch dispatches them to (``x * 2``
arrives as ``Tensor.mul``), so the name is that method's.

``op_name`` returns None for calls that do no math on tensor values and would only add noise
and overhead: the IGNORED_OPS list below. It is part of the documented behaviour
(docs/capture.md); everything not listed is captured.
"""

from __future__ import annotations

#: Calls the API level never records. Reasons, by group:
#: metadata (no data read): size, dim, stride, numel, shape/dtype/grad/... attribute reads
#: (every attribute read arrives as "__get__"), is_* predicates, data_ptr, storage access;
#: value reads (item, tolist, __bool__, __float__, ...): they copy a value the producing op's
#: record already holds; autograd plumbing (backward, register_hook, retain_grad,
#: requires_grad_, detach): no math, and backward's own work is captured by the hooks;
#: printing and serialisation; profiler markers and grad-mode switches torch issues itself.
IGNORED_OPS = frozenset(
    {
        # attribute access: x.shape, x.grad, x.T, x.device, p.grad = g ...
        "__get__", "__set__", "__delete__",
        # metadata
        "Tensor.size", "Tensor.dim", "Tensor.ndimension", "Tensor.stride", "Tensor.numel",
        "Tensor.nelement", "Tensor.element_size", "Tensor.is_contiguous", "Tensor.data_ptr",
        "Tensor.storage_offset", "Tensor.untyped_storage", "Tensor.storage",
        "Tensor._typed_storage", "Tensor.get_device", "Tensor.is_floating_point",
        "Tensor.is_complex", "Tensor.is_signed", "Tensor.is_inference", "Tensor.is_pinned",
        "Tensor.is_shared", "Tensor.is_set_to", "Tensor.is_coalesced", "Tensor.has_names",
        "Tensor.dim_order", "Tensor._is_view", "Tensor.__len__", "Tensor.__hash__",
        "Tensor.__dir__", "Tensor.__sizeof__", "Tensor._nnz", "Tensor.is_nonzero",
        "torch.is_tensor", "torch.is_storage", "torch.is_complex", "torch.is_floating_point",
        "torch.is_nonzero", "torch.numel", "torch.is_grad_enabled", "torch.result_type",
        "torch.can_cast", "torch.promote_types", "torch.get_default_dtype", "torch.device",
        "torch._set_grad_enabled", "torch.is_inference_mode_enabled",
        # value reads
        "Tensor.item", "Tensor.tolist", "Tensor.numpy", "Tensor.__bool__", "Tensor.__int__",
        "Tensor.__float__", "Tensor.__complex__", "Tensor.__index__", "Tensor.__array__",
        "Tensor.__array_wrap__", "Tensor.__dlpack__", "Tensor.__dlpack_device__",
        "Tensor.__iter__",
        # autograd plumbing
        "Tensor.backward", "Tensor.register_hook", "Tensor.register_post_accumulate_grad_hook",
        "Tensor.retain_grad", "Tensor.requires_grad_", "Tensor.detach", "Tensor.detach_",
        "torch.autograd.backward", "torch.autograd.grad",
        # printing, copying the Python object, serialisation
        "Tensor.__repr__", "Tensor.__str__", "Tensor.__format__", "Tensor.__reduce_ex__",
        "Tensor.__deepcopy__", "Tensor.__setstate__", "Tensor.__getstate__",
        "Tensor.share_memory_", "Tensor.pin_memory",
        # allocations without values: their memory is whatever was there (FSDP2 allocates its
        # all-gather buffers so on every step); what is written into them later is recorded
        "torch.empty", "torch.empty_like", "torch.empty_strided", "Tensor.new_empty",
        "Tensor.new_empty_strided",
        # FSDP2's copy of the local shards into its all-gather buffer: the all-gather that
        # follows records the same values, and the buffer's other ranks' parts are unset
        "ops.fsdp.all_gather_copy_in",
    }
)

#: function __module__ -> name prefix; torch's C modules and their Python façades agree.
_MODULE_PREFIX = {
    "torch": "torch",
    "torch.functional": "torch",
    "torch._C._VariableFunctions": "torch",
    "torch._C": "torch",
    "torch._C._nn": "functional",
    "torch.nn.functional": "functional",
    "torch._C._linalg": "linalg",
    "torch.linalg": "linalg",
    "torch._C._fft": "fft",
    "torch.fft": "fft",
    "torch._C._special": "special",
    "torch.special": "special",
    "torch._C._nested": "nested",
    "torch._C._sparse": "sparse",
    "torch.sparse": "sparse",
    "torch.distributed.distributed_c10d": "distributed",
    "torch.distributed": "distributed",
    "torch.autograd": "torch.autograd",
    "torch.autograd.functional": "torch.autograd",
    "torch._tensor": "Tensor",
}
#: C functions of torch._C._linalg etc. are named "linalg_vector_norm": drop the repeat.
_STRIP = {"linalg": "linalg_", "fft": "fft_", "special": "special_", "nested": "nested_",
          "sparse": "sparse_"}
#: whole modules of internal plumbing torch routes through the mode (profiler markers).
_IGNORED_MODULES = ("torch._ops.profiler", "torch.autograd.profiler", "torch.profiler")

#: op name of each torch callable seen (None: ignored); api_mode reads it first
NAMES: dict = {}
MISSING = object()
#: the slot names of positional inputs and their gradients, made once (input.N, grad_input.N)
INPUT_SLOTS = tuple(f"input.{i}" for i in range(64))
GRAD_INPUT_SLOTS = tuple("grad_" + slot for slot in INPUT_SLOTS)


def input_slot(position: int) -> str:
    """``input.N`` of a call's positional argument N."""
    return INPUT_SLOTS[position] if position < len(INPUT_SLOTS) else f"input.{position}"


def grad_input_slot(position: int) -> str:
    """``grad_input.N``: the gradient slot of a call's positional argument N."""
    return GRAD_INPUT_SLOTS[position] if position < len(GRAD_INPUT_SLOTS) else f"grad_input.{position}"


def op_name(func) -> str | None:
    """Stable name of a torch callable, or None when it is in IGNORED_OPS (cached)."""
    try:
        name = NAMES.get(func, MISSING)
    except TypeError:  # unhashable callable: name it every time
        return _classify(func)
    if name is MISSING:
        name = _classify(func)
        NAMES[func] = name
    return name


def _classify(func) -> str | None:
    name = _raw_name(func)
    if name is None or name in IGNORED_OPS or name.rsplit(".", 1)[-1] in ("__get__", "__set__"):
        return None
    if name.startswith("distributed."):
        from probe.compat import COLLECTIVE_ALIASES  # one name per collective on every torch

        name = COLLECTIVE_ALIASES.get(name, name)
    return name


def _raw_name(func) -> str | None:
    short = getattr(func, "__name__", None) or type(func).__name__
    module = getattr(func, "__module__", None)
    if module is not None and module.startswith(_IGNORED_MODULES):
        return None
    if short in ("__get__", "__set__", "__delete__"):
        return short
    owner = getattr(func, "__objclass__", None)
    if owner is not None and owner.__name__ in ("TensorBase", "Tensor"):
        return f"Tensor.{short}"
    qualname = getattr(func, "__qualname__", "") or ""
    if qualname.startswith(("Tensor.", "TensorBase.")):
        return f"Tensor.{qualname.split('.', 1)[1]}"
    if module is None:
        return f"{type(func).__name__}.{short}"
    prefix = _MODULE_PREFIX.get(module)
    if prefix is None:
        if module.startswith("torch._ops"):
            return f"ops.{func}"  # torch.ops.aten.add.Tensor and friends: str() is the op
        prefix = module[len("torch."):] if module.startswith("torch.") else module
    strip = _STRIP.get(prefix)
    if strip and short.startswith(strip):
        short = short[len(strip):]
    return f"{prefix}.{short}"


class Namer:
    """Per-step counters: call index per (module, op) and the global event sequence."""

    __slots__ = ("counts", "seq")

    def __init__(self) -> None:
        self.counts: dict[tuple[str, str], int] = {}
        self.seq = 0

    def index(self, module: str, op: str) -> int:
        """The next call index of op inside module (0, 1, 2, ... within the step)."""
        key = (module, op)
        index = self.counts.get(key, 0)
        self.counts[key] = index + 1
        return index

    def next_seq(self) -> int:
        seq = self.seq
        self.seq = seq + 1
        return seq

    def reset(self) -> None:
        self.counts.clear()
        self.seq = 0
