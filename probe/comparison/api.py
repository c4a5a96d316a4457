"""Compare dump A (the reference) with dump B: the stages, step file pair by step file pair.

    load (load.py) -> for each pair of step files: engine.compare_step (normalize, align,
    measure, judge, attribute) -> assemble (assemble.py) -> CompareResult

The result is data. ``probe.compare`` (probe/compare_and_replay.py) adds the replay and the
renderers (to_text, to_json, write_csv, write_html). A is the reference: relative errors
are relative to A.
"""

from __future__ import annotations

import contextlib
import os
from typing import Callable, Iterable

from probe.comparison import load as L
from probe.comparison import result as R
from probe.comparison import envelope_summary, model_overlap, run_info
from probe.comparison import sharded_steps
from probe.comparison.assemble import assemble
from probe.comparison.drift import apply_drift
from probe.comparison.engine import compare_step
from probe.comparison.entering import rank_entering
from probe.comparison.mapping import NameMapping, load_mapping, mapping_from_dict
from probe.comparison.autocast_runs import shared_autocast
from probe.comparison.precision import PrecisionTally, judge_precision
from probe.comparison.records import content_keys
from probe.comparison.result import StepOutcome
from probe.comparison.rounding import measured_envelopes
from probe.comparison.tolerances import Tolerances
from probe.errors import CompareError

DEFAULT_TOP = 10


def compare(
    a,
    b,
    *,
    rtol: float | None = None,
    atol: float | None = None,
    tol: Iterable[str] = (),
    tol_file: str | None = None,
    tolerances: dict | None = None,
    mapping=None,
    allow_missing: bool = False,
    steps: Iterable[int] | None = None,
    ranks: Iterable[int] | None = None,
    top: int = DEFAULT_TOP,
    strict: bool = False,
    progress: Callable[[float, int], None] | None = None,
    baseline=None,
) -> R.CompareResult:
    """Compare dump A (the reference) with dump B (probe.compare documents the options).

    baseline: dump C, a second trusted run of A's kind (another thread count, another GPU of
    the same type, ``probe run --perturb``): each output's envelope is then measured, what
    C differs from A by there (rounding.measured_envelopes), and B - A is judged against it."""
    if isinstance(top, bool) or not isinstance(top, int) or top < 0:
        raise CompareError(f"top must be an integer >= 0, found {top!r}")
    measured = None
    if baseline is not None:
        trusted = compare(a, baseline, rtol=rtol, atol=atol, tol=tol, tol_file=tol_file, tolerances=tolerances,
                          mapping=mapping, allow_missing=allow_missing, steps=steps, ranks=ranks, top=top)
        measured = measured_envelopes(trusted.rows)
    table = Tolerances.build(rtol=rtol, atol=atol, per_dtype=tol, tol_file=tol_file, overrides=tolerances)
    names = _mapping(mapping)
    path_a, path_b = os.fspath(a), os.fspath(b)
    dump_a, dump_b = L.load_dumps(path_a, path_b)
    sharded = None
    if os.path.isdir(path_a) and os.path.isdir(path_b):
        sharded = sharded_steps.plan(dump_a, dump_b, None if steps is None else set(steps),
                                     None if ranks is None else set(ranks), allow_missing)
    if sharded is None:
        pairs, missing = L.pair_step_files(dump_a, dump_b, path_a, path_b, allow_missing, steps, ranks)
        opened = L.open_step_files(dump_a, dump_b, pairs)
    else:  # DTensor records, or different world sizes: logical tensors (shards.py)
        pairs, missing, opened = sharded.pairs, sharded.missing, sharded.step_files()

    notes = L.dump_notes(dump_a, dump_b)
    differences: list[dict] = []
    outcomes: list[StepOutcome] = []
    steps_info = []
    total_bytes = 0
    previous: dict[int, set] = {}  # rank -> content keys of A's last compared step file
    devices_ab = ("", "")
    explained: dict[int, dict] = {}  # rank -> accepted differences of A's last compared step file
    same_model = None
    autocast_runs: list = []  # (A's, B's) root attribute autocast, per step file pair
    with contextlib.closing(opened) as step_files:
        for position, files in enumerate(step_files):
            def report(done, total, read, _position=position):
                if progress is not None:
                    progress((_position + done / max(total, 1)) / len(pairs), total_bytes + read)

            key_a, key_b = files.key_a, files.key_b
            if position == 0:
                notes += L.attr_notes(files.attrs_a, files.attrs_b)
                differences = run_info.run_differences(files.attrs_a, files.attrs_b)
                devices_ab = (str(files.attrs_a.get("device") or ""), str(files.attrs_b.get("device") or ""))
                if names is None:
                    share = model_overlap.overlap(files.records_a.columns["module"], files.records_b.columns["module"])
                    same_model = model_overlap.different_models_note(share)
            autocast_a, autocast_b = files.attrs_a.get("autocast"), files.attrs_b.get("autocast")
            outcome = compare_step(
                files.records_a,
                files.records_b,
                files.fetch_a,
                files.fetch_b,
                table,
                names,
                step=key_a[0],
                rank=key_a[1],
                progress=report,
                previous=previous.get(key_a[1]),
                previous_explained=explained.get(key_a[1]),
                autocast=shared_autocast(autocast_a, autocast_b),
                strict=strict,
                baseline=measured.get((key_a[0], key_a[1]), {}) if measured is not None else None,
            )
            autocast_runs.append((autocast_a, autocast_b))
            previous[key_a[1]] = content_keys(files.records_a)
            explained[key_a[1]] = outcome.explained
            total_bytes += outcome.tensor_bytes
            outcomes.append(outcome)
            counts = outcome.counts()
            steps_info.append({
                "step": key_a[0],
                "rank": key_a[1],
                "step_b": key_b[0],
                "rank_b": key_b[1],
                "file_a": dump_a.files[key_a],
                "file_b": dump_b.files[key_b],
                "verdict": None,  # assemble.py decides, with strict
                "counts": counts,
            })
    if sharded is not None:
        notes += sharded.notes
    precision = PrecisionTally()  # lower dtypes on one side (comparison/precision.py)
    for outcome, (runs_a, runs_b), info in zip(outcomes, autocast_runs, steps_info):
        judge_precision(outcome.rows, runs_a, runs_b, precision)
        info["counts"] = outcome.counts()
    result = assemble(outcomes, steps_info, table, path_a, path_b, missing, notes, top, strict, devices_ab)
    result.run_differences = differences + precision.differences()
    result.notes.extend(precision.notes())
    apply_drift(result)
    rank_entering(result)
    result.envelope = envelope_summary.summarize(result.rows, result.notes, strict,
                                                 os.fspath(baseline) if baseline is not None else None)
    if same_model is not None:
        result.notes.insert(0, same_model)
    return result


def _mapping(mapping) -> NameMapping | None:
    if mapping is None or isinstance(mapping, NameMapping):
        return mapping
    if isinstance(mapping, dict):
        return mapping_from_dict(mapping)
    return load_mapping(os.fspath(mapping))
