"""The records of one step file as plain columns, and their grouping into calls.

Compare works on this small in-memory form so that the same code runs on a step file
(``Records.from_table(step.records)``) and on hand-made records in tests
(``Records.from_dicts([...])``). A *call* is every record of one (module, op, index, phase):
the inputs, parameters, arguments and outputs of one forward call or one backward firing.

Optimizer calls
---------------

What the optimizer's calls look like, for the stages that split, name and pair them: the
blocks of a parameter group, a tensor's fingerprint (how a foreach or fused op is spelled is
ops.py's).

Name mapping
------------

Name mapping for ports whose module paths or op names differ (``--mapping map.yaml``).

    modules:
      encoder.layer: model.layers        # module-path prefix in one run: prefix in the other
    ops:
      npu_fusion_attention: functional.scaled_dot_product_attention

Module prefixes match on dot boundaries ("encoder.layer" matches "encoder.layer.3.attn",
not "encoder.layers"); the longest matching prefix wins. An op key matches an op name
exactly, or, when the key has no dot, the op name's last dotted part
("npu_fusion_attention" matches "torch_npu.npu_fusion_attention").

The renames apply to both dumps before alignment, so the file works whichever run is A.
They only decide which calls pair up; reports show each run's own names.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass, field

import numpy as np

from probe.dump import schema
from probe.errors import CompareError

@dataclass(slots=True)
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
    #: a foreach call's i-th tensor seen as its own call (normalize.py): i, else -1
    element: int = -1
    #: the parameter group (foreach block, normalize.py) a foreach element belongs to, else -1
    block: int = -1
    #: slots of a foreach element that every element of the call shares (a scalar argument)
    shared: frozenset = frozenset()
    #: the parameter an optimizer call updates ("fc1.weight"; normalize.py), "" when not known
    target: str = ""

    @property
    def key(self) -> str:
        element = f"[{self.element}]" if self.element >= 0 else ""
        return f"{self.module}/{self.op}#{self.index}{element}/{self.phase}"

    def order(self) -> tuple[int, int]:
        return (self.seq, self.first_row)


@dataclass(slots=True)
class CallPair:
    """One call of A and its partner in B (either may be None: no partner)."""

    a: Call | None
    b: Call | None
    how: str = ""  # align.SEQUENCE | NAME | KEY, foreach FOREACH | FUSED; "" when one side is missing
    order: tuple = ()  # execution-order sort key (A's order; B-only calls follow their anchor)

    @property
    def phase(self) -> str:
        return (self.a or self.b).phase


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


#: the slots of a parameter (a module's param.*) and of its gradient (param_grad.*)
PARAMETER_SLOTS = ("param.", "param_grad.")


def is_param_slot(slot: str) -> bool:
    return slot.startswith("param.")


def parse_shape(text) -> tuple:
    """A shape column ("[4, 8]") as a tuple of ints; () when it is empty or not a shape."""
    if isinstance(text, (tuple, list)):
        return tuple(int(v) for v in text)
    return _parse_shape_text(text)


@functools.lru_cache(maxsize=4096)
def _parse_shape_text(text) -> tuple:
    try:
        value = json.loads(text) if text else []
    except (TypeError, ValueError):
        return ()
    return tuple(int(v) for v in value) if isinstance(value, list) else ()


def param_name(module: str, slot: str) -> str:
    """fc1.weight: the parameter a module's param.* or param_grad.* slot holds."""
    name = slot.split(".", 1)[1] if slot.startswith(PARAMETER_SLOTS) else slot
    return f"{module}.{name}" if module else name


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
        self._prints: dict[bool, list] = {}  # one_element -> tensor_prints of the rows so far
        self._nans: tuple | None = None  # (rows, any NaN statistics, all NaN statistics), see nan_statistics

    def __len__(self) -> int:
        return self._length

    def get(self, name: str, row: int):
        return self.columns[name][row]

    def prints(self, one_element: bool = False) -> list:
        """Every row's tensor_prints entry, made once (and for appended rows when they come)."""
        made = self._prints.setdefault(one_element, [])
        if len(made) < self._length:
            made.extend(tensor_prints(self.columns, len(made), one_element))
        return made

    def nan_statistics(self) -> tuple[list, list]:
        """Per record: (any, all) of min, max, mean and norm are NaN, read once per length."""
        if self._nans is None or self._nans[0] != self._length:
            cols = self.columns
            nan = np.isnan(np.array([cols[name] for name in STATS[:4]], dtype=np.float64).reshape(4, self._length))
            self._nans = (self._length, nan.any(axis=0).tolist(), nan.all(axis=0).tolist())
        return self._nans[1], self._nans[2]

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
        for name in (_PLACEMENT, _UNINITIALIZED, schema.BUFFER):  # a DTensor's place (shards.py); unwritten
            # memory; the model buffer a record holds
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
        if any(schema.BUFFER in row for row in rows):
            columns[schema.BUFFER] = [row.get(schema.BUFFER, "") for row in rows]
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
    for row, (module, op, index, phase, kind, seq, slot) in enumerate(zip(modules, ops, indexes, phases, kinds,
                                                                          seqs, slots)):
        group = (module, op, index, phase)
        call = calls.get(group)
        if call is None:
            call = calls[group] = Call(module=module, op=op, index=int(index), phase=phase, kind=kind, seq=int(seq),
                                       first_row=row)
        else:
            if kind != "param" and call.kind == "param":
                call.kind = kind  # a module call that also carries its parameters
            if seq < call.seq:
                call.seq = int(seq)
        # a repeated slot (never written by probe) keeps its first record; the rest stay unpaired
        if slot in call.slots:
            call.extras.append(row)
        else:
            call.slots[slot] = row
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


