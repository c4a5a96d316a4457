"""Load stage: the two dumps, their step files paired by (step, rank), and their records.

A and B are dump files or dump folders. Folders pair their step files by (step, rank); a step
or rank found on one side only is an error (CompareError) unless allow_missing, which compares
the common ones and lists the rest. Two files compare with each other whatever their steps.

Run info
--------

What the two runs of a compare were: the settings each dump recorded, and where they differ.

Every step file records the run it came from (root attributes: probe and torch versions,
device, the seed_all report, the determinism settings, since schema 2 a ``run_id``). Two
runs that differ in seed, thread count, torch version or determinism settings are expected
to differ numerically; the user should hear that before reading any divergence as a bug.

* ``run_differences(attrs_a, attrs_b)``: the "the runs differ in" lines of a compare
  (terminal, JSON ``run_differences``, HTML).
* ``mixed_runs(dump)``: a note when one dump folder holds step files of different runs (two
  runs wrote the same dump_path one after the other, or a folder was assembled by hand).

Torch-free (``probe compare`` never imports torch); reads only the attribute dicts that
probe.dump.reader returns.

Model overlap
-------------

Do the two dumps describe the same model? Their share of module paths in common.

Comparing a conv net with a Llama still pairs some calls (a linear here, a loss there) and
gives a plausible DIVERGED; a user who gave the wrong folder must hear that the dumps do not
describe one model. The share is |paths of A and B| / |paths of A or B| over the module paths
(the ``module`` column, every level of each dotted path) of the first compared step files.
Below SAME_MODEL_SHARE the compare says "A and B look like different models (12% of module
paths in common)". Skipped with a name mapping (the user renamed modules on purpose) and when
either dump has no module path at all (an api-level dump of functions). Torch-free.

Sharded steps
-------------

Which step files to compare when a run is sharded, and their records as logical tensors.

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
import gc
import os
from dataclasses import dataclass, field
from typing import Any, Iterator

from probe.comparison import shards
from probe.comparison.records import Records
from probe.dump.mapped import fetch as tensor_fetch  # large tensors mapped: compare drops each once measured
from probe.errors import CompareError

@dataclass
class StepFiles:
    """One pair of step files, open: the records of each and how to read their tensors."""

    key_a: tuple  # (step, rank)
    key_b: tuple
    records_a: Records
    records_b: Records
    fetch_a: object  # tensor_id -> array, or None when the file holds no tensors
    fetch_b: object
    attrs_a: dict
    attrs_b: dict


def load_dumps(path_a: str, path_b: str):
    """Either dump may be probe's or msprobe's (found by its layout), each seen as the other records."""
    from probe.dump.formats import load_pair

    return load_pair(path_a, path_b)


def open_step_files(dump_a, dump_b, pairs) -> Iterator[StepFiles]:
    """Each pair of step files in turn, open while the caller compares it."""
    for key_a, key_b in pairs:
        with dump_a.open(*key_a) as file_a, dump_b.open(*key_b) as file_b:
            yield StepFiles(
                key_a, key_b,
                Records.from_table(file_a.records, file_a.path),
                Records.from_table(file_b.records, file_b.path),
                tensor_fetch(file_a), tensor_fetch(file_b),
                file_a.attrs, file_b.attrs,
            )


def dump_notes(dump_a, dump_b) -> list[str]:
    """Incomplete step files, and step files of different runs mixed in one folder."""
    notes = [f"A: {message}" for message in dump_a.incomplete_messages()]
    notes += [f"B: {message}" for message in dump_b.incomplete_messages()]
    notes += [note for note in (mixed_runs(dump_a, "A"), mixed_runs(dump_b, "B")) if note]
    from probe.dump.formats import notes as format_notes

    return notes + format_notes(dump_a, dump_b)


def pair_step_files(dump_a, dump_b, path_a, path_b, allow_missing, steps, ranks):
    from probe.dump.formats import names_one_step as one_file  # a step file, or an msprobe rank folder

    files_a, files_b = dict(dump_a.files), dict(dump_b.files)
    if one_file(path_a) and one_file(path_b):
        return [(next(iter(files_a)), next(iter(files_b)))], []
    keep_steps = None if steps is None else set(steps)
    keep_ranks = None if ranks is None else set(ranks)

    def wanted(key):
        return (keep_steps is None or key[0] in keep_steps) and (keep_ranks is None or key[1] in keep_ranks)

    keys_a = {key for key in files_a if wanted(key)}
    keys_b = {key for key in files_b if wanted(key)}
    if one_file(path_a) or one_file(path_b):
        # one file against a folder: the folder's file for the same step and rank
        single, side = (keys_a, "B") if one_file(path_a) else (keys_b, "A")
        other = keys_b if side == "B" else keys_a
        key = next(iter(single))
        if key not in other:
            folder = path_b if side == "B" else path_a
            raise CompareError(f"{folder} has no step {key[0]} rank {key[1]} to compare with the file given for {'A' if side == 'B' else 'B'}")
        return [(key, key)], []
    if not keys_a or not keys_b:
        empty = path_a if not keys_a else path_b
        raise CompareError(f"{empty} has no step file for the selected steps {sorted(keep_steps or [])} and ranks {sorted(keep_ranks or [])}")
    only_a, only_b = sorted(keys_a - keys_b), sorted(keys_b - keys_a)
    missing = [_only_in(key, "A", dump_b) for key in only_a] + [_only_in(key, "B", dump_a) for key in only_b]
    common = sorted(keys_a & keys_b)
    if missing and not common:
        # --allow-missing would fail too: nothing in common. Two files compare whatever their steps.
        example_a, example_b = files_a[min(keys_a)], files_b[min(keys_b)]
        raise CompareError(
            f"the dumps have no step and rank in common ({_describe(only_a, 'A')}; {_describe(only_b, 'B')}); "
            f"to compare two step files whatever their step numbers, name them: "
            f"probe compare {example_a} {example_b}"
        )
    if missing and not allow_missing:
        raise CompareError(
            f"the dumps hold different steps or ranks ({'; '.join(missing[:3])}"
            f"{f' and {len(missing) - 3} more' if len(missing) > 3 else ''}); "
            f"pass --allow-missing to compare the {len(common)} common ones"
        )
    if not common:
        raise CompareError(
            f"{path_a} (steps {dump_a.steps}, ranks {dump_a.ranks}) and {path_b} (steps {dump_b.steps}, "
            f"ranks {dump_b.ranks}) have no step and rank in common"
        )
    return [(key, key) for key in common], missing


def _only_in(key, side: str, other) -> str:
    """'step 1 rank 0 only in A', or, when the other dump holds that step's .h5.partial, that
    its file there is incomplete: the other run died while writing it, it is not a missing step."""
    partial = other.incomplete_at(*key)
    if partial is None:
        return f"step {key[0]} rank {key[1]} only in {side}"
    other_side = "B" if side == "A" else "A"
    return (f"step {key[0]} rank {key[1]} is incomplete in {other_side}: its run died while writing "
            f"it ({partial})")


def _describe(keys, side) -> str:
    if not keys:
        return ""
    shown = ", ".join(f"step {s} rank {r}" for s, r in keys[:3])
    more = f" and {len(keys) - 3} more" if len(keys) > 3 else ""
    return f"{shown}{more} only in {side}"


def attr_notes(attrs_a: dict, attrs_b: dict) -> list[str]:
    notes = []
    for name in ("task", "level"):  # a device difference is the one device note (assemble.py)
        if attrs_a.get(name) != attrs_b.get(name):
            notes.append(f"{name} differs: {attrs_a.get(name)!r} in A, {attrs_b.get(name)!r} in B")
    return notes


#: (label, how to read it from a step file's root attributes), in the order printed. The device
#: is not one of them: comparison/record_rules.py reports a change of device once, as a note.
_FACTS = (
    ("seed", lambda a: _get(a, "seed_report", "seed")),
    ("deterministic mode", lambda a: _get(a, "seed_report", "mode")),
    ("threads", lambda a: _get(a, "determinism", "num_threads")),
    ("interop threads", lambda a: _get(a, "determinism", "num_interop_threads")),
    ("torch version", lambda a: a.get("torch_version")),
    ("probe version", lambda a: a.get("probe_version")),
    ("world size", lambda a: a.get("world_size")),
    ("deterministic algorithms", lambda a: _get(a, "determinism", "deterministic_algorithms")),
    ("cudnn.deterministic", lambda a: _get(a, "determinism", "cudnn.deterministic")),
    ("cudnn.benchmark", lambda a: _get(a, "determinism", "cudnn.benchmark")),
    ("float32 matmul precision", lambda a: _get(a, "determinism", "float32_matmul_precision")),
    ("TF32 matmul", lambda a: _get(a, "determinism", "cuda.matmul.allow_tf32")),
    ("TF32 cuDNN", lambda a: _get(a, "determinism", "cudnn.allow_tf32")),
    ("dropout removed", lambda a: _get(a, "determinism", "dropout_removed")),
    ("PYTHONHASHSEED", lambda a: _hash_seed(a)),
    ("OMP_NUM_THREADS", lambda a: _get(a, "determinism", "env", "OMP_NUM_THREADS")),
    ("CUBLAS_WORKSPACE_CONFIG", lambda a: _get(a, "determinism", "env", "CUBLAS_WORKSPACE_CONFIG")),
)


def _hash_seed(attrs: dict) -> Any:
    """The hash seed the run's interpreter had; env's PYTHONHASHSEED is what seed_all set for
    child processes (the config's seed in every run), so it is only the fallback for older dumps."""
    state = attrs.get("determinism")
    if isinstance(state, dict) and "hash_seed_at_start" in state:
        return state["hash_seed_at_start"] or "random"
    return _get(attrs, "determinism", "env", "PYTHONHASHSEED")


def _get(attrs: dict, *path: str) -> Any:
    value: Any = attrs
    for name in path:
        if not isinstance(value, dict):
            return None
        value = value.get(name)
    return value


def _shown(value: Any) -> str:
    if value is None:
        return "not recorded"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def run_differences(attrs_a: dict, attrs_b: dict) -> list[dict]:
    """[{"setting", "a", "b"}] for every recorded setting whose value differs between the
    two runs (values as text; "not recorded" where a dump lacks it). Settings neither
    dump recorded are left out."""
    differences = []
    for label, read in _FACTS:
        value_a, value_b = read(attrs_a), read(attrs_b)
        if value_a is None and value_b is None:
            continue
        if value_a != value_b:
            differences.append({"setting": label, "a": _shown(value_a), "b": _shown(value_b)})
    return differences


def difference_lines(differences: list[dict]) -> list[str]:
    """'seed: 1 in A, 2 in B' for each difference (the terminal and HTML form)."""
    return [f"{d['setting']}: {d['a']} in A, {d['b']} in B" for d in differences]


def block_lines(differences: list[dict]) -> list[str]:
    """The terminal block: a heading and one indented line per difference; [] when none."""
    if not differences:
        return []
    return ["the runs differ in (expect numbers to differ for these reasons too):"] + [
        f"  {line}" for line in difference_lines(differences)]


def mixed_runs(dump, side: str = "") -> str:
    """A note when the step files of one rank of a dump come from more than one run (by run_id),
    else "". Each rank of a distributed job has a debugger, and so a run id, of its own: only
    different run ids within one rank mean that two runs wrote the folder."""
    runs: dict[int, dict[str, list[int]]] = {}  # rank -> run_id -> steps
    for step, rank in dump.files:
        try:
            run_id = dump.run_id(step, rank)
        except Exception:  # unreadable files are reported where they are compared
            continue
        if run_id:
            runs.setdefault(rank, {}).setdefault(str(run_id), []).append(step)
    mixed = {rank: by_run for rank, by_run in sorted(runs.items()) if len(by_run) > 1}
    if not mixed:
        return ""
    parts = []
    for rank, by_run in mixed.items():
        for run_id, steps in sorted(by_run.items(), key=lambda item: min(item[1])):
            shown = ", ".join(f"step {s}" for s in sorted(steps)[:3])
            more = f" and {len(steps) - 3} more" if len(steps) > 3 else ""
            parts.append(f"rank {rank} run {run_id}: {shown}{more}")
    count = max(len(by_run) for by_run in mixed.values())
    prefix = f"{side}: " if side else ""
    return (f"{prefix}{dump.path} holds step files of {count} different runs ({'; '.join(parts)}); "
            "steps of different runs do not belong together")


__all__ = ["run_differences", "difference_lines", "block_lines", "mixed_runs"]


#: below this share of module paths in common the dumps are called different models
SAME_MODEL_SHARE = 0.5


def module_paths(modules) -> set:
    """Every module path and its parents ("blocks.0.fc" -> blocks, blocks.0, blocks.0.fc)."""
    paths = set()
    for name in set(modules):
        if not name:
            continue
        parts = name.split(".")
        for end in range(1, len(parts) + 1):
            paths.add(".".join(parts[:end]))
    return paths


def overlap(modules_a, modules_b) -> float | None:
    """The share of module paths in common, or None when a side has none."""
    paths_a, paths_b = module_paths(modules_a), module_paths(modules_b)
    if not paths_a or not paths_b:
        return None
    return len(paths_a & paths_b) / len(paths_a | paths_b)


def different_models_note(share: float | None) -> str | None:
    if share is None or share >= SAME_MODEL_SHARE:
        return None
    return (f"A and B look like different models ({share:.0%} of module paths in common): check that the two "
            "dumps come from the same model; the records that pair may do so by chance")


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

    def step_files(self, steps=None):
        """The pairs of step files of each step (of ``steps``, all by default), in order."""
        for step in self.steps if steps is None else steps:
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
                view_a, view_b, local_a, local_b, blocks = _logical_views(merged_a, merged_b)
                if step == self.steps[0]:
                    self.notes += _block_notes(blocks, len(self.ranks_a), len(self.ranks_b))
                if step == self.steps[0] and (local_a or local_b):
                    self.notes.append(
                        f"{local_a} rank-local records of A and {local_b} of B not compared: "
                        f"the world sizes differ ({len(self.ranks_a)} and {len(self.ranks_b)})")
                rank_a, rank_b = self.ranks_a[0], self.ranks_b[0]
                yield _files(step, rank_a, rank_b, view_a, view_b, _fetch(merged_a, files_a, rank_a),
                             _fetch(merged_b, files_b, rank_b), files_a[rank_a], files_b[rank_b])


@dataclass
class UnitPlan:
    """The compare's pairs of step files and its units: a pair, or a sharded step's pairs
    (every rank of its group, merged together), each unit a list of positions in ``pairs``."""

    pairs: list  # ((step, rank) of A, of B), in compare order
    missing: list
    units: list
    sharded: ShardedPlan | None = None

    def chains(self) -> list[list[int]]:
        """Units (their numbers) that depend on each other, in order: a rank's step files hand
        on what A's previous one carries (structs.Carry); a sharded step hands it on for every
        rank, so a sharded compare is one chain."""
        if self.sharded is not None:
            return [list(range(len(self.units)))]
        chains: dict = {}
        for number, unit in enumerate(self.units):
            chains.setdefault(self.pairs[unit[0]][0][1], []).append(number)
        return list(chains.values())

    def open(self, dump_a, dump_b, unit: list) -> Iterator[StepFiles]:
        """The unit's pairs of step files, open while the caller compares them."""
        if self.sharded is None:
            return open_step_files(dump_a, dump_b, [self.pairs[position] for position in unit])
        return self.sharded.step_files([self.pairs[unit[0]][0][0]])


def collect_rarely() -> tuple:
    """Full garbage collections every 1,000 middle ones, not 10, and young ones every 100,000
    allocations, not 700, while units are compared (the thresholds before returned): a unit's
    objects form no cycle, each full one walked them all, and young ones scanned them for
    nothing (7% of a compare at 20,000)."""
    before = gc.get_threshold()
    gc.set_threshold(max(before[0], 100_000), before[1], max(before[2], 1000))
    return before


@contextlib.contextmanager
def few_full_collections():
    before = collect_rarely()
    try:
        yield
    finally:
        gc.set_threshold(*before)


def plan_units(dump_a, dump_b, path_a: str, path_b: str, allow_missing=False, steps=None, ranks=None) -> UnitPlan:
    """Pair the step files (pair_step_files, or plan for sharded runs) and group them into units."""
    sharded = None
    if os.path.isdir(path_a) and os.path.isdir(path_b):
        sharded = plan(dump_a, dump_b, None if steps is None else set(steps), None if ranks is None else set(ranks),
                       allow_missing)
    if sharded is None:
        pairs, missing = pair_step_files(dump_a, dump_b, path_a, path_b, allow_missing, steps, ranks)
        return UnitPlan(pairs, missing, [[position] for position in range(len(pairs))])
    units: dict = {}
    for position, (key_a, _) in enumerate(sharded.pairs):
        units.setdefault(key_a[0], []).append(position)
    return UnitPlan(sharded.pairs, sharded.missing, list(units.values()), sharded)


def _logical_views(merged_a, merged_b) -> tuple:
    """Each side's logical records across world sizes, with the rank-local records that are
    each rank's block of a tensor the other side holds whole merged first (shards.merge_rank_blocks):
    (view_a, view_b, rank-local left out of A, of B, (blocks merged in A, in B))."""
    view_a, _ = shards.logical_view(merged_a)
    view_b, _ = shards.logical_view(merged_b)
    blocks_b = shards.merge_rank_blocks(merged_b, view_a)
    blocks_a = shards.merge_rank_blocks(merged_a, view_b)
    view_a, local_a = shards.logical_view(merged_a)
    view_b, local_b = shards.logical_view(merged_b)
    return view_a, view_b, local_a, local_b, (blocks_a, blocks_b)


def _block_notes(blocks, world_a: int, world_b: int) -> list[str]:
    notes = []
    for side, count, world, other in (("A", blocks[0], world_a, world_b), ("B", blocks[1], world_b, world_a)):
        if count:
            notes.append(f"{side}: merged {count} plain records of {world} ranks, each rank's block of a "
                         f"tensor the other run holds whole (one dimension split {world} ways)")
    return notes


def _fetch(merged, files: dict, rank):
    """rank's tensor fetch, reassembling the logical tensors; None when no file has tensors."""
    by_rank = {r: tensor_fetch(f) for r, f in files.items() if f.tensor_count}
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


def run_head(files: StepFiles, mapped: bool) -> dict:
    """What the compare's first pair of step files says of the two runs: the notes on their
    attributes, the settings they differ in, their devices, and (without a mapping file,
    ``mapped``) the note that they record different models, or None."""
    same_model = None
    if not mapped:
        same_model = different_models_note(overlap(files.records_a.columns["module"], files.records_b.columns["module"]))
    return {"notes": attr_notes(files.attrs_a, files.attrs_b),
            "differences": run_differences(files.attrs_a, files.attrs_b),
            "devices": (str(files.attrs_a.get("device") or ""), str(files.attrs_b.get("device") or "")),
            "same_model": same_model}
