"""Assemble stage, story rule: a parameter shard that differs on entry on one rank.

FSDP2 gathers a module's parameters from every rank's shard (an all-gather) before the
module's forward. When one rank's shard differs (a rank-local edit, a bad checkpoint shard,
a corrupted copy), that rank's all-gather input differs while no recorded op made it, the
other ranks' inputs agree, and every rank's gathered output differs. Judged rank by rank,
the collective on rank 0 looks as if it introduced the error: its own inputs agree.

``find`` judges the ranks of one step file set together (``apply``: of every step). A collective call whose input
differs on some ranks, where nothing recorded made it, and agrees on the others:

* on the other ranks that call's outputs are inherited (they gather the differing input);
* the story's cause is the first differing parameter record under the collective's module on
  the first rank where the input differs, introduced: that parameter, on that rank;
  where no parameter record differs, the collective's differing input on that rank.

Where every rank's input differs, or the inputs agree everywhere (a faulty collective), the
rank-by-rank verdicts stand.
"""

from __future__ import annotations

from probe.comparison import result as R
from probe.comparison.record_rules import param_name
from probe.comparison.ops import is_gathering_collective
from probe.comparison.records import is_param_slot, module_within
from probe.comparison.structs import rel_error, sci

def _call(row: R.RecordRow) -> tuple:
    return row.module, row.op, row.index, row.phase


def apply(outcomes) -> dict:
    """{step: find() of its step files} for every step where a record diverged."""
    steps = sorted({outcome.step for outcome in outcomes if outcome.diverged})
    found = {step: find([outcome for outcome in outcomes if outcome.step == step]) for step in steps}
    return {step: entered for step, entered in found.items() if entered is not None}


def find(outcomes) -> tuple[R.RecordRow, tuple] | None:
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
        name = param_name(param, None)
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
