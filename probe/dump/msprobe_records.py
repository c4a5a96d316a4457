"""One msprobe rank folder's dump.json (with construct.json and stack.json) as probe's records.

Each tensor or argument msprobe describes becomes one record of schema.RECORD_COLUMNS:

* module: the innermost module of an API call is its construct.json parent; a module record
  names its own path. A backward API record takes its forward call's module (construct.json
  often has no parent for it), and the optimizer's calls are the root's ("").
* index: msprobe counts each API over the whole step (``Functional.linear.1`` is the step's
  second linear, wherever it ran); probe counts per (module, op). The forward calls are
  renumbered that way in execution order, and each backward record takes the index of its
  forward call. Module calls and parameter gradients (whose counter msprobe does not reset
  every step) are renumbered per step the same way.
* slot: ``input_args[i]`` -> ``input.i`` (nested: ``input.i.j``), ``input_kwargs[k]`` ->
  ``kwarg.k``, ``output[i]`` -> ``output.i``, ``parameters[w]`` -> ``param.w``,
  ``parameters_grad[w]`` -> ``param_grad.w``; backward ``input[i]`` (the gradient arriving)
  -> ``grad_output.i``; a module's backward ``output[i]`` -> ``grad_input.i``. An API's
  backward ``output`` is what the last autograd node of the call passes on (msprobe hooks that
  node, not the call's arguments: linear gives the gradients of bias, input and weight.T, in
  that order): ``grad_node.i``, a slot of its own that pairs only with another msprobe dump.
* seq: execution order is dump.json's order, except that msprobe writes a module's record
  when the module returns: its inputs and parameters get the seq just before its first inner
  call, its outputs the seq where the record stands.
* statistics: ``Max``/``Min``/``Mean``/``Norm``; null is unknown (NaN), never zero (msprobe
  leaves ``Mean``/``Norm`` out for integers, float64 and ``precision: high``). msprobe counts
  no NaN or Inf: a NaN extreme (torch.max propagates NaN) is recorded as one NaN, an infinite
  extreme as one Inf, finite extremes as none. A 0-d tensor's ``Norm`` is its value in msprobe
  and its absolute value here. ``md5`` (CRC-32, or XOR with summary_mode xor) -> checksum
  ``crc32:...`` / ``xor:...``.
* in-place writes: msprobe reads a module's inputs when the module returns, so a module whose
  inner call wrote its input in place (``ReLU(inplace=True)``) records the written values as
  its input. Where the API records show it (the inner in-place call's output has exactly the
  module input's statistics and its own input did not), that record's slot is
  ``written_input.i`` (io "out"): kept, never compared with a true input.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field

from probe.dump import msprobe_names as N
from probe.dump import msprobe_quirks
from probe.dump import schema
from probe.dump.msprobe_layout import CONSTRUCT_JSON, DUMP_JSON, STACK_JSON
from probe.dump.table import ColumnTable
from probe.errors import DumpFormatError

#: msprobe's levels -> probe's
LEVELS = {"L0": "module", "L1": "api", "mix": "mix"}
TASKS = ("statistics", "tensor")
WRITTEN_INPUT = "written_input."
GRAD_NODE = "grad_node."
_FRAME = re.compile(r"^File (.+), line (\d+), in ")
#: an installed torch or msprobe: their frames are not where the user's code called
_LIBRARY = re.compile(r"[/\\](?:site|dist)-packages[/\\](?:torch|msprobe)[/\\]")
_STATS = ("min", "max", "mean", "norm")


@dataclass
class StepRecords:
    table: ColumnTable
    tensor_files: list  # tensor_id -> file name in dump_tensor_data
    header: dict  # dump.json's fields other than data
    level: str  # probe's name of msprobe's level
    task: str
    written_inputs: int = 0
    stale_checksums: int = 0  # checksums dropped: maybe read after an in-place write (msprobe_quirks.py)
    autocast: list | None = None  # the autocast attribute the records imply (msprobe_quirks.py)
    not_read: list = field(default_factory=list)  # record names that are neither API nor module calls


def _load_json(path: str, required: bool):
    if not os.path.isfile(path):
        if required:
            raise DumpFormatError(f"{path} does not exist")
        return None
    try:
        with open(path, encoding="utf-8") as handle:
            return json.load(handle)  # accepts msprobe's bare NaN / Infinity tokens
    except (OSError, UnicodeDecodeError) as error:
        raise DumpFormatError(f"cannot read {path}: {error}") from None
    except ValueError as error:
        raise DumpFormatError(f"{path} is not valid JSON ({error}); msprobe rewrites it while the step runs: "
                              "a run killed mid-step leaves it cut short") from None


def header_of(folder: str) -> tuple[dict, dict]:
    """(dump.json without its data, the data), checked: a PyTorch statistics or tensor dump."""
    path = os.path.join(folder, DUMP_JSON)
    loaded = _load_json(path, required=True)
    if not isinstance(loaded, dict) or not isinstance(loaded.get("data"), dict):
        raise DumpFormatError(f"{path} has no 'data' object: not an msprobe dump.json")
    header = {name: value for name, value in loaded.items() if name != "data"}
    if header.get("framework", "pytorch") != "pytorch":
        raise DumpFormatError(f"{path} has framework {header.get('framework')!r}; probe reads msprobe's "
                              "PyTorch dumps (framework 'pytorch')")
    if header.get("task") not in TASKS:
        raise DumpFormatError(f"{path} has task {header.get('task')!r}; probe reads msprobe dumps of task "
                              f"{' or '.join(repr(t) for t in TASKS)}")
    if header.get("level") not in LEVELS:
        raise DumpFormatError(f"{path} has level {header.get('level')!r}; probe reads msprobe's levels "
                              f"{', '.join(LEVELS)}")
    return header, loaded["data"]


def _sources(stack) -> dict[str, str]:
    """record name -> "file.py:line" of the first frame outside torch and msprobe."""
    found: dict[str, str] = {}
    if not isinstance(stack, dict):
        return found
    for entry in stack.values():
        if not (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], list)):
            continue
        names, frames = entry
        source = ""
        for frame in frames if isinstance(frames, list) else ():
            match = _FRAME.match(str(frame))
            if match and not _LIBRARY.search(match.group(1)):
                source = f"{match.group(1)}:{match.group(2)}"
                break
        for name in names:
            found[str(name)] = source
    return found


class _Columns:
    """The record columns as they are built, with each row's place in execution order."""

    def __init__(self):
        self.rows: dict[str, list] = {name: [] for name in schema.COLUMN_NAMES + ("value_type",)}
        self.order: list[tuple] = []
        self.tensor_files: list[str] = []
        self._tensor_ids: dict = {}  # a tensor's identity -> its id

    def add(self, where: dict, slot: str, leaf: dict, order: tuple) -> int:
        rows = self.rows
        values = {name: "" for name in ("dtype", "shape", "device", "value", "checksum", "value_type")}
        stats = dict.fromkeys(_STATS, math.nan)
        counts = {"nan_count": 0, "inf_count": 0, "numel": 0, "tensor_id": -1}
        if N.is_tensor(leaf):
            shape = [int(size) for size in leaf.get("shape") or []]
            values["dtype"], values["shape"] = N.dtype_name(leaf["dtype"]), json.dumps(shape)
            stats = {"min": N.number(leaf.get("Min")), "max": N.number(leaf.get("Max")),
                     "mean": N.number(leaf.get("Mean")), "norm": N.number(leaf.get("Norm"))}
            if not shape and math.isfinite(stats["norm"]):
                stats["norm"] = abs(stats["norm"])  # msprobe's Norm of a 0-d tensor is its value
            counts["numel"] = math.prod(shape)
            # a NaN extreme says "at least one NaN"; a null one says nothing
            counts["nan_count"] = int(any(isinstance(leaf.get(k), float) and math.isnan(leaf[k]) for k in ("Min", "Max")))
            if not counts["nan_count"]:
                counts["inf_count"] = int(stats["max"] == math.inf) + int(stats["min"] == -math.inf)
            digest = leaf.get("md5")
            if isinstance(digest, str) and digest:
                values["checksum"] = ("xor:" if digest.startswith("0x") else "crc32:") + digest
            data_name = leaf.get("data_name")
            if isinstance(data_name, str) and data_name:
                counts["tensor_id"] = self._tensor_id(data_name, values, stats, counts["numel"])
        else:
            described = N.value_of(leaf)
            if described is None:
                return -1
            values["value"], values["value_type"] = described
        io = "in" if slot.startswith(("input", "kwarg", "param.", "grad_output")) else "out"
        row = {**where, **values, **stats, **counts, "slot": slot, "io": io, "seq": 0,
               "key": schema.make_key(where["module"], where["op"], where["index"], where["phase"], slot)}
        for name, column in rows.items():
            column.append(row[name])
        self.order.append(order)
        return len(self.order) - 1


    def _tensor_id(self, data_name: str, values: dict, stats: dict, numel: int) -> int:
        """msprobe saves a tensor once per record that shows it (a module's output is also the
        next call's input); records of one tensor share one id, as in a probe dump, so that
        the compare sees where each input was made. One tensor: same dtype, shape and known
        statistics, the test probe's own statistics dumps use."""
        known = numel > 1 and all(math.isfinite(value) for value in stats.values())
        identity = (values["dtype"], values["shape"], *stats.values()) if known else data_name
        number = self._tensor_ids.setdefault(identity, len(self.tensor_files))
        if number == len(self.tensor_files):
            self.tensor_files.append(data_name)
        return number


