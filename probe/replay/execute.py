"""Replay one recorded call of one side in float64 and measure that side's own error.

error_X = ||out_X - f64(X's inputs)|| / ||f64(X's inputs)||: the recorded output against the
float64 result of the same function on the same (widened) inputs and arguments. ulps: that
error over the machine epsilon of the output's dtype, so a correctly rounded result scores
at most 0.5 whatever its dtype. Several outputs (a tuple, or a backward's gradients): the
worst one, by how far it is beyond rounding (below).

What rounding explains depends on the op's conditioning: a reduction whose terms cancel (the
bias gradient of a convolution followed by BatchNorm sums to almost nothing) is far off in
relative terms on every correct kernel. So each call is replayed three times: on the exact
inputs in float64 (the truth); on the inputs moved at random by the unit roundoff of the
output's dtype (each element times 1 +- u, a fixed draw), in float64; and with torch's own CPU
kernel in the recorded dtypes (what a correct kernel in that dtype gives, when the CPU has it).
How far the last two land from the truth (``noise``, the larger) is the error rounding alone
explains; ``excess`` = error / max(noise, eps) is how many times beyond it the side's own error
is (a correctly rounded elementwise op: <= 1).

Forward: the call's function on its ``input.*``/``kwarg.*`` records. Backward: the forward
call again, in float64 on the forward's dumped inputs with the inputs that got a gradient
marked as requiring grad, then ``torch.autograd.grad`` of its outputs with the dumped
``grad_output.*``; the results are compared with the dumped ``grad_input.*``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from probe.capture import bound_values
from probe.replay import ops
from probe.replay.calls import Call, StepSource, epsilon, is_checked, is_float, rebuild_arguments, to_float64_dtype
from probe.replay.ops import NotReplayable

Tensor = torch.Tensor


@dataclass
class SideResult:
    """One side's replay of one call."""

    error: float  # rel L2 of the worst output against its float64 truth
    ulp: float  # error in machine epsilons of that output's dtype
    noise: float  # rel L2 that rounding the inputs at that dtype's unit roundoff causes
    excess: float  # error / max(noise, eps): how many times beyond rounding
    dtype: str  # the output's dtype, or the coarser one its computation ran in (ulps are of it)
    slot: str  # the worst output's slot
    outputs: dict = field(default_factory=dict)  # slot -> recorded output (float64), to compare A with B
    inputs: dict = field(default_factory=dict)  # slot -> recorded float input (float64)
    arguments: dict | None = None  # name -> value of the call's non-tensor arguments, defaults bound
    bytes_read: int = 0


def replay_call(source: StepSource, prefix: str, kind: str, op: str, phase: str) -> SideResult:
    """Replay the call with key prefix on this side; NotReplayable says why it cannot be."""
    call = source.call(prefix)
    if call is None:
        raise NotReplayable(f"no saved inputs: {source.path} has no records of {prefix.rstrip('/')}")
    before = source.bytes_read
    if kind == "param":
        raise NotReplayable("a parameter record: its gradient is the sum over the whole backward, not one call")
    if kind == "module":
        result = _module_call(source, call, op, phase)
    elif phase == "backward":
        forward = source.call(prefix[: -len("backward/")] + "forward/")
        if forward is None:
            raise NotReplayable(f"no saved inputs: the forward of {prefix.rstrip('/')} was not recorded")
        result = _backward_call(source, forward, call, op)
    else:
        result = _forward_call(source, call, op)
    result.bytes_read = source.bytes_read - before
    return result


# ---------------------------------------------------------------------------- forward

def _forward_call(source: StepSource, call: Call, op: str) -> SideResult:
    function = ops.resolve(op)
    inputs: dict = {}
    load = _loader(source, inputs)

    def truth(variant):
        args, kwargs = rebuild_arguments(call, _variant(load, variant))
        ops.check_random(op, args, kwargs)
        with torch.no_grad():
            return _output_slots(_run(function, op, args, _for_replay(kwargs)))

    result = _measure(source, call, "output", truth, inputs)
    result.arguments = _arguments(function, call, load)
    return result


def _arguments(function, call: Call, load) -> dict | None:
    """The call's non-tensor arguments by name, its signature's defaults filled in (None
    when the signature is unknown): what the two sides computed with."""
    args, kwargs = rebuild_arguments(call, load)
    return bound_values(function, args, kwargs)


def _run(function, op, args, kwargs):
    if op == "Tensor.__setitem__":  # x[i] = v, replayed on a copy
        target = args[0].clone()
        target.__setitem__(*args[1:], **kwargs)
        return target
    try:
        return function(*args, **kwargs)
    except (RuntimeError, TypeError, ValueError, IndexError) as error:
        raise NotReplayable(f"calling {op} on the dumped arguments failed: {str(error).splitlines()[0][:200]}") from None


def _for_replay(kwargs: dict) -> dict:
    kwargs = {name: value for name, value in kwargs.items() if name != "out"}
    if kwargs.get("inplace") is True:
        kwargs["inplace"] = False
    return kwargs


