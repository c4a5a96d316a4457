"""Result stage, who is to blame: the first divergence and the likely cause, and the rules
over every step file that restate an origin before the result exists: a parameter shard
that differs on entry on one rank, where a low-precision error entered within tolerance, and
drift (correct runs parting over steps; within every op's rounding envelope, rounding).
They write rows only; the op summaries are made from the rows after the last of them
(assemble.py). Torch-free. docs/compare-rules.md gives each rule with its measurements.

Story: the first divergence is the earliest divergent output record in A's execution order;
records on one side only are counted, never a pass or a divergence. The likely cause is the
first divergent output that introduced its error (story()).

Drift: two correct runs that differ only in summation order agree within tolerance at their
first step, yet AdamW turns rounding-noise gradients into lr-sized updates and later steps
differ beyond it, entering through parameters as a weight bug would. Drift is told by its
growth: the runs differ at rounding level at the first compared step; every divergence that
is not inherited enters through parameters whose difference the previous step's recorded
update already wrote (at least 1/CARRIED_SHARE of it), or, where the model makes its own
data (a policy's rollouts: inputs no recorded op made already differ within tolerance), through
those data, and once they part (differ beyond tolerance) through ops amplifying what their
inputs already differ by; nothing else enters (no changed argument, no data a dataset gave,
no precision finding, no op amplifying agreeing inputs). A fault jumps instead and is named
where it enters, also after the runs drifted: what drift explains is not the story there
(drift_facts marks it, drifted takes it back). When it is drift, no op is "introduced" and
the likely cause is None.

Drift within rounding: such a pair exits 0 as rounding only when every divergent output is
within its rounding envelope ("within", or "unbounded" while no op introduced an error), or,
once the data the model made parted, when drift explains every step file's introduced errors
(what follows from different samples has no rounding envelope). The settled rows are
explained, origin ``rounding``, so that counts, step verdicts, the headline and ``--json``
tell the same; ``--strict`` keeps the verdict diverged.

Shard entry: a gathering collective whose input (an FSDP2 parameter shard) differs on some
ranks, made by nothing recorded, and agrees on others is inherited on every rank; the story
starts at the first differing parameter record under its module on the first such rank.

Entering: in a bfloat16 model a fault under the tolerance passes where it enters, and the
first op beyond it downstream took the blame. Two correct kernels differ by well under one
unit roundoff u, so in the step file of the first divergence and before it, the first API
call judged at a 16-bit or coarser tolerance that differs by ENTERING_UNITS x u or more and
takes that from a source (a parameter, an external input, a tensor changed in between) at
least as large as its produced inputs carry, or makes it itself (over AMPLIFICATION x that,
and over sqrt(carried x u)), is the likely cause unless an op introduced its error before.
"""

from __future__ import annotations

import copy
import math

from probe.comparison import result as R
from probe.comparison.op_envelopes import LOW_PRECISION, unit_roundoff
from probe.comparison.ops import is_gathering_collective
from probe.comparison.records import is_param_slot, module_within, param_name
from probe.comparison.rounding import ROUNDING
from probe.comparison.structs import CHANGED_INPUT, CARRIERS, EXTERNAL, PARAM_INPUT, finite, rel_error, sci


def first_divergence(rows: list[R.RecordRow]) -> R.RecordRow | None:
    """Earliest divergent output in execution order (inputs only if no output diverged)."""
    diverged = [row for row in rows if row.status == R.DIVERGED]
    outputs = [row for row in diverged if row.divergence in (R.OUTPUT, R.PRECISION)]
    candidates = outputs or [row for row in diverged if row.divergence in (R.PARAM, R.ARGUMENT, R.INPUT)] or diverged
    return min(candidates, key=lambda row: row.order, default=None)


def likely_cause(rows: list[R.RecordRow], first: R.RecordRow | None) -> R.RecordRow | None:
    """The first divergent output that introduced its error; failing that, the first record
    where error entered (a changed parameter or argument, a divergent external input); else
    the first divergence."""
    ordered = sorted((row for row in rows if row.status == R.DIVERGED), key=lambda row: row.order)
    for row in ordered:
        if row.divergence in (R.OUTPUT, R.PRECISION) and row.origin == R.INTRODUCED:
            return row
    for row in ordered:
        if row.divergence in (R.PARAM, R.ARGUMENT, R.INPUT) and row.origin == R.INTRODUCED:
            return row
    return first


