"""Make a run repeatable: seed every random source and, on request, force determinism.

``seed_all(seed, mode, remove_dropout)`` seeds Python, numpy and torch on every device, pins
cuDNN to deterministic kernels, and with ``mode`` forces deterministic algorithms and turns
TF32 off. It returns a SeedReport saying exactly what it set. ``determinism_state()`` is a
JSON-able snapshot of the settings in force, stored in every dump file.

Dropout removal uses a torch.overrides.TorchFunctionMode (no monkey-patching): every dropout
call reaching torch is re-issued with training off / dropout_p=0. Modes are thread-local and
stack; the rule is strict last-in-first-out: restore_dropout() pops only our own mode and
raises SeedError when another mode (e.g. probe's capture mode) was pushed after it and is
still active. Stop the debugger first, then restore.
"""

from __future__ import annotations

import importlib.util
import inspect
import numbers
import os
import random
import sys
import threading
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from probe.errors import SeedError

SEED_MAX = 2**32 - 1
CUBLAS_DETERMINISTIC_WORKSPACE = ":4096:8"
ENV_VARS = (
    "PYTHONHASHSEED",
    "CUBLAS_WORKSPACE_CONFIG",
    "HCCL_DETERMINISTIC",
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "CUDA_VISIBLE_DEVICES",
)


@dataclass(frozen=True)
class SeedReport:
    """What one seed_all call set. ``settings`` maps each setting to the value applied."""

    seed: int
    mode: bool | str
    remove_dropout: bool
    sources: tuple[str, ...]
    devices: tuple[str, ...]
    settings: dict[str, Any] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    warnings: tuple[str, ...] = ()
    hash_seed_note: str = ""
    determinism: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        for name in ("sources", "devices", "warnings"):
            data[name] = list(data[name])
        return data


# ---------------------------------------------------------------- validation


def check_seed(seed: Any, caller: str = "seed_all") -> int:
    """The seed as an int, or SeedError naming the caller, the value and the allowed range."""
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise SeedError(
            f"{caller}: seed is {seed!r} ({type(seed).__name__}), expected an int in 0 .. {SEED_MAX}"
        )
    if not 0 <= int(seed) <= SEED_MAX:
        raise SeedError(f"{caller}: seed is {seed!r}, expected an int in 0 .. {SEED_MAX}")
    return int(seed)


def _check(seed: Any, mode: Any, remove_dropout: Any) -> int:
    seed = check_seed(seed)
    if not (mode is True or mode is False or (isinstance(mode, str) and mode == "warn")):
        raise SeedError(f"seed_all: mode is {mode!r}, expected False, True or \"warn\"")
    if not isinstance(remove_dropout, bool):
        raise SeedError(f"seed_all: remove_dropout is {remove_dropout!r}, expected True or False")
    return seed


# ---------------------------------------------------------------- seeding


def _npu_module():
    """torch_npu when it is installed and imports; None otherwise (never raises)."""
    if "torch_npu" not in sys.modules and importlib.util.find_spec("torch_npu") is None:
        return None
    try:
        import torch_npu  # noqa: F401  (registers torch.npu)
    except Exception:  # a broken install must not stop seeding on CPU/GPU
        return None
    return getattr(torch, "npu", None)


def _seed_devices(seed: int, settings: dict, sources: list, devices: list) -> None:
    random.seed(seed)
    settings["random.seed"] = seed
    sources.append("python")
    try:
        import numpy
    except ImportError:
        pass
    else:
        numpy.random.seed(seed)
        settings["numpy.random.seed"] = seed
        sources.append("numpy")
    torch.manual_seed(seed)  # CPU and, lazily, every other registered device
    settings["torch.manual_seed"] = seed
    sources.append("torch.cpu")
    devices.append("cpu")
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)
        settings["torch.cuda.manual_seed_all"] = seed
        sources.append("torch.cuda")
        devices.extend(f"cuda:{i}" for i in range(torch.cuda.device_count()))
    npu = _npu_module()
    if npu is not None and npu.is_available():
        npu.manual_seed_all(seed)
        settings["torch.npu.manual_seed_all"] = seed
        sources.append("torch.npu")
        devices.extend(f"npu:{i}" for i in range(npu.device_count()))


# The hash seed is read once at interpreter start-up; the closest record of it we have is the
# variable as it stood when probe.seed was first imported (before any seed_all wrote it).
_STARTUP_HASH_SEED = os.environ.get("PYTHONHASHSEED")


