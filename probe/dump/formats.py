"""Any dump by its layout: probe's step files or msprobe's rank folders, and two dumps of
different formats seen alike.

    formats.load(path)               probe.load for either format
    formats.open_step_file(path)     one step file, or one msprobe rank folder
    formats.load_pair(a, b)          the two dumps of a compare, each seen as its partner records
    formats.notes(dump_a, dump_b)    what reading another tool's dump means for the compare

A pair of different formats is compared on what both record. probe counts NaN and Inf
values and takes checksums of its own kind; msprobe knows only whether an extreme is NaN or
infinite and takes CRC-32s. So each side's records are seen with the NaN/Inf counts as msprobe
can know them (0 or 1 NaN; one Inf per infinite extreme), no checksums and no sketches. An
msprobe dump of level L1 records no module paths: against it the other side's API calls are
seen without theirs too (index per op, in execution order, as msprobe counts them), so that
calls pair by op and order.
"""

from __future__ import annotations

import math
import os

from probe.dump import msprobe, msprobe_layout, reader, schema
from probe.dump.msprobe_records import GRAD_NODE, WRITTEN_INPUT
from probe.dump.table import ColumnTable

PROBE = "probe"
#: root attributes that say how a probe run was set up; msprobe records none of them
_RUN_SETTINGS = ("seed_report", "determinism", "torch_version", "probe_version")


def format_of(dump) -> str:
    return getattr(dump, "format", PROBE)


def load(path):
    """A probe dump or an msprobe dump, told apart by the folder layout."""
    path = os.fspath(path)
    return msprobe.load(path) if msprobe_layout.is_msprobe_dump(path) else reader.load(path)


def open_step_file(path):
    """A probe step file, or an msprobe rank folder (or its dump.json)."""
    path = os.fspath(path)
    return msprobe.open_step(path) if msprobe_layout.is_msprobe_dump(path) else reader.open_step_file(path)


def names_one_step(path) -> bool:
    """path names one step of one rank: a probe step file, or an msprobe rank folder or its
    dump.json (two such compare with each other whatever their step numbers)."""
    path = os.fspath(path)
    return os.path.isfile(path) or msprobe_layout.is_rank_folder(path)


def _level(dump) -> str:
    if not dump.files:
        return ""
    with dump.open(*next(iter(dump.files))) as step:
        return str(step.attrs.get("level", ""))


def load_pair(path_a, path_b) -> tuple:
    """(dump A, dump B), each wrapped as its partner's format needs (module docstring)."""
    dump_a, dump_b = load(path_a), load(path_b)
    mixed = format_of(dump_a) != format_of(dump_b)
    pathless_a = format_of(dump_a) == msprobe.FORMAT and _level(dump_a) == "api"
    pathless_b = format_of(dump_b) == msprobe.FORMAT and _level(dump_b) == "api"
    flatten_a, flatten_b = pathless_b and not pathless_a, pathless_a and not pathless_b
    if mixed or flatten_a:
        dump_a = PairedDump(dump_a, format_of(dump_b), flatten_a)
    if mixed or flatten_b:
        dump_b = PairedDump(dump_b, format_of(dump_a), flatten_b)
    return dump_a, dump_b


def notes(dump_a, dump_b) -> list[str]:
    """The compare's notes on dumps of another tool (none for two probe dumps)."""
    found: list[str] = []
    for side, dump, other in (("A", dump_a, dump_b), ("B", dump_b, dump_a)):
        if format_of(dump) == msprobe.FORMAT:
            found += _msprobe_notes(side, dump, format_of(other))
        elif format_of(other) == msprobe.FORMAT:
            found.append(f"{side}'s run settings (seed, threads, determinism, versions) and device are not "
                         "compared: the msprobe dump records none")
        if getattr(dump, "flatten", False):
            found.append(f"{side}: API calls seen without their module paths (the other dump, msprobe level L1, "
                         "records none): they pair by op and order")
    return found