#: how a foreach element paired with a per-tensor call (CallPair.how)
FOREACH = "foreach"
#: how a fused kernel's element paired with the last call of a per-parameter chain
FUSED = "fused"


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


def tensor_prints(cols: dict, start: int = 0, one_element: bool = False) -> list:
    """Each tensor's identity within one step file, rows start on: its stored id, else its
    statistics (of a one-element tensor only with one_element, and never of a 0-dim one);
    None for a value, a scalar, or statistics all NaN. Made column by column: a row at a time,
    they took a twentieth of a statistics compare's time."""
    found = []
    numbers = (number_keys(cols[name][start:]) for name in ("min", "max", "mean", "norm"))
    for dtype, tensor_id, shape, numel, checksum, low, high, mean, norm in zip(*(
            cols[name][start:] for name in ("dtype", "tensor_id", "shape", "numel", "checksum")), *numbers):
        if dtype == "":
            found.append(None)
        elif tensor_id >= 0:
            found.append(("id", tensor_id))
        elif (numel <= 1 and not (one_element and shape not in ("", "[]"))) or (
                low == high == mean == norm == _NAN_KEY):
            found.append(None)  # a scalar (a step counter) says nothing about which parameter it is
        else:
            found.append(("stats", dtype, shape, low, high, mean, norm, checksum))
    return found


def number_keys(values: list) -> list:
    """A key per number, equal only for the same number (NaN for NaN, -0.0 not for 0.0): its
    float64 bits, the whole column at once (repr, number by number, took several times longer)."""
    try:
        array = np.array(values, dtype=np.float64)
    except (TypeError, ValueError):
        return [repr(value) for value in values]
    nan = np.isnan(array)
    if nan.any():
        array[nan] = np.nan
    return array.view(np.int64).tolist()


_NAN_KEY = number_keys([math.nan])[0]


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


#: the statistics of a record that an in-place write check compares (record_rules.StaleRecords)
STATS = ("min", "max", "mean", "norm", "nan_count", "inf_count", "numel", "checksum", "shape", "dtype")


def unknown_statistics(records: Records) -> list[bool]:
    """Per record: min, max, mean and norm are all NaN (a plain value, or no statistics)."""
    return records.nan_statistics()[1]


