"""What compare knows about each op: one spec per op, and the one place op names are spelled.

An op's spec (``spec(op)``) says everything the stages ask of it:

* ``family``: its rounding-envelope family (envelope.py's model: dot product, convolution,
  normalization, ...); None where the model does not know the op (the fixed tolerance then
  judges alone);
* ``form``: which formula of its family the envelope takes (a quotient, a square root, a
  gather, a normalization over channels ...); "" for the family's plain one;
* ``amplifies``: its conditioning can make its output differ far more, relatively, than its
  inputs without an error of its own (a division by values near their own error, a square
  root near 0, a subtraction of nearly equal values, exp of a difference, the optimizer
  updates built on them: Adam's m / (sqrt(v) + eps) is about sign(g) whatever |g|):
  call_rules.py calls such an output "amplified";
* ``sums``: its output sums (SUM) or averages (MEAN) input.0 over many values: a cancelling
  sum is judged against the scale of its summands (call_rules.py), and the envelope weighs each
  value by 1/K for a mean;
* ``lipschitz``: a bound of |f'| of an elementwise function of one argument (GELU's is 1.13);
* ``replay``: how the amplification recheck (rounding.py) recomputes it in float64 from one
  run's recorded inputs, elementwise; None where it is not replayed.

A dump names an op as its call was spelled (``functional.linear``, ``torch._foreach_addcdiv_``,
``Tensor.add_``, a module's class ``LayerNorm``); ``op_name`` is the one normalizer that
turns every spelling into the name the specs are kept under.

Adding an op is a line in ``SPECS``. A new family or form is named here and given its
formula in envelope.py (and, for a float64 replay, a function below). Torch-free.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, replace
from typing import Callable

import numpy as np

# envelope families (envelope.py)
DOT, CONV, NORM, SOFTMAX, SUM, LOSS, ATTENTION, DIVIDE, ELEMENTWISE, COPY, CAST, OPTIMIZER = (
    "dot product", "convolution", "normalization", "softmax", "sum", "loss", "attention", "division",
    "elementwise", "copy", "cast", "optimizer update")

# forms: which formula of its family an op's envelope takes (envelope.py)
#: a normalization over each channel (batch, instance norm), over each sample (group norm)
CHANNELS, SAMPLES = "channels", "samples"
#: a copy that reads a row once per index (its backward sums the gradients of repeated
#: indices), one that repeats each value (its backward sums the copies), a concatenation
GATHER, BROADCAST, CONCAT = "gather", "broadcast", "concat"
#: a / b; a + value * t1 / t2; a + value * t1 * t2; a * b; a^2; a^p; exp; a + w (b - a);
#: a + alpha * b (the second operand weighed by alpha)
QUOTIENT, ADDCDIV, ADDCMUL, PRODUCT, SQUARE, POW, EXP, LERP, SHIFT = (
    "quotient", "addcdiv", "addcmul", "product", "square", "pow", "exp", "lerp", "shift")
#: inverse functions, whose slope grows as their argument nears 0
SQRT, RSQRT, RECIPROCAL, LOG, LOG1P = "sqrt", "rsqrt", "reciprocal", "log", "log1p"

#: what a reduction does with its input's values (OpSpec.sums)
SUMS, MEANS = "sum", "mean"


class NotReplayable(Exception):
    """A recorded call whose inputs do not give a float64 replay (an argument not recorded)."""


class Replay:
    """One run's recorded inputs of a call, as a replay reads them: tensor slots as float64
    arrays, plain-value slots as their recorded text. A slot a replay needs and the call does
    not hold raises NotReplayable."""

    def __init__(self, tensors: dict, values: dict):
        self.tensors, self.values = tensors, values

    @property
    def x(self):
        """input.0, a tensor."""
        return self.tensor("input.0")

    def tensor(self, slot: str):
        if slot not in self.tensors:
            raise NotReplayable(slot)
        return self.tensors[slot]

    def operand(self, slot: str):
        """A tensor, or a number given in its place (x + 2)."""
        if slot in self.tensors:
            return self.tensors[slot]
        return self.number(slot)

    def number(self, *slots: str, default=None):
        """The number recorded in the first of slots the call holds; default when it holds none."""
        for slot in slots:
            if slot in self.values:
                value = self._parsed(slot)
                if not isinstance(value, (int, float)) or isinstance(value, bool):
                    raise NotReplayable(slot)
                return value
        if default is None:
            raise NotReplayable(slots[0])
        return default

    def none(self, slot: str) -> None:
        """The argument is absent or None (division's rounding_mode: not a plain quotient)."""
        if slot in self.values and self._parsed(slot) is not None:
            raise NotReplayable(slot)

    def _parsed(self, slot: str):
        try:
            return json.loads(self.values[slot])
        except (TypeError, ValueError):
            raise NotReplayable(slot) from None


def _add(r: Replay):
    return r.x + r.number("kwarg.alpha", "input.2", default=1) * r.operand("input.1")


def _sub(r: Replay):
    return r.x - r.number("kwarg.alpha", "input.2", default=1) * r.operand("input.1")


def _div(r: Replay):
    r.none("kwarg.rounding_mode")
    return r.x / r.operand("input.1")


def _lerp(r: Replay):
    x = r.x
    return x + r.operand("input.2") * (r.operand("input.1") - x)


def _addcdiv(r: Replay):
    return r.x + r.number("kwarg.value", "input.3", default=1) * (r.tensor("input.1") / r.tensor("input.2"))


def _addcmul(r: Replay):
    return r.x + r.number("kwarg.value", "input.3", default=1) * (r.tensor("input.1") * r.tensor("input.2"))


@dataclass(frozen=True)
class OpSpec:
    """What compare knows about one op (the module docstring)."""

    family: str | None = None
    form: str = ""
    amplifies: bool = False
    #: its backward computes the derivative from the saved output by a cancellation (tanh's
    #: 1 - y^2, sigmoid's y (1 - y)): near saturation it amplifies what the output differs by
    backward_amplifies: bool = False
    sums: str = ""
    lipschitz: float = 1.0
    replay: Callable[[Replay], object] | None = None
    #: this spelling writes into its first argument (Tensor.add_, torch._foreach_lerp_)
    in_place: bool = False


def _specs(family: str | None, names: str, **spec) -> dict[str, OpSpec]:
    return {name: OpSpec(family, **spec) for name in names.split()}


#: op name (op_name) -> its spec
SPECS: dict[str, OpSpec] = {
    **_specs(DOT, "linear matmul mm bmm addmm baddbmm addbmm addmv mv dot vdot einsum inner outer bilinear Linear"),
    **_specs(CONV, "conv1d conv2d conv3d conv_transpose1d conv_transpose2d conv_transpose3d "
                   "Conv1d Conv2d Conv3d ConvTranspose1d ConvTranspose2d ConvTranspose3d"),
    **_specs(NORM, "layer_norm rms_norm normalize", amplifies=True),
    **_specs(NORM, "batch_norm instance_norm", form=CHANNELS, amplifies=True),
    **_specs(NORM, "group_norm", form=SAMPLES, amplifies=True),
    **_specs(SOFTMAX, "softmax log_softmax Softmax LogSoftmax", amplifies=True),
    **_specs(SOFTMAX, "logsumexp"),
    **_specs(SUM, "sum nansum", sums=SUMS),
    **_specs(SUM, "mean nanmean", sums=MEANS),
    **_specs(SUM, "cumsum"),
    **_specs(LOSS, "cross_entropy nll_loss mse_loss l1_loss smooth_l1_loss binary_cross_entropy "
                   "binary_cross_entropy_with_logits kl_div CrossEntropyLoss MSELoss NLLLoss L1Loss"),
    **_specs(ATTENTION, "scaled_dot_product_attention"),
    "div": OpSpec(DIVIDE, QUOTIENT, amplifies=True, replay=_div),
    **_specs(DIVIDE, "divide", form=QUOTIENT, amplifies=True),
    "addcdiv": OpSpec(DIVIDE, ADDCDIV, amplifies=True, replay=_addcdiv),
    "sqrt": OpSpec(DIVIDE, SQRT, amplifies=True, replay=lambda r: np.sqrt(r.x)),
    "rsqrt": OpSpec(DIVIDE, RSQRT, amplifies=True, replay=lambda r: 1 / np.sqrt(r.x)),
    "reciprocal": OpSpec(DIVIDE, RECIPROCAL, amplifies=True, replay=lambda r: 1 / r.x),
    "log": OpSpec(DIVIDE, LOG, amplifies=True),
    "log1p": OpSpec(DIVIDE, LOG1P, amplifies=True),
    "add": OpSpec(ELEMENTWISE, SHIFT, replay=_add),
    "sub": OpSpec(ELEMENTWISE, SHIFT, amplifies=True, replay=_sub),
    "rsub": OpSpec(ELEMENTWISE, SHIFT, amplifies=True),
    "mul": OpSpec(ELEMENTWISE, PRODUCT, replay=lambda r: r.x * r.operand("input.1")),
    "addcmul": OpSpec(ELEMENTWISE, ADDCMUL, replay=_addcmul),
    "square": OpSpec(ELEMENTWISE, SQUARE),
    "pow": OpSpec(ELEMENTWISE, POW, amplifies=True),
    "exp": OpSpec(ELEMENTWISE, EXP, amplifies=True, replay=lambda r: np.exp(r.x)),
    "lerp": OpSpec(ELEMENTWISE, LERP, amplifies=True, replay=_lerp),  # a + w (b - a): b - a cancels
    "neg": OpSpec(ELEMENTWISE, replay=lambda r: np.negative(r.x)),
    "abs": OpSpec(ELEMENTWISE, replay=lambda r: np.abs(r.x)),
    **_specs(ELEMENTWISE, "relu clamp clamp_min clamp_max where masked_fill maximum minimum relu6 leaky_relu "
                          "hardtanh sign ReLU Identity dropout Dropout elu softplus sin cos"),
    **_specs(ELEMENTWISE, "tanh Tanh", backward_amplifies=True),
    **_specs(ELEMENTWISE, "gelu GELU erf", lipschitz=1.13),
    **_specs(ELEMENTWISE, "silu SiLU mish", lipschitz=1.1),
    **_specs(ELEMENTWISE, "sigmoid Sigmoid", lipschitz=0.25, backward_amplifies=True),
    **_specs(COPY, "view reshape transpose permute contiguous clone split chunk getitem __getitem__ squeeze "
                   "unsqueeze flatten unflatten t narrow select detach copy flip roll unbind view_as reshape_as "
                   "movedim swapaxes tril triu zero fill zeros_like ones_like"),
    **_specs(COPY, "embedding Embedding index_select gather", form=GATHER),
    **_specs(COPY, "expand expand_as repeat repeat_interleave", form=BROADCAST),
    **_specs(COPY, "cat concat stack", form=CONCAT),
    **_specs(CAST, "to float half bfloat16 double type type_as"),
    **_specs(OPTIMIZER, "adam adamw sgd fused_adam fused_adamw fused_sgd", amplifies=True),
    # no envelope (the fixed tolerance judges alone), but a conditioning that amplifies
    **_specs(None, "exp2 expm1 var std var_mean std_mean atan2 tan", amplifies=True),
}

#: other spellings of one op: a foreach op runs its per-tensor op under another name
#: (``_foreach_norm`` runs ``vector_norm``), and torch has aliases
ALIASES = {"vector_norm": "norm", "true_divide": "div", "multiply": "mul", "subtract": "sub"}
UNKNOWN = OpSpec()

FOREACH_PREFIX = "torch._foreach_"
FUSED_PREFIX = "torch._fused_"
#: calls that only move a tensor between devices (or pin it): their output equals their input
MOVE_OPS = ("Tensor.cuda", "Tensor.cpu", "Tensor.npu", "Tensor.xpu", "Tensor.mps", "Tensor.pin_memory")
#: the collective FSDP2 reduces gradients with, as the API level names it on every torch
REDUCE_SCATTER = "distributed.reduce_scatter_single"
#: the ops of collectives (torch.distributed's and the functional ones tensor parallel calls)
COLLECTIVE_PREFIXES = ("distributed.", "ops._c10d_functional.")
#: collectives that gather, reduce or scatter a tensor, by the last part of their recorded
#: name (distributed.all_gather_single, ops._c10d_functional.all_gather_into_tensor.default)
_GATHERS = ("all_gather", "all_reduce", "reduce_scatter", "broadcast", "all_to_all", "scatter", "gather", "reduce")
#: batch_norm(input, running_mean, running_var, weight, bias, training, ...): the slots that say
#: it runs in training mode, and the running statistics that mode only updates, never reads
BATCH_NORM_TRAINING = ("kwarg.training", "input.5")
RUNNING_STATISTICS = frozenset({"input.1", "input.2", "kwarg.running_mean", "kwarg.running_var"})


@functools.lru_cache(maxsize=4096)
def op_name(op: str) -> str:
    """The name an op's spec is kept under, whatever its spelling: functional.linear -> linear,
    torch._foreach_addcdiv_ -> addcdiv, torch._fused_adam_ -> adam, Tensor.add_ -> add,
    torch.linalg.vector_norm -> norm; a module's class name stays itself."""
    name = op.rsplit(".", 1)[-1]
    if name in SPECS:
        return name
    name = name.removeprefix("_foreach_").removeprefix("_fused_")
    if name not in SPECS:
        name = name.strip("_")
    return ALIASES.get(name, name)


@functools.lru_cache(maxsize=4096)
def spec(op: str) -> OpSpec:
    """The spec of an op as this spelling calls it (UNKNOWN where compare knows nothing of it)."""
    found = _named_spec(op_name(op))
    return replace(found, in_place=True) if is_in_place(op) else found


def _named_spec(name: str) -> OpSpec:
    """Module classes ending in Norm (LayerNorm, LlamaRMSNorm, BatchNorm2d) are normalizations,
    those ending in Softmax amplify; a fused_ op of a known family is an optimizer update."""
    found = SPECS.get(name)
    if found is not None:
        return found
    lowered = name.lower().rstrip("123d")
    if lowered.endswith("norm"):
        return OpSpec(NORM, CHANNELS if lowered.startswith(("batchnorm", "instancenorm")) else "", amplifies=True)
    if lowered.endswith("softmax"):
        return OpSpec(amplifies=True)
    fused = SPECS.get(name.removeprefix("fused_")) if name.startswith("fused_") else None
    if fused is not None:
        return OpSpec(OPTIMIZER if fused.family is not None else None, amplifies=fused.amplifies)
    return UNKNOWN


def is_foreach(op: str) -> bool:
    return op.startswith((FOREACH_PREFIX, FUSED_PREFIX))


def is_fused(op: str) -> bool:
    return op.startswith(FUSED_PREFIX)


def is_in_place(op: str) -> bool:
    """Tensor.add_, torch._foreach_lerp_: the op writes into its first argument."""
    name = op.rsplit(".", 1)[-1]
    return name.endswith("_") and not name.startswith("__") and not op.startswith("distributed.")


def is_collective_op(op: str) -> bool:
    """An op of a collective (an all-gather, a reduce-scatter, a barrier)."""
    return op.startswith(COLLECTIVE_PREFIXES)


def is_gathering_collective(op: str) -> bool:
    """A collective that gathers, reduces or scatters a tensor across ranks."""
    parts = op.split(".")
    name = parts[-2] if parts[-1] == "default" and len(parts) > 1 else parts[-1]
    return (op.startswith("distributed.") or "c10d" in op) and name.startswith(_GATHERS)


def is_batch_norm(op: str) -> bool:
    """A batch norm call (functional or torch's), whose training mode reads no running statistics."""
    return op.endswith("batch_norm")
