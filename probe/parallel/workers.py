"""``probe compare --jobs N``: a compare's units spread over N processes of this machine.

A unit (a pair of step files; a sharded step's pairs, every rank of its group) is compared
and reduced to its summary (comparison.summary.Partial) in a worker process, which merges it into
the summary of every unit it compared so far. Units of one chain (a rank's steps: each hands on
what A's step file carries, comparison/load.py UnitPlan.chains) run one after the other, the
chain's state travelling with them through this process; chains run side by side, the longest
first. Once every unit is compared each worker hands its summary over, and this process merges
them. The merge does not depend on the order or the grouping, so the result is the one
``--jobs 1`` gives. Merging in the workers keeps this process's share small: it had decoded and
merged one summary a unit (7 ms against 0.2 s of a worker's compare, which made it the limit of
a compare beyond about 25 workers); it now reads one small answer a unit and one summary a
worker. At most two units per worker are in flight.

Workers ignore Ctrl-C: this process stops them (Pool.terminate) and raises KeyboardInterrupt.
Python drops a KeyboardInterrupt raised inside a weakref or garbage-collector callback
("Exception ignored in ..."), and a Ctrl-C can land there while the dumps are opened and the
units planned, or while this process waits for the workers: the Ctrl-C is also remembered
(RememberedCtrlC, around the whole compare command) and raised again at the next unit.
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import signal
import sys
import threading

from probe.comparison.api import Chain, CompareJob, Context, compare_unit, run_units
from probe.comparison.load import collect_rarely
from probe.comparison.summary import Partial, kept_cutoff
from probe.errors import CompareError
from probe.parallel import wire
from probe.parallel.ctrl_c import RememberedCtrlC, ctrl_c_held

#: fork on Linux: a worker starts in milliseconds, with probe.comparison imported, and does not
#: import the caller's main module again (spawn and forkserver run an unguarded script's
#: top level in every worker). This process holds no open step file when it forks; a worker
#: opens its own. Elsewhere spawn.
_START = "fork" if sys.platform.startswith("linux") else "spawn"


def default_jobs() -> int:
    """The cores this process may run on (its CPU affinity), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