def _leaves(value, slot: str, keep_null: bool):
    """(slot, leaf) of every tensor or argument in a nested msprobe description."""
    if value is None:
        if keep_null:
            yield slot, {"type": "NoneType", "value": None}
        return
    if isinstance(value, list):
        for position, item in enumerate(value):
            yield from _leaves(item, f"{slot}.{position}", keep_null)
    elif isinstance(value, dict):
        if "type" in value or "class_type" in value:
            yield slot, value
        else:
            for name, item in value.items():
                yield from _leaves(item, f"{slot}.{name}", keep_null)


#: record field -> (probe slot prefix, its fields hold None arguments) per phase
_FORWARD_FIELDS = (("input_args", "input", True), ("input_kwargs", "kwarg", True), ("output", "output", False))


class _Renumber:
    """Per-step counters: a forward call's index local to (module, op) in execution order."""

    def __init__(self):
        self.next: dict[tuple, int] = {}
        self.forward: dict[str, tuple[str, int]] = {}  # msprobe forward name -> (module, index)

    def take(self, group: tuple) -> int:
        index = self.next.get(group, 0)
        self.next[group] = index + 1
        return index


def _first_inside(names: list[str], construct: dict) -> tuple[dict, dict]:
    """Module forward record -> position of the first record made inside the module's forward
    (or its own), and of the first backward record of a call made inside it (or its own)."""
    forward: dict[str, int] = {}
    backward: dict[str, int] = {}
    for position, name in enumerate(names):
        parsed = N.parse(name)
        if parsed is None or parsed.kind == "param_grad":
            continue
        found = forward if parsed.phase == N.FORWARD else backward
        owner = name if parsed.phase == N.FORWARD else parsed.forward_name()
        for _ in range(256):  # up the construct.json chain; a loop in it ends here
            if not isinstance(owner, str) or owner in found and found[owner] <= position:
                break
            if owner.startswith(N.MODULE_PREFIXES):
                found[owner] = position
            owner = construct.get(owner)
            owner = owner[0] if isinstance(owner, list) and owner else owner
    return forward, backward