def story(outcomes, entered: dict | None = None) -> tuple[R.RecordRow | None, R.RecordRow | None]:
    """(first divergence, likely cause) of a whole compare: one story for every report.

    The earliest step file pair with a divergence decides the step. Among its ranks, a rank
    where an op introduced its error tells the story (on the other ranks the error arrives
    through a collective, DDP's gradient all-reduce, and is only inherited): a rank-1-only
    fault is named on rank 1. When no op of that step introduced its error, the likely cause
    is the first introduced one of a later step file, if any. entered: shard_entries'
    {step: (row, order)}: a shard that differed on entry on one rank tells its step's story
    unless an op introduced an error before it."""
    diverged = [o for o in outcomes if o.diverged]
    if not diverged:
        return None, None
    step = min(o.step for o in diverged)
    shard = (entered or {}).get(step)
    told = []
    for outcome in (o for o in diverged if o.step == step):
        first = first_divergence(outcome.rows)
        told.append((outcome.rank, first, likely_cause(outcome.rows, first)))
    introducing = [t for t in told if t[2] is not None and t[2].origin == R.INTRODUCED]
    if shard is not None and all(shard[1] <= t[2].order for t in introducing):
        return shard[0], shard[0]
    if introducing:
        rank, first, cause = min(introducing, key=lambda t: (t[2].order, t[0]))
        return first, cause
    rank, first, cause = min(told, key=lambda t: (t[1].order, t[0]))
    for outcome in sorted(diverged, key=lambda o: (o.step, o.rank)):
        later = likely_cause(outcome.rows, None)
        if later is not None and later.origin == R.INTRODUCED:
            return first, later
    return first, cause


# ---------------------------------------------------------------------------- shard entry


def _call(row: R.RecordRow) -> tuple:
    return row.module, row.op, row.index, row.phase


def shard_entries(outcomes) -> dict:
    """{step: shard_entry() of its step files} for every step where a record diverged."""
    steps = sorted({outcome.step for outcome in outcomes if outcome.diverged})
    found = {step: shard_entry([outcome for outcome in outcomes if outcome.step == step]) for step in steps}
    return {step: entered for step, entered in found.items() if entered is not None}


def shard_entry(outcomes) -> tuple[R.RecordRow, tuple] | None:
    """(the parameter or collective input row the step's story starts from, with its origin
    and cause set; the execution order where it entered: the collective's input), the
    collective's outputs made inherited; None when no collective input differs on some ranks
    only. outcomes: one step's, every rank."""
    if len(outcomes) < 2:
        return None
    entering: dict = {}  # call -> {rank: the differing input row}
    agreeing: dict = {}  # call -> ranks whose inputs of the call were compared and agree
    for outcome in outcomes:
        for row in outcome.rows:
            if row.io != "in" or row.status not in R.PAIRED or not is_gathering_collective(row.op):
                continue
            if row.status == R.DIVERGED:
                entering.setdefault(_call(row), {}).setdefault(outcome.rank, row)
            elif row.metrics is not None and row.metrics.evidence != "value":
                agreeing.setdefault(_call(row), set()).add(outcome.rank)
    candidates = [(call, ranks) for call, ranks in entering.items()
                  if agreeing.get(call, set()) - set(ranks)]
    if not candidates:
        return None
    by_rank = {outcome.rank: outcome for outcome in outcomes}
    for call, ranks in candidates:
        _inherit(call, ranks, by_rank)
    # the story starts where a differing input entered unmade (not carried from an earlier op)
    unmade = [(call, ranks) for call, ranks in candidates
              if any(row.divergence == R.INPUT and row.origin == R.INTRODUCED for row in ranks.values())]
    if not unmade:
        return None
    call, ranks = min(unmade, key=lambda item: min(row.order for row in item[1].values()))
    rank = min(r for r, row in ranks.items() if row.origin == R.INTRODUCED)
    source = ranks[rank]
    gathered = f"{call[0] or '<root>'} {call[1]}#{call[2]}"
    param = min((row for row in by_rank[rank].rows
                 if row.status == R.DIVERGED and is_param_slot(row.slot) and module_within(row.module, call[0])),
                key=lambda row: row.order, default=None)
    elsewhere = _ranks(agreeing[call] - set(ranks))
    if param is not None:
        name = param_name(param.module, param.slot)
        param.origin = R.INTRODUCED
        param.cause = (f"rank {rank}'s shard of parameter {name} differs on entry, before anything in this step "
                       f"computed it: {gathered} gathers it from rank {rank}'s {source.slot} (rel L2 "
                       f"{sci(rel_error(source))}), which differs on {_ranks(ranks)} and agrees on {elsewhere}; "
                       f"the gathered {name} differs by rel L2 {sci(rel_error(param))} on every rank")
        param.reasons.append(f"rank {rank}'s shard differs on entry")
        return param, source.order
    source.cause = (f"rank {rank}'s {source.slot} of {gathered} differs while no recorded op made it (a parameter "
                    f"shard, data); it agrees on {elsewhere}")
    return source, source.order


