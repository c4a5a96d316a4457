"""Measure stage, provenance: where each input tensor of run A came from.

An input is *produced* by an earlier record of the step, a *param* (or a *param_update* once
the backward began), *carried* over from the previous step file, *unrecorded* (made after
the backward began by something not recorded) or *external* (data, buffers, constants).
The judge stage (explain.py) adds *changed*, *unpaired* and *forward* from the judged rows.
"""

from __future__ import annotations

import math

from probe.comparison.records import Call, Records, content_key, is_param_slot

STAT_COLUMNS = ("min", "max", "mean", "norm", "nan_count", "inf_count", "numel", "checksum", "dtype")


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
