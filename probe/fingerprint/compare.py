"""Where two fingerprinted runs part: the first step, jump or drift, which tensors (torch-free).

Two runs' fingerprint files (file.read) are lined up by step number and tensor name; each
tensor's gap is measured at every common step and judged against its rounding envelope
(envelope.py). The result is plain data (``FingerprintResult``); report.py renders it.

* **parting step**: the first step where any parameter, gradient or state tensor leaves its
  envelope (its gap's low end above one step's fresh rounding);
* **kind**: "jump" when some tensor jumped at that step (its gap grew by more than rounding
  allows in one step), else "drift" (accumulated rounding, which every pair of runs that sum
  in another order shows sooner or later);
* **first jump**: the first step where any tensor jumped (a later bug can follow an early
  drift), and the tensors that jumped there, largest jump (low end / allowed) first.

The verdict is "diverged" when a jump was found, "pass" otherwise (drift alone included):
a drift is what rounding does, a jump is not.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field

import numpy as np

from probe.config import KEYS
from probe.errors import CompareError
from probe.fingerprint import envelope, inherit
from probe.fingerprint.file import Fingerprints


@dataclass
class TensorStep:
    """One tensor at one step: its gap and what rounding allowed."""

    name: str
    kind: str
    step: int
    gap: float
    low: float
    high: float
    allowed: float
    fresh: float

    @property
    def ratio(self) -> float:
        return self.low / self.allowed if self.allowed > 0 else math.inf


@dataclass
class Series:
    """One tensor's gap over the common steps (for the plot)."""

    name: str
    kind: str
    gap: list
    allowed: list
    fresh: list


@dataclass
class FingerprintResult:
    a: str
    b: str
    rank: int
    steps: list  # the common steps, in order
    parting_step: int | None  # first step outside the envelope
    parting_kind: str | None  # "jump" | "drift"
    parting_tensors: list  # TensorStep outside at the parting step, largest gap first
    jump_step: int | None
    jumped: list  # TensorStep that jumped at jump_step, largest jump first
    only_a_steps: list
    only_b_steps: list
    only_a_tensors: list
    only_b_tensors: list
    loss_a: list
    loss_b: list
    series: list = field(default_factory=list)  # Series
    config_a: dict = field(default_factory=dict)
    config_b: dict = field(default_factory=dict)
    #: the first step where a tensor grew by more than rounding allows in one step from what
    #: it read that had already parted (inherit.py: no jump), and those tensors
    inherited_step: int | None = None
    inherited: list = field(default_factory=list)
    #: the dtypes autocast computed each run's steps in ({"a": [...], "b": [...]}: "" off),
    #: what the rounding allowed was sized from; empty lists where the files do not say
    compute: dict = field(default_factory=dict)

    @property
    def diverged(self) -> bool:
        return self.jump_step is not None

    @property
    def verdict(self) -> str:
        return "diverged" if self.diverged else "pass"

    def dump_configs(self) -> tuple[dict, dict] | None:
        """The configs that capture the step to look at (the first jump, else where the runs
        part) in full in both runs: each run's own config with only that step, full tensors,
        a dump folder of its own, fingerprints off."""
        step = self.jump_step if self.jump_step is not None else self.parting_step
        if step is None:
            return None
        a, b = _dump_config(self.config_a, step), _dump_config(self.config_b, step)
        if a["dump_path"] == b["dump_path"]:  # both runs used one dump_path: one folder each
            a["dump_path"] += "_a"
            b["dump_path"] += "_b"
        return a, b

    def to_dict(self) -> dict:
        focus = self.jumped[0] if self.jumped else None
        first = None
        if focus is not None:
            first = {"step": self.jump_step, "rank": self.rank, "key": focus.name, **_place(focus),
                     "origin": "introduced", "parting": "jump",
                     "metrics": {"rel_l2": focus.gap, "low": focus.low, "high": focus.high,
                                 "allowed": focus.allowed}}
        configs = self.dump_configs()
        return {
            "verdict": self.verdict,
            "kind": "fingerprints",
            "a": self.a, "b": self.b, "rank": self.rank,
            "first_divergence": first,
            "parting": None if self.parting_step is None else {
                "step": self.parting_step, "kind": self.parting_kind,
                "tensors": [asdict(t) for t in self.parting_tensors[:10]]},
            "first_jump": None if self.jump_step is None else {
                "step": self.jump_step, "tensors": [asdict(t) for t in self.jumped]},
            "first_inherited": None if self.inherited_step is None else {
                "step": self.inherited_step, "tensors": [asdict(t) for t in self.inherited[:10]]},
            "counts": {"steps": len(self.steps), "tensors": len(self.series),
                       "only_a": len(self.only_a_tensors), "only_b": len(self.only_b_tensors),
                       "only_a_steps": len(self.only_a_steps), "only_b_steps": len(self.only_b_steps),
                       "matched": len(self.series), "diverged": len(self.jumped)},
            "dump_configs": None if configs is None else {"a": configs[0], "b": configs[1]},
            "envelope": {"growth": envelope.GROWTH, "window": envelope.WINDOW,
                         "fresh_ulps": envelope.FRESH_ULPS, "compute_ulps": envelope.COMPUTE_ULPS},
            "compute_dtypes": self.compute,
        }