def _hash_seed_note(seed: int) -> str:
    if _STARTUP_HASH_SEED == str(seed):
        return f"PYTHONHASHSEED={seed} was set when this process started: str hashes are fixed."
    started = f"PYTHONHASHSEED={_STARTUP_HASH_SEED}" if _STARTUP_HASH_SEED else "random"
    return (
        f"PYTHONHASHSEED={seed} is set for child processes only; this interpreter's hash seed "
        f"was fixed at start-up ({started}). "
        f"Launch with `probe run --seed {seed} -- python train.py` to fix it here too."
    )


def _set(settings: dict, problems: list, name: str, apply, value) -> None:
    """Apply one backend setting; a backend that refuses it becomes a report warning."""
    try:
        apply(value)
    except (RuntimeError, AttributeError, ValueError) as error:
        problems.append(f"could not set {name}={value!r}: {error}")
    else:
        settings[name] = value


def _set_attr(owner, attribute):
    return lambda value: setattr(owner, attribute, value)


def _apply_mode(mode: bool | str, settings: dict, env: dict, problems: list) -> None:
    if os.environ.get("CUBLAS_WORKSPACE_CONFIG") is None:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = CUBLAS_DETERMINISTIC_WORKSPACE
        env["CUBLAS_WORKSPACE_CONFIG"] = CUBLAS_DETERMINISTIC_WORKSPACE
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            problems.append(
                "CUBLAS_WORKSPACE_CONFIG was set after CUDA was initialised and may not take "
                "effect; launch with `probe run` or call seed_all before touching CUDA"
            )
    os.environ["HCCL_DETERMINISTIC"] = "true"
    env["HCCL_DETERMINISTIC"] = "true"
    warn_only = mode == "warn"
    _set(settings, problems, "torch.use_deterministic_algorithms",
         lambda on: torch.use_deterministic_algorithms(on, warn_only=warn_only), True)
    settings["torch.use_deterministic_algorithms.warn_only"] = warn_only
    _set(settings, problems, "torch.backends.cuda.matmul.allow_tf32",
         _set_attr(torch.backends.cuda.matmul, "allow_tf32"), False)
    _set(settings, problems, "torch.backends.cudnn.allow_tf32",
         _set_attr(torch.backends.cudnn, "allow_tf32"), False)
    _set(settings, problems, "torch.set_float32_matmul_precision",
         torch.set_float32_matmul_precision, "highest")


def seed_all(seed: int = 1234, mode: bool | str = False, remove_dropout: bool = False) -> SeedReport:
    """Seed Python, numpy and torch (every device), pin cuDNN, and apply ``mode``.

    mode False: seeds and cuDNN flags only (deterministic-algorithm and TF32 settings are left
    as they are). True: also torch.use_deterministic_algorithms(True) (nondeterministic ops
    raise), TF32 off, float32 matmul precision "highest", CUBLAS_WORKSPACE_CONFIG and
    HCCL_DETERMINISTIC. "warn": the same with warn_only=True. remove_dropout=True turns every
    dropout into a no-op until restore_dropout(); False leaves dropout removal as it is.
    """
    seed = _check(seed, mode, remove_dropout)
    settings: dict[str, Any] = {}
    env: dict[str, str] = {}
    sources: list[str] = []
    devices: list[str] = []
    problems: list[str] = []

    os.environ["PYTHONHASHSEED"] = str(seed)
    env["PYTHONHASHSEED"] = str(seed)
    _seed_devices(seed, settings, sources, devices)
    _set(settings, problems, "torch.backends.cudnn.benchmark",
         _set_attr(torch.backends.cudnn, "benchmark"), False)
    _set(settings, problems, "torch.backends.cudnn.deterministic",
         _set_attr(torch.backends.cudnn, "deterministic"), True)
    if mode is not False:
        _apply_mode(mode, settings, env, problems)
    if remove_dropout:
        remove_dropout_now()
        settings["remove_dropout"] = True
    for problem in problems:
        warnings.warn(f"probe.seed_all: {problem}", RuntimeWarning, stacklevel=2)
    return SeedReport(
        seed=seed,
        mode=mode,
        remove_dropout=dropout_removed(),
        sources=tuple(sources),
        devices=tuple(devices),
        settings=settings,
        env=env,
        warnings=tuple(problems),
        hash_seed_note=_hash_seed_note(seed),
        determinism=determinism_state(),
    )


