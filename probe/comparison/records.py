"""The records of one step file as plain columns, and their grouping into calls.

Compare works on this small in-memory form so that the same code runs on a step file
(``Records.from_table(step.records)``) and on hand-made records in tests
(``Records.from_dicts([...])``). A *call* is every record of one (module, op, index, phase):
the inputs, parameters, arguments and outputs of one forward call or one backward firing.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

from probe.dump import schema

_NUMERIC = {name for name, kind in schema.RECORD_COLUMNS if kind != "str"}
#: the slot prefix of a rank-local gradient linked as an input of the gradient an unrecorded
#: collective reduced from it (reduced_grads.py)
LOCAL_GRAD = "local_grad."
_IN_PREFIXES = ("input", "kwarg", "param.", "grad_output", LOCAL_GRAD)
_PLACEMENT = "placement"  # optional column (schema.OPTIONAL_COLUMNS)


def slot_io(slot: str) -> str:
    """The io a slot has by the schema's rules (used to fill hand-made records)."""
    return "in" if slot.startswith(_IN_PREFIXES) else "out"


def is_param_slot(slot: str) -> bool:
    return slot.startswith("param.")


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

    def append(self, record: dict) -> int:
        """Add a derived record (a foreach call's per-element argument); returns its row."""
        for name, values in self.columns.items():
            values.append(record[name])
        self._length += 1
        return self._length - 1

    @classmethod
    def from_table(cls, table, source: str = "") -> "Records":
        """From probe.dump.reader's RecordTable (numpy columns)."""
        columns = {name: table.column(name).tolist() for name in schema.COLUMN_NAMES}
        if _PLACEMENT in getattr(table, "columns", ()):  # a DTensor's place (shards.py)
            columns[_PLACEMENT] = table.column(_PLACEMENT).tolist()
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


@dataclass
class Call:
    """The records of one call: (module, op, index, phase), in execution order by seq."""

    module: str
    op: str
    index: int
    phase: str
    kind: str
    seq: int
    first_row: int
    slots: dict[str, int] = field(default_factory=dict)  # slot -> row
    extras: list[int] = field(default_factory=list)  # rows repeating a slot: never paired
    name: tuple[str, str] = ("", "")  # (module, op) after the mapping file's renames
    shapes: tuple = ()  # ((slot, shape), ...) of the tensor slots: the call's signature
    values: tuple = ()  # ((slot, value), ...) of the plain-value slots (arguments)
    #: a foreach call's i-th tensor seen as its own call (foreach.py): i, else -1
    element: int = -1
    #: the parameter group (foreach block, foreach.py) a foreach element belongs to, else -1
    block: int = -1
    #: slots of a foreach element that every element of the call shares (a scalar argument)
    shared: frozenset = frozenset()
    #: the parameter an optimizer call updates ("fc1.weight"; optimizer_targets.py), "" when not known
    target: str = ""

    @property
    def key(self) -> str:
        element = f"[{self.element}]" if self.element >= 0 else ""
        return f"{self.module}/{self.op}#{self.index}{element}/{self.phase}"

    def order(self) -> tuple[int, int]:
        return (self.seq, self.first_row)


@dataclass
class CallPair:
    """One call of A and its partner in B (either may be None: no partner)."""

    a: Call | None
    b: Call | None
    how: str = ""  # align.SEQUENCE | NAME | KEY, foreach FOREACH | FUSED; "" when one side is missing
    order: tuple = ()  # execution-order sort key (A's order; B-only calls follow their anchor)

    @property
    def phase(self) -> str:
        return (self.a or self.b).phase


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


def content_key(cols: dict, row: int) -> int | None:
    """A tensor's values, comparable across step files: its checksum when recorded, else its
    statistics (None when neither is known)."""
    head = (cols["dtype"][row], cols["shape"][row], cols["numel"][row])
    if cols["checksum"][row]:
        return hash(head + (cols["checksum"][row],))
    numbers = tuple(cols[name][row] for name in ("min", "max", "mean", "norm"))
    if all(math.isnan(value) for value in numbers):
        return None
    # NaN hashes by identity: spell it out so equal statistics give equal keys
    numbers = tuple("nan" if math.isnan(value) else value for value in numbers)
    return hash(head + numbers + (cols["nan_count"][row], cols["inf_count"][row]))


def content_keys(records: Records) -> set:
    """content_key of every tensor record of a step file (what the next step may carry over)."""
    cols = records.columns
    keys = {content_key(cols, row) for row in range(len(records)) if cols["dtype"][row] != ""}
    keys.discard(None)
    return keys