def _loader(source: StepSource, inputs: dict):
    """record -> its tensor (float64 where floating) or value; tensors read once, the floating
    ones kept in inputs (slot -> tensor) to compare the sides' inputs."""
    cache: dict = {}

    def load(record):
        if record.is_tensor:
            tensor = cache.get(record.slot)
            if tensor is None:
                tensor = cache[record.slot] = source.tensor(record)
                if tensor.is_floating_point():
                    inputs[record.slot] = tensor
            return tensor
        return source.value(record)

    return load


#: the variant of a replay that runs torch's CPU kernel in the recorded dtypes
NATIVE = "native"


def _variant(load, variant):
    """load for one replay: None = exact float64 copies, NATIVE = the recorded dtypes, or a
    nudge function moving each floating tensor (float64)."""
    def loaded(record):
        value = load(record)
        if isinstance(value, Tensor):
            if not value.is_floating_point():
                return value.clone()
            if variant == NATIVE:
                return value.to(getattr(torch, record.dtype), copy=True)  # in-place ops write copies
            return variant(value) if variant is not None else value.clone()
        return value if variant == NATIVE else to_float64_dtype(value)

    return loaded


def _nudge(unit: float):
    """Each element times 1 +- unit, the signs a fixed draw per shape (the same on both sides,
    in every run)."""
    def nudge(tensor: Tensor) -> Tensor:
        return tensor * (1 + unit * _signs(tuple(tensor.shape)))

    return nudge


_SIGNS: dict = {}


def _signs(shape: tuple) -> Tensor:
    signs = _SIGNS.get(shape)
    if signs is None:
        generator = torch.Generator().manual_seed(12345)
        signs = torch.randint(0, 2, shape, generator=generator, dtype=torch.float64) * 2 - 1
        if len(_SIGNS) >= 64:
            _SIGNS.clear()
        _SIGNS[shape] = signs
    return signs


def _output_slots(result, name: str = "output") -> dict:
    if isinstance(result, Tensor):
        return {f"{name}.0": result}
    from probe.capture import flatten  # capture's walk names the slots the same way

    return {slot: leaf for slot, leaf in flatten(result, name, []) if isinstance(leaf, Tensor)}


# ---------------------------------------------------------------------------- backward

def _backward_call(source: StepSource, forward: Call, backward: Call, op: str) -> SideResult:
    function = ops.resolve(op)
    wanted = {}  # forward slot -> grad_input slot
    for slot, record in backward.records.items():
        if slot.startswith("grad_input.") and record.io == "out" and is_float(record.dtype):
            rest = slot[len("grad_input."):]
            wanted[("input." if rest.split(".")[0].isdigit() else "kwarg.") + rest] = slot
    if not wanted:
        raise NotReplayable("no saved outputs: the backward record holds no grad_input to check")
    inputs: dict = {}
    load = _loader(source, inputs)
    grads_in = {slot: record for slot, record in backward.records.items()
                if slot.startswith("grad_output.") and record.io == "in" and record.is_tensor}
    for record in grads_in.values():
        load(record)

    def truth(variant):
        leaves: dict = {}

        def leaf(slot, value):
            if slot in wanted and isinstance(value, Tensor) and value.is_floating_point():
                value = value.detach().requires_grad_(True)
                leaves[slot] = value
            return value

        loaded = _variant(load, variant)
        args, kwargs = rebuild_arguments(forward, loaded, leaf)
        ops.check_random(op, args, kwargs)
        with torch.enable_grad():
            produced = _output_slots(_run(function, op, args, _for_replay(kwargs)))
        outputs, grad_outputs = [], []
        for slot, record in grads_in.items():
            out = produced.get(slot[len("grad_"):])
            if out is None or not out.requires_grad:
                continue
            outputs.append(out)
            grad_outputs.append(loaded(record).to(out.dtype))
        if not outputs:
            raise NotReplayable("no saved inputs: the backward record holds no grad_output that replay reproduces")
        slots = [slot for slot in wanted if slot in leaves]
        try:
            grads = torch.autograd.grad(outputs, [leaves[slot] for slot in slots], grad_outputs, allow_unused=True)
        except RuntimeError as error:
            raise NotReplayable(f"autograd through {op} failed: {str(error).splitlines()[0][:200]}") from None
        return {wanted[slot]: (grad if grad is not None else torch.zeros_like(leaves[slot]))
                for slot, grad in zip(slots, grads)}

    # a backward runs in the precision its forward ran in (autocast: bfloat16 saved inputs),
    # whatever dtype the gradients it sends back are cast to
    ran_in = [record.dtype for slot, record in forward.records.items()
              if slot.startswith("output") and record.io == "out" and is_float(record.dtype)]
    result = _measure(source, backward, "grad_input", truth, inputs, ran_in)
    result.arguments = _arguments(function, forward, load)
    return result


