"""Normalize stage: both runs' records as calls that can be aligned.

Each normalize step takes a NormalizedStep and returns it, its calls (and, where a step
derives records, its records) rewritten; api.NORMALIZE lists the steps in the order they
run. A step sees both runs, so it can make one run's spelling match the other's.

* link_reduced_gradients (normalize.py): a gradient reduced across ranks (FSDP2's
  reduced shard, and its backward reduce-scatter call) gets the rank-local gradients it was
  made from as inputs;
* build_call_lists: the records of each run grouped into calls (records.build_calls), module
  and op names renamed through the name mapping;
* split_foreach_calls: a foreach or fused optimizer call as one call per parameter
  (normalize.py);
* name_optimizer_targets: each optimizer call named by the parameter it updates
  (normalize.py), so that fused kernels pair by that name.

Reduced grads
-------------

Normalize stage: a gradient reduced across ranks, linked to the rank-local gradients it was
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
(call_rules.judge_call): made from accepted differences, within AMPLIFICATION of them, it is
explained (amplified); made from local gradients that agree while it differs, the reduction
itself computed differently, and the divergence is introduced there. The reduce-scatter's
unrecorded input is accepted as the linked gradients are (call_rules._accept_assembled).

Only the rank's own local gradients are linked. Those of the other ranks are judged in
their own rank's comparison; a copy here could only be judged by its tolerance, without the
explanation its own comparison may give it (a bfloat16 gradient amplified beyond its
tolerance by accepted rounding), which would turn an accepted difference into an alarm.

Foreach
-------

Normalize stage: a foreach or fused optimizer call as one call per parameter.

On CUDA, torch's optimizers run their *foreach* implementation: one ``torch._foreach_*``
call over all parameters of a group (``_foreach_lerp_(exp_avgs, grads, 0.1)``); on a CPU they
loop over the parameters and call the per-tensor op for each (``exp_avg.lerp_(grad, 0.1)``).
The i-th tensor of a foreach call is the i-th parameter's, so split_foreach splits each
foreach call into one *element* call per tensor (slots ``input.K.i`` -> ``input.K``,
``output.i`` -> ``output.0``, a list argument -> its i-th value, appended to the records as a
derived record; any other argument is shared by every element). The elements of a *block*
(the foreach calls of one parameter group) are numbered so that the align stage
(foreach_pairing.py) can lay them out parameter by parameter.

Fused kernels (``torch._fused_adam_``, ``_fused_adamw_``, ``_fused_sgd_``) update in place
and return nothing, so their records hold the inputs only: they are split into elements
too, named (normalize.py) and paired with a fused call on the other side; against
an unfused run they stay unpaired (counted, never a pass), as docs/compare-rules.md says.

Optimizer targets
-----------------

Normalize stage: every optimizer call named by the parameter it updates.

An optimizer call (run after the backward began, outside any module) is named by the
parameter it updates: a tensor it reads or writes is that parameter's ``param.*`` or
``param_grad.*`` record, or was made by an optimizer call already named; the elements of
one foreach block share their position's name; a call linked to nothing takes the name of
the next named call (a loop body starts with its step counter). Fused kernels pair by
that name (foreach_pairing.py).
"""

from __future__ import annotations

import json
import re
from collections import defaultdict

from probe.comparison.ops import REDUCE_SCATTER, is_foreach, op_name
from probe.comparison.records import (
    Call, NameMapping,
    LOCAL_GRAD, PARAMETER_SLOTS, Records, build_calls, module_within, param_name, parameter_blocks,
)
from probe.comparison.structs import NormalizedStep, Side
from probe.dump.schema import make_key

def normalize(records_a: Records, records_b: Records, mapping: NameMapping | None, steps) -> NormalizedStep:
    """Run the normalize steps in order on one pair of step files."""
    normalized = NormalizedStep(Side(records_a), Side(records_b), mapping)
    for step in steps:
        normalized = step(normalized)
    return normalized


def build_call_lists(normalized: NormalizedStep) -> NormalizedStep:
    rename = normalized.mapping.rename if normalized.mapping else None
    for side in normalized.sides:
        side.calls = build_calls(side.records, rename)
    return normalized


def split_foreach_calls(normalized: NormalizedStep) -> NormalizedStep:
    # a foreach call is one call per tensor (the i-th parameter's), on both sides
    for side in normalized.sides:
        side.calls = split_foreach(side.calls, side.records)
    return normalized