class LocalRunner:
    """api.compare's runner for ``--jobs N``. ``done``/``total``: units compared so far, of all."""

    def __init__(self, jobs: int | None = None):
        self.jobs = default_jobs() if jobs is None else jobs
        self.done = 0
        self.total = 0

    def __call__(self, job: CompareJob, context: Context, progress=None) -> Partial:
        chains = context.plan.chains()
        self.total = len(context.plan.units)
        with RememberedCtrlC() as ctrl_c:
            if self.jobs <= 1 or len(chains) <= 1:
                partial = run_units(job, context, self._counting(progress, ctrl_c))
                self.done = self.total
                return partial
            return self._spread(job, context, sorted(chains, key=len, reverse=True), progress, ctrl_c)

    def share_exit(self, code):
        """The exit code every process of the compare returns (one process here)."""
        return code

    def _counting(self, progress, ctrl_c):
        def report(fraction, read):
            ctrl_c.check()
            self.done = int(fraction * self.total)  # units wholly compared
            if progress is not None:
                progress(fraction, read)
        return report

    def _spread(self, job: CompareJob, context: Context, chains: list, progress, ctrl_c) -> Partial:
        units = context.plan.units
        partial = Partial(budget=job.keep_rows)
        answers: queue.SimpleQueue = queue.SimpleQueue()
        workers = min(self.jobs, len(chains))
        pool = None
        waiting = list(range(len(chains)))  # chains not started, longest first
        read = 0
        cutoff = [None]  # the smallest key a worker's summary left out: none after it is kept (Partial.keep)
        kept = {}  # worker's pid -> the kept_sizes() of its summary, as of its last unit

        def submit(chain: int, step: int, state: bytes | None) -> None:
            pool.apply_async(_compare, (units[chains[chain][step]], state, cutoff[0]),
                             callback=lambda answer: answers.put((chain, step, answer, None)),
                             error_callback=lambda error: answers.put((chain, step, None, error)))

        try:
            # held: a Ctrl-C inside Pool() would leave the workers it started with no pool to
            # stop them, and the pool's thread forking new ones while this process exits
            with ctrl_c_held():
                start = multiprocessing.get_context(_START)
                pool = start.Pool(workers, initializer=_start_worker, initargs=(job, start.Barrier(workers)))
            for _ in range(min(2 * workers, len(waiting))):
                submit(waiting.pop(0), 0, None)
            while self.done < self.total:
                ctrl_c.check()
                try:
                    chain, step, answer, error = answers.get(timeout=_WAKE_S)
                except queue.Empty:
                    continue
                if error is not None:
                    raise error
                state, unit_read, kept_to, (worker, sizes) = answer
                if kept_to is not None:
                    cutoff[0] = kept_to if cutoff[0] is None else min(cutoff[0], kept_to)
                kept[worker] = sizes
                self.done += 1
                read += unit_read
                if progress is not None:
                    progress(self.done / self.total, read)
                if step + 1 < len(chains[chain]):
                    submit(chain, step + 1, state)
                elif waiting:
                    submit(waiting.pop(0), 0, None)
            # each worker drops the kept rows the merge would drop: every one keeps its first pair,
            # and this process would decode a pair's rows a worker to keep one of them
            left_out = kept_cutoff([size for sizes in kept.values() for size in sizes], job.keep_rows, cutoff[0])
            handed = [pool.apply_async(_hand_over, (left_out,)) for _ in range(workers)]
            for answer in handed:
                while not answer.ready():
                    ctrl_c.check()
                    answer.wait(_WAKE_S)
                summary = answer.get()
                if summary is not None:
                    partial.merge(wire.decode(summary))
            lost = {position for unit in units for position in unit} - set(partial.files)
            if lost:  # a worker that ended between two units took their summaries with it
                raise CompareError(f"{len(lost)} pairs of step files were compared by a worker process that "
                                   "ended before handing their summary over (killed: out of memory?); run the "
                                   "compare again, with fewer --jobs")
        except BaseException:
            RememberedCtrlC.caught()
            if pool is not None:
                pool.terminate()
            raise
        pool.close()
        pool.join()
        return partial


#: how often the wait for the workers' answers looks for a Ctrl-C Python dropped
_WAKE_S = 0.2


_CONTEXT: Context | None = None
#: what this worker compared so far, merged; the barrier every worker meets when handing it over
_HELD: Partial | None = None
_BARRIER = None


def _start_worker(job: CompareJob, barrier) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops the workers on Ctrl-C
    global _CONTEXT, _BARRIER
    collect_rarely()  # this process compares units until the pool ends
    _CONTEXT = Context.of(job)
    _BARRIER = barrier


def _compare(unit: list, state: bytes | None, cutoff) -> tuple[bytes, int, tuple | None, tuple]:
    """One unit in a worker, merged into what it compared before: (its chain's state after it,
    tensor bytes read, the smallest key this worker's summary left out so far, (this worker's
    pid, the kept_sizes() of its summary))."""
    global _HELD
    chain = wire.decode(state) if state is not None else Chain()
    partial, read = compare_unit(_CONTEXT, unit, chain, None, cutoff)
    _HELD = partial if _HELD is None else _HELD.merge(partial)
    return wire.encode(chain), read, _HELD.cutoff, (os.getpid(), _HELD.kept_sizes())


def _hand_over(left_out: tuple | None) -> bytes | None:
    """This worker's summary (None: it compared nothing), once, without the kept pairs from key
    left_out on (summary.kept_cutoff). Every worker waits at the barrier before answering, so
    that each takes exactly one of the pool's hand-over tasks."""
    global _HELD
    held, _HELD = _HELD, None
    if held is not None:
        held.leave_out_from(left_out)
    try:
        _BARRIER.wait(timeout=_HAND_OVER_S)
    except threading.BrokenBarrierError:
        raise CompareError(f"a worker process did not come to hand its summary over within {_HAND_OVER_S:g} s "
                           "(ended, or stopped); run the compare again, with fewer --jobs") from None
    return wire.encode(held) if held is not None else None


#: how long the workers wait for each other to hand their summaries over: every one is idle
#: by then, so they meet within milliseconds unless one has gone
_HAND_OVER_S = 120.0