def row_facts(records: Records) -> tuple[list, list]:
    """(statistics, content_key) of every record, column by column. Statistics: the values
    STATS names, a NaN spelled "nan" (None for a plain value, or a tensor with no statistics)."""
    cols = records.columns
    some, every = records.nan_statistics()
    stats = list(zip(*(cols[name] for name in STATS)))
    keys = [hash((dtype, shape, numel, checksum)) if checksum else hash((dtype, shape, numel, low, high, mean, norm,
                                                                             nans, infs))
            for low, high, mean, norm, nans, infs, numel, checksum, shape, dtype in stats]
    for row in [row for row, nan in enumerate(some) if nan]:
        # NaN hashes by identity: spell it out so equal statistics give equal keys
        values = stats[row] = tuple("nan" if isinstance(v, float) and math.isnan(v) else v for v in stats[row])
        if not values[7]:
            keys[row] = None if every[row] else hash((values[9], values[8], values[6], *values[:6]))
    return [None if empty or values[9] == "" else values for values, empty in zip(stats, every)], keys


ALLOWED_KEYS = ("modules", "ops")


@dataclass(frozen=True)
class NameMapping:
    modules: tuple[tuple[str, str], ...] = ()  # (prefix, replacement), longest prefix first
    ops: dict = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.modules or self.ops)

    def module(self, path: str) -> str:
        for prefix, replacement in self.modules:
            if prefix == "":
                return f"{replacement}.{path}" if path else replacement
            if path == prefix:
                return replacement
            if path.startswith(prefix + "."):
                return replacement + path[len(prefix):]
        return path

    def op(self, name: str) -> str:
        if name in self.ops:
            return self.ops[name]
        last = name.rsplit(".", 1)[-1]
        if last != name and last in self.ops and "." not in last:
            return self.ops[last]
        return name

    def rename(self, module: str, op: str) -> tuple[str, str]:
        return self.module(module), self.op(op)

    def to_dict(self) -> dict:
        return {"modules": dict(self.modules), "ops": dict(self.ops)}


def mapping_from_dict(data, where: str = "mapping") -> NameMapping:
    """Validate the parsed YAML/dict form; raise CompareError naming the bad entry."""
    if data is None:
        return NameMapping()
    if not isinstance(data, dict):
        raise CompareError(f"{where} must be a mapping with keys {' and '.join(ALLOWED_KEYS)}, found {type(data).__name__}")
    unknown = [key for key in data if key not in ALLOWED_KEYS]
    if unknown:
        raise CompareError(f"{where} has unknown key {unknown[0]!r}; allowed keys: {', '.join(ALLOWED_KEYS)}")
    modules = _string_map(data.get("modules"), f"{where} modules")
    ops = _string_map(data.get("ops"), f"{where} ops")
    for name in ops:
        if name == "":
            raise CompareError(f"{where} ops has an empty op name")
    ordered = tuple(sorted(modules.items(), key=lambda item: len(item[0]), reverse=True))
    return NameMapping(modules=ordered, ops=ops)


def _string_map(value, where: str) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise CompareError(f"{where} must map names to names, found {type(value).__name__}")
    result = {}
    for key, target in value.items():
        if key is None:
            key = ""
        if not isinstance(key, str) or not isinstance(target, str):
            raise CompareError(f"{where} entry {key!r}: {target!r} must map a string to a string")
        result[key] = target
    return result


def load_mapping(path: str) -> NameMapping:
    """Read a mapping YAML file; every problem is one CompareError sentence."""
    import yaml

    try:
        with open(path, encoding="utf-8") as handle:
            data = yaml.safe_load(handle)
    except FileNotFoundError:
        raise CompareError(f"mapping file {path} does not exist") from None
    except IsADirectoryError:
        raise CompareError(f"mapping file {path} is a folder, expected a YAML file") from None
    except (OSError, UnicodeDecodeError) as error:
        raise CompareError(f"mapping file {path} cannot be read: {getattr(error, 'strerror', None) or error}") from None
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise CompareError(f"mapping file {path} is not valid YAML{where}") from None
    if data is None:
        raise CompareError(f"mapping file {path} is empty; expected keys {' and '.join(ALLOWED_KEYS)}")
    return mapping_from_dict(data, f"mapping file {path}")