def _ranks(ranks) -> str:
    """"rank 1", "ranks 0, 2"."""
    ordered = sorted(ranks)
    return f"rank{'s' if len(ordered) > 1 else ''} {', '.join(str(rank) for rank in ordered)}"


def _inherit(call, ranks: dict, by_rank: dict) -> None:
    """The collective's outputs combine the differing input of some ranks: inherited on every
    rank (the ranks whose inputs agree gather another's)."""
    rank = min(ranks)
    source = ranks[rank]
    for other, outcome in by_rank.items():
        if other in ranks:
            cause = f"its own {ranks[other].slot} differs on this rank (rel L2 {sci(rel_error(ranks[other]))})"
        else:
            cause = (f"its inputs on this rank agree; it combines rank {rank}'s {source.slot}, which differs there "
                     f"(rel L2 {sci(rel_error(source))})")
        for row in outcome.rows:
            if _call(row) == call and row.io == "out" and row.status == R.DIVERGED \
                    and row.origin == R.INTRODUCED:
                row.origin = R.INHERITED
                row.cause = cause


# ---------------------------------------------------------------------------- drift


#: a parameter's difference is carried by the optimizer when its last update differs by at least 1/this of it
CARRIED_SHARE = 10.0


def _source_params(row, data: bool) -> tuple[list, bool] | None:
    """([(parameter name, rel L2)] of the divergent sources of an introduced output, whether
    some source is data the model made), or None when any source is neither a parameter
    recorded as one nor such data (a changed argument, data a dataset gave)."""
    found, made = [], False
    for item in row.input_errors:
        if item.get("status") != R.DIVERGED or item.get("source") in CARRIERS:
            continue
        producer = item.get("producer") or ""
        if item.get("source") == EXTERNAL and data:
            made = True  # data the drifted model made (a policy's rollouts)
            continue
        if item.get("source") != "param":
            return None
        if item["slot"].startswith("param."):  # a module's own parameter
            found.append((param_name(row.module, item["slot"]), item.get("rel_l2") or 0.0))
        elif "/param." in producer:  # an api call's input holding a parameter
            module = producer.split("/", 1)[0]
            found.append((param_name(module, "param." + producer.rsplit("/param.", 1)[1]), item.get("rel_l2") or 0.0))
        else:
            return None
    return found, made


def differs_at_rounding(rows) -> bool:
    """Some record within tolerance differs at all (the runs already differ at rounding level)."""
    tensors = [row for row in rows if row.status in R.WITHIN and row.metrics is not None
               and row.metrics.evidence != "value"]
    return any(rel_error(row) > 0 or row.metrics.bit_equal is False for row in tensors)


#: update_sizes' entry that says the rank's data are made by its model (model_made_data)
MODEL_DATA = "\0data the model makes"
#: ... and that those data have parted (an input no recorded op made differs beyond tolerance)
DATA_PARTED = "\0data parted"


