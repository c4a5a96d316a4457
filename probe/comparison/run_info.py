"""What the two runs of a compare were: the settings each dump recorded, and where they differ.

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
"""

from __future__ import annotations

from typing import Any

#: (label, how to read it from a step file's root attributes), in the order printed. The device
#: is not one of them: comparison/devices.py reports a change of device once, as a note.
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
            with dump.open(step, rank) as step_file:
                run_id = step_file.attrs.get("run_id")
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
