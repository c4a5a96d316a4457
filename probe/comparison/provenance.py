"""Measure stage, provenance: where each input tensor of run A came from.

An input is *produced* by an earlier record of the step, a *param* (or a *param_update* once
the backward began), *carried* over from the previous step file, *unrecorded* (made after
the backward began by something not recorded) or *external* (data, buffers, constants).
The judge stage (explain.py) adds *changed*, *unpaired* and *forward* from the judged rows.
"""

from __future__ import annotations

import math

from probe.comparison.records import Call, Records, is_param_slot

#: input kinds (Provenance.kind, explain.judge_call): where the tensor an input slot holds came from
PRODUCED, PARAM_INPUT, PARAM_UPDATE, CARRIED, UNRECORDED, EXTERNAL, CHANGED = (
    "produced", "param", "param_update", "carried", "unrecorded", "external", "changed")
#: a produced input whose producing call has no partner in the other run
UNPAIRED = "unpaired"
#: a tensor record of the forward of the call whose backward is judged: the values the
#: backward computes from (saved activations, the weight the forward read)
FORWARD = "forward"
#: inputs that pass on an error made upstream, divergent or not; parameters and external
#: inputs carry their error too while within tolerance, and are sources once beyond it
CARRIERS = (PRODUCED, PARAM_UPDATE, CARRIED, UNRECORDED, FORWARD)
STAT_COLUMNS = ("min", "max", "mean", "norm", "nan_count", "inf_count", "numel", "checksum", "dtype")


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


class Provenance:
    """Where an input tensor of run A came from: produced by an earlier record of the step, a
    parameter, state carried over from the previous step file, made after the backward began
    by something unrecorded, or none of these (external)."""

    def __init__(self, records: Records, calls: list[Call], previous: set | None = None):
        cols = records.columns
        self._cols = cols
        self._prints: dict[int, list] = {}
        self.produced: dict = {}  # fingerprint -> (order, row) of its earliest output record
        self.params: dict = {}  # fingerprint -> row of a param.* record holding that tensor
        self.previous = previous or set()  # content keys of the previous step file's records
        seqs = cols["seq"]
        backward = [seq for seq, phase in zip(seqs, cols["phase"]) if phase == "backward"]
        # what enters a step from outside (data, weights, buffers) is read by the forward;
        # a tensor no record made that first shows up once the backward has begun was made
        # by something unrecorded from the step's own values (autograd's .grad accumulation)
        self.backward_from = min(backward) if backward else math.inf
        self._call_of: dict[int, int] = {}
        for number, call in enumerate(calls):
            for slot, row in call.slots.items():
                self._call_of[row] = number
                if cols["dtype"][row] == "":
                    continue
                prints = self.fingerprints(row)
                if is_param_slot(slot):
                    for mark in prints:
                        self.params.setdefault(mark, row)
                elif cols["io"][row] == "out":
                    made = ((int(seqs[row]), row), row)
                    for mark in prints:
                        known = self.produced.get(mark)
                        if known is None or made[0] < known[0]:
                            self.produced[mark] = made

    def fingerprints(self, row: int) -> list:
        """The tensor's identity: its tensor_id when stored, else its checksum and statistics."""
        found = self._prints.get(row)
        if found is not None:
            return found
        cols = self._cols
        if cols["tensor_id"][row] >= 0:
            marks = [("id", cols["tensor_id"][row])]
        elif all(math.isnan(cols[name][row]) for name in ("min", "max", "mean", "norm")):
            marks = []
        else:
            marks = [("stats", tuple(repr(cols[name][row]) for name in STAT_COLUMNS) + (cols["shape"][row],))]
        self._prints[row] = marks
        return marks

    def _late_producer_ok(self, row: int, producer: int) -> bool:
        """A gradient flowing into a module (grad_output) is recorded by its module hook before
        the downstream module's hook records the grad_input that is the same tensor: the
        producer of a backward grad_output may come later in seq (never from its own call)."""
        cols = self._cols
        return (
            cols["phase"][row] == "backward"
            and cols["slot"][row].startswith("grad_output")
            and self._call_of.get(producer) != self._call_of.get(row)
        )

    def kind(self, row: int, order: tuple) -> tuple[str, int | None]:
        """(kind, row): ("produced", producing row) | ("param" | "param_update", param record) |
        ("carried" | "unrecorded" | "external", None).

        "carried": no record of this step made it, but the previous step file holds the same
        values (optimizer state, a parameter updated in place, a buffer): its error, if any,
        was made in an earlier step. "unrecorded": no record made it and it first shows up
        after the backward began (a parameter gradient accumulated by autograd, optimizer
        state): made from the step's own values by something not recorded. "external": read
        before the backward and made by no record (data, buffers, weights of an api-level
        dump): what enters the step from outside."""
        prints = self.fingerprints(row)
        for mark in prints:
            made = self.produced.get(mark)
            if made is None:
                continue
            if made[0] < order:
                return "produced", made[1]
            if self._late_producer_ok(row, made[1]):
                return "produced", made[1]
        param = next((self.params[mark] for mark in prints if mark in self.params), None)
        if param is not None:
            # read once the backward began: the optimizer updating it; its difference, if
            # any, entered the step where the forward read it
            return ("param_update" if order[0] > self.backward_from else "param"), param
        forward = self._cols["phase"][row] == "forward"
        if forward and self.previous and content_key(self._cols, row) in self.previous:
            return "carried", None
        if order[0] > self.backward_from:
            return "unrecorded", None
        return "external", None
