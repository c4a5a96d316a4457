"""PrecisionDebugger: the lifecycle of a capture. What is recorded lives in probe/capture/,
how a step's file is opened and finished in debugger/step_files.py, what became of each file in
debugger/write_results.py.

    debugger = PrecisionDebugger("config.json")   # seeds once, installs nothing
    for batch in loader:
        debugger.start(model)                     # hooks + API mode, if this step is selected
        loss = train_step(model, batch)
        debugger.stop()                           # everything removed; rows handed to the writer
        debugger.step()                           # step file finished; step counter + 1

or, for one whole step, ``with debugger.capture(model): train_step(...)``.

Rules (docs/capture.md):
* several start()/stop() pairs inside one step accumulate into that step's file;
* start() while started, or stop() while not started, raises CaptureError: a second start
  would hook everything twice, and a stray stop() means the script's structure is not what
  its author thinks. step() while started stops first;
* on a step or rank the config does not select, start() installs nothing at all;
* step() finishes ``{dump_path}/step{N}/rank{R}.h5``: with config ``writer`` "process"
  (what "auto" picks on two CPUs or more; statistics and checksum) it hands the records to
  this process's writer process (probe/dump/background.py) and returns, and the file is
  written while the next step trains (a thread would not help: the HDF5 work holds the GIL
  the training thread needs); with "inline", and always for task tensor, step() writes it.
  wait(), close(), reading ``last_file``, interpreter exit, and probe.load in this process
  wait for the files in flight. A process killed mid-step leaves at most
  ``rank{R}.<token>.h5.partial``, never a file that looks finished;
* a step file that cannot be written (disk full, ...) never raises inside the user's
  forward, backward or optimizer step: storing stops, the step runs to its end, and the next
  step(), wait(), close() or read of last_file after the failure is known raises DumpError
  naming the step (``on_write_error: raise``, the default) or warns once (``warn``);
* one live debugger per dump_path and rank: the first selected start() takes a lock
  (rank_lock.RankLock) that close() or the death of the process releases;
* every step file carries this debugger's ``run_id``.
"""

from __future__ import annotations

import atexit
import contextlib
import difflib
import os
import secrets
import sys
import time
import warnings
import weakref

import torch

from probe import command_config, compat
from probe.compat import version_gaps
from probe import config as config_module
from probe.capture import (ApiCaptureMode, Gate, ModuleHooks, Recorder, RegionTaps, RelaxedCollector,
                           activate_graph_taps, deactivate_graph_taps, region_targets, WriteWatchMode,
                           device_path_on_cpu, user_modules)
from probe.dump import run_folder
from probe.dump.schema import COLUMN_NAMES
from probe.errors import CaptureError, DumpError, ProbeError
from probe.debugger.step_files import StepFiles
from probe.debugger.write_results import WriteResults
from probe.seed import seed_all

_LIVE: "weakref.WeakSet[PrecisionDebugger]" = weakref.WeakSet()
_EXIT_HOOKED = False


