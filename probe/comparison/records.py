"""The records of one step file as plain columns, and their grouping into calls.

Compare works on this small in-memory form so that the same code runs on a step file
(``Records.from_table(step.records)``) and on hand-made records in tests
(``Records.from_dicts([...])``). A *call* is every record of one (module, op, index, phase):
the inputs, parameters, arguments and outputs of one forward call or one backward firing.

Optimizer calls
---------------

What the optimizer's calls look like, for the stages that split, name and pair them: the
foreach/fused spellings of an op, the blocks of a parameter group, a tensor's fingerprint.
"""

from __future__ import annotations

import json
import math

from probe.comparison.structs import Call
from probe.dump import schema

_NUMERIC = {name for name, kind in schema.RECORD_COLUMNS if kind != "str"}
#: the slot prefix of a rank-local gradient linked as an input of the gradient an unrecorded
#: collective reduced from it (normalize.py)
LOCAL_GRAD = "local_grad."
_IN_PREFIXES = ("input", "kwarg", "param.", "grad_output", LOCAL_GRAD)
_PLACEMENT = "placement"  # optional column (schema.OPTIONAL_COLUMNS)
#: the reader's column of the records of memory nothing had written yet (files that list some)
_UNINITIALIZED = schema.UNINITIALIZED


def slot_io(slot: str) -> str:
    """The io a slot has by the schema's rules (used to fill hand-made records)."""
    return "in" if slot.startswith(_IN_PREFIXES) else "out"


def is_param_slot(slot: str) -> bool:
    return slot.startswith("param.")


def module_within(module: str, owner: str) -> bool:
    """module is owner or inside it ("blocks.1.fc" within "blocks.1"; everything within the root "")."""
    return not owner or module == owner or module.startswith(owner + ".")


class Records:
    """Column name -> Python list, one entry per record (row i of each list = record i)."""

    def __init__(self, columns: dict[str, list], source: str = ""):
        lengths = {len(values) for values in columns.values()}
        if len(lengths) > 1:
            raise ValueError(f"record columns of unequal length in {source or 'records'}")
        self.columns = columns
        self.source = source
        self._length = lengths.pop() if lengths else 0

    def __len__(self) -> int:
        return self._length

    def get(self, name: str, row: int):
        return self.columns[name][row]

    def row(self, row: int) -> dict:
        return {name: values[row] for name, values in self.columns.items()}

    def append_record(self, record: dict) -> int:
        """Add a derived record (a foreach call's per-element argument); returns its row."""
        for name, values in self.columns.items():
            values.append(record[name])
        self._length += 1
        return self._length - 1

    @classmethod
    def from_table(cls, table, source: str = "") -> "Records":
        """From probe.dump.reader's RecordTable (numpy columns)."""
        columns = {name: table.column(name).tolist() for name in schema.COLUMN_NAMES}
        for name in (_PLACEMENT, _UNINITIALIZED):  # a DTensor's place (shards.py); unwritten memory
            if name in getattr(table, "columns", ()):
                columns[name] = table.column(name).tolist()
        sketches = table.sketches() if hasattr(table, "sketches") else None  # schema 2
        if sketches is not None:
            columns[schema.SKETCH] = list(sketches)
        return cls(columns, source)

    @classmethod
    def from_dicts(cls, rows: list[dict], source: str = "") -> "Records":
        """From record dicts; missing columns get the schema's 'not recorded' values."""
        filled = [_fill(row) for row in rows]
        columns = {name: [row[name] for row in filled] for name in schema.COLUMN_NAMES}
        if any(_PLACEMENT in row for row in rows):
            columns[_PLACEMENT] = [row.get(_PLACEMENT, "") for row in rows]
        if any(_UNINITIALIZED in row for row in rows):
            columns[_UNINITIALIZED] = [bool(row.get(_UNINITIALIZED)) for row in rows]
        if any(schema.SKETCH in row for row in rows):  # optional sketches
            columns[schema.SKETCH] = [row.get(schema.SKETCH) for row in rows]
        return cls(columns, source)


def _fill(row: dict) -> dict:
    row = dict(row)
    slot = row.get("slot", "output.0")
    row.setdefault("slot", slot)
    row.setdefault("module", "")
    row.setdefault("op", "op")
    row.setdefault("index", 0)
    row.setdefault("phase", "forward")
    row.setdefault("kind", "param" if is_param_slot(slot) or slot.startswith("param_grad") else "api")
    row.setdefault("io", slot_io(slot))
    row.setdefault("seq", 0)
    row.setdefault("key", schema.make_key(row["module"], row["op"], row["index"], row["phase"], slot))
    is_value = "value" in row and row["value"] != ""
    row.setdefault("value", "")
    row.setdefault("dtype", "" if is_value else "float32")
    row.setdefault("shape", "" if is_value else "[]")
    row.setdefault("device", "" if is_value else "cpu")
    if "numel" not in row:
        row["numel"] = 0 if is_value else math.prod(json.loads(row["shape"] or "[]"))
    for name in ("min", "max", "mean", "norm"):
        row.setdefault(name, math.nan)
    for name in ("nan_count", "inf_count"):
        row.setdefault(name, 0)
    row.setdefault("checksum", "")
    row.setdefault("tensor_id", -1)
    row.setdefault("source", "")
    missing = [name for name in schema.COLUMN_NAMES if name not in row]
    if missing:
        raise ValueError(f"record lacks {missing}")
    return row


def build_calls(records: Records, rename=None) -> list[Call]:
    """Group records into calls, in execution order. rename(module, op) -> (module, op)."""
    cols = records.columns
    modules, ops, indexes, phases = cols["module"], cols["op"], cols["index"], cols["phase"]
    kinds, seqs, slots, dtypes, shapes = cols["kind"], cols["seq"], cols["slot"], cols["dtype"], cols["shape"]
    calls: dict[tuple, Call] = {}
    for row in range(len(records)):
        group = (modules[row], ops[row], indexes[row], phases[row])
        call = calls.get(group)
        if call is None:
            call = Call(
                module=modules[row], op=ops[row], index=int(indexes[row]), phase=phases[row],
                kind=kinds[row], seq=int(seqs[row]), first_row=row,
            )
            calls[group] = call
        elif kinds[row] != "param" and call.kind == "param":
            call.kind = kinds[row]  # a module call that also carries its parameters
        call.seq = min(call.seq, int(seqs[row]))
        # a repeated slot (never written by probe) keeps its first record; the rest stay unpaired
        if slots[row] in call.slots:
            call.extras.append(row)
        else:
            call.slots[slots[row]] = row
    result = list(calls.values())
    for call in result:
        call.name = rename(call.module, call.op) if rename else (call.module, call.op)
        call.shapes = tuple(
            sorted((slot, shapes[row]) for slot, row in call.slots.items() if dtypes[row] != "")
        )
        call.values = tuple(
            sorted((slot, cols["value"][row]) for slot, row in call.slots.items() if dtypes[row] == "")
        )
    result.sort(key=Call.order)
    return result


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
