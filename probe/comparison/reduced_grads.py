"""Normalize stage: a gradient reduced across ranks by code probe does not record, linked to
the rank-local gradients it was made from.

FSDP2 records each parameter's gradient twice in the backward: ``param_grad`` call 0 is the
gradient this rank computed (a plain tensor), and a later call holds the shard that FSDP2's
reduce-scatter made from the local gradients of every rank (a DTensor: it has a placement).
The reduce-scatter runs inside autograd's backward, where capture sees no call
(docs/capture.md, "Collectives"), so the reduced record has no recorded input, and an error
it carries from its local gradients would look like its own.

``link_reduced_gradients`` gives each reduced gradient call, on both sides, the rank-local
gradients of the same parameters as inputs: copies of the earlier ``param_grad`` records of
the same module (slot ``local_grad.<name>``; ``local_grad.<name>.<call>`` when gradients
were accumulated over several calls). Provenance finds each copy produced by its local
gradient record, so the judge explains the reduced gradient by the rule it uses for every
call (explain.judge_call): made from accepted differences, within AMPLIFICATION of them, it
is explained (amplified); made from local gradients that agree while it differs, the
reduction itself computed differently, and the divergence is introduced there.

Only the rank's own local gradients are linked. Those of the other ranks are judged in
their own rank's comparison; a copy here could only be judged by its tolerance, without the
explanation its own comparison may give it (a bfloat16 gradient amplified beyond its
tolerance by accepted rounding), which would turn an accepted difference into an alarm.
"""

from __future__ import annotations

from probe.comparison.records import LOCAL_GRAD, Records
from probe.dump.schema import make_key

_PARAM_GRAD = "param_grad."
PLACEMENT = "placement"


def link_reduced_gradients(normalized):
    """The normalize step (engine.NORMALIZE; before build_call_lists: it adds records)."""
    for side in normalized.sides:
        link(side.records)
    return normalized


def link(records: Records) -> int:
    """Append the local-gradient inputs of every reduced gradient call; returns how many."""
    cols = records.columns
    placements = cols.get(PLACEMENT)
    if not placements or not any(placements):
        return 0
    local: dict = {}  # (module, op, slot) -> rows of rank-local gradients since the last reduction
    reduced: dict = {}  # (module, op, index) -> [(seq, row of a local gradient)]
    for row in sorted(range(len(records)), key=lambda r: (cols["seq"][r], r)):
        slot = cols["slot"][row]
        if not slot.startswith(_PARAM_GRAD) or cols["phase"][row] != "backward" or cols["io"][row] != "out":
            continue
        name = (cols["module"][row], cols["op"][row], slot)
        if not placements[row]:
            local.setdefault(name, []).append(row)
            continue
        sources = local.pop(name, [])
        if sources:
            call = reduced.setdefault((cols["module"][row], cols["op"][row], cols["index"][row]), [])
            call.extend((cols["seq"][row], source) for source in sources)
    added = 0
    for (module, op, index), sources in reduced.items():
        counts: dict = {}
        for _, source in sources:
            counts[cols["slot"][source]] = counts.get(cols["slot"][source], 0) + 1
        for seq, source in sources:
            record = records.row(source)
            name = record["slot"][len(_PARAM_GRAD):]
            slot = f"{LOCAL_GRAD}{name}"
            if counts[record["slot"]] > 1:
                slot += f".{record['index']}"
            record.update(slot=slot, io="in", index=index, seq=seq, placement="",
                          key=make_key(module, op, index, "backward", slot))
            records.append(record)
            added += 1
    return added