def name_optimizer_targets(normalized: NormalizedStep) -> NormalizedStep:
    # optimizer records named by the parameter they update (fused kernels pair by that name)
    for side in normalized.sides:
        name_targets(side.calls, side.records)
    return normalized


_PARAM_GRAD = "param_grad."
PLACEMENT = "placement"


def link_reduced_gradients(normalized):
    """The normalize step (api.NORMALIZE; before build_call_lists: it adds records)."""
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
        if (cols["op"][row] == REDUCE_SCATTER and cols["io"][row] == "out" and backward_from is not None
                and cols["seq"][row] > backward_from):
            # FSDP2's reduce-scatter of a module's gradients: its input is their flat copy
            owner = cols["module"][row]
            if (owner, REDUCE_SCATTER, cols["index"][row]) in reduced:
                continue  # a second output slot of the same call
            call = reduced.setdefault((owner, REDUCE_SCATTER, cols["index"][row]), [])
            call.extend((cols["seq"][row], source) for (module, _, _), rows in local.items()
                        if module_within(module, owner) for source in rows)
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
            if op == REDUCE_SCATTER:  # an input of the collective's call, as its input.1 is
                phase, record["kind"] = "forward", "api"
            record.update(slot=slot, io="in", index=index, seq=seq, placement="", module=module, op=op,
                          phase=phase, key=make_key(module, op, index, phase, slot))
            records.append_record(record)
            added += 1
    return added


_ELEMENT = re.compile(r"^(input|kwarg)\.([^.]+)\.(\d+)(.*)$")
_OUTPUT = re.compile(r"^output\.(\d+)$")
def _elements(call: Call, records: Records) -> list[Call]:
    """A foreach call as one call per tensor of its lists (empty when it holds no list)."""
    cols = records.columns
    per_element: dict[int, dict[str, int]] = defaultdict(dict)
    shared: dict[str, int] = {}
    lists: dict[str, list] = {}
    for slot, row in call.slots.items():
        match = _ELEMENT.match(slot)
        out = _OUTPUT.match(slot)
        if match and cols["dtype"][row] != "":
            per_element[int(match.group(3))][f"{match.group(1)}.{match.group(2)}{match.group(4)}"] = row
        elif out and cols["dtype"][row] != "":
            per_element[int(out.group(1))]["output.0"] = row
        else:
            shared[slot] = row
            value = _list_value(cols["value"][row]) if cols["dtype"][row] == "" else None
            if value is not None:
                lists[slot] = value
    count = len(per_element)
    if count == 0 or sorted(per_element) != list(range(count)):
        return []
    elements = []
    for i in range(count):
        slots = dict(per_element[i])
        common = set()
        for slot, row in shared.items():
            if slot in slots:
                continue
            values = lists.get(slot)
            if values is not None and len(values) == count:
                derived = records.row(row)
                derived["value"] = json.dumps(values[i])
                derived["key"] = f"{derived['key']}[{i}]"
                slots[slot] = records.append_record(derived)
            else:
                slots[slot] = row
                common.add(slot)
        first = min(slots.values())
        element = Call(
            module=call.module, op=call.op, index=call.index, phase=call.phase, kind=call.kind, seq=call.seq,
            first_row=first, slots=slots, name=call.name, element=i, shared=frozenset(common),
        )
        element.shapes = tuple(sorted((s, cols["shape"][r]) for s, r in slots.items() if cols["dtype"][r] != ""))
        elements.append(element)
    return elements


def split_foreach(calls: list[Call], records: Records) -> list[Call]:
    """Every foreach call replaced by its elements (in the call's place, element order)."""
    result: list[Call] = []
    for call in calls:
        elements = _elements(call, records) if is_foreach(call.op) else []
        result.extend(elements or [call])
    for number, block in enumerate(parameter_blocks([c for c in result if c.element >= 0], records)):
        for elements in block:
            for element in elements:
                element.block = number
    return result


def _list_value(text: str):
    try:
        value = json.loads(text) if text else None
    except ValueError:
        return None
    return value if isinstance(value, list) else None


