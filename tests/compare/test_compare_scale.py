"""A compare at the scale of a job: each step-and-rank unit reduced before the next (memory
does not grow with the rank files), the same report from any number of processes, and from
torchrun's processes."""

import gc
import os
import signal
import subprocess
import sys
import time
import weakref

import pytest
import torch

import probe

from probe.comparison.api import compare, run_units
from probe.comparison.assemble import FileFacts
from probe.comparison.structs import RecordRow
from probe.comparison.summary import Partial
from probe.parallel import workers
from tests import rounding_pairs as P

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _nudge(model):
    with torch.no_grad():
        next(model.parameters()).mul_(1.001)  # a divergence for the report to tell


def _small():
    return P.DeepStack(depth=2)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two 2-step statistics runs of a two-block DeepStack, B with a nudged weight: {ranks: (A,
    B)} for 2, 4, 16, 64 and 256 rank files per step (hard links: made in a moment)."""
    root = tmp_path_factory.mktemp("scale")
    one = (P.run(root / "a1", _small, steps=2, task="statistics"),
           P.run(root / "b1", _small, steps=2, task="statistics", fault=_nudge))
    return {ranks: tuple(P.rank_files(side, str(root / f"{name}{ranks}x"), ranks) for name, side in zip("ab", one))
            for ranks in (2, 4, 16, 64, 256)}


def _peak_live_rows(a, b, monkeypatch) -> int:
    """The most RecordRows alive at the end of any unit of compare(a, b), keeping no rows for a
    report's tables past the first step file's."""
    made_rows: list = []  # a weak reference to every RecordRow made
    made = RecordRow.__init__

    def tracked(self, *args, **kwargs):
        made(self, *args, **kwargs)
        made_rows.append(weakref.ref(self))

    monkeypatch.setattr(RecordRow, "__init__", tracked)
    peak, seen = [0], [-1]

    def runner(job, context, progress=None):
        units = len(context.plan.units)

        def counting(fraction, read):
            if int(fraction * units) != seen[0]:  # a unit has ended: what is left of it is its summary
                seen[0] = int(fraction * units)
                # no gc.collect(): a compare makes no reference cycles (the test below holds
                # that), so what it let go of is already freed, and each full collection here
                # walked every object the process holds (0.3 s with torch loaded)
                peak[0] = max(peak[0], sum(1 for row in made_rows if row() is not None))

        return run_units(job, context, counting, None)

    compare(a, b, keep_rows=0, runner=runner)
    monkeypatch.undo()
    return peak[0]


def test_the_rows_alive_during_a_compare_do_not_grow_with_the_rank_files(runs, monkeypatch):
    """Each unit is reduced to its summary before the next: 4 rank files hold no more rows alive
    than 2 (every unit's rows kept would hold 2x)."""
    two, four = _peak_live_rows(*runs[2], monkeypatch), _peak_live_rows(*runs[4], monkeypatch)
    assert two > 0
    assert four <= 1.5 * two, (two, four)


def test_units_are_compared_with_rare_full_collections_and_make_no_reference_cycles(runs):
    """A full garbage collection walks every live object; while units are compared they run
    every 1,000 middle collections, and young ones every 100,000 allocations (about two a
    unit of the 16-rank bench's, not eight; thresholds restored after). That is safe because a compare leaves no garbage
    that only a collection frees: with the collector off, a 16-rank compare leaves as little
    cyclic garbage as a 2-rank one."""
    seen = []

    def runner(job, context, progress=None):
        seen.append(gc.get_threshold())
        return run_units(job, context, progress, None)

    before = gc.get_threshold()
    cyclic = {}
    gc.collect()
    gc.disable()
    try:
        for ranks in (2, 16):
            compare(*runs[ranks], runner=runner)
            cyclic[ranks] = gc.collect()
    finally:
        gc.enable()
    assert gc.get_threshold() == before
    assert all(found[2] >= 1000 and found[0] >= 100_000 for found in seen), seen
    assert cyclic[16] <= cyclic[2] + 10, cyclic


def _summary_rows(a, b) -> int:
    """The rows the merged summary of compare(a, b)'s step 0 holds (the first step file's kept for
    a report's tables among them)."""
    partials = []

    def runner(job, context, progress=None):
        partials.append(run_units(job, context, progress, None))
        return partials[-1]

    compare(a, b, keep_rows=0, steps=[0], runner=runner)
    return len(partials[0].rows())


def test_the_summary_of_a_step_holds_as_many_rows_for_16_ranks_as_for_2(runs):
    """What the story, the first divergences and the changes read of a step is chosen as the
    units merge, not kept per rank file."""
    assert _summary_rows(*runs[16]) == _summary_rows(*runs[2]) > 0


def _facts_read_per_file(a, b, monkeypatch) -> float:
    """How many step files' facts Partial.prune reads over compare(a, b), per step file."""
    reads, pruning, prune = [0], [False], Partial.prune
    read = FileFacts.__getattribute__

    def counting(self, name):
        if pruning[0] and name == "story":  # every file prune visits is asked for its story rows
            reads[0] += 1
        return read(self, name)

    def counted_prune(self):
        pruning[0] = True
        try:
            prune(self)
        finally:
            pruning[0] = False

    monkeypatch.setattr(FileFacts, "__getattribute__", counting)
    monkeypatch.setattr(Partial, "prune", counted_prune)
    result = compare(a, b, keep_rows=0)
    monkeypatch.undo()
    return reads[0] / len(result.steps)


def test_merging_a_unit_costs_no_more_after_16_rank_files_than_after_4(runs, monkeypatch):
    """Partial.prune visits the step files that still hold rows, not every file merged so far:
    the work of a merge does not grow with the units merged before it (when it did, a compare
    of N rank files cost N squared: 8% of the compare at 8,192 rank files)."""
    four, sixteen = _facts_read_per_file(*runs[4], monkeypatch), _facts_read_per_file(*runs[16], monkeypatch)
    assert 0 < sixteen <= 1.25 * four, (four, sixteen)


def test_the_report_covers_every_unit_whatever_rows_it_keeps(runs):
    """Counts, verdicts and the story do not depend on how many rows the result keeps."""
    kept, every = compare(*runs[2], keep_rows=0), compare(*runs[2], keep_rows=None)
    assert kept.counts == every.counts and len(kept.steps) == len(every.steps) == 4
    assert kept.first_divergence.key == every.first_divergence.key and kept.verdict == every.verdict == "diverged"
    assert len(kept.rows) < len(every.rows)


def _cli(*arguments, launcher=(sys.executable, "-m", "probe")):
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])))
    return subprocess.run([*launcher, "compare", *arguments], capture_output=True, text=True, env=env, timeout=300,
                          cwd=REPO)