def read_step(folder: str) -> StepRecords:
    header, data = header_of(folder)
    construct = _load_json(os.path.join(folder, CONSTRUCT_JSON), required=False)
    construct = construct if isinstance(construct, dict) else {}
    sources = _sources(_load_json(os.path.join(folder, STACK_JSON), required=False))
    names = list(data)
    first_forward, first_backward = _first_inside(names, construct)
    columns, counters, not_read = _Columns(), _Renumber(), []
    calls: dict[str, dict[str, int]] = {}  # forward record name -> slot -> row
    for position, name in enumerate(names):
        record, parsed = data[name], N.parse(name)
        if parsed is None or not isinstance(record, dict):
            not_read.append(name)
            continue
        module, index = _place(parsed, name, construct, counters)
        where = {"kind": "api" if parsed.kind == "api" else "module", "module": module,
                 "op": parsed.op, "index": index, "phase": parsed.phase, "source": sources.get(name, "")}
        rows = calls.setdefault(name, {})
        late = (position, 1, 0)
        if parsed.kind == "param_grad":
            for param, leaf in record.items():
                for slot, item in _leaves(leaf[0] if isinstance(leaf, list) and leaf else leaf,
                                          f"param_grad.{param}", False):
                    rows[slot] = columns.add(dict(where, kind="param"), slot, item, late)
            continue
        if parsed.phase == N.FORWARD:
            early = (first_forward.get(name, position), 0, module.count(".")) if parsed.kind == "module" else late
            for field_name, prefix, keep_null in _FORWARD_FIELDS:
                order = late if prefix == "output" else early
                for slot, item in _leaves(record.get(field_name), prefix, keep_null):
                    rows[slot] = columns.add(where, slot, item, order)
            for param, leaf in (record.get("parameters") or {}).items():
                for slot, item in _leaves(leaf, f"param.{param}", False):
                    rows[slot] = columns.add(dict(where, kind="param"), slot, item, early)
            continue
        # a module's grad_output arrives before its inner calls' backward runs
        arrives = (first_backward.get(parsed.forward_name(), position), 0, module.count(".")) \
            if parsed.kind == "module" else late
        made = "grad_input" if parsed.kind == "module" else GRAD_NODE[:-1]
        for field_name, prefix, order in (("input", "grad_output", arrives), ("output", made, late)):
            for slot, item in _leaves(record.get(field_name), prefix, False):
                rows[slot] = columns.add(where, slot, item, order)
    written = _mark_written_inputs(columns, calls, construct)
    _number_events(columns)
    every_call = list(calls.values())
    stale = msprobe_quirks.drop_stale_checksums(columns.rows, every_call)
    autocast = msprobe_quirks.autocast_runs(columns.rows, every_call)
    table = ColumnTable(_in_seq_order(columns.rows), os.path.join(folder, DUMP_JSON))
    return StepRecords(table, columns.tensor_files, header, LEVELS[header["level"]], header["task"], written,
                       stale, autocast, not_read)


