"""``probe compare A B`` when A and B are fingerprinted runs (torch-free).

A and B may each be a run's dump_path holding only ``fingerprints/`` (no step files), a
fingerprints folder, or one rank's fingerprint file. When one side also holds step files and
the other holds fingerprints only, the fingerprints both hold are what the two share: they
are compared, and the report says so (two runs that both hold step files compare as dumps).
Every rank both have is compared; the report is the rank whose runs jump first (else part
first), the others summed up in a line each. Exit code: 1 when a jump was found (verdict
"diverged"), 0 for drift alone or a pass.
"""

from __future__ import annotations

from probe.errors import CompareError
from probe.fingerprint import compare as compare_module, file, report


def is_fingerprints(a: str, b: str) -> bool:
    """Compare A and B by their fingerprints: both hold some, and one holds no step files."""
    return (file.has_fingerprints(a) and file.has_fingerprints(b)
            and not (file.has_step_files(a) and file.has_step_files(b)))


def shared_note(a: str, b: str) -> str | None:
    """What to say when only one side holds step files (None when neither does)."""
    with_steps = [path for path in (a, b) if file.has_step_files(path)]
    if not with_steps:
        return None
    lacking = b if with_steps[0] == a else a
    return (f"{lacking} holds no step files: the two runs share only fingerprints, so their "
            f"fingerprints are compared ({with_steps[0]} holds step files too)")


def run(a: str, b: str, ranks=None) -> tuple[compare_module.FingerprintResult, list]:
    """(the rank to report, [every rank's result])."""
    ranks_a, ranks_b = file.ranks_in(a), file.ranks_in(b)
    both = [rank for rank in ranks_a if rank in ranks_b and (not ranks or rank in ranks)]
    if not both:
        raise CompareError(f"{a} (ranks {ranks_a}) and {b} (ranks {ranks_b}) share no rank to compare")
    results = []
    for rank in both:
        reference = file.read(file.find_file(a, rank))
        candidate = file.read(file.find_file(b, rank))
        results.append(compare_module.compare(reference, candidate, rank))

    def first(result):
        jump = result.jump_step if result.jump_step is not None else float("inf")
        part = result.parting_step if result.parting_step is not None else float("inf")
        return (jump, part, result.rank)

    return min(results, key=first), results


def render(primary, results: list, as_json: bool, note: str | None = None) -> str:
    """The report of the rank shown and a line for each other; ``note`` (shared_note) first."""
    if as_json:
        import json

        data = json.loads(report.as_json(primary))
        data["ranks"] = [{"rank": r.rank, "verdict": r.verdict, "parting_step": r.parting_step,
                          "parting_kind": r.parting_kind, "jump_step": r.jump_step} for r in results]
        data["note"] = note
        return json.dumps(data, indent=2) + "\n"
    text = (f"note: {note}\n" if note else "") + report.terminal(primary)
    others = [r for r in results if r is not primary]
    for other in others:
        text += (f"rank {other.rank}: {other.verdict}"
                 + (f", jump at step {other.jump_step}" if other.jump_step is not None else "")
                 + (f", part at step {other.parting_step} ({other.parting_kind})"
                    if other.parting_step is not None else "") + "\n")
    return text


__all__ = ["is_fingerprints", "shared_note", "run", "render"]
