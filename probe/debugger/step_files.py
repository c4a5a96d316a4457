"""The step files of one PrecisionDebugger: open a captured step, finish its file.

A selected start() opens the step: the dump folder, the lock of its rank (one live writer
per dump folder and rank, dump/rank_lock.py), and a Recorder with the step file's root
attributes. step() finishes it: with config ``writer`` "process" (what "auto" picks on two
CPUs or more; statistics and checksum) the records go to this process's writer process
(dump/background.py) and the file is written while the next step trains; with "inline",
and always for task tensor, step() writes it. What became of each file is WriteResults'
(debugger/write_results.py).
"""

from __future__ import annotations

import os
import warnings

import torch

from probe._version import __version__
from probe.capture import CaptureFilter, DeviceBucket, HostBatch, Recorder, SourceLocator
from probe.capture import recorder as recorder_module
from probe.dump.schema import SCHEMA_VERSION, step_file_path
from probe.errors import DumpError
from probe.debugger.write_results import WriteResults
from probe.seed import determinism_state


class StepFiles:
    def __init__(self, config, run_id: str, seed_report: dict, results: WriteResults):
        self.config = config
        self.run_id = run_id
        self.results = results
        self._seed_report = seed_report
        self._lock = None  # rank_lock.RankLock, taken by the first opened step
        self._filter = CaptureFilter(config)  # caches decisions and source files across steps
        self._locate = SourceLocator()
        # arenas of small CPU tensors' statistics, reused step after step (capture/numbers/host_batch.py)
        self._host_batch = HostBatch(config.sketch_size) if recorder_module.HOST_BATCH else None
        # device tensors' statistics; its layouts are reused step after step (device_bucket.py)
        self._device_bucket = DeviceBucket(config.sketch_size)
        self._no_process = False  # the writer process could not be started: write inline

    def open(self, step: int, rank: int, world_size: int) -> Recorder:
        """The recorder of a newly captured step (its writer opens when first needed)."""
        cfg = self.config
        self._take_lock(rank)
        attrs = {
            "run_id": self.run_id,
            "schema_version": SCHEMA_VERSION,
            "probe_version": __version__,
            "torch_version": str(torch.__version__),
            "step": step,
            "rank": rank,
            "world_size": world_size,
            "task": cfg.task,
            "level": cfg.level,
            "device": "",
            "config": cfg.to_dict(),
            "seed_report": self._seed_report,
            "determinism": determinism_state(),
            "autocast": [],  # filled in place by the recorder: which calls ran under autocast
        }

        def open_writer():
            from probe.dump.writer import StepWriter

            return StepWriter(cfg.dump_path, step, rank, attrs, buffer_bytes=cfg.buffer_mb << 20)

        recorder = Recorder(cfg, open_writer, capture_filter=self._filter,
                            locate=self._locate, host_batch=self._host_batch or False,
                            device_bucket=self._device_bucket)
        recorder.step_attrs = attrs
        recorder.autocast_runs = attrs["autocast"]
        return recorder

    @staticmethod
    def take_rows(recorder: Recorder) -> list:
        """The step's records, taken from its recorder, which forgets the step."""
        recorder.resolve()
        rows, recorder.rows = recorder.rows, []
        recorder.end_step()
        return rows

    def write(self, recorder: Recorder, rows: list) -> str | None:
        """Hand the step's records to a writer; the path its file has (or will have), None
        when it could not be written."""
        writer = recorder.writer
        attrs = recorder.step_attrs
        device = recorder.device or "cpu"
        extra = {"device": device, "cost": recorder.cost(), **recorder.end_attrs()}
        if recorder.write_error is not None:
            if writer is not None:
                writer.abort()
            self.results.deliver(block=False)
            self.results.failed(recorder.write_error, attrs["step"])
            return None
        path = None
        if writer is None and self._in_background():
            path = self._hand_over(rows, attrs, extra)
        if path is None:
            path = self._write_inline(writer or recorder.open_writer(), rows, extra)
        return path

    def release_lock(self) -> None:
        lock, self._lock = self._lock, None
        if lock is not None:
            lock.release()

    def _take_lock(self, rank: int) -> None:
        """Hold this rank's lock in dump_path, making the folder the first time: a bad
        dump_path fails at the first start(), not at the first write. Later steps leave the
        folder to the file writer, which makes it again if it went missing (a mkdir each
        start() cost 50-110 us on a busy machine)."""
        from probe.dump.layout import make_folder  # h5py, once something is dumped
        from probe.dump.rank_lock import RankLock

        if self._lock is None or self._lock.rank != rank:
            if self._lock is not None:
                self._lock.release()
            make_folder(self.config.dump_path, "dump_path")
            self._lock = RankLock(self.config.dump_path, rank, self.run_id)

    def _in_background(self) -> bool:
        """Statistics and checksum steps go to the writer process (config writer)."""
        choice = self.config.writer
        if choice == "auto":
            choice = "process" if _usable_cpus() >= 2 else "inline"
        return choice == "process" and self.config.task != "tensor" and not self._no_process

    def _write_inline(self, target, rows: list, extra: dict) -> str | None:
        path = error = None
        try:
            path = target.finish(rows, extra)
        except DumpError as failure:
            error = failure
        self.results.written_inline(target.step, path, error)
        return path

    def _hand_over(self, rows: list, attrs: dict, extra: dict) -> str | None:
        """Give the step to the writer process and return the path its file will have;
        None when no writer process can be started (then this debugger writes inline from now
        on, and says so once)."""
        from probe.dump import background

        results = self.results
        if results.pending is None:
            results.pending = background.PendingSteps()
        if results.pending.full():
            results.pending.wait_oldest()  # bounds memory; its result is delivered below
        job = {"dump_path": os.path.abspath(self.config.dump_path), "step": attrs["step"],
               "rank": attrs["rank"], "attrs": attrs, "extra": extra, "rows": rows}
        path = step_file_path(self.config.dump_path, attrs["step"], attrs["rank"])
        try:
            results.pending.submit(job, path)
        except OSError as error:
            self._no_process = True
            warnings.warn(f"probe: cannot start the writer process ({error}); step() writes "
                          "the step files itself from now on", RuntimeWarning, stacklevel=5)
            return None
        results.deliver(block=False)
        return path


def _usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask, else the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1
