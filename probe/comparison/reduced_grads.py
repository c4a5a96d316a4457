"""Normalize stage: a gradient reduced across ranks, linked to the rank-local gradients it was
made from.

FSDP2 records each parameter's gradient twice in the backward: ``param_grad`` call 0 is the
gradient this rank computed (a plain tensor), and a later call holds the shard that FSDP2's
reduce-scatter made from the local gradients of every rank (a DTensor: it has a placement).
That shard is a view of the reduce-scatter's output, which no record links it to, and the
reduce-scatter's input is a flat copy of the module's local gradients that FSDP2 makes in
code capture skips (where the torch cannot record the collective at all, nothing of it is
seen). An error either carries from the local gradients would look like its own.

``link`` gives each reduced gradient call, and each reduce-scatter call recorded in the
backward, on both sides, the rank-local gradients of the same parameters (of the module the
collective is named after, and of the modules inside it) as inputs: copies of the earlier
``param_grad`` records (slot ``local_grad.<name>``, ``local_grad.<path>.<name>`` for a
module inside the named one; ``.<call>`` appended when gradients were accumulated over
several calls). Provenance finds each copy produced by its local gradient record, so the
judge explains the reduced gradient by the rule it uses for every call
(explain.judge_call): made from accepted differences, within AMPLIFICATION of them, it is
explained (amplified); made from local gradients that agree while it differs, the reduction
itself computed differently, and the divergence is introduced there. The reduce-scatter's
unrecorded input is accepted as the linked gradients are (explain._accept_assembled).

Only the rank's own local gradients are linked. Those of the other ranks are judged in
their own rank's comparison; a copy here could only be judged by its tolerance, without the
explanation its own comparison may give it (a bfloat16 gradient amplified beyond its
tolerance by accepted rounding), which would turn an accepted difference into an alarm.
"""

from __future__ import annotations

from probe.comparison.records import LOCAL_GRAD, Records
from probe.dump.schema import make_key

_PARAM_GRAD = "param_grad."
#: the collective FSDP2 reduces gradients with, as the API level names it on every torch
_REDUCE_SCATTER = "distributed.reduce_scatter_single"


def _inside(module: str, owner: str) -> bool:
    return not owner or module == owner or module.startswith(owner + ".")
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
    backward_from = min((seq for seq, phase in zip(cols["seq"], cols["phase"]) if phase == "backward"),
                        default=None)
    for row in sorted(range(len(records)), key=lambda r: (cols["seq"][r], r)):
        slot = cols["slot"][row]
        if (cols["op"][row] == _REDUCE_SCATTER and cols["io"][row] == "out" and backward_from is not None
                and cols["seq"][row] > backward_from):
            # FSDP2's reduce-scatter of a module's gradients: its input is their flat copy
            owner = cols["module"][row]
            if (owner, _REDUCE_SCATTER, cols["index"][row]) in reduced:
                continue  # a second output slot of the same call
            call = reduced.setdefault((owner, _REDUCE_SCATTER, cols["index"][row]), [])
            call.extend((cols["seq"][row], source) for (module, _, _), rows in local.items()
                        if _inside(module, owner) for source in rows)
            continue
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
            named = (cols["module"][source], cols["slot"][source])
            counts[named] = counts.get(named, 0) + 1
        for seq, source in sources:
            record = records.row(source)
            name = record["slot"][len(_PARAM_GRAD):]
            if record["module"] != module:  # a reduce-scatter of a block: q.weight, k.weight
                name = f"{record['module'][len(module) + 1 if module else 0:]}.{name}"
            slot = f"{LOCAL_GRAD}{name}"
            if counts[(record["module"], record["slot"])] > 1:
                slot += f".{record['index']}"
            phase = "backward"
            if op == _REDUCE_SCATTER:  # an input of the collective's call, as its input.1 is
                phase, record["kind"] = "forward", "api"
            record.update(slot=slot, io="in", index=index, seq=seq, placement="", module=module, op=op,
                          phase=phase, key=make_key(module, op, index, phase, slot))
            records.append(record)
            added += 1
    return added
