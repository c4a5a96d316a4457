"""``probe.compare(a, b, **options) -> CompareResult``: the Python face of ``probe compare``.

It runs the compare pipeline (probe/comparison/api.py), then, when asked, the float64
replay of the ops it names (probe/replay/), and returns the result with its renderers
(probe/report/rendered.py). Neither the compare nor the reports import the replay: it sits
above them, and this module above all three.

A and B are dump files or dump folders. Folders pair their step files by (step, rank);
a step or rank found on one side only is an error (CompareError) unless
``allow_missing=True``, which compares the common ones and lists the rest in
``result.missing``. Two files compare with each other whatever their step numbers.
A is the reference: relative errors are relative to A.
"""

from __future__ import annotations

from typing import Callable

from probe.comparison import api
from probe.errors import CompareError
from probe.report.rendered import RenderedResult


def compare(
    a,
    b,
    *,
    replay: int | None = None,
    replay_budget: float = 60.0,
    replay_progress: Callable | None = None,
    jobs: int = 1,
    **options,
) -> RenderedResult | None:
    """Compare dump A (the reference) with dump B.

    options (probe/comparison/api.py compare): rtol, atol, tol, tol_file, tolerances, mapping,
    allow_missing, steps, ranks, top (default 10), strict, progress.
    rtol/atol: override every floating dtype; tol: ["bfloat16=1e-2,1e-5", ...];
    tol_file: YAML {dtype: {rtol, atol}}; tolerances: {dtype: (rtol, atol)} (Python form).
    mapping: a YAML path, a dict {"modules": {...}, "ops": {...}} or a NameMapping.
    steps/ranks: compare only these. strict: records present on one side only count as a
    divergence. progress(fraction_done, tensor_bytes_read) is called as the compare goes.
    keep_rows: the records whose rows the result keeps (default 20,000; None: every one; the
    counts, verdicts, top ops and story always cover every record). runner: how the units
    run (probe/parallel: ``LocalRunner(jobs)`` over processes of this machine, ``TorchrunRunner()``
    under torchrun); None: one after the other in this process. jobs: compare on this many
    processes of this machine (the result is the same). Returns None in a process of a
    torchrun compare that is not rank 0.
    replay: replay the first divergence, the likely cause and the top ``replay`` ops in
    float64 from each side's dumped inputs (task "tensor"; imports torch), within
    replay_budget seconds; the verdicts land in ``result.replay`` (probe.replay).
    replay_progress(done, total, call_name, verdict_or_None) follows it.
    """
    _check_replay(replay, replay_budget)
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        raise CompareError(f"jobs must be an integer >= 1 (processes to compare with), found {jobs!r}")
    if jobs > 1 and options.get("runner") is None:
        from probe.parallel.workers import LocalRunner

        options["runner"] = LocalRunner(jobs)
    if replay is not None:
        options["keep_rows"] = None  # the replay finds the calls it replays in the rows
    compared = api.compare(a, b, **options)
    if compared is None:  # another process of the compare (torchrun) finishes it
        return None
    result = RenderedResult.of(compared)
    if replay is not None:
        # torch is imported here only: a compare without replay stays torch-free
        from probe.replay import replay_result

        replay_result(result, count=replay, budget=replay_budget, progress=replay_progress)
        result.notes.extend(result.replay.notes)
    return result


def _check_replay(replay, budget) -> None:
    if replay is not None and (isinstance(replay, bool) or not isinstance(replay, int) or replay < 0):
        raise CompareError(f"replay must be an integer >= 0 (how many top ops to replay), found {replay!r}")
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not budget > 0:
        raise CompareError(f"replay_budget must be a number of seconds > 0, found {budget!r}")
