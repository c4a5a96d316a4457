"""Normalize stage: both runs' records as calls that can be aligned.

Each normalize step takes a NormalizedStep and returns it, its calls (and, where a step
derives records, its records) rewritten; engine.NORMALIZE lists the steps in the order they
run. A step sees both runs, so it can make one run's spelling match the other's.

* link_reduced_gradients (reduced_grads.py): a gradient reduced across ranks (FSDP2's
  reduced shard, and its backward reduce-scatter call) gets the rank-local gradients it was
  made from as inputs;
* build_call_lists: the records of each run grouped into calls (records.build_calls), module
  and op names renamed through the name mapping;
* split_foreach_calls: a foreach or fused optimizer call as one call per parameter
  (foreach.py);
* name_optimizer_targets: each optimizer call named by the parameter it updates
  (optimizer_targets.py), so that fused kernels pair by that name.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from probe.comparison.foreach import split_foreach
from probe.comparison.mapping import NameMapping
from probe.comparison.optimizer_targets import name_targets
from probe.comparison.records import Call, Records, build_calls


@dataclass
class Side:
    """One run's step file: its records and, once built, its calls."""

    records: Records
    calls: list[Call] = field(default_factory=list)


@dataclass
class NormalizedStep:
    """What the normalize steps hand on: both sides, and the mapping that renames them."""

    a: Side
    b: Side
    mapping: NameMapping | None = None

    @property
    def sides(self) -> tuple[Side, Side]:
        return self.a, self.b


def normalize(records_a: Records, records_b: Records, mapping: NameMapping | None, steps) -> NormalizedStep:
    """Run the normalize steps in order on one pair of step files."""
    normalized = NormalizedStep(Side(records_a), Side(records_b), mapping)
    for step in steps:
        normalized = step(normalized)
    return normalized


def build_call_lists(normalized: NormalizedStep) -> NormalizedStep:
    rename = normalized.mapping.rename if normalized.mapping else None
    for side in normalized.sides:
        side.calls = build_calls(side.records, rename)
    return normalized


def split_foreach_calls(normalized: NormalizedStep) -> NormalizedStep:
    # a foreach call is one call per tensor (the i-th parameter's), on both sides
    for side in normalized.sides:
        side.calls = split_foreach(side.calls, side.records)
    return normalized


def name_optimizer_targets(normalized: NormalizedStep) -> NormalizedStep:
    # optimizer records named by the parameter they update (fused kernels pair by that name)
    for side in normalized.sides:
        name_targets(side.calls, side.records)
    return normalized
