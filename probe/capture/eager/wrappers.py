"""The user's module paths and class names under the wrappers that training stacks add.

DDP and DataParallel hold the model as ``module``, ``torch.compile`` as ``_orig_mod``,
activation checkpointing as ``_checkpoint_wrapped_module`` and FSDP1 as
``_fsdp_wrapped_module``. Those segments are not the user's model: a record named after
them pairs with nothing but a run wrapped the same way. Here a wrapper and the module it
wraps share one path (the wrapped module's, with every wrapper segment left out), and the
wrapper itself is not listed, so it is neither hooked nor named.

FSDP2 (``fully_shard``) swaps a module's class for a subclass named ``FSDP<Class>``;
``user_kind`` gives the class the user wrote.

Wrappers are recognised by class name and attribute, so nothing here imports
torch.distributed (absent or partial on some builds).
"""

from __future__ import annotations

import torch

from probe import compat

#: wrapper class name -> the attribute holding the wrapped module
WRAPPED_ATTRIBUTE = {
    "DistributedDataParallel": "module",
    "DataParallel": "module",
    "OptimizedModule": "_orig_mod",
    "CheckpointWrapper": "_checkpoint_wrapped_module",
    "OffloadWrapper": "_checkpoint_wrapped_module",
    "FullyShardedDataParallel": "_fsdp_wrapped_module",
}

_FSDP2_BASE = "FSDPModule"


def wrapped_attribute(module: torch.nn.Module) -> str | None:
    """The attribute under which ``module`` holds the model it wraps, or None."""
    for cls in type(module).__mro__:
        name = WRAPPED_ATTRIBUTE.get(cls.__name__)
        if name is not None:
            inner = compat.child_modules(module).get(name)
            return name if isinstance(inner, torch.nn.Module) else None
    return None


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The user's model inside any number of wrappers."""
    while (name := wrapped_attribute(model)) is not None:
        model = compat.child_modules(model)[name]
    return model


def user_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """``(path, module)`` for every module of ``model``, as ``named_modules()`` lists them,
    with wrapper segments left out of the paths and the wrappers themselves left out."""
    user_path: dict[str, str] = {}
    wrapped_by: dict[str, str] = {}  # wrapper path -> its wrapped attribute
    listed = []
    for path, module in model.named_modules(remove_duplicate=True):
        parent, _, leaf = path.rpartition(".")
        if not path:
            mine = ""
        elif wrapped_by.get(parent) == leaf:
            mine = user_path[parent]
        else:
            base = user_path.get(parent, parent)
            mine = f"{base}.{leaf}" if base else leaf
        user_path[path] = mine
        attribute = wrapped_attribute(module)
        if attribute is not None:
            wrapped_by[path] = attribute
            continue
        listed.append((mine, module))
    return listed


def is_fsdp2(module: torch.nn.Module) -> bool:
    """Whether ``fully_shard`` was applied to this module (its class is ``FSDP<Class>``)."""
    return any(base.__name__ == _FSDP2_BASE for base in type(module).__bases__)


def user_kind(module: torch.nn.Module) -> str:
    """The class name the user wrote: FSDP2's ``FSDPLinear(FSDPModule, Linear)`` is ``Linear``."""
    cls = type(module)
    if is_fsdp2(module):
        return next((base.__name__ for base in cls.__bases__ if base.__name__ != _FSDP2_BASE),
                    cls.__name__)
    return cls.__name__
