"""The live comparison: a running candidate against a finished (or still running)
reference's fingerprints, step by step (torch-free).

``LiveReference.check`` takes the candidate's fingerprint of one step as the recorder writes
it, reads the reference's fingerprint of the same step (file.Follower: the reference may
still be writing its file), and judges every tensor with the same envelope as the offline
compare (envelope.py). It never raises for what the reference lacks: a step the reference
does not have (it ended early, or skipped that step) and tensors it does not hold are said
once each through ``say`` and left out.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from probe.fingerprint import envelope, inherit
from probe.fingerprint.file import Follower, find_file


@dataclass
class LiveStep:
    """What one step's comparison found: the tensors outside their envelope and those that
    jumped, each as (name, gap, allowed), largest first."""

    step: int
    outside: list = field(default_factory=list)
    jumped: list = field(default_factory=list)


class LiveReference:
    """The reference run's fingerprints of one rank, read as the candidate trains."""

    def __init__(self, path: str, rank: int, say) -> None:
        self.path = find_file(path, rank)
        self._say = say
        self._follower: Follower | None = None
        self._tracker = envelope.Tracker()
        self._parted = False  # some parameter has left its envelope at a compared step
        self._said_end = False
        self._missing_run: tuple[int, int] | None = None  # (first, last) of missing steps
        self._unknown: set[str] = set()
        self.compared = 0
        self.parted_at: int | None = None
        self._reference()  # an unreadable reference is a mistake to report now, not mid-run

    def _reference(self) -> Follower:
        if self._follower is None:
            self._follower = Follower(self.path)
        return self._follower

    def check(self, step: int, rows: list, described: dict, compute_unit: float = np.nan) -> LiveStep | None:
        """The verdict of one step, or None when the reference has no such step.
        ``rows``: [(name, numbers (6,), sketch (k,))]; ``described``: name -> description;
        ``compute_unit``: the unit roundoff autocast computed the candidate's step in."""
        reference = self._reference()
        found = reference.get(step)
        if found is None:
            self._note_missing(step, reference.last_step)
            return None
        self._close_missing_run()
        self.compared += 1
        result = LiveStep(step)
        computed = envelope.compute_units(found.compute_unit, compute_unit)
        judged = []  # (name, description, gaps, outside, jumped, allowed)
        for name, numbers, sketch in rows:
            theirs = found.tensors.get(name)
            if theirs is None:
                if name not in self._unknown:
                    self._unknown.add(name)
                    self._say(f"the reference {self.path} has no tensor {name}; it is not compared")
                continue
            entry = described[name]
            recent = self._tracker.recent_norm(name, float(theirs[0][3]))
            gaps = envelope.measure(theirs[0], theirs[1], np.asarray(numbers), np.asarray(sketch),
                                    entry["dtype"], int(entry["numel"]), np.asarray([recent]), computed)
            judged.append((name, entry, gaps, *self._tracker.judge(name, gaps)))
        for (name, _, gaps, outside, _, allowed), jumped in zip(judged, self._not_inherited(judged)):
            if outside:
                result.outside.append((name, float(gaps.estimate[0]), allowed))
            if jumped:
                result.jumped.append((name, float(gaps.estimate[0]), allowed))
        result.outside.sort(key=lambda entry: entry[1], reverse=True)
        result.jumped.sort(key=lambda entry: entry[1] / entry[2] if entry[2] > 0 else np.inf, reverse=True)
        if result.outside and self.parted_at is None:
            self.parted_at = step
        return result

    def _not_inherited(self, judged: list) -> list:
        """Each tensor's jump, less those inherited from what it read (inherit.py, as the
        offline compare judges them); remembers whether some parameter has left its envelope."""
        if not judged:
            return []
        kinds = [entry.get("kind", "") for _, entry, *_ in judged]
        params = [entry.get("param", "") for _, entry, *_ in judged]
        outside = np.array([[row[3] for row in judged]])
        jumped = np.array([[row[4] for row in judged]])
        nonfinite = np.array([[bool(row[2].nonfinite[0]) for row in judged]])
        passed_on = inherit.inherited(kinds, params, outside, jumped, nonfinite, np.array([self._parted]))
        self._parted = self._parted or bool(inherit.weights_outside(kinds, outside)[0])
        return list(jumped[0] & ~passed_on[0])

    def _note_missing(self, step: int, last: int | None) -> None:
        if last is None or step > last:
            if not self._said_end:
                self._said_end = True
                where = "holds no step yet" if last is None else f"ends at step {last}"
                self._say(f"the reference {self.path} {where}: step {step} and later are not "
                          "compared (they are if the reference grows)")
            return
        if self._missing_run is not None and self._missing_run[1] == step - 1:
            self._missing_run = (self._missing_run[0], step)
        else:
            self._close_missing_run()
            self._missing_run = (step, step)

    def _close_missing_run(self) -> None:
        run, self._missing_run = self._missing_run, None
        if run is not None:
            steps = f"step {run[0]}" if run[0] == run[1] else f"steps {run[0]}-{run[1]}"
            self._say(f"the reference {self.path} has no {steps}; not compared")

    def close(self) -> None:
        self._close_missing_run()
        if self._follower is not None:
            self._follower.close()
            self._follower = None


__all__ = ["LiveReference", "LiveStep"]