def _place(tensor: TensorStep) -> dict:
    """first_divergence's module/op/phase/slot for a tensor of the fingerprint: a gradient is
    made by backward, a parameter or a state tensor by the optimizer step (phase "forward", as
    a step file records the optimizer's calls); the slot names it
    as a step file's param records do ("param.bias", "param_grad.bias", "state.exp_avg.bias")."""
    parts = tensor.name.split("/")
    param = parts[1] if len(parts) > 1 else tensor.name
    module, _, leaf = param.rpartition(".")
    slot = {"param": f"param.{leaf}", "grad": f"param_grad.{leaf}"}.get(
        tensor.kind, f"state.{parts[-1]}.{leaf}")
    # the compare contract's phases: a step file records the optimizer's updates as forward
    # calls (`Tensor.addcdiv_ [updates fc2.bias] (forward, ...)`); "made_by" says which
    return {"module": module, "param": param, "op": None,
            "phase": "backward" if tensor.kind == "grad" else "forward", "slot": slot,
            "made_by": "backward" if tensor.kind == "grad" else "optimizer"}


#: keys a full dump of one step leaves out of the run's config
_NOT_FOR_THE_DUMP = ("fingerprint", "reference", "stop_on_divergence", "writer")


def _dump_config(config: dict, step: int) -> dict:
    """The run's own config (the keys it set), with only ``step``, in full, in a folder of
    its own: the capture that reproduces that step where the run is deterministic."""
    out = {key: value for key, value in config.items()
           if key in KEYS and key not in _NOT_FOR_THE_DUMP and value != KEYS[key].default}
    base = str(config.get("dump_path", "./probe_dump")).rstrip("/\\") or "./probe_dump"
    out.update({"task": "tensor", "level": "mix", "step": [step], "dump_path": f"{base}_step{step}",
                "overwrite": True})
    return out


