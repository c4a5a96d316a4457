"""msprobe's record names and argument descriptions, read as probe's (module, op, slot, value).

Record names (dump.json's ``data`` keys)::

    Functional.linear.0.forward           an API call: prefix, API name, counter, phase
    Tensor.__add__.3.backward             (the counter counts that API's calls in the step)
    Module.blocks.0.fc.Linear.forward.0   a module call: path, class, phase, counter
    Module.fc.Linear.parameters_grad.0    the gradients of that module's parameters

API names become probe's op names: ``Functional.linear`` -> ``functional.linear``,
``Torch.matmul`` -> ``torch.matmul``, ``Distributed.all_reduce`` -> ``distributed.all_reduce``;
a functional that is torch's own function is named as such (``Functional.conv2d`` ->
``torch.conv2d``: ``F.conv2d is torch.conv2d``); a Tensor operator is named by the method torch
dispatches it to, as probe's capture sees it (``Tensor.__add__`` -> ``Tensor.add``,
``Tensor.__rmul__`` -> ``Tensor.mul``). A name this
table does not know keeps msprobe's spelling: its calls then pair only with msprobe's.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

FORWARD, BACKWARD = "forward", "backward"
PARAMS_GRAD = "parameters_grad"
MODULE_PREFIXES = ("Module", "Cell")

_NAMESPACES = {
    "Functional": "functional", "Torch": "torch", "Tensor": "Tensor", "Distributed": "distributed",
    "Aten": "aten", "NPU": "torch_npu", "VF": "VF", "MindSpeed": "mindspeed",
}
#: Tensor operators -> the method probe records (torch dispatches x + y to Tensor.add, ...)
_TENSOR_OPERATORS = {
    "__add__": "add", "__radd__": "add", "__iadd__": "add_", "__sub__": "sub", "__isub__": "sub_",
    "__mul__": "mul", "__rmul__": "mul", "__imul__": "mul_", "__truediv__": "div", "__itruediv__": "div_",
    "__rtruediv__": "__rdiv__", "__matmul__": "matmul", "__pow__": "pow", "__ipow__": "pow_",
    "__mod__": "remainder", "__gt__": "gt", "__lt__": "lt", "__ge__": "ge", "__le__": "le",
    "__neg__": "neg", "__abs__": "abs",
}
#: torch.nn.functional names that are torch's own functions (F.conv2d is torch.conv2d): probe
#: names them torch.*, as the function torch hands its function mode
_FUNCTIONAL_IS_TORCH = frozenset({
    "adaptive_avg_pool1d", "avg_pool1d", "bilinear", "celu_", "channel_shuffle", "conv1d", "conv2d", "conv3d",
    "conv_tbc", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d", "cosine_similarity", "hardshrink",
    "native_channel_shuffle", "pairwise_distance", "pdist", "pixel_shuffle", "pixel_unshuffle", "prelu",
    "relu_", "rrelu_", "selu_", "threshold_",
})


@dataclass(frozen=True)
class Name:
    """One record name, parsed. kind: "api", "module" or "param_grad"; op: probe's op name
    (the class name for modules); path: a module's dotted path ("" for API calls)."""

    kind: str
    op: str
    path: str
    count: int
    phase: str
    api: str = ""  # msprobe's own "Prefix.api" for API calls (its counter's name)

    def forward_name(self) -> str:
        """The msprobe name of the forward call a backward record belongs to."""
        if self.kind == "api":
            return f"{self.api}.{self.count}.{FORWARD}"
        return f"Module.{self.path}.{self.op}.{FORWARD}.{self.count}" if self.path else ""


def parse(name: str) -> Name | None:
    """The parsed name, or None for a name that is neither an API nor a module record."""
    parts = name.split(".")
    if len(parts) < 4:
        return None
    if parts[0] in MODULE_PREFIXES:
        if not parts[-1].isdigit() or parts[-2] not in (FORWARD, BACKWARD, PARAMS_GRAD) or len(parts) < 5:
            return None
        kind = "param_grad" if parts[-2] == PARAMS_GRAD else "module"
        phase = FORWARD if parts[-2] == FORWARD else BACKWARD
        return Name(kind, parts[-3], ".".join(parts[1:-3]), int(parts[-1]), phase)
    if parts[-1] not in (FORWARD, BACKWARD) or not parts[-2].isdigit():
        return None
    prefix, api = parts[0], ".".join(parts[1:-2])
    if prefix == "Tensor":
        api = _TENSOR_OPERATORS.get(api, api)
    namespace = "torch" if prefix == "Functional" and api in _FUNCTIONAL_IS_TORCH else \
        _NAMESPACES.get(prefix, prefix.lower())
    op = f"{namespace}.{api}"
    return Name("api", op, "", int(parts[-2]), parts[-1], api=".".join(parts[:-2]))


def module_path(record_name) -> str:
    """The module path of a construct.json parent ("Module.blocks.0.Block.forward.0" ->
    "blocks.0"); "" for none, the optimizer, or a name that is not a module's."""
    if isinstance(record_name, list):  # Megatron's [parent, micro step]
        record_name = record_name[0] if record_name else None
    if not isinstance(record_name, str):
        return ""
    parsed = parse(record_name)
    return parsed.path if parsed is not None and parsed.kind == "module" else ""


def is_tensor(leaf: dict) -> bool:
    return "dtype" in leaf and "shape" in leaf


def dtype_name(text) -> str:
    """torch.float32 -> float32 (probe's dtype names); numpy's names are already those."""
    return str(text).removeprefix("torch.")


def number(value) -> float:
    """A statistic as float64; null (unknown), text and other types -> NaN."""
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)):
        return float(value)
    return math.nan


def _json(value) -> str:
    if isinstance(value, float) and not math.isfinite(value):
        value = "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")  # as probe writes them
    return json.dumps(value)


def value_of(leaf: dict) -> tuple[str, str] | None:
    """(probe's value text, value_type) of a non-tensor argument, or None when msprobe could
    not describe it (an empty dict)."""
    kind = leaf.get("type")
    value = leaf.get("value")
    if kind is None:
        return None
    if kind == "slice":
        start, stop, step = (list(value) + [None, None, None])[:3] if isinstance(value, list) else (None,) * 3
        return f"slice({start}, {stop}, {step})", "slice"
    if kind == "ellipsis":
        return _json("..."), "ellipsis"
    if kind == "torch.dtype":
        return _json(dtype_name(value)), "dtype"
    if kind == "torch.device":
        return _json(str(value)), "device"
    if kind == "torch.memory_format":
        return _json(f"torch.{leaf.get('format')}"), "memory_format"
    if kind == "torch.distributed.ReduceOp":
        return _json(value), "reduce_op"
    if kind == "torch.ProcessGroup":
        return _json(leaf.get("group_ranks")), "process_group"
    if "value" not in leaf:
        return None
    return _json(value), ""
