"""What the optimizer's calls look like, for the stages that split, name and pair them: the
foreach/fused spellings of an op, the blocks of a parameter group, a tensor's fingerprint."""

from __future__ import annotations

import math

from probe.comparison.records import Call, Records

FOREACH_PREFIX = "torch._foreach_"
FUSED_PREFIX = "torch._fused_"
#: how a foreach element paired with a per-tensor call (CallPair.how)
FOREACH = "foreach"
#: how a fused kernel's element paired with the last call of a per-parameter chain
FUSED = "fused"
#: per-tensor spellings of a foreach op's base name (``_foreach_norm`` runs vector_norm)
_ALIASES = {"vector_norm": "norm", "true_divide": "div", "multiply": "mul", "subtract": "sub"}


def is_foreach(op: str) -> bool:
    return op.startswith((FOREACH_PREFIX, FUSED_PREFIX))


def base_op(op: str) -> str:
    """The op whatever its spelling: torch._foreach_add_, Tensor.add_, torch.add -> "add"."""
    name = op.removeprefix(FOREACH_PREFIX).rsplit(".", 1)[-1].rstrip("_")
    return _ALIASES.get(name, name)


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
