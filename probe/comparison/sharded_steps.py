"""Which step files to compare when a run is sharded, and their records as logical tensors.

A plain compare pairs step files by (step, rank). When one run recorded DTensors (FSDP2,
tensor parallel) or the runs have different world sizes, the records of every rank of a
step are read together and merged (shards.merge_ranks) first:

* equal world sizes: rank r of A with rank r of B, each side's records with every sharded
  record standing for its logical tensor (so FSDP2 parameters pair with DDP's);
* different world sizes (one device against two tensor-parallel ranks): one comparison per
  step, of the logical records alone (shards.logical_view); rank-local records are counted
  in a note, not compared.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

from probe.comparison import shards
from probe.comparison.load import StepFiles
from probe.comparison.records import Records
from probe.errors import CompareError


@dataclass
class ShardedPlan:
    dump_a: object
    dump_b: object
    steps: list  # the steps both sides hold
    ranks_a: list
    ranks_b: list
    pairs: list  # ((step, rank), (step, rank)) in the order step_files() yields them
    missing: list  # steps one side lacks (compared without them: allow_missing)
    notes: list = field(default_factory=list)  # filled while step_files() runs

    def step_files(self):
        for step in self.steps:
            with contextlib.ExitStack() as stack:
                files_a = {rank: stack.enter_context(self.dump_a.open(step, rank)) for rank in self.ranks_a}
                files_b = {rank: stack.enter_context(self.dump_b.open(step, rank)) for rank in self.ranks_b}
                merged_a = shards.merge_ranks({r: Records.from_table(f.records, f.path) for r, f in files_a.items()})
                merged_b = shards.merge_ranks({r: Records.from_table(f.records, f.path) for r, f in files_b.items()})
                if step == self.steps[0]:
                    self.notes += shards.summary("A", merged_a, len(self.ranks_a))
                    self.notes += shards.summary("B", merged_b, len(self.ranks_b))
                if self.ranks_a == self.ranks_b:
                    for rank in self.ranks_a:
                        yield _files(step, rank, rank, merged_a.views[rank], merged_b.views[rank],
                                     _fetch(merged_a, files_a, rank), _fetch(merged_b, files_b, rank),
                                     files_a[rank], files_b[rank])
                    continue
                view_a, local_a = shards.logical_view(merged_a)
                view_b, local_b = shards.logical_view(merged_b)
                if step == self.steps[0] and (local_a or local_b):
                    self.notes.append(
                        f"{local_a} rank-local records of A and {local_b} of B not compared: "
                        f"the world sizes differ ({len(self.ranks_a)} and {len(self.ranks_b)})")
                rank_a, rank_b = self.ranks_a[0], self.ranks_b[0]
                yield _files(step, rank_a, rank_b, view_a, view_b, _fetch(merged_a, files_a, rank_a),
                             _fetch(merged_b, files_b, rank_b), files_a[rank_a], files_b[rank_b])


def _fetch(merged, files: dict, rank):
    """rank's tensor fetch, reassembling the logical tensors; None when no file has tensors."""
    by_rank = {r: f.tensor for r, f in files.items() if f.tensor_count}
    if rank not in by_rank:
        return None
    return merged.fetch(by_rank, by_rank[rank]) if merged.assembled else by_rank[rank]


def _files(step, rank_a, rank_b, records_a, records_b, fetch_a, fetch_b, file_a, file_b) -> StepFiles:
    return StepFiles((step, rank_a), (step, rank_b), records_a, records_b, fetch_a, fetch_b,
                     file_a.attrs, file_b.attrs)


def plan(dump_a, dump_b, steps=None, ranks=None, allow_missing=False) -> ShardedPlan | None:
    """A ShardedPlan when either dump holds DTensor records or the world sizes differ, and
    each dump holds every rank of its world; None for a plain compare. Steps and ranks
    filter as in load.pair_step_files."""
    keys_a, keys_b = set(dump_a.files), set(dump_b.files)
    ranks_a = sorted({rank for _, rank in keys_a if ranks is None or rank in ranks})
    ranks_b = sorted({rank for _, rank in keys_b if ranks is None or rank in ranks})
    steps_a = {step for step, _ in keys_a if steps is None or step in steps}
    steps_b = {step for step, _ in keys_b if steps is None or step in steps}
    common = sorted(steps_a & steps_b)
    if not ranks_a or not ranks_b or not common:
        return None
    complete = all((step, rank) in keys_a for step in common for rank in ranks_a) and \
        all((step, rank) in keys_b for step in common for rank in ranks_b)
    if not complete:
        return None  # steps or ranks missing on a side: the plain compare says which
    world_a, sharded_a = _inspect(dump_a, common[0], ranks_a[0])
    world_b, sharded_b = _inspect(dump_b, common[0], ranks_b[0])
    if len(ranks_a) != world_a or len(ranks_b) != world_b:
        return None  # not every rank of a run is here (a rank filter): compare rank by rank
    if world_a == world_b and (ranks_a != ranks_b or not (sharded_a or sharded_b)):
        return None
    missing = [f"step {step} only in A" for step in sorted(steps_a - steps_b)]
    missing += [f"step {step} only in B" for step in sorted(steps_b - steps_a)]
    if missing and not allow_missing:
        raise CompareError(f"the dumps hold different steps ({'; '.join(missing[:3])}"
                           f"{' and more' if len(missing) > 3 else ''}); pass --allow-missing "
                           f"to compare the {len(common)} common ones")
    if ranks_a == ranks_b:
        pairs = [((step, rank), (step, rank)) for step in common for rank in ranks_a]
    else:
        pairs = [((step, ranks_a[0]), (step, ranks_b[0])) for step in common]
    return ShardedPlan(dump_a, dump_b, common, ranks_a, ranks_b, pairs, missing)


def _inspect(dump, step, rank) -> tuple[int, bool]:
    """(the run's world size, whether the step file holds DTensor records)."""
    with dump.open(step, rank) as step_file:
        table = step_file.records
        sharded = shards.PLACEMENT in table.columns and any(table.column(shards.PLACEMENT))
        try:
            world = int(step_file.attrs.get("world_size") or 1)
        except (TypeError, ValueError):
            world = 1
        return world, sharded