def test_jobs_2_gives_the_json_report_of_jobs_1_byte_for_byte(runs):
    a, b = runs[2]  # two chains of two steps: one to each worker
    one, two = _cli(a, b, "--json", "--rows", "--jobs", "1"), _cli(a, b, "--json", "--rows", "--jobs", "2")
    assert one.returncode == two.returncode == 1, two.stderr
    assert one.stdout == two.stdout and '"verdict": "diverged"' in one.stdout


def test_with_jobs_2_each_worker_merges_its_units_and_this_process_reads_one_summary_a_worker(runs, monkeypatch):
    """8 units on two workers: the command decodes two summaries, not eight (it had been the
    limit of a compare on many cores), and reports what --jobs 1 does."""
    from probe.parallel import wire

    decoded = []
    decode = wire.decode
    monkeypatch.setattr(wire, "decode", lambda data: decoded.append(len(data)) or decode(data))
    alone = probe.compare(*runs[4], jobs=1).to_json()
    decoded.clear()  # what a worker decodes (its chain's state) it counts in its own memory, if at all
    spread = probe.compare(*runs[4], jobs=2).to_json()
    assert len(decoded) == 2 and spread == alone


@pytest.mark.parametrize("keep_rows", [0, 1500, None])  # a pair holds 492 rows
def test_with_jobs_2_this_process_decodes_only_the_kept_rows_the_report_keeps(runs, monkeypatch, keep_rows):
    """Every worker keeps its first pair's rows (it cannot know another holds an earlier one);
    each leaves out, before handing its summary over, the pairs the merge would drop: the
    command decodes the rows of the kept pairs once, and the report is --jobs 1's."""
    from probe.parallel import wire

    decoded = []
    decode = wire.decode
    monkeypatch.setattr(wire, "decode", lambda data: decoded.append(decode(data)) or decoded[-1])
    alone = probe.compare(*runs[4], jobs=1, keep_rows=keep_rows)
    decoded.clear()
    spread = probe.compare(*runs[4], jobs=2, keep_rows=keep_rows)
    rows = sum(len(kept.rows) for summary in decoded if isinstance(summary, Partial) for kept in summary.kept)
    assert rows == len(spread.rows) == len(alone.rows) > 0 and spread.to_json() == alone.to_json()