def determinism_state() -> dict[str, Any]:
    """A JSON-able snapshot of the determinism settings in force now."""
    cudnn = torch.backends.cudnn
    state: dict[str, Any] = {
        "cudnn.enabled": bool(cudnn.enabled),
        "cudnn.benchmark": bool(cudnn.benchmark),
        "cudnn.deterministic": bool(cudnn.deterministic),
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "deterministic_algorithms_warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "num_threads": torch.get_num_threads(),
        "num_interop_threads": torch.get_num_interop_threads(),
        "mkldnn.enabled": bool(torch.backends.mkldnn.enabled),
        "dropout_removed": dropout_removed(),
    }
    for name, read in (
        ("cuda.matmul.allow_tf32", lambda: torch.backends.cuda.matmul.allow_tf32),
        ("cudnn.allow_tf32", lambda: cudnn.allow_tf32),
    ):
        try:
            state[name] = bool(read())
        except (RuntimeError, AttributeError) as error:  # backends that refuse the legacy flag
            state[name] = f"unknown ({error})"
    state["env"] = {name: os.environ[name] for name in ENV_VARS if name in os.environ}
    # env's PYTHONHASHSEED is what seed_all set for child processes; this is what hashed str in
    # this interpreter (None: random)
    state["hash_seed_at_start"] = _STARTUP_HASH_SEED
    return state


# ---------------------------------------------------------------- dropout removal


def _dropout_rules() -> dict[Any, tuple[str, int, Any]]:
    """function -> (parameter, position, value that disables dropout)."""
    rules: dict[Any, tuple[str, int, Any]] = {}
    for fn in (F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout,
               F.feature_alpha_dropout):
        rules[fn] = ("training", _position(fn, "training"), False)
    for name in ("dropout", "dropout_", "alpha_dropout", "alpha_dropout_", "feature_dropout",
                 "feature_dropout_", "feature_alpha_dropout", "feature_alpha_dropout_",
                 "native_dropout"):
        fn = getattr(torch, name, None)
        if fn is not None:
            rules[fn] = ("train", 2, False)
    # a C builtin without an introspectable signature: (query, key, value, attn_mask, dropout_p)
    rules[F.scaled_dot_product_attention] = ("dropout_p", 4, 0.0)
    # nn.MultiheadAttention passes dropout_p positionally.
    mha = F.multi_head_attention_forward
    rules[mha] = ("dropout_p", _position(mha, "dropout_p"), 0.0)
    return rules


def _position(fn, parameter: str) -> int:
    return list(inspect.signature(fn).parameters).index(parameter)


class DropoutRemover(TorchFunctionMode):
    """A torch function mode that re-issues every dropout call with dropout disabled.

    Usable directly as a context manager (``with DropoutRemover(): ...``); seed_all pushes one
    globally for the calling thread and restore_dropout() pops it.
    """

    _rules: dict | None = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs) if kwargs else {}
        if DropoutRemover._rules is None:
            DropoutRemover._rules = _dropout_rules()
        rule = DropoutRemover._rules.get(func)
        if rule is not None:
            name, position, value = rule
            if len(args) > position:
                args = (*args[:position], value, *args[position + 1:])
            else:
                kwargs[name] = value
        return func(*args, **kwargs)


# The torch function mode stack is thread-local, so the remover we pushed is too.
_local = threading.local()


def _active() -> DropoutRemover | None:
    return getattr(_local, "remover", None)


def _mode_stack() -> list:
    from probe.compat import function_mode_stack

    return function_mode_stack()


def dropout_removed() -> bool:
    """True while seed_all's dropout removal is on this thread's torch function mode stack."""
    remover = _active()
    return remover is not None and any(mode is remover for mode in _mode_stack())


def remove_dropout_now() -> None:
    """Push the dropout remover for this thread unless it is already active."""
    if dropout_removed():
        return
    _local.remover = DropoutRemover()
    _local.remover.__enter__()


def restore_dropout() -> bool:
    """Pop seed_all's dropout remover. Returns False when it was not active.

    Raises SeedError when another torch function mode sits above it (pushed later and still
    active): popping ours would pop theirs. Stop that mode (e.g. debugger.stop()) first.
    """
    remover = _active()
    stack = _mode_stack()
    if remover is None or not any(mode is remover for mode in stack):
        _local.remover = None
        return False
    if stack[-1] is not remover:
        raise SeedError(
            f"restore_dropout: another torch function mode ({type(stack[-1]).__name__}) was "
            f"pushed after dropout removal and is still active; stop it first (modes pop last-in, first-out)"
        )
    remover.__exit__(None, None, None)
    _local.remover = None
    return True


__all__ = [
    "seed_all", "SeedReport", "determinism_state", "check_seed", "restore_dropout", "dropout_removed",
    "remove_dropout_now", "DropoutRemover",
]