def model_made_data(rows) -> bool:
    """Whether the step's data are made by the model: in a step file that records the model's
    parameters, an input no recorded op made (data) differs, within tolerance. Data a model
    that rounds otherwise computed (a policy's rollouts: their log-probabilities, advantages)
    differ so from the start; data a dataset gives are the same in both runs until something
    changes them."""
    if not any(row.kind == "param" for row in rows):
        return False  # an api-level dump: its weights are inputs no recorded op made
    return any(item.get("source") == EXTERNAL and item.get("status") in R.WITHIN and finite(item.get("rel_l2")) > 0
               for row in rows if row.io == "out" for item in row.input_errors)


def _composed(row, rows) -> bool:
    """A module's output whose api calls inside were recorded and differ (level mix): what
    they computed, each judged on its own."""
    if row.kind != "module" or row.io != "out":
        return False
    return any(other.kind == "api" and other.io == "out" and other.phase == row.phase
               and other.status == R.DIVERGED and module_within(other.module, row.module) for other in rows)


def _from_divergent(row) -> bool:
    """An output some input of which differs beyond tolerance, or by a tenth of the output's
    difference or more (a record not compared, its values stale, still measures it): what the
    op amplified."""
    out = finite(rel_error(row))
    return any(item.get("status") == R.DIVERGED or finite(item.get("rel_l2")) * AMPLIFICATION >= out
               for item in row.input_errors)


def update_sizes(rows, previous: dict | None = None) -> dict:
    """{parameter: the largest difference of the optimizer's writes to it} of one step file
    pair: what drift_facts of the rank's next step file checks its parameters against; with
    MODEL_DATA once some step file of the rank (previous: the update_sizes before) showed
    data the model makes."""
    updates: dict = {}
    for row in rows:
        if row.target and row.io == "out" and row.status in R.PAIRED:
            updates[row.target] = max(updates.get(row.target, 0.0), rel_error(row))
    if (previous or {}).get(MODEL_DATA) or model_made_data(rows):
        updates[MODEL_DATA] = True
        if (previous or {}).get(DATA_PARTED) or any(row.status == R.DIVERGED and row.divergence == R.INPUT
                                                    for row in rows):
            updates[DATA_PARTED] = True  # the data the model made differ beyond tolerance from here on
    return updates


def drift_facts(rows, previous: dict | None) -> tuple[bool, bool]:
    """(whether an error is introduced in this step file pair, whether drift explains each: it enters through
    parameters the previous step's update wrote, or data the drifted model made); each row drift explains is
    marked (row.drifting). previous: update_sizes of the rank's previous step file, None for its first."""
    data = previous is not None and (bool(previous.get(MODEL_DATA)) or model_made_data(rows))
    parted = data and bool(update_sizes(rows, previous).get(DATA_PARTED))
    introduced, carried, holding = False, True, []
    for row in rows:
        if row.status != R.DIVERGED or row.origin != R.INTRODUCED:
            continue
        if _composed(row, rows):
            row.drifting = True
            continue
        if row.divergence == R.PARAM and not row.slot.startswith("param."):  # an api input holding one
            holding.append(row)
            continue
        introduced = True
        row.drifting = previous is not None and _drifts(row, previous, data, parted)
        carried = carried and row.drifting
    params: dict = {}  # module -> its parameter records' drifting: a holding row drifts with them
    for row in (row for row in rows if holding and row.divergence == R.PARAM and row.kind == "param"):
        params.setdefault(row.module, []).append(row.drifting)
    for row in holding:
        row.drifting = all(params.get(row.module, [False]))
    return introduced, carried


def _drifts(row, previous: dict, data: bool, parted: bool) -> bool:
    """Whether drift explains one introduced row (drift_facts)."""
    if row.divergence == R.INPUT:
        return data  # data the drifted model made; an op that reads it is judged on its own
    if row.divergence == R.PARAM:
        params, made = [(param_name(row.module, row.slot), rel_error(row))], False
    elif row.divergence == R.OUTPUT:
        found = _source_params(row, data)
        if found is None:
            return False  # a source that is neither a carried parameter nor the model's data
        params, made = found
    else:
        return False  # a changed argument, a precision finding
    if not params and not made:
        # an op that made its error itself: from agreeing inputs never; once the data parted,
        # amplifying what its inputs already differ by (different samples, different actions)
        return parted and _from_divergent(row)
    # a parameter whose difference jumped is not what its last update wrote
    return all(previous.get(name, 0.0) * CARRIED_SHARE >= rel for name, rel in params)


