"""Compare dump A (the reference) with dump B: the stages, step file pair by step file pair.

    load (load.py) -> for each pair of step files: compare_step -> assemble (assemble.py)
        -> CompareResult

and for one pair of step files (compare_step):

    StepInput --normalize--> calls --align--> call pairs and their Slots
        --measure--> Measurements --judge--> StepOutcome (statuses, origins)

Each stage is a module with one job; it takes the previous stage's struct (structs.py) and
returns its own, and no stage calls back into an earlier one. After measure no stage reads
a record column: what the judge needs of the records is in each Measurement (the float64
recheck, rounding.py, is the one exception: it replays an op from the dumped tensors). A
normalize step (a function NormalizedStep -> NormalizedStep) or an align refiner (a function
(pairs, records_a, records_b) -> pairs) is added by listing it below. docs/architecture.md
draws the stages.

The result is data. ``probe.compare`` (probe/compare_and_replay.py) adds the replay and the
renderers (to_text, to_json, write_csv, write_html). A is the reference: relative errors
are relative to A.
"""

from __future__ import annotations

import contextlib
import os
from typing import Callable, Iterable

from probe.comparison import load as L
from probe.comparison import normalize
from probe.comparison import result as R
from probe.comparison.align import align
from probe.comparison.assemble import assemble
from probe.comparison.foreach_pairing import pair_foreach
from probe.comparison.judge import judge
from probe.comparison.measure import measure, shared_autocast
from probe.comparison.records import NameMapping, load_mapping, mapping_from_dict
from probe.comparison.rounding import measured_envelopes
from probe.comparison.structs import Carry, StepInput, StepOutcome
from probe.comparison.tolerances import Tolerances
from probe.errors import CompareError

DEFAULT_TOP = 10
#: the normalize steps, in the order they run on both sides' records and calls
NORMALIZE = (
    normalize.link_reduced_gradients,
    normalize.build_call_lists,
    normalize.split_foreach_calls,
    normalize.name_optimizer_targets,
)
#: what pairs the calls align.align_calls left alone, in order
ALIGN_REFINERS = (
    pair_foreach,
)


def compare_step(step_input: StepInput, tolerances: Tolerances, mapping: NameMapping | None = None,
                 carry: Carry | None = None) -> StepOutcome:
    """Normalize, align, measure and judge one pair of step files.

    tolerances: the table in force, and whether it decides alone (Tolerances.strict: rounding
    envelopes are information only); mapping: the renames of a mapping file; carry: what A's
    previous step file of the same rank handed on (its content keys and its accepted
    differences, StepOutcome.explained), None for the first one."""
    carry = carry or Carry()
    normalized = normalize.normalize(step_input.records_a, step_input.records_b, mapping, NORMALIZE)
    aligned = align(normalized, ALIGN_REFINERS, step_input.step, step_input.rank)
    measured = measure(aligned, step_input.fetch_a, step_input.fetch_b, tolerances, carry.content_keys,
                       step_input.progress, shared_autocast(step_input.autocast_a, step_input.autocast_b))
    return judge(measured, carry.explained, (step_input.autocast_a, step_input.autocast_b), tolerances.strict,
                 step_input.baseline)


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
    table = Tolerances.build(rtol=rtol, atol=atol, per_dtype=tol, tol_file=tol_file, overrides=tolerances,
                             strict=strict)
    names = _mapping(mapping)
    path_a, path_b = os.fspath(a), os.fspath(b)
    dump_a, dump_b = L.load_dumps(path_a, path_b)
    sharded = None
    if os.path.isdir(path_a) and os.path.isdir(path_b):
        sharded = L.plan(dump_a, dump_b, None if steps is None else set(steps),
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
    carried: dict[int, Carry] = {}  # rank -> what A's last compared step file of that rank hands on
    devices_ab = ("", "")
    same_model = None
    with contextlib.closing(opened) as step_files:
        for position, files in enumerate(step_files):
            def report(done, total, read, _position=position):
                if progress is not None:
                    progress((_position + done / max(total, 1)) / len(pairs), total_bytes + read)

            key_a, key_b = files.key_a, files.key_b
            if position == 0:
                notes += L.attr_notes(files.attrs_a, files.attrs_b)
                differences = L.run_differences(files.attrs_a, files.attrs_b)
                devices_ab = (str(files.attrs_a.get("device") or ""), str(files.attrs_b.get("device") or ""))
                if names is None:
                    share = L.overlap(files.records_a.columns["module"], files.records_b.columns["module"])
                    same_model = L.different_models_note(share)
            step_input = StepInput(files.records_a, files.records_b, files.fetch_a, files.fetch_b, key_a[0], key_a[1],
                                   files.attrs_a.get("autocast"), files.attrs_b.get("autocast"), report,
                                   measured.get((key_a[0], key_a[1]), {}) if measured is not None else None)
            outcome = compare_step(step_input, table, names, carried.get(key_a[1]))
            carried[key_a[1]] = Carry(outcome.content_keys, outcome.explained)
            total_bytes += outcome.tensor_bytes
            outcomes.append(outcome)
            steps_info.append({
                "step": key_a[0],
                "rank": key_a[1],
                "step_b": key_b[0],
                "rank_b": key_b[1],
                "file_a": dump_a.files[key_a],
                "file_b": dump_b.files[key_b],
                "verdict": None,  # assemble.py decides, with strict
                "counts": outcome.counts(),
            })
    if sharded is not None:
        notes += sharded.notes
    return assemble(outcomes, steps_info, table, path_a, path_b, missing, notes, top, strict, devices_ab,
                    differences, same_model, os.fspath(baseline) if baseline is not None else None)


def _mapping(mapping) -> NameMapping | None:
    if mapping is None or isinstance(mapping, NameMapping):
        return mapping
    if isinstance(mapping, dict):
        return mapping_from_dict(mapping)
    return load_mapping(os.fspath(mapping))