# ---------------------------------------------------------------------------- module level

def _module_call(source: StepSource, call: Call, op: str, phase: str) -> SideResult:
    if phase == "backward":
        raise NotReplayable("module-level backward: its grad_input is summed over every use of the input; "
                            "replay the api-level calls inside it (level 'mix')")
    if op in ops.RANDOM_MODULES:
        raise NotReplayable(f"random op: module {op} draws random numbers")
    build = ops.MODULES.get(op)
    if build is None:
        raise NotReplayable(f"module {op}: its constructor arguments are not in the dump; "
                            "replay the api-level calls inside it (level 'mix' or 'api')")
    inputs: dict = {}
    base = _loader(source, inputs)

    def truth(variant):
        load = _variant(base, variant)
        params = {slot[len("param."):]: load(record) for slot, record in call.records.items()
                  if slot.startswith("param.")}
        positional = {}
        for slot, record in call.records.items():
            if slot.startswith("input.") and slot.count(".") == 1:
                positional[int(slot.split(".")[1])] = load(record)
        try:
            with torch.no_grad():
                return _output_slots(build([positional[i] for i in range(len(positional))], params))
        except (KeyError, RuntimeError, TypeError) as error:
            raise NotReplayable(f"module {op} could not be rebuilt from the dump: {error}") from None

    return _measure(source, call, "output", truth, inputs)


# ---------------------------------------------------------------------------- errors

def _measure(source: StepSource, call: Call, head: str, truth, inputs: dict, ran_in=()) -> SideResult:
    """Each recorded output against truth(None) (exact inputs), with the noise level from
    truth(nudge) (inputs moved by the unit roundoff of the outputs' dtype) and truth(NATIVE).

    ran_in: dtypes the call also computed in (a backward: its forward's outputs); errors are
    counted in ulps of the coarsest of those and the output's own dtype (the side's dtype)."""
    records = [(slot, record) for slot, record in call.records.items()
               if slot.split(".", 1)[0] == head and record.io == "out" and is_checked(record.dtype)]
    if not records:
        raise NotReplayable(f"no {head} recorded to check (no stored tensor of a number dtype)")
    coarsest = max(ran_in, key=epsilon, default=None)
    exact = truth(None)
    floats = [record.dtype for _, record in records if is_float(record.dtype)] + list(ran_in)
    eps = max((epsilon(name) for name in floats), default=2.0 ** -52)
    nudged = truth(_nudge(eps / 2))
    try:
        native = truth(NATIVE)
    except NotReplayable:  # no CPU kernel for these dtypes (float8 matmul, ...): nudge only
        native = {}
    worst = None
    outputs = {}
    for slot, record in records:
        expected = exact.get(slot)
        if expected is None:
            raise NotReplayable(f"replay produced no {slot}")
        recorded = source.tensor(record)
        if tuple(recorded.shape) != tuple(expected.shape):
            raise NotReplayable(f"replay's {slot} has shape {list(expected.shape)}, the dump's {list(recorded.shape)}")
        outputs[slot] = recorded
        expected = expected.detach().to(torch.float64)
        error = rel_error(recorded, expected)
        dtype = record.dtype
        if coarsest is not None and is_float(dtype) and epsilon(coarsest) > epsilon(dtype):
            dtype = coarsest
        slot_eps = epsilon(dtype)
        noise = rel_error(nudged[slot].detach().to(torch.float64), expected) if slot in nudged else 0.0
        if slot in native and tuple(native[slot].shape) == tuple(expected.shape):
            kernel = native[slot].detach().to(_torch_dtype(record.dtype)).to(torch.float64)
            noise = max(noise, rel_error(kernel, expected))
        excess = error / max(noise, slot_eps) if not math.isnan(error) else math.inf
        if worst is None or excess > worst.excess:
            worst = SideResult(error, error / slot_eps, noise, excess, dtype, slot)
    worst.outputs, worst.inputs = outputs, inputs
    return worst


def _torch_dtype(name: str):
    return getattr(torch, name)


def rel_error(value: Tensor, truth: Tensor) -> float:
    """||value - truth|| / ||truth|| over finite positions; inf when the non-finite ones differ."""
    value, truth = value.to(torch.float64), truth.to(torch.float64)
    diff = float(torch.linalg.vector_norm(value - truth))
    norm = float(torch.linalg.vector_norm(truth))
    if not (math.isfinite(diff) and math.isfinite(norm)):  # rare: compare the finite positions
        finite = torch.isfinite(truth)
        same = (torch.isnan(value) & torch.isnan(truth)) | (value == truth)
        if not bool(same[~finite].all()) or not bool(torch.isfinite(value[finite]).all()):
            return math.inf
        value, truth = value[finite], truth[finite]
        diff = float(torch.linalg.vector_norm(value - truth))
        norm = float(torch.linalg.vector_norm(truth))
    if norm == 0.0:
        return 0.0 if diff == 0.0 else math.inf
    return diff / norm
