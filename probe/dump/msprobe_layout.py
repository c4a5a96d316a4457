"""Where an msprobe dump keeps its files, found from the folder names alone (nothing is read).

msprobe (mindstudio-probe) writes one folder per step and per process::

    dump_path/step{N}/rank{R}/dump.json       a distributed run: one folder per rank
    dump_path/step{N}/proc{pid}/dump.json     a run without torch.distributed: the process id
                  .../stack.json, construct.json, dump_tensor_data/*.pt (task "tensor")

A path given to probe may be that root, one step folder, one rank (or proc) folder, or its
dump.json. ``is_msprobe_dump`` tells such a path from a probe dump by its layout;
``discover`` finds its (step, rank) -> rank folder. A proc folder is rank 0; two proc folders
in one step are two runs, and the user is asked to name one.
"""

from __future__ import annotations

import os
import re

from probe.errors import DumpFormatError

DUMP_JSON = "dump.json"
STACK_JSON = "stack.json"
CONSTRUCT_JSON = "construct.json"
TENSOR_FOLDER = "dump_tensor_data"

_STEP = re.compile(r"^step(\d+)$")
_RANK = re.compile(r"^rank(\d*)$")
_PROC = re.compile(r"^proc(\d+)$")


def is_rank_folder(path: str) -> bool:
    return os.path.isfile(os.path.join(path, DUMP_JSON))


def _process_folders(step_folder: str) -> list[str]:
    """The rank and proc folders of a step folder that hold a dump.json, sorted by name."""
    try:
        names = sorted(os.listdir(step_folder))
    except OSError:
        return []
    return [name for name in names if (_RANK.match(name) or _PROC.match(name))
            and is_rank_folder(os.path.join(step_folder, name))]


def _step_folders(root: str) -> list[tuple[int, str]]:
    try:
        names = sorted(os.listdir(root))
    except OSError:
        return []
    found = []
    for name in names:
        match = _STEP.match(name)
        if match and os.path.isdir(os.path.join(root, name)):
            found.append((int(match.group(1)), os.path.join(root, name)))
    return sorted(found)


def is_msprobe_dump(path) -> bool:
    """Whether path is an msprobe dump root, step folder, rank folder or dump.json (by layout;
    a probe dump's step folders hold rank<R>.h5 files, never rank folders with a dump.json)."""
    path = os.fspath(path)
    if os.path.isfile(path):
        return os.path.basename(path) == DUMP_JSON
    if not os.path.isdir(path):
        return False
    if is_rank_folder(path) or _process_folders(path):
        return True
    steps = _step_folders(path)
    # the first step folder decides: a probe dump root is not listed any further
    return bool(steps) and bool(_process_folders(steps[0][1]))


def rank_of(folder_name: str) -> int | None:
    """rank{R} -> R; proc{pid} (no torch.distributed) -> 0; anything else -> None."""
    match = _RANK.match(folder_name)
    if match:
        return int(match.group(1) or 0)
    return 0 if _PROC.match(folder_name) else None


def step_of(folder_name: str) -> int | None:
    match = _STEP.match(folder_name)
    return int(match.group(1)) if match else None


def run_of(folder_name: str) -> str:
    """The process a proc folder names ("proc1234"), which tells two runs apart; "" for ranks."""
    return folder_name if _PROC.match(folder_name) else ""


def discover(path) -> dict[tuple[int, int], str]:
    """(step, rank) -> rank folder of every finished-or-running step under path."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise DumpFormatError(f"{path} does not exist")
    if os.path.isfile(path):
        path = os.path.dirname(os.path.abspath(path))
    if is_rank_folder(path):
        name = os.path.basename(os.path.normpath(path))
        step = step_of(os.path.basename(os.path.dirname(os.path.abspath(path))))
        rank = rank_of(name)
        return {(0 if step is None else step, 0 if rank is None else rank): path}
    own_step = step_of(os.path.basename(os.path.normpath(path)))
    steps = _step_folders(path)
    if not steps and own_step is not None:
        steps = [(own_step, path)]
    found: dict[tuple[int, int], str] = {}
    for step, folder in steps:
        names = _process_folders(folder)
        procs = [name for name in names if _PROC.match(name)]
        if len(procs) > 1:
            raise DumpFormatError(
                f"{folder} holds {len(procs)} msprobe process folders ({', '.join(procs[:4])}): two runs wrote "
                f"this dump path; name the one to read, e.g. {os.path.join(folder, procs[0])}")
        for name in names:
            rank = rank_of(name)
            if (step, rank) in found:
                raise DumpFormatError(
                    f"{folder} holds both {os.path.basename(found[(step, rank)])} and {name} for rank {rank}; "
                    f"name the one to read, e.g. {os.path.join(folder, name)}")
            found[(step, rank)] = os.path.join(folder, name)
    if not found:
        raise DumpFormatError(
            f"{path} holds no msprobe dump (expected step<N>/rank<R>/dump.json or step<N>/proc<pid>/dump.json)")
    return dict(sorted(found.items()))
