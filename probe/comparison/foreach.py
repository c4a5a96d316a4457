"""Normalize stage: a foreach or fused optimizer call as one call per parameter.

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
too, named (optimizer_targets.py) and paired with a fused call on the other side; against
an unfused run they stay unpaired (counted, never a pass), as docs/compare-rules.md says.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict

from probe.comparison.optimizer_calls import is_foreach, parameter_blocks
from probe.comparison.records import Call, Records

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
                slots[slot] = records.append(derived)
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


