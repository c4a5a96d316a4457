"""Config key ``random_on_cpu``: random numbers meant for an accelerator come from the CPU.

A CPU run and a GPU run seeded alike still draw different numbers: each device has its own
generator and its own kernels. With this mode active, every covered random call whose target
device is not the CPU (nor "meta", which holds no values) is made on the CPU, with the CPU generator, exactly as a CPU run of
the same code makes it, and the result is copied to the target device. The numbers, the
dropout masks and the CPU generator's advance are then the same on every device.

Covered (``COVERED`` lists them):

* factories: torch.rand, randn, randint, randperm, normal, bernoulli, multinomial, poisson,
  rand_like, randn_like, randint_like, Tensor.bernoulli, Tensor.multinomial;
* in-place fills: Tensor.normal_, uniform_, bernoulli_, exponential_, random_, geometric_,
  log_normal_, cauchy_, and nn.init's uniform_, normal_, trunc_normal_, xavier_*, kaiming_*,
  orthogonal_, sparse_ (filled on a CPU tensor of the same layout, then copied);
* dropout: F.dropout, nn.Dropout, F.dropout1d/2d/3d, torch.dropout/feature_dropout (and their
  in-place forms): the mask is drawn on the CPU by the CPU kernel itself (run on a tensor of
  ones, which gives the scaled mask exactly) and the input is multiplied by it on the device,
  which is the CPU kernel's own arithmetic, so results match a CPU run bit for bit;
* F.alpha_dropout, F.feature_alpha_dropout, F.rrelu (and torch.* forms): run on the CPU
  (rrelu draws one number per negative input, so its draws depend on the values), result
  copied back.

Cost, only while active: one host-to-device copy per draw (its size), plus for alpha dropout
and rrelu a device-to-host copy of the input, and a synchronisation per copy. Off (the
default) nothing is installed: zero cost.

Not covered: draws inside a torch function the mode does not see into (the dropout of
F.scaled_dot_product_attention and F.multi_head_attention_forward: set ``remove_dropout``
for those), draws with an explicit non-CPU ``generator=`` (kept on that generator, the
user chose it), and calls with ``out=`` (left as they are).

It is a torch.overrides.TorchFunctionMode: nothing is patched. Modes are per thread and stack
last-in, first-out; the debugger pushes this one before its capture mode, so capture records
the user's call (F.dropout) once, whatever this mode does inside it.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from probe import compat

DeviceContext = compat.device_context_class()

#: True while dynamo traces (torch >= 2.3; before that there is nothing to tell it by)
_is_compiling = getattr(getattr(torch, "compiler", None), "is_compiling", lambda: False)

Tensor = torch.Tensor
_CPU = torch.device("cpu")
#: draws aimed at these stay where they are: the CPU itself, and "meta" (shapes only: a CPU run
#: of the same code draws nothing there either, and deferred initialisation of a large model on
#: meta must not allocate it on the host)
_LEFT_ALONE = ("cpu", "meta")

#: out-of-place draws whose tensor arguments only give a layout (no values are read)
_LIKE = ("rand_like", "randn_like", "randint_like")
_FACTORIES = ("rand", "randn", "randint", "randperm", "normal", "bernoulli", "multinomial",
              "poisson") + _LIKE
_METHODS = ("bernoulli", "multinomial")
_FILLS = ("normal_", "uniform_", "bernoulli_", "exponential_", "random_", "geometric_",
          "log_normal_", "cauchy_")
#: nn.init's random initialisers are torch functions themselves: the mode sees them, not the
#: fill inside, so they are redirected whole (computed on a CPU tensor, copied into the weight)
_INITS = ("uniform_", "normal_", "trunc_normal_", "xavier_uniform_", "xavier_normal_",
          "kaiming_uniform_", "kaiming_normal_", "orthogonal_", "sparse_")
#: dropouts whose CPU kernel is input * noise: noise drawn on the CPU, multiply on the device
_MASK_DROPOUTS_F = ("dropout", "dropout1d", "dropout2d", "dropout3d")
_MASK_DROPOUTS_TORCH = ("dropout", "dropout_", "feature_dropout", "feature_dropout_")
#: random ops whose draws depend on the values or are not a plain mask: computed on the CPU
_ON_CPU_F = ("alpha_dropout", "feature_alpha_dropout", "rrelu")
_ON_CPU_TORCH = ("alpha_dropout", "alpha_dropout_", "feature_alpha_dropout",
                 "feature_alpha_dropout_", "rrelu", "rrelu_")
#: positional parameters of the torch.* builtins (no introspectable signature)
_TORCH_PARAMS = {"rrelu": ("input", "lower", "upper", "training", "generator")}
_DROPOUT_PARAMS = ("input", "p", "train")


def _groups() -> tuple:
    """(owner, names, handler kind) for every covered group."""
    return (
        (torch, _FACTORIES, "factory"), (Tensor, _METHODS, "factory"), (Tensor, _FILLS, "fill"),
        (torch.nn.init, _INITS, "init"), (F, _MASK_DROPOUTS_F, "mask"),
        (torch, _MASK_DROPOUTS_TORCH, "mask"), (F, _ON_CPU_F, "on_cpu"),
        (torch, _ON_CPU_TORCH, "on_cpu"), (F, ("rrelu_",), "on_cpu"),
    )


def _functions() -> dict:
    """func -> handler kind, for every covered function that exists in this torch."""
    return {getattr(owner, name): kind for owner, names, kind in _groups()
            for name in names if hasattr(owner, name)}


def covered_names() -> list[str]:
    """The covered functions by name (for docs and messages)."""
    names = [f"torch.{n}" for n in _FACTORIES] + [f"Tensor.{n}" for n in _METHODS + _FILLS]
    names += [f"nn.init.{n}" for n in _INITS]
    names += [f"F.{n}" for n in _MASK_DROPOUTS_F + _ON_CPU_F] + ["F.rrelu_"]
    names += [f"torch.{n}" for n in _MASK_DROPOUTS_TORCH + _ON_CPU_TORCH]
    return names


COVERED = covered_names()


def _bind(func, args, kwargs) -> dict:
    """Parameter name -> value (defaults filled) for the dropout/rrelu family."""
    name = getattr(func, "__name__", "")
    if _is_python_function(func):
        bound = inspect.signature(func).bind(*args, **kwargs)
        bound.apply_defaults()
        return dict(bound.arguments)
    params = _TORCH_PARAMS.get(name.rstrip("_"), _DROPOUT_PARAMS)
    values = dict(zip(params, args))
    values.update(kwargs)
    return values


def _device_of(value) -> torch.device | None:
    return value.device if isinstance(value, Tensor) else None


def _to_cpu(value, layout_only: bool = False):
    if not isinstance(value, Tensor):
        return value
    if layout_only:
        return torch.empty_like(value, device=_CPU)
    return value.to(_CPU)


def _default_device() -> torch.device:
    """Where a factory call without device= allocates: an active ``with torch.device(...)``
    (a DeviceContext mode), else torch.set_default_device's, else the CPU. What
    torch.get_default_device() answers, without its 10 us (it also resolves the index)."""
    for mode in reversed(compat.current_function_modes()):
        if isinstance(mode, DeviceContext):
            return torch.device(mode.device)
    context = compat.global_device_context()
    return torch.device(context.device) if context is not None else _CPU


class RandomOnCpu(TorchFunctionMode):
    """Make covered random draws with the CPU generator; move results to their device.

    ``redirected`` counts the calls it moved to the CPU (the ones whose target was not the CPU).
    """

    _table: dict | None = None

    def __init__(self) -> None:
        super().__init__()
        self.redirected = 0
        if RandomOnCpu._table is None:
            RandomOnCpu._table = _functions()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _is_compiling():
            # dynamo traces this mode into a compiled region: draws there are the compiled
            # code's own, and the region stays one graph
            return func(*args, **kwargs)
        kind = RandomOnCpu._table.get(func)
        if kind is None or "out" in kwargs or not _cpu_generator(kwargs):
            return func(*args, **kwargs)
        if kind == "factory":
            return self._factory(func, args, kwargs)
        if kind in ("fill", "init"):
            return self._fill(func, args, kwargs, kind == "init")
        return self._dropout(func, args, kwargs, kind)

    def _factory(self, func, args, kwargs):
        tensors = [v for v in (*args, *kwargs.values()) if isinstance(v, Tensor)]
        if "device" in kwargs and kwargs["device"] is not None:
            target = torch.device(kwargs["device"])
        elif tensors:
            target = tensors[0].device
        else:
            target = _default_device()
        if target.type in _LEFT_ALONE:
            return func(*args, **kwargs)
        layout_only = getattr(func, "__name__", "") in _LIKE
        cpu_args = tuple(_to_cpu(a, layout_only) for a in args)
        cpu_kwargs = {k: _to_cpu(v, layout_only) for k, v in kwargs.items()}
        requires_grad = bool(cpu_kwargs.pop("requires_grad", False))
        if "device" in cpu_kwargs or not tensors:
            cpu_kwargs["device"] = _CPU
        result = func(*cpu_args, **cpu_kwargs).to(target)
        self.redirected += 1
        return result.requires_grad_() if requires_grad else result

    def _fill(self, func, args, kwargs, init: bool):
        target = args[0] if args else kwargs.get("tensor", kwargs.get("self"))
        if not isinstance(target, Tensor) or target.device.type in _LEFT_ALONE:
            return func(*args, **kwargs)
        # the same layout as the target: the CPU kernel fills it in the order a CPU run would
        fresh = torch.empty_strided(target.size(), target.stride(), dtype=target.dtype, device=_CPU)
        rest = {k: _to_cpu(v) for k, v in kwargs.items() if v is not target}
        func(fresh, *(_to_cpu(a) for a in args[1:]), **rest)
        if init:  # nn.init fills parameters in place without recording autograd history
            with torch.no_grad():
                target.copy_(fresh)
        else:
            target.copy_(fresh)
        self.redirected += 1
        return target

    def _dropout(self, func, args, kwargs, kind):
        from probe.seed.seed import dropout_removed

        params = _bind(func, args, kwargs)
        source = params.get("input")
        training = params.get("training", params.get("train", False))
        device = _device_of(source)
        if (device is None or device.type in _LEFT_ALONE or not training or params.get("p", 1) == 0
                or dropout_removed()):
            return func(*args, **kwargs)  # nothing random happens, or seed_all removes it
        inplace = bool(params.get("inplace", False)) or func.__name__.endswith("_")
        self.redirected += 1
        if kind == "mask":
            params["input"] = torch.ones_like(source, device=_CPU)
            if "inplace" in params:
                params["inplace"] = False
            noise = _call(func, params).to(device)  # 1 * mask / (1 - p): the scaled mask exactly
            return source.mul_(noise) if inplace else source.mul(noise)
        params["input"] = source.to(_CPU)
        result = _call(func, params).to(device)
        return source.copy_(result) if inplace else result


def _is_python_function(func) -> bool:
    """F.dropout & co. (introspectable); False for torch.* builtins such as torch.dropout."""
    return getattr(func, "__module__", None) == "torch.nn.functional" and inspect.isfunction(func)


def _call(func, params: dict):
    return func(**params)  # builtins take their schema's names as keywords too


def _cpu_generator(kwargs) -> bool:
    """False when the call names a generator of another device: that draw stays where it is."""
    generator = kwargs.get("generator")
    return generator is None or generator.device.type == "cpu"


def install() -> RandomOnCpu:
    """Push a RandomOnCpu mode for this thread (the caller pops it, last in, first out)."""
    mode = RandomOnCpu()
    mode.__enter__()
    return mode


__all__ = ["RandomOnCpu", "COVERED", "install", "covered_names"]