def compare(a: Fingerprints, b: Fingerprints, rank: int = 0) -> FingerprintResult:
    """Judge every common step and tensor of two runs' fingerprints (a is the reference)."""
    steps_a = {int(s): i for i, s in enumerate(a.steps)}
    steps_b = {int(s): i for i, s in enumerate(b.steps)}
    common = sorted(set(steps_a) & set(steps_b))
    if not common:
        raise CompareError(f"{a.path} and {b.path} share no step (A has {_span(steps_a)}, B has "
                           f"{_span(steps_b)}); expected two fingerprints of the same training")
    rows_a = np.array([steps_a[s] for s in common])
    rows_b = np.array([steps_b[s] for s in common])
    computed = envelope.compute_units(_compute(a)[rows_a], _compute(b)[rows_b])
    names = [entry["name"] for entry in a.tensors if entry["name"] in b.index]
    series, outside_at, jumped_at = [], [], []
    for name in names:
        entry = a.tensors[a.index[name]]
        ta, tb = a.index[name], b.index[name]
        numbers_a, numbers_b = a.numbers[rows_a, ta], b.numbers[rows_b, tb]
        present = ~np.isnan(numbers_a[:, 4]) & ~np.isnan(numbers_b[:, 4])  # a row on both sides
        gaps = envelope.measure(numbers_a, a.sketch[rows_a, ta], numbers_b, b.sketch[rows_b, tb],
                                entry["dtype"], int(entry["numel"]), envelope.recent_norms(numbers_a[:, 3]),
                                computed)
        limit = envelope.allowed(gaps.fresh, envelope.recent_max(gaps.high))
        jumped = gaps.nonfinite | (gaps.low > limit)
        outside = gaps.outside
        jumped &= present
        outside &= present
        series.append([name, entry["kind"], gaps, limit, outside, jumped])
    _inherit(series, [a.tensors[a.index[name]].get("param", "") for name in names])
    result = FingerprintResult(
        a=a.path, b=b.path, rank=rank, steps=common, parting_step=None, parting_kind=None,
        parting_tensors=[], jump_step=None, jumped=[],
        only_a_steps=sorted(set(steps_a) - set(steps_b)), only_b_steps=sorted(set(steps_b) - set(steps_a)),
        only_a_tensors=[e["name"] for e in a.tensors if e["name"] not in b.index],
        only_b_tensors=[e["name"] for e in b.tensors if e["name"] not in a.index],
        loss_a=_floats(a.loss[rows_a]), loss_b=_floats(b.loss[rows_b]),
        config_a=a.config, config_b=b.config,
        compute={"a": _dtypes(_compute(a)[rows_a]), "b": _dtypes(_compute(b)[rows_b])})
    first_out = _first(series, 4)
    first_jump = _first(series, 5)
    if first_out is not None:
        result.parting_step = common[first_out]
        result.parting_tensors = _at(series, first_out, 4, common, by_ratio=False)
        result.parting_kind = "jump" if first_jump == first_out else "drift"
    if first_jump is not None:
        result.jump_step = common[first_jump]
        result.jumped = _at(series, first_jump, 5, common, by_ratio=True)
    first_inherited = _first(series, 6)
    if first_inherited is not None:
        result.inherited_step = common[first_inherited]
        result.inherited = _at(series, first_inherited, 6, common, by_ratio=True)
    result.series = [Series(name, kind, _floats(gaps.estimate), _floats(limit), _floats(gaps.fresh))
                     for name, kind, gaps, limit, *_ in series]
    return result


def _inherit(series: list, params: list) -> None:
    """Moves the jumps a step inherits from what it read (inherit.py) out of each entry's
    jumped flags into a column of their own (the entry's seventh)."""
    if not series:
        return
    kinds = [entry[1] for entry in series]
    outside = np.stack([entry[4] for entry in series], axis=1)
    jumped = np.stack([entry[5] for entry in series], axis=1)
    nonfinite = np.stack([entry[2].nonfinite for entry in series], axis=1)
    passed_on = inherit.inherited(kinds, params, outside, jumped, nonfinite, inherit.parted_before(kinds, outside))
    for column, entry in enumerate(series):
        entry[5] = jumped[:, column] & ~passed_on[:, column]
        entry.append(passed_on[:, column])


def _compute(prints: Fingerprints) -> np.ndarray:
    """Per step of a file, the unit autocast computed it in (NaN: the file does not say)."""
    if len(prints.compute_unit) == len(prints.steps):
        return prints.compute_unit
    return np.full(len(prints.steps), np.nan)


def _dtypes(units: np.ndarray) -> list:
    """The distinct compute dtypes of some steps, in order ("" for autocast off); [] when
    no step says (a file written before they were recorded)."""
    known = [envelope.dtype_of_unit(unit) for unit in units if unit == unit]
    return list(dict.fromkeys(known))


def _first(series, column: int) -> int | None:
    found = [int(np.argmax(entry[column])) for entry in series if entry[column].any()]
    return min(found) if found else None


def _at(series, position: int, column: int, steps: list, by_ratio: bool) -> list:
    picked = []
    for name, kind, gaps, limit, *flags in series:
        if flags[column - 4][position]:
            picked.append(TensorStep(name=name, kind=kind, step=steps[position],
                                     gap=float(gaps.estimate[position]), low=float(gaps.low[position]),
                                     high=float(gaps.high[position]), allowed=float(limit[position]),
                                     fresh=float(gaps.fresh[position])))
    picked.sort(key=(lambda t: t.ratio) if by_ratio else (lambda t: t.gap), reverse=True)
    return picked


def _floats(values) -> list:
    return [float(v) if np.isfinite(v) else (None if np.isnan(v) else float(v)) for v in np.asarray(values)]


def _span(positions: dict) -> str:
    if not positions:
        return "no step"
    return f"steps {min(positions)}-{max(positions)}"


def config_text(config: dict) -> str:
    return json.dumps(config, indent=2)


__all__ = ["compare", "FingerprintResult", "TensorStep", "Series", "config_text"]
