"""The one exception tree of probe.

Every error a user can cause (bad config, bad dump, bad arguments) is a ProbeError subclass
carrying one sentence that names the file or field, what was found and what was expected.
The CLI prints that sentence and exits 2; it never shows a traceback for these.
"""


class ProbeError(Exception):
    """Base of every error probe raises on purpose."""


class ConfigError(ProbeError):
    """A config file or value is missing, malformed or out of range."""


class SeedError(ProbeError):
    """seed_all was given a seed or mode it cannot honour."""


class DumpError(ProbeError):
    """A dump could not be written (unwritable path, disk full, ...)."""


class DumpFormatError(ProbeError):
    """A file is not a readable probe dump (missing, not HDF5, wrong schema, truncated)."""


class CaptureError(ProbeError):
    """The debugger was used out of order (stop before start, ...) or cannot hook a model."""


class CompareError(ProbeError):
    """Two dumps cannot be compared (mismatched steps/ranks, bad mapping file, ...)."""


class NonfiniteError(ProbeError):
    """stop_on_nonfinite: a captured step held NaN/Inf; its file is on disk, training stops."""


class NothingRecordedError(ProbeError):
    """A check found nothing to look at (0 records): it must not pass."""


class RunExistsError(DumpError):
    """dump_path already holds another run's step files, and config "overwrite" is false."""


class DivergenceError(ProbeError):
    """stop_on_divergence: a step's fingerprint jumped away from the reference run's; that
    step's full capture is on disk, training stops."""