def find_drift(first, verdict: str, files: list[dict]) -> dict | None:
    """{step, rank, text} when the compare's divergences are drift (see the module docstring).
    files: one entry per compared pair of step files, {step, rank, differs, introduced, carried}
    (differs_at_rounding and drift_facts of its rows)."""
    if first is None or verdict != "diverged":
        return None
    rank = first.rank
    own = sorted((info for info in files if info["rank"] == rank), key=lambda info: info["step"])
    if len(own) < 2 or first.step == own[0]["step"]:
        return None
    if not own[0]["differs"]:
        return None  # identical before the divergence: something changed, not rounding
    if any(info["introduced"] and (info["rank"] != rank or not info["carried"]) for info in files):
        return None
    text = (f"drift: the runs part through accumulated rounding; they already differ at rounding level at step "
            f"{own[0]['step']} (within tolerance), and every divergence from step {first.step} on enters through "
            "parameters whose difference the previous step's optimizer update wrote, or through data the drifted "
            "model made (a policy's rollouts); no op introduced an error "
            "(replay with --replay on tensor dumps checks that no op computes beyond rounding)")
    return {"step": first.step, "rank": rank, "text": text}


def drifting_ranks(files: list[dict]) -> set:
    """The ranks whose runs differ at rounding level at their first compared step file
    (find_drift's facts): there, what drift explains (drift_facts) is not the story, and a
    fault after the runs drifted (and their data parted) is named where it enters."""
    firsts: dict = {}
    for info in files:
        if info["rank"] not in firsts or info["step"] < firsts[info["rank"]]["step"]:
            firsts[info["rank"]] = info
    return {rank for rank, info in firsts.items() if info["differs"]}


def drifted(rows: list) -> list:
    """A step file's story rows, copies of those drift explains with "introduced" taken back."""
    copies = [restated(row) if row.drifting else row for row in rows]
    apply_drift({}, [row for row in copies if row.drifting])
    return copies


def apply_drift(found: dict, rows: list) -> None:
    """Take the "introduced" origins of rows back where the compare is drift."""
    for row in rows:
        if row.status == R.DIVERGED and row.origin == R.INTRODUCED:
            row.origin = R.INHERITED
            row.cause = f"{row.cause}; drift: this difference grew over the earlier steps' updates"


#: envelope verdicts a drifting output may have (rounding.py, envelope.Envelope.judge)
_SETTLED = ("within", "unbounded")


def within_envelopes(rows) -> bool:
    """Every divergent record is an inherited input or an output within its envelope."""
    diverged = [row for row in rows if row.status == R.DIVERGED]
    if not diverged:
        return False
    for row in diverged:
        if row.io == "out":
            if row.envelope is None or row.envelope.get("verdict") not in _SETTLED:
                return False
        elif row.origin != R.INHERITED:
            return False
    return True


def settles(drift: dict | None, within: bool, strict: bool) -> bool:
    """A drift whose every divergent record is within its envelope (within_envelopes over
    every row: ``within``) is rounding, unless --strict."""
    return not strict and drift is not None and within


def settle_row(row) -> None:
    """Explain one divergent row of a drift within the envelopes, or from data it made (none)."""
    envelope = row.envelope or {}
    if row.divergence == R.INPUT or (row.io == "out" and envelope.get("verdict") not in _SETTLED):
        return row.explain("drift: follows from the data the drifted model made (other samples, other actions)",
                           ROUNDING)
    within = f"; {envelope['text']}" if envelope else ""
    row.explain(f"drift within its rounding envelope: grown over the earlier steps' optimizer updates from "
                f"rounding{within}", ROUNDING)


def settled_note(drift: dict, settled: int) -> str:
    """The note of a drift settled within rounding; settled: the records it explained."""
    return (f"drift within rounding: the runs part through accumulated rounding from step {drift['step']} on "
            f"({settled} records beyond the fixed tolerance, each within its rounding envelope or following from data "
            "the drifted model made, grown over the optimizer's updates); no op introduced an error. --strict judges "
            "by the fixed tolerance alone")