class PrecisionDebugger:
    """Capture module and/or torch API calls of a training step into dump files.

    ``config``: a path to a .json/.yaml config, a dict of config keys, a probe.config.Config,
    or None (then the config ``probe run -c`` or ``probe determinism`` handed down in
    $PROBE_CONFIG, else the defaults). In a program such a command launched, the keys its
    config sets win over a config given here (probe/command_config.py).
    """

    def __init__(self, config=None) -> None:
        self.config = _resolve_config(config)
        cfg = self.config
        config_module.check_dump_path(cfg)
        # another run's step files in dump_path: refused, or removed with "overwrite": true
        run_folder.claim(cfg.dump_path, _current_rank(), cfg.overwrite, cfg.source)
        #: written into every step file: a dump folder mixing two runs' steps is detectable
        self.run_id = secrets.token_hex(8)
        self._warned_selection = False
        self._results = WriteResults(cfg.on_write_error)
        #: DumpErrors of steps that could not be written (with on_write_error "warn")
        self.write_errors: list[DumpError] = self._results.errors
        self.seed_report = seed_all(cfg.seed, cfg.mode, cfg.remove_dropout)
        self.current_step = 0
        self._model: torch.nn.Module | None = None
        #: (model, whether it is sharded): start() runs every step, the walk once per model
        self._sharded: tuple = (None, False)
        self._started = False
        self._recorder: Recorder | None = None  # the open step, if any
        self._mode: ApiCaptureMode | None = None
        self._hooks: ModuleHooks | None = None
        #: a plain torch.compile's regions run through graph taps while started (api, mix)
        self._region_taps = RegionTaps()
        self._collector = RelaxedCollector()  # fewer garbage collections in a captured step
        # opens each captured step and finishes its file (debugger/step_files.py); the rank's lock
        # is taken by the first selected start()
        self._files = StepFiles(cfg, self.run_id, self.seed_report.to_dict(), self._results)
        self._collectives_checked = False  # warned (once) about collectives torch hides?
        self.last_step_calls = 0  # API and module calls captured in that step
        self._nonfinite_stop: ProbeError | None = None  # stop_on_nonfinite: raised by step()
        # random_on_cpu: between start() and stop(); for the whole run when `probe run`
        # handed the config down (pushed here, under every later mode, never popped)
        self._random = self._random_whole_run = None
        self._rank: int | None = None  # set by a trainer integration (its process index)
        self._divergence_stop: ProbeError | None = None  # stop_on_divergence: raised by step()
        #: "fingerprint": true: every optimizer step's fingerprint (probe/fingerprint/session.py)
        self.fingerprints = None
        if cfg.fingerprint:
            from probe.fingerprint.session import FingerprintSession

            self.fingerprints = FingerprintSession(cfg, self.run_id, lambda: self.current_step,
                                                   lambda: self.rank)
        if cfg.random_on_cpu and config is None:
            from probe.seed import random_on_cpu

            self._random_whole_run = random_on_cpu.install()
        _LIVE.add(self)
        attached = sys.modules.get("probe.autoattach.session")
        if attached is not None:  # zero-edit capture gives way to the script's own debugger
            attached.on_debugger_created(self)

    def hand_over_random_mode(self) -> None:
        """Take out the whole-run ``random_on_cpu`` mode this debugger pushed (zero-edit
        capture steps aside for the script's own debugger, which installs its own)."""
        mode, self._random_whole_run = self._random_whole_run, None
        if mode is not None:
            compat.remove_function_mode(mode)

    # ------------------------------------------------------------------ public lifecycle

    @property
    def started(self) -> bool:
        return self._started

    @property
    def rank(self) -> int:
        """The rank in step file names: set by a trainer integration, else torch.distributed's
        rank, else $RANK, else 0."""
        return _current_rank() if self._rank is None else self._rank

    @rank.setter
    def rank(self, value: int | None) -> None:
        self._rank = None if value is None else int(value)

    @property
    def last_file(self) -> str | None:
        """Path of the step file written last (None when the last step could not be written).
        Waits for the step files still being written, as wait() does."""
        self.wait()
        return self._results.last_file

    @last_file.setter
    def last_file(self, path: str | None) -> None:
        self.wait()
        self._results.last_file = path

    def wait(self) -> None:
        """Wait until every step file handed to the writer process is on disk (or failed).
        A step that could not be written raises DumpError here (on_write_error "raise") or
        warns (on_write_error "warn"), as step() would."""
        self._results.deliver(block=True)

    def start(self, model: torch.nn.Module | None = None) -> None:
        """Begin (or resume) capturing the current step. model: the root nn.Module."""
        if self._started:
            raise CaptureError(
                f"start() called while capture of step {self.current_step} is already started; "
                "call stop() first"
            )
        if model is not None:
            if not isinstance(model, torch.nn.Module):
                raise CaptureError(
                    f"start(model=...) got {type(model).__name__}, expected a torch.nn.Module or None"
                )
            self._model = model
        if self.fingerprints is not None:
            self.fingerprints.watch(self._model)
        self._started = True
        if self.config.random_on_cpu and self._random_whole_run is None:
            from probe.seed import random_on_cpu

            # below the capture mode, on every step (captured or not): a run draws alike throughout
            self._random = random_on_cpu.install()
        if not self._selected():
            return
        began = time.perf_counter()
        try:
            self._warn_if_scope_selects_nothing()
            recorder = self._recorder or self._open_step()
            recorder.active = True
            level = self.config.level
            gate = Gate()
            targets = None  # the model's modules (compiled_regions.targets), when it has one
            recorder.copy_when_recorded(self._model_is_sharded())
            if self._model is not None:
                recorder.know_buffers(self._model)
                version_gaps.warn_sharded_capture_gap(self._model)
                targets = region_targets(self._model)  # one walk of the model for every part
                if level in ("api", "mix"):
                    self._region_taps.install(self._model, targets)
                self._hooks = ModuleHooks(self._model, recorder, record=level in ("module", "mix"),
                                          gate=gate, region_params=level == "module",
                                          targets=targets)
                self._hooks.install()
            if level in ("api", "mix"):
                if not self._collectives_checked:
                    self._collectives_checked = version_gaps.warn_uncaptured_collectives()
                self._mode = ApiCaptureMode(recorder, targets=targets)
                self._mode.__enter__()
                gate.mode = self._mode
            elif _statistics_read_later(self._model):
                # module level on the device path: no mode records calls, one must still
                # tell the device bucket before a tensor it holds is written in place
                self._mode = WriteWatchMode(recorder)
                self._mode.__enter__()
            activate_graph_taps(recorder, self._model, level, targets)
        except BaseException:
            self._uninstall()
            self._started = False
            raise
        self._collector.relax()  # after a start() that failed, the thresholds are as they were
        recorder.busy_s += time.perf_counter() - began

    def start_inside_forward(self, model: torch.nn.Module, args: tuple, kwargs: dict):
        """start(model) from a forward pre-hook of ``model``'s call that is already running
        (automatic capture starts a step there): torch read that call's hook list before
        start() installed the model's own hooks, so its inputs are recorded here. Returns
        what the pre-hook returns: None, or the (args, kwargs) to run the call with."""
        self.start(model)
        return None if self._hooks is None else self._hooks.enter_running_call(model, args, kwargs)

    def stop(self) -> None:
        """Remove every hook and the API mode; the records so far go to the step's writer."""
        if not self._started:
            raise CaptureError(
                f"stop() called but capture of step {self.current_step} is not started; "
                "call start() first"
            )
        self._started = False
        began = time.perf_counter()
        problem = self._uninstall()
        if self._recorder is not None:
            self._recorder.active = False
            self._recorder.resolve()
            self._recorder.busy_s += time.perf_counter() - began
        if problem is not None:
            raise problem

    def step(self) -> None:
        """Finish the current step's file (if it was captured) and advance the step counter."""
        if self._started:
            self.stop()
        try:
            verdict = self.fingerprints.end_step() if self.fingerprints is not None else None
            self._finish_step(verdict)
        finally:
            self.current_step += 1
            self._collector.restore(self.last_step_calls)  # the step's records are handed over
        stop, self._nonfinite_stop = self._nonfinite_stop, None
        if stop is None:
            stop, self._divergence_stop = self._divergence_stop, None
        if stop is not None:
            raise stop

    def note_loss(self, loss) -> None:
        """Give the current step's loss to the fingerprints (a tensor or a number; several
        calls in one step are averaged). The model's own output is taken when it is a loss
        (a scalar, or an output with a ``loss``); a no-op without ``"fingerprint": true``."""
        if self.fingerprints is not None:
            self.fingerprints.note_loss(loss)

    @contextlib.contextmanager
    def capture(self, model: torch.nn.Module | None = None, *, finish_step: bool = True):
        """``with debugger.capture(model): ...`` = start(model) ... stop(), then step().

        finish_step=False leaves the step open (for several captures in one step). On an
        exception the hooks and the mode are removed, the step is still written, and the
        exception propagates.
        """
        self.start(model)
        try:
            yield self
        except BaseException:
            with _reported("closing the capture after an exception"):
                self.stop()
                if finish_step:
                    self.step()
            raise
        self.stop()
        if finish_step:
            self.step()

    def close(self) -> None:
        """Stop if started, write the open step's file (what the exit handler does), wait
        for every step file in flight and release the dump folder's lock."""
        try:
            if self._started:
                self.stop()
            if self._recorder is not None:
                self._finish_step()
        finally:
            try:
                self._results.deliver(block=True)
            finally:
                self._files.release_lock()
                self._collector.restore()
                if self.fingerprints is not None:
                    self.fingerprints.close()

    # ------------------------------------------------------------------ internals

    def _model_is_sharded(self) -> bool:
        """FSDP2 modules or DTensor parameters in the model (walked once per model)."""
        model = self._model
        if model is None:
            return False
        if self._sharded[0] is not model:
            self._sharded = (model, version_gaps.is_sharded(model))
        return self._sharded[1]

    def _selected(self) -> bool:
        cfg = self.config
        if self.fingerprints is not None and self.fingerprints.provisional:
            return cfg.wants_rank(self.rank)  # every step, kept only if it jumps
        return cfg.wants_step(self.current_step) and cfg.wants_rank(self.rank)

    def _warn_if_scope_selects_nothing(self) -> None:
        """A scope that matches no module of this model dumps empty files that compare
        as equal: say so once, with the closest module path."""
        scope = self.config.scope
        if self._warned_selection or not scope or self._model is None:
            return
        names = [name for name, _ in user_modules(self._model) if name]
        if any(self.config.in_scope(name) for name in names) or "" in scope:
            return
        self._warned_selection = True
        close = difflib.get_close_matches(scope[0], names, n=1, cutoff=0.5)
        hint = f"; did you mean {close[0]!r}?" if close else ";"
        warnings.warn(
            f"probe: scope {list(scope)} selects no module of this "
            f"{type(self._model).__name__} ({len(names)} modules){hint} the step files will "
            "hold no records of modules in scope", UserWarning, stacklevel=3)

    def _warn_if_selection_recorded_nothing(self, rows: list) -> None:
        cfg = self.config
        if self._warned_selection or rows or not (cfg.scope or cfg.list):
            return
        self._warned_selection = True
        warnings.warn(
            f"probe: step {self.current_step} recorded nothing: scope {list(cfg.scope)} and "
            f"list {list(cfg.list)} select no call of this model (check them for typos); "
            "two empty dumps compare as nothing, not as a pass", UserWarning, stacklevel=4)

    def _open_step(self) -> Recorder:
        # h5py and probe.dump.writer first: their exit hooks must be registered before this
        # module's, which atexit then runs first (a step is finished before its writer closes)
        import probe.dump.writer  # noqa: F401

        _hook_exit()
        self._recorder = self._files.open(self.current_step, self.rank, _world_size())
        return self._recorder

    def _finish_step(self, verdict=None) -> None:
        recorder, self._recorder = self._recorder, None
        jumped = verdict is not None and bool(verdict.jumped)
        if recorder is None:
            self._results.deliver(block=False)
            if jumped:  # nothing captured (another rank's selection): still said, still stops
                self._divergence_stop = self.fingerprints.diverged(verdict, None)
            return
        self.last_step_calls = recorder.calls
        rows = self._files.take_rows(recorder)
        if (self.fingerprints is not None and self.fingerprints.provisional and not jumped
                and not self.config.wants_step(self.current_step)):
            # a live reference's provisional capture of a step that did not jump: dropped
            if recorder.writer is not None:
                recorder.writer.abort()
            self._results.deliver(block=False)
            return
        self._warn_if_selection_recorded_nothing(rows)
        attrs = recorder.step_attrs
        path = self._files.write(recorder, rows)
        if jumped:
            self._divergence_stop = self.fingerprints.diverged(verdict, path)
            if self._divergence_stop is not None:
                self._results.deliver(block=True)  # the step's file is on disk before the stop
        if path is not None and self.config.stop_on_nonfinite:
            from probe.analysis.nonfinite import stop_error

            stop = stop_error(rows, COLUMN_NAMES, attrs["step"], attrs["rank"], path)
            if stop is not None:
                self._results.deliver(block=True)  # "its file is written": make it so first
                if self._results.last_file == path:
                    self._nonfinite_stop = stop

    def _uninstall(self) -> ProbeError | None:
        """Remove the mode and hooks; never leaves either behind, even when one fails."""
        problem = None
        mode, self._mode = self._mode, None
        if mode is not None:
            stack = compat.function_mode_stack()
            if stack and stack[-1] is mode:
                mode.__exit__(None, None, None)
            elif any(m is mode for m in stack):
                top = type(stack[-1]).__name__
                problem = CaptureError(
                    f"stop(): another TorchFunctionMode ({top}) was entered after start() and is "
                    "still active; exit it before stop()"
                )
                compat.remove_function_mode(mode)
        random_mode, self._random = self._random, None
        if random_mode is not None and any(
                m is random_mode for m in compat.current_function_modes()):
            compat.remove_function_mode(random_mode)
        hooks, self._hooks = self._hooks, None
        if hooks is not None:
            hooks.remove()
        self._region_taps.remove()
        deactivate_graph_taps()
        return problem

    def __repr__(self) -> str:
        cfg = self.config
        state = "started" if self._started else "stopped"
        return (f"PrecisionDebugger(task={cfg.task!r}, level={cfg.level!r}, "
                f"dump_path={cfg.dump_path!r}, step={self.current_step}, {state})")


