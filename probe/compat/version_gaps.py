"""What this torch version keeps probe from recording, said once, where it matters.

Each ``*_gap`` function names what the running torch lacks for one kind of capture (None when
nothing), and each ``warn_*`` says it once, as a TorchVersionWarning, at the start() that
would be affected. docs/torch-versions.md explains each gap for a user. The private torch API
these checks rest on stays in ``probe/compat/__init__.py``.
"""

from __future__ import annotations

import warnings

import torch

from probe.compat import COLLECTIVES, VERSION, uncaptured_collectives


class TorchVersionWarning(UserWarning):
    """This torch version keeps probe from recording something it records on others."""


_warned_group = None


def warn_uncaptured_collectives() -> bool:
    """Warn when a process group is up and this torch hides some collectives from the API
    level. Returns True once the question is settled (a process group exists, or
    torch.distributed is unavailable), so that the caller (PrecisionDebugger.start) asks,
    and warns, once."""
    distributed = torch.distributed
    if not distributed.is_available():
        return True
    if not distributed.is_initialized():
        return False
    # once per process group, not once per debugger: a job that makes a debugger per
    # config or per phase would repeat it, and Python's own once-per-place filter forgets a
    # warning whenever anything changes the warning filters (torch and libraries do)
    global _warned_group
    group = getattr(distributed.group, "WORLD", None)
    if group is not None and group is _warned_group:
        return True
    _warned_group = group
    missing = uncaptured_collectives()
    if missing:
        which = "any collective" if len(missing) == len(COLLECTIVES) else ", ".join(missing)
        warnings.warn(
            f"probe: torch {torch.__version__} does not pass {which} through "
            "__torch_function__, so the api level cannot record those calls (torch 2.12 and "
            "later passes them all); module-level records are unaffected. "
            "See docs/torch-versions.md.", TorchVersionWarning, stacklevel=3)
    return True


def compiled_capture_gap() -> str | None:
    """Why this torch cannot capture compiled models as docs/torch-versions.md says, or None.

    Capture at a compiled region's boundary needs forward hooks that run even when the forward
    raises (``always_call``, 2.1) and ``torch.compiler.is_compiling`` (2.3); graph taps need
    the FX ``nn_module_stack`` dynamo writes into every node."""
    missing = []
    if "always_call" not in torch.nn.Module.register_forward_hook.__code__.co_varnames:
        missing.append("forward hooks with always_call")
    if not hasattr(getattr(torch, "compiler", None), "is_compiling"):
        missing.append("torch.compiler.is_compiling")
    if not hasattr(torch.nn.Module, "compile"):
        missing.append("nn.Module.compile")
    if not missing:
        return None
    return f"torch {torch.__version__} lacks {', '.join(missing)}"


_warned_compiled = False


def warn_compiled_capture_gap() -> None:
    """Warn once, at the start() of a model with compiled regions, where this torch lacks
    what capturing them needs."""
    global _warned_compiled
    gap = compiled_capture_gap()
    if gap is None or _warned_compiled:
        return
    _warned_compiled = True
    warnings.warn(f"probe: {gap}: compiled regions of this model may be traced with probe's "
                  "hooks (graph breaks) or recorded at their boundary only; see "
                  "docs/torch-versions.md", TorchVersionWarning, stacklevel=4)


def sharded_capture_gap() -> str | None:
    """What sharded capture (FSDP2, DTensor) lacks on this torch, or None (checked on CPU with
    gloo on 2.4.1, 2.8.0, 2.10.0, 2.12.0, 2.13.0 and 2.15.0; see docs/torch-versions.md)."""
    if VERSION < (2, 8):
        return (f"torch {torch.__version__}'s FSDP2 runs on CUDA only (on CPU its forward "
                "calls CUDA), and sharded capture is checked from torch 2.12 on")
    wait = (f"sharded capture (FSDP2, DTensor) on torch {torch.__version__}: the wait of a "
            "functional collective (tensor parallel's all_reduce) does not reach probe, so its "
            "result is not recorded")
    if VERSION < (2, 10):
        return wait + ", and FSDP2 on CPU with gloo sums gradients where DDP averages them"
    if VERSION < (2, 12):
        return wait
    return None


_warned_sharded = False


def is_sharded(model) -> bool:
    """The model has FSDP2 modules or DTensor parameters."""
    # by class name: the FSDP2 and DTensor modules moved between torch versions
    if any(any(cls.__name__ == "FSDPModule" for cls in type(module).__mro__)
           for module in model.modules()):
        return True
    return any(type(param).__name__ == "DTensor" for param in model.parameters())


def warn_sharded_capture_gap(model) -> None:
    """Warn once, at the start() of a model with FSDP2 modules or DTensor parameters, where
    this torch is known not to capture sharded training fully."""
    global _warned_sharded
    if _warned_sharded or model is None:
        return
    gap = sharded_capture_gap()
    if gap is None or not is_sharded(model):
        return
    _warned_sharded = True
    warnings.warn(f"probe: {gap}; see docs/torch-versions.md", TorchVersionWarning, stacklevel=4)