def _place(parsed: N.Name, name: str, construct: dict, counters: _Renumber) -> tuple[str, int]:
    """(module path, index local to (module, op)) of a record, renumbered per step."""
    if parsed.kind == "param_grad":
        return parsed.path, counters.take(("param_grad", parsed.path, parsed.op))
    if parsed.phase == N.FORWARD:
        module = parsed.path if parsed.kind == "module" else N.module_path(construct.get(name))
        index = counters.take((module, parsed.op, N.FORWARD))
        counters.forward[name] = (module, index)
        return module, index
    known = counters.forward.get(parsed.forward_name())
    if known is not None:
        return known
    # a backward record whose forward was not dumped (data_mode backward): its own order
    module = parsed.path if parsed.kind == "module" else N.module_path(construct.get(name))
    return module, counters.take((module, parsed.op, N.BACKWARD))


def _stats(columns: _Columns, row: int) -> tuple | None:
    numbers = tuple(columns.rows[name][row] for name in _STATS)
    if all(math.isnan(value) for value in numbers):
        return None
    return (columns.rows["shape"][row],) + tuple("nan" if math.isnan(value) else value for value in numbers)


def _in_place(columns: _Columns, rows: dict[str, int]) -> bool:
    values = {slot: columns.rows["value"][row] for slot, row in rows.items() if not columns.rows["dtype"][row]}
    return msprobe_quirks.is_in_place(columns.rows["op"][next(iter(rows.values()))], values)


def _mark_written_inputs(columns: _Columns, calls: dict, construct: dict) -> int:
    """Rename the module inputs recorded after an inner in-place write (module docstring)."""
    inner: dict[str, list[str]] = {}
    for child, parent in construct.items():
        parent = parent[0] if isinstance(parent, list) and parent else parent
        parsed = N.parse(child) if isinstance(parent, str) and child in calls else None
        if parsed is not None and parsed.phase == N.FORWARD and parsed.kind != "param_grad":
            inner.setdefault(parent, []).append(child)
    written = 0
    for name, rows in calls.items():
        parsed = N.parse(name)
        if parsed is None or parsed.kind != "module" or parsed.phase != N.FORWARD:
            continue
        writes = []
        stack, seen = list(inner.get(name, ())), set()
        while stack:
            call = stack.pop()
            if call in seen:
                continue
            seen.add(call)
            stack += inner.get(call, ())
            slots = calls.get(call) or {}
            if slots and "output.0" in slots and "input.0" in slots and _in_place(columns, slots):
                after, before = _stats(columns, slots["output.0"]), _stats(columns, slots["input.0"])
                if after is not None and after != before:
                    writes.append(after)
        for slot, row in list(rows.items()):
            if slot.startswith("input.") and columns.rows["dtype"][row] and _stats(columns, row) in writes:
                _rename(columns, row, WRITTEN_INPUT + slot[len("input."):])
                written += 1
    return written


def _rename(columns: _Columns, row: int, slot: str) -> None:
    rows = columns.rows
    rows["slot"][row], rows["io"][row] = slot, "out"
    rows["key"][row] = schema.make_key(rows["module"][row], rows["op"][row], rows["index"][row],
                                       rows["phase"][row], slot)


def _number_events(columns: _Columns) -> None:
    """seq: the rank of each row's place in execution order (rows of one event share it)."""
    ranks = {order: rank for rank, order in enumerate(sorted(set(columns.order)))}
    columns.rows["seq"] = [ranks[order] for order in columns.order]


def _in_seq_order(rows: dict) -> dict:
    order = sorted(range(len(rows["seq"])), key=lambda row: (rows["seq"][row], row))
    return {name: [values[row] for row in order] for name, values in rows.items()}