def _statistics_read_later(model) -> bool:
    """The recorder will read this model's tensors at the end of the step, not when recorded:
    on an accelerator, or on the CPU with PROBE_DEVICE_PATH=1 (device_bucket.py)."""
    if device_path_on_cpu():
        return True
    if model is None:
        return False
    for param in model.parameters():
        return param.device.type != "cpu"
    return False


def _resolve_config(config) -> config_module.Config:
    """The config to use: the one given, with the keys of the config a probe command
    (``probe run -c``, ``probe determinism``) handed down laid over it when one launched
    this program (probe/command_config.py); with none given, the handed-down one."""
    if config is None:
        return config_module.from_env() or config_module.Config()
    return command_config.resolve(_given_config(config))


def _given_config(config) -> config_module.Config:
    if isinstance(config, config_module.Config):
        return config
    if isinstance(config, (str, os.PathLike)):
        return config_module.load(config)
    if isinstance(config, dict):
        return config_module.from_dict(config)
    raise CaptureError(
        f"PrecisionDebugger(config=...) got {type(config).__name__}, expected a path to a "
        ".json/.yaml file, a probe.config.Config, a dict of config keys, or None"
    )


def _current_rank() -> int:
    return _launch_number("get_rank", "RANK", 0)


def _world_size() -> int:
    return _launch_number("get_world_size", "WORLD_SIZE", 1)


