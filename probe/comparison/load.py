"""Load stage: the two dumps, their step files paired by (step, rank), and their records.

A and B are dump files or dump folders. Folders pair their step files by (step, rank);
a step or rank found on one side only is an error (CompareError) unless allow_missing,
which compares the common ones and lists the rest. Two files compare with each other
whatever their step numbers.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Iterator

from probe.comparison import run_info
from probe.comparison.records import Records
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
    from probe.dump.reader import load

    return load(path_a), load(path_b)


def open_step_files(dump_a, dump_b, pairs) -> Iterator[StepFiles]:
    """Each pair of step files in turn, open while the caller compares it."""
    for key_a, key_b in pairs:
        with dump_a.open(*key_a) as file_a, dump_b.open(*key_b) as file_b:
            yield StepFiles(
                key_a, key_b,
                Records.from_table(file_a.records, file_a.path),
                Records.from_table(file_b.records, file_b.path),
                file_a.tensor if file_a.tensor_count else None,
                file_b.tensor if file_b.tensor_count else None,
                file_a.attrs, file_b.attrs,
            )


def dump_notes(dump_a, dump_b) -> list[str]:
    """Incomplete step files, and step files of different runs mixed in one folder."""
    notes = [f"A: {message}" for message in dump_a.incomplete_messages()]
    notes += [f"B: {message}" for message in dump_b.incomplete_messages()]
    notes += [note for note in (run_info.mixed_runs(dump_a, "A"), run_info.mixed_runs(dump_b, "B")) if note]
    return notes


def pair_step_files(dump_a, dump_b, path_a, path_b, allow_missing, steps, ranks):
    files_a, files_b = dict(dump_a.files), dict(dump_b.files)
    if os.path.isfile(path_a) and os.path.isfile(path_b):
        return [(next(iter(files_a)), next(iter(files_b)))], []
    keep_steps = None if steps is None else set(steps)
    keep_ranks = None if ranks is None else set(ranks)

    def wanted(key):
        return (keep_steps is None or key[0] in keep_steps) and (keep_ranks is None or key[1] in keep_ranks)

    keys_a = {key for key in files_a if wanted(key)}
    keys_b = {key for key in files_b if wanted(key)}
    if os.path.isfile(path_a) or os.path.isfile(path_b):
        # one file against a folder: the folder's file for the same step and rank
        single, side = (keys_a, "B") if os.path.isfile(path_a) else (keys_b, "A")
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
