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
import math
import re
from collections import defaultdict

from probe.comparison.records import Call, Records

FOREACH_PREFIX = "torch._foreach_"
FUSED_PREFIX = "torch._fused_"
#: how a foreach element paired with a per-tensor call (CallPair.how)
FOREACH = "foreach"
#: how a fused kernel's element paired with the last call of a per-parameter chain
FUSED = "fused"
_ELEMENT = re.compile(r"^(input|kwarg)\.([^.]+)\.(\d+)(.*)$")
_OUTPUT = re.compile(r"^output\.(\d+)$")
#: per-tensor spellings of a foreach op's base name (``_foreach_norm`` runs vector_norm)
_ALIASES = {"vector_norm": "norm", "true_divide": "div", "multiply": "mul", "subtract": "sub"}


def is_foreach(op: str) -> bool:
    return op.startswith((FOREACH_PREFIX, FUSED_PREFIX))


def base_op(op: str) -> str:
    """The op whatever its spelling: torch._foreach_add_, Tensor.add_, torch.add -> "add"."""
    name = op.removeprefix(FOREACH_PREFIX).rsplit(".", 1)[-1].rstrip("_")
    return _ALIASES.get(name, name)


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


def _signature(element: Call, records: Records) -> tuple:
    """(op, plain scalar arguments): the same signature twice means a new parameter group."""
    cols = records.columns
    scalars = tuple(sorted((slot, cols["value"][row]) for slot, row in element.slots.items()
                           if slot in element.shared and cols["dtype"][row] == ""))
    return element.op, scalars


def _calls_of(elements: list[Call]) -> list[list[Call]]:
    """Elements -> the foreach calls they came from (each its elements in order), in call order."""
    calls: dict = {}
    for element in elements:
        calls.setdefault((element.op, element.index), []).append(element)
    ordered = sorted(calls.values(), key=lambda group: group[0].order())
    return [sorted(group, key=lambda e: e.element) for group in ordered]


def parameter_blocks(elements: list[Call], records: Records) -> list[list[list[Call]]]:
    """Foreach elements -> blocks (a parameter group's calls) -> each call's elements."""
    blocks: list[list[list[Call]]] = []
    seen: set = set()
    size = None
    for call in _calls_of(elements):
        if [e.element for e in call] != list(range(len(call))):
            continue  # some elements already paired: not a whole call
        signature = _signature(call[0], records)
        if not blocks or len(call) != size or signature in seen:
            blocks.append([])
            seen = set()
            size = len(call)
        seen.add(signature)
        blocks[-1].append(call)
    return blocks


def parameter_major(block: list[list[Call]]) -> list[Call]:
    """The elements of a block in the per-tensor loop's order: every op of tensor 0, then 1..."""
    return [elements[i] for i in range(len(block[0])) for elements in block]


def tensor_print(cols: dict, row: int):
    """A tensor's identity within one step file: its stored id, else its statistics."""
    if cols["dtype"][row] == "":
        return None
    if cols["tensor_id"][row] >= 0:
        return ("id", cols["tensor_id"][row])
    numbers = tuple(cols[name][row] for name in ("min", "max", "mean", "norm"))
    if all(math.isnan(value) for value in numbers) or cols["numel"][row] <= 1:
        return None  # a scalar (a step counter) says nothing about which parameter it is
    return ("stats", cols["dtype"][row], cols["shape"][row], *map(repr, numbers), cols["checksum"][row])