def _msprobe_notes(side: str, dump, other_format: str) -> list[str]:
    """What an msprobe dump's records can say, and what its first step file showed."""
    with dump.open(*next(iter(dump.files))) as step:
        parsed, tensors = step.parsed, step.tensor_count
    kept = "tensors from dump_tensor_data" if tensors else "statistics without sketches: an error is only " \
        "bounded from below (by how max, min, mean and norm change; a change that keeps those four is not seen), " \
        "and NaN and Inf are known only as present or absent"
    found = [f"{side} is an msprobe dump (level {parsed.level}, task {parsed.task}): read as probe's records "
             f"(module from construct.json, counters per module and op renumbered every step); evidence: {kept}"]
    if parsed.tensor_files and not tensors:
        found.append(f"{side} keeps .pt tensors, which need torch to read (pip install torch): compared by statistics")
    if other_format != msprobe.FORMAT:
        found.append(f"{side}'s API backward records hold what each call's last autograd node passes on "
                     f"({GRAD_NODE}N), not the gradient of each argument: they pair only with another msprobe dump")
    where = f"in step {step.step} rank {step.rank}"
    if parsed.written_inputs:
        found.append(f"{side}: {parsed.written_inputs} module input record(s) {where} hold what an inner in-place call "
                     f"wrote (msprobe read them after the write): kept as {WRITTEN_INPUT}N, not compared as inputs")
    if parsed.stale_checksums:
        found.append(f"{side}: {parsed.stale_checksums} checksum(s) {where} of inputs to in-place calls dropped: msprobe "
                     "takes them on a worker thread, maybe after the write; their statistics are compared")
    if parsed.not_read:
        found.append(f"{side}: {len(parsed.not_read)} record(s) {where} are neither API nor module calls and were not "
                     f"read (first: {parsed.not_read[0]})")
    return found


class PairedDump:
    """A dump seen beside a dump of another format (load_pair): opens PairedSteps."""

    def __init__(self, inner, partner_format: str, flatten: bool):
        self.inner = inner
        self.format = format_of(inner)
        self.alike = partner_format != self.format
        self.flatten = flatten

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __repr__(self) -> str:
        return f"PairedDump({self.inner!r})"

    def open(self, step: int, rank: int = 0) -> "PairedStep":
        return PairedStep(self.inner.open(step, rank), self.alike, self.flatten)


class PairedStep:
    """A step file (either format) whose records are rewritten as PairedDump says."""

    def __init__(self, inner, alike: bool, flatten: bool):
        self.inner = inner
        self._alike, self._flatten = alike, flatten
        self._records: ColumnTable | None = None

    def __getattr__(self, name):
        return getattr(self.inner, name)

    @property
    def attrs(self) -> dict:
        """The step's attributes; beside another tool's dump, without the run settings only
        probe records (seed, threads, versions, device) that the other side cannot match."""
        attrs = self.inner.attrs
        if not self._alike:
            return attrs
        return {name: ("" if name == "device" else value) for name, value in attrs.items()
                if name not in _RUN_SETTINGS}

    def __enter__(self) -> "PairedStep":
        return self

    def __exit__(self, *exc) -> None:
        self.inner.close()

    @property
    def records(self) -> ColumnTable:
        if self._records is None:
            table = self.inner.records
            lists = {name: table.column(name).tolist() for name in table.columns}
            if self._alike:
                _as_msprobe_sees(lists, format_of_step(self.inner) == PROBE)
            if self._flatten:
                _without_api_modules(lists)
            sketches = None if self._alike else (table.sketches() if hasattr(table, "sketches") else None)
            self._records = ColumnTable(lists, self.inner.path, sketches)
        return self._records


def format_of_step(step) -> str:
    return str(step.attrs.get("format", PROBE))


def _as_msprobe_sees(lists: dict, probe_side: bool) -> None:
    """No checksums (two kinds never agree); on probe's side, NaN/Inf counts as msprobe knows them."""
    lists["checksum"] = [""] * len(lists["checksum"])
    if not probe_side:
        return
    for row, dtype in enumerate(lists["dtype"]):
        if not dtype:
            continue
        nan = int(lists["nan_count"][row] != 0)
        lists["nan_count"][row] = nan
        lists["inf_count"][row] = 0 if nan else int(lists["max"][row] == math.inf) + int(lists["min"][row] == -math.inf)


def _without_api_modules(lists: dict) -> None:
    """API calls under module "" with msprobe's counting: per op, in forward execution order;
    a backward call keeps its forward call's index."""
    rows = sorted((row for row, kind in enumerate(lists["kind"]) if kind == "api"),
                  key=lambda row: (lists["seq"][row], row))
    forward: dict[tuple, int] = {}  # (module, op, index) of a forward call -> its new index
    orphans: dict[tuple, int] = {}  # the same for backward calls whose forward was not recorded
    taken: dict[tuple, int] = {}
    for row in rows:
        op, phase = lists["op"][row], lists["phase"][row]
        call = (lists["module"][row], op, lists["index"][row])
        if phase == "forward" and call not in forward:
            forward[call] = _next(taken, (op, phase))
        elif phase != "forward" and call not in forward and call not in orphans:
            orphans[call] = _next(taken, (op, phase))
        lists["index"][row] = forward[call] if call in forward else orphans[call]
        lists["module"][row] = ""
        lists["key"][row] = schema.make_key("", op, lists["index"][row], phase, lists["slot"][row])


def _next(taken: dict, group: tuple) -> int:
    number = taken.get(group, 0)
    taken[group] = number + 1
    return number