def _hand_over_losing_the_first_unit(left_out):
    """A worker's hand-over as if it had been killed between two units: the summary holding the
    compare's first unit is gone (the other worker's is handed over)."""
    held = workers._HELD
    summary = _REAL_HAND_OVER(left_out)
    return None if held is not None and 0 in held.files else summary


#: taken when this module is imported: before the test patches it in a forked worker, and in a
#: spawned one (which imports this module afresh and finds it unpatched)
_REAL_HAND_OVER = workers._hand_over


def test_a_worker_that_ends_without_handing_over_its_summary_is_an_error_not_a_smaller_report(runs, monkeypatch):
    from probe.errors import CompareError

    monkeypatch.setattr(workers, "_hand_over", _hand_over_losing_the_first_unit)
    with pytest.raises(CompareError, match=r"pairs of step files were compared by a worker process that ended"):
        probe.compare(*runs[4], jobs=2)


def test_a_two_process_torchrun_compare_of_a_four_rank_dump_prints_the_jobs_1_report_on_rank_0(runs):
    a, b = runs[4]
    alone = subprocess.CompletedProcess((), 1, probe.compare(a, b, jobs=1).to_json(), "")
    spread = _cli(a, b, "--json", launcher=(sys.executable, "-m", "torch.distributed.run", "--standalone",
                                            "--nproc_per_node", "2", "-m", "probe"))
    # rank 0 exits 1 (diverged), and torchrun turns a rank's non-zero exit into its own failure
    assert spread.returncode != 0 and "diverged" in alone.stdout, spread.stderr[-3000:]
    assert spread.stdout == alone.stdout, spread.stderr[-3000:]


def _runs_python(pid: str) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            return handle.read().split(b"\0")[0] == sys.executable.encode()
    except OSError:  # gone already
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds the worker processes left behind through /proc, which only Linux has")
def test_ctrl_c_stops_a_jobs_2_compare_with_one_line_exit_2_and_no_worker_left(runs):
    # 512 units: seconds of work, stopped as soon as the workers run (with 128, a fast
    # compare could end before the signal came, and rightly exit 1 with its report)
    a, b = runs[256]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    # SIGINT as an interactive shell gives it: a suite started in the background (``cmd &``
    # without job control) passes on an ignored SIGINT, and the compare would rightly ignore it
    process = subprocess.Popen([sys.executable, "-m", "probe", "compare", a, b, "--jobs", "2"], env=env, cwd=REPO,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    children = f"/proc/{process.pid}/task/{process.pid}/children"
    workers = []
    # both workers are comparing. Two, not one: a library may run another program first
    # (`uname -p`), and its child reads as this Python between its fork and its exec
    while process.poll() is None and len(workers) < 2:
        with open(children, encoding="ascii") as handle:
            workers = [pid for pid in handle.read().split() if _runs_python(pid)]
        time.sleep(0.02)
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=60)
    assert process.returncode == 2 and out == "", err
    assert err.startswith("probe: interrupted after comparing ") and "of 512 units" in err and "Traceback" not in err
    deadline = time.monotonic() + 10
    while [pid for pid in workers if os.path.exists(f"/proc/{pid}")] and time.monotonic() < deadline:
        time.sleep(0.05)  # a worker the command stopped may take a moment to be gone
    assert not [pid for pid in workers if os.path.exists(f"/proc/{pid}")]

