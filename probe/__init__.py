"""probe: precision debugging for PyTorch training.

Public names are loaded lazily so that ``probe compare`` and ``probe.load`` never pay for
importing torch.
"""

from importlib import import_module

from probe._version import __version__
from probe.errors import (
    CaptureError,
    CompareError,
    ConfigError,
    DumpError,
    DumpFormatError,
    ProbeError,
    SeedError,
    NonfiniteError,
    DivergenceError,
    NothingRecordedError,
    RunExistsError,
)

__all__ = [
    "__version__",
    "seed_all",
    "SeedReport",
    "dataloader_kwargs",
    "seed_worker",
    "PrecisionDebugger",
    "load_config",
    "Config",
    "load",
    "compare",
    "ProbeError",
    "ConfigError",
    "SeedError",
    "DumpError",
    "DumpFormatError",
    "CaptureError",
    "CompareError",
    "NonfiniteError",
    "DivergenceError",
    "NothingRecordedError",
    "RunExistsError",
    "first_nonfinite",
    "compile",
]

# name -> (module, attribute); resolved on first access.
_LAZY = {
    "seed_all": ("probe.seed", "seed_all"),
    "SeedReport": ("probe.seed", "SeedReport"),
    "dataloader_kwargs": ("probe.seed.data", "dataloader_kwargs"),
    "seed_worker": ("probe.seed.data", "seed_worker"),
    "PrecisionDebugger": ("probe.debugger.debugger", "PrecisionDebugger"),
    "load_config": ("probe.config", "load"),
    "Config": ("probe.config", "Config"),
    "load": ("probe.dump.formats", "load"),
    "compare": ("probe.compare_and_replay", "compare"),
    "first_nonfinite": ("probe.analysis.nonfinite", "first_nonfinite"),
    "compile": ("probe.capture", "compile"),
}


def __getattr__(name):
    try:
        module_name, attribute = _LAZY[name]
    except KeyError:
        raise AttributeError(f"module 'probe' has no attribute {name!r}") from None
    value = getattr(import_module(module_name), attribute)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
