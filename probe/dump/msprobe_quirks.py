"""What an msprobe dump does not say outright, read from its records.

* Checksums taken after an in-place write. msprobe computes CRC-32s (summary_mode md5) on a
  worker thread, from the live tensor: the input of an in-place call (``relu(x, inplace=True)``,
  ``x.add_(y)``) can be read after the call wrote it, and two dumps of one run then disagree on
  that checksum. The checksum of such an input, and of the enclosing modules' inputs holding
  the same tensor (same statistics), is dropped; their statistics stay.
* Autocast. msprobe does not record whether autocast was on. Autocast shows in the records:
  a call (linear, matmul, ...) whose output is in a coarser floating dtype than every floating
  input it was given lowered the precision itself; a model's own cast gives the call inputs
  that are already coarse. A dump with such a call is read as computed under autocast from
  that call to the end of its forward (``[[first_seq, last_seq, dtype]]``, the root attribute
  probe writes); one with API records and no such call as made without autocast (``[]``);
  one without API records (level L0) cannot tell (None). The compare's precision rule reads
  it: a lower dtype by the model's own casts is a finding, under autocast a note.
"""

from __future__ import annotations

#: significand bits: the coarser dtype has fewer
_BITS = {"float64": 53, "float32": 24, "float16": 11, "bfloat16": 8, "float8_e4m3fn": 4, "float8_e4m3fnuz": 4,
         "float8_e5m2": 3, "float8_e5m2fnuz": 3}
#: ops whose job is to change the dtype: they lower precision because the model asked
_CASTS = {"Tensor.to", "Tensor.type", "Tensor.half", "Tensor.bfloat16", "Tensor.float", "Tensor.double",
          "Tensor.type_as", "torch.to", "torch._to_copy"}
_STATS = ("min", "max", "mean", "norm")


def is_in_place(op: str, values: dict) -> bool:
    """op ("Tensor.add_") writes its first argument, or the call passed inplace=True.
    values: slot -> value text of the call's non-tensor arguments."""
    name = op.rsplit(".", 1)[-1]
    return (name.endswith("_") and not name.startswith("__")) or values.get("kwarg.inplace") == "true"


def _stats(rows: dict, row: int) -> tuple:
    return (rows["shape"][row],) + tuple(repr(rows[name][row]) for name in _STATS)


def drop_stale_checksums(rows: dict, calls: list[dict]) -> int:
    """Clear the checksums an in-place call's input may have been read with after its write:
    its own input.0's and those of the enclosing modules' inputs holding the same tensor (same
    statistics). calls: each call's slot -> row. Returns how many were cleared."""
    stale: list[tuple[str, tuple]] = []  # (module of the in-place call, statistics of what it wrote into)
    cleared = 0
    for slots in calls:
        first = slots.get("input.0")
        if first is None or not rows["checksum"][first] or rows["kind"][first] != "api" \
                or rows["phase"][first] != "forward":
            continue
        values = {slot: rows["value"][row] for slot, row in slots.items() if not rows["dtype"][row]}
        if is_in_place(rows["op"][first], values):
            stale.append((rows["module"][first], _stats(rows, first)))
            rows["checksum"][first] = ""
            cleared += 1
    module_inputs: dict[tuple, list[int]] = {}  # statistics -> module forward input rows holding them
    for row, checksum in enumerate(rows["checksum"]):
        if checksum and rows["kind"][row] == "module" and rows["phase"][row] == "forward" \
                and rows["slot"][row].startswith("input."):
            module_inputs.setdefault(_stats(rows, row), []).append(row)
    for module, stats in stale:
        for row in module_inputs.get(stats, ()):
            if rows["checksum"][row] and _encloses(rows["module"][row], module):
                rows["checksum"][row] = ""
                cleared += 1
    return cleared


def _encloses(owner: str, module: str) -> bool:
    return module == owner or module.startswith(owner + ".")


def autocast_runs(rows: dict, calls: list[dict]) -> list | None:
    """The autocast attribute the records imply (module docstring)."""
    forward = [slots for slots in calls
               if slots and rows["kind"][next(iter(slots.values()))] == "api"
               and rows["phase"][next(iter(slots.values()))] == "forward"]
    if not forward:
        return None
    last = max(rows["seq"][row] for slots in forward for row in slots.values())
    for slots in sorted(forward, key=lambda s: min(rows["seq"][row] for row in s.values())):
        out = slots.get("output.0")
        if out is None or rows["dtype"][out] not in _BITS or rows["op"][out] in _CASTS:
            continue
        given = [rows["dtype"][row] for slot, row in slots.items()
                 if slot.startswith(("input.", "kwarg.")) and rows["dtype"][row] in _BITS]
        if given and all(_BITS[dtype] > _BITS[rows["dtype"][out]] for dtype in given):
            return [[int(rows["seq"][out]), int(last), rows["dtype"][out]]]
    return []