def settled_copies(rows) -> list:
    """Copies of divergent rows as drift within rounding explains them."""
    copies = [restated(row) for row in rows]
    for row in copies:
        settle_row(row)
    return copies


def restated(row):
    """A row to restate: its own lists, so that explain() leaves the original alone."""
    twin = copy.copy(row)
    twin.reasons, twin.notes = list(row.reasons), list(row.notes)
    return twin


def story_rows(rows) -> list:
    """The rows story() reads of a pair: its first divergence and the first divergent output and
    entry that introduced their error; first_divergence and likely_cause give the same answer
    on them as on every row (in row order, as the rows hold them)."""
    chosen = {id(first_divergence(rows)): None}
    for kinds in ((R.OUTPUT, R.PRECISION), (R.PARAM, R.ARGUMENT, R.INPUT)):
        for drift in (True, False):  # and the first that drift does not explain (drifted)
            found = min((row for row in rows if row.status == R.DIVERGED and row.divergence in kinds
                         and row.origin == R.INTRODUCED and (drift or not row.drifting)),
                        key=lambda row: row.order, default=None)
            if found is not None:
                chosen[id(found)] = None
    return [row for row in rows if id(row) in chosen]


# ---------------------------------------------------------------------------- entering


#: an error entering this many unit roundoffs of the dtype is beyond two correct kernels' rounding
ENTERING_UNITS = 1.0
#: an op makes the error itself when its output differs this many times more than its inputs
AMPLIFICATION = 10.0
#: where an error enters a call (input kinds, structs.py), and what carries one made upstream
_SOURCES = (PARAM_INPUT, EXTERNAL, CHANGED_INPUT)


def entering_reason(row) -> str | None:
    """Why the error enters at this output row, or None when it does not (module docstring)."""
    # only where two correct kernels round apart (16-bit and 8-bit floats)
    unit = unit_roundoff(row.tol_dtype) if row.tol_dtype in LOW_PRECISION else None
    if unit is None or row.kind != "api" or row.io != "out" or row.status not in R.PAIRED:
        return None
    if row.metrics is None or row.metrics.evidence == "value":
        return None
    out = finite(rel_error(row))
    if out < ENTERING_UNITS * unit:
        return None
    carried = max((finite(item.get("rel_l2")) for item in row.input_errors if item.get("source") in CARRIERS),
                  default=0.0)
    sources = [item for item in row.input_errors if item.get("source") in _SOURCES]
    entering = max(sources, key=lambda item: finite(item.get("rel_l2")), default=None)
    size = f"rel L2 {out:.2e}, {out / unit:.3g} units of {row.tol_dtype} roundoff"
    if entering is not None and finite(entering.get("rel_l2")) >= max(ENTERING_UNITS * unit, carried):
        what = entering.get("producer") or entering["slot"]
        return (f"the error enters here within tolerance: input {entering['slot']} ({entering['source']}: {what}) "
                f"differs by rel L2 {finite(entering.get('rel_l2')):.2e} ({size} at the output; its produced inputs "
                f"carry {carried:.2e}); two correct kernels differ by well under one unit, and the later "
                "divergence grows from here")
    if out > AMPLIFICATION * max(carried, math.sqrt(carried * unit)):
        return (f"the error enters here within tolerance: the op makes it from inputs that agree ({size}; its "
                f"inputs carry {carried:.2e}); two correct kernels differ by well under one unit, and the later "
                "divergence grows from here")
    return None


def entering_cause(first, cause, rows: list):
    """The likely cause, made the first op where a low-precision error entered when there is
    one before any op introduced its error (module docstring)."""
    if first is None:
        return cause
    rows = sorted((row for row in rows if row.step == first.step and row.rank == first.rank
                   and row.order <= first.order), key=lambda row: row.order)
    for row in rows:
        if cause is not None and cause.origin == R.INTRODUCED and cause.step == row.step and cause.order <= row.order:
            return cause  # an op introduced its error at or before this one
        reason = entering_reason(row)
        if reason is None:
            continue
        if row.status != R.DIVERGED:
            row.origin = R.INTRODUCED
            row.cause = reason
        return row
    return cause