def _launch_number(getter: str, variable: str, default: int) -> int:
    """The rank or world size: torch.distributed's once it is up, the launcher's before."""
    distributed = torch.distributed
    if distributed.is_available() and distributed.is_initialized():
        return getattr(distributed, getter)()
    try:
        return int(os.environ.get(variable, default))
    except ValueError:
        return default


@contextlib.contextmanager
def _reported(what: str):
    """Run cleanup during an exception: a second failure is a warning, not a new exception."""
    try:
        yield
    except Exception as error:
        warnings.warn(f"probe: {what} failed: {error}", RuntimeWarning, stacklevel=3)


def _hook_exit() -> None:
    """Register the exit handler once, after probe.dump.writer (and h5py) are imported, so it
    runs before theirs: atexit runs last-registered first."""
    global _EXIT_HOOKED
    if not _EXIT_HOOKED:
        atexit.register(_close_all_at_exit)
        _EXIT_HOOKED = True


def _close_all_at_exit() -> None:
    for debugger in list(_LIVE):
        for _ in range(1000):  # every step that failed is reported, one message each
            try:
                debugger.close()
                break
            except Exception as error:
                print(f"probe: error: closing step {debugger.current_step} at exit: {error}",
                      file=sys.stderr)
    background = sys.modules.get("probe.dump.background")
    if background is not None:
        background.shutdown()


__all__ = ["PrecisionDebugger"]
