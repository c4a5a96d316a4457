"""Recorded op name -> the torch callable that replays it, or why it cannot be replayed.

The names are capture's (probe.capture.eager.naming): ``functional.gelu`` -> torch.nn.functional.gelu,
``torch.conv2d`` -> torch.conv2d, ``linalg.vector_norm`` -> torch.linalg.vector_norm,
``Tensor.add`` -> torch.Tensor.add (called with the tensor as first argument), ``ops.aten.mm.default``
-> torch.ops.aten.mm.default. An in-place op (``Tensor.add_``, ``Tensor.__iadd__``) replays out of
place (``Tensor.add``): replay never writes into the tensors it compares with.

Not replayable, with the reason reports show: random ops (their output is a draw, not a function
of the inputs), collectives (they need the other ranks), and names torch does not have.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from probe import compat

#: ops whose output is a random draw: replaying them says nothing about the recorded kernel
RANDOM_OPS = frozenset({
    "torch.rand", "torch.rand_like", "torch.randn", "torch.randn_like", "torch.randint",
    "torch.randint_like", "torch.randperm", "torch.normal", "torch.poisson", "torch.bernoulli",
    "torch.multinomial", "torch.dropout_", "torch.native_dropout",
    "torch.rrelu", "torch.rrelu_", "functional.rrelu", "functional.rrelu_", "functional.gumbel_softmax",
    "Tensor.random_", "Tensor.uniform_", "Tensor.normal_", "Tensor.bernoulli", "Tensor.bernoulli_",
    "Tensor.exponential_", "Tensor.geometric_", "Tensor.log_normal_", "Tensor.cauchy_",
    "Tensor.multinomial",
})
#: ops that draw random numbers only with a dropout probability > 0 (and, where they take one,
#: training=True): op -> ((name, position, default) of the probability, of the training flag)
_DROPOUT = (("p", 1, 0.5), ("training", 2, True))
CONDITIONALLY_RANDOM = {
    "functional.dropout": _DROPOUT, "functional.dropout1d": _DROPOUT, "functional.dropout2d": _DROPOUT,
    "functional.dropout3d": _DROPOUT, "functional.alpha_dropout": _DROPOUT,
    "functional.feature_alpha_dropout": _DROPOUT,
    "torch.dropout": (("p", 1, 0.5), ("train", 2, True)),
    "torch.alpha_dropout": (("p", 1, 0.5), ("train", 2, True)),
    "torch.feature_dropout": (("p", 1, 0.5), ("train", 2, True)),
    "torch.feature_alpha_dropout": (("p", 1, 0.5), ("train", 2, True)),
    "functional.scaled_dot_product_attention": (("dropout_p", 4, 0.0), None),
    "functional.multi_head_attention_forward": (("dropout_p", 10, 0.0), ("training", 13, True)),
}

#: module classes whose forward is a random draw in training
RANDOM_MODULES = frozenset({"Dropout", "Dropout1d", "Dropout2d", "Dropout3d", "AlphaDropout",
                            "FeatureAlphaDropout", "RReLU"})

#: dtype conversions: in float64 every one of them is the identity, so it replays as .double()
CASTS = frozenset({"Tensor.float", "Tensor.half", "Tensor.bfloat16", "Tensor.double"})

_NAMESPACES = {
    "torch": (torch,),
    "functional": (F, compat.C_NN),
    "linalg": (torch.linalg,),
    "fft": (torch.fft,),
    "special": (torch.special,),
    "sparse": (torch.sparse,),
    "Tensor": (torch.Tensor,),
}

#: module classes replay can rebuild from the dump: their computation is fixed by their
#: parameters (recorded as param.<name>) and their inputs. Others need constructor arguments
#: (a Conv2d's stride and padding) that no record holds.
MODULES = {
    "Linear": lambda inputs, params: F.linear(inputs[0], params["weight"], params.get("bias")),
    "Bilinear": lambda inputs, params: F.bilinear(inputs[0], inputs[1], params["weight"], params.get("bias")),
    "Identity": lambda inputs, params: inputs[0],
    "ReLU": lambda inputs, params: torch.relu(inputs[0]),
    "Tanh": lambda inputs, params: torch.tanh(inputs[0]),
    "Sigmoid": lambda inputs, params: torch.sigmoid(inputs[0]),
    "SiLU": lambda inputs, params: F.silu(inputs[0]),
    "Mish": lambda inputs, params: F.mish(inputs[0]),
}


class NotReplayable(Exception):
    """The call cannot be replayed; str() is the reason reports show."""


@functools.lru_cache(maxsize=None)
def resolve(op: str):
    """The callable replaying op (in-place ops out of place); NotReplayable with the reason."""
    if op in RANDOM_OPS:
        raise NotReplayable(f"random op: {op}'s output is a random draw, not a function of its inputs")
    if op.startswith("distributed."):
        raise NotReplayable(f"collective: {op} needs the other ranks")
    if op in CASTS:
        return torch.Tensor.double
    if op.startswith("ops."):
        return _torch_op(op)
    prefix, _, name = op.partition(".")
    spaces = _NAMESPACES.get(prefix)
    if spaces is None or not name:
        raise NotReplayable(f"unknown function: probe does not know how to call {op!r}")
    for space in spaces:
        if is_in_place(op):
            name = _out_of_place(space, name)
        function = getattr(space, name, None)
        if callable(function):
            return function
    raise NotReplayable(f"unknown function: torch {torch.__version__} has no {op}")


def check_random(op: str, args, kwargs) -> None:
    """NotReplayable when this call of a conditionally random op drew random numbers
    (F.dropout in training with p > 0; eval-mode or p=0 dropout replays as the identity)."""
    spec = CONDITIONALLY_RANDOM.get(op)
    if spec is None:
        return
    (p_name, p_at, p_default), flag = spec
    p = _argument(args, kwargs, p_name, p_at, p_default)
    training = True if flag is None else _argument(args, kwargs, *flag)
    if training and isinstance(p, (int, float)) and p > 0:
        raise NotReplayable(f"random op: {op} with {p_name}={p:g} drops a random draw of elements")


def _argument(args, kwargs, name, position, default):
    if name in kwargs:
        return kwargs[name]
    return args[position] if len(args) > position else default


def is_in_place(op: str) -> bool:
    name = op.rpartition(".")[2]
    return (name.endswith("_") and not name.endswith("__")) or name.startswith("__i")


def _out_of_place(space, name: str) -> str:
    if name.startswith("__i") and name.endswith("__") and hasattr(space, "__" + name[3:]):
        return "__" + name[3:]  # __iadd__ -> __add__
    if name.endswith("_") and not name.endswith("__") and hasattr(space, name[:-1]):
        return name[:-1]  # add_ -> add, torch._foreach_mul_ -> torch._foreach_mul
    return name


def _torch_op(op: str):
    target = torch.ops
    for part in op.split(".")[1:]:
        target = getattr(target, part, None)
        if target is None:
            raise NotReplayable(f"unknown function: torch {torch.__version__} has no {op}")
    if not callable(target):
        raise NotReplayable(f"unknown function: {op} is not callable")
    name = op.split(".")
    if len(name) > 2 and is_in_place(".".join(name[:3])):
        raise NotReplayable(f"in-place torch op {op}: replay calls only out-of-place ops")
    return target