def name_targets(calls: list[Call], records: Records) -> None:
    """Set Call.target on the optimizer calls of one run (module docstring: name_targets)."""
    cols = records.columns
    start = min((s for s, phase in zip(cols["seq"], cols["phase"]) if phase == "backward"), default=None)
    if start is None:
        return
    start = int(start)
    names = _parameter_prints(records)
    prints = records.prints(one_element=True)
    made: dict = defaultdict(set)  # fingerprint -> names of the optimizer calls that wrote it
    region = [c for c in calls if c.phase == "forward" and c.seq > start and c.kind == "api" and c.module == ""]
    decisive: dict[int, str] = {}  # id(call) -> name, for calls a parameter's value or gradient names
    for call in region:
        found, direct = _linked(call, cols, prints, names, made)
        if len(found) == 1:
            call.target = next(iter(found))
            if direct:
                decisive[id(call)] = call.target
            for slot, row in call.slots.items():
                if cols["io"][row] == "out" or slot == "input.0":
                    mark = prints[row]
                    if mark is not None:
                        made[mark].add(call.target)
    _vote_in_bodies([c for c in region if c.element < 0], records, decisive)
    _share_in_blocks(region)
    following = ""
    for call in reversed(region):
        if call.target:
            following = call.target
        elif following:
            call.target = following


def _linked(call: Call, cols: dict, prints: list, names: dict, made: dict) -> set:
    """The parameters a call's tensors tie it to: a tensor that is one parameter's value or
    gradient decides; else one written by an optimizer call named before; else what every
    linked tensor agrees on (all-zero state of equal shape matches many parameters). prints:
    Records.prints(one_element=True) (a [1] bias, a value head's, is a parameter as much as a
    matrix is)."""
    direct, produced = [], []
    for row in call.slots.values():
        mark = prints[row]
        if mark is None:
            continue
        if names.get(mark):
            direct.append(names[mark])
        if cols["io"][row] == "in" and made.get(mark):
            produced.append(made[mark])
    for found, decides in ((direct, True), (produced, False)):
        unique = set().union(*(names_ for names_ in found if len(names_) == 1))
        if len(unique) == 1:
            return unique, decides
    linked = direct + produced
    common = set.intersection(*linked) if linked else set()
    return (common if len(common) == 1 else set()), False


def _vote_in_bodies(calls: list[Call], records: Records, decisive: dict) -> None:
    """A per-parameter loop runs the same ops for every parameter: split its calls (creation
    ops aside) into equal bodies and name each body by the parameter most of its decisively
    linked calls name (all-zero or all-one tensors of equal shape link to many parameters,
    and a wrong guess must not spread)."""
    cols = records.columns
    loop = [c for c in calls if any(s.startswith("input.") and cols["dtype"][r] != "" for s, r in c.slots.items())]
    while len(loop) >= 4:
        bodies = _trailing_bodies(loop)
        if not bodies:
            return
        _vote(bodies, decisive)
        loop = loop[:len(loop) - sum(len(body) for body in bodies)]


def _trailing_bodies(loop: list[Call]) -> list[list[Call]]:
    """The longest run of equal bodies (same ops in the same order) that ends the loop."""
    ops = [op_name(c.op) for c in loop]
    best: list = []
    for size in range(1, min(len(loop) // 2, 64) + 1):
        pattern = ops[len(ops) - size:]
        count = 0
        while (count + 1) * size <= len(ops) and ops[len(ops) - (count + 1) * size:len(ops) - count * size] == pattern:
            count += 1
        if count >= 2 and count * size > sum(len(b) for b in best):
            best = [loop[len(loop) - (k + 1) * size:len(loop) - k * size] for k in reversed(range(count))]
    return best


def _vote(bodies, decisive: dict) -> None:
    for body in bodies:
        votes: dict[str, int] = defaultdict(int)
        for call in body:
            if id(call) in decisive:
                votes[decisive[id(call)]] += 1
        if votes:
            best = max(votes.values())
            winners = [name for name, count in votes.items() if count == best]
            if len(winners) == 1:
                for call in body:
                    call.target = winners[0]


def _share_in_blocks(region: list[Call]) -> None:
    """The elements at one position of a foreach block (a parameter group) are one parameter's:
    a position named by any of its elements names them all."""
    by_position: dict = defaultdict(list)
    for call in region:
        if call.element >= 0:
            by_position[(call.block, call.element)].append(call)
    for elements in by_position.values():
        named = {c.target for c in elements if c.target}
        if len(named) == 1:
            for call in elements:
                call.target = call.target or next(iter(named))


def _parameter_prints(records: Records) -> dict:
    """fingerprint -> names of the parameters whose value or gradient it is."""
    cols = records.columns
    prints = records.prints(one_element=True)
    names: dict = defaultdict(set)
    for row, slot in enumerate(cols["slot"]):
        if not slot.startswith(PARAMETER_SLOTS):
            continue
        mark = prints[row]
        if mark is not None:
            names[mark].add(param_name(cols["module"][row], slot))
    return names
