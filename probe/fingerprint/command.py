"""``probe compare A B`` when A and B are fingerprinted runs (torch-free).

A and B may each be a run's dump_path holding only ``fingerprints/`` (no step files), a
fingerprints folder, or one rank's fingerprint file. Every rank both have is compared; the
report is the rank whose runs jump first (else part first), the others summed up in a line
each. Exit code: 1 when a jump was found (verdict "diverged"), 0 for drift alone or a pass.
"""

from __future__ import annotations

from probe.errors import CompareError
from probe.fingerprint import compare as compare_module, file, report


def is_fingerprints(a: str, b: str) -> bool:
    return file.is_fingerprint_run(a) and file.is_fingerprint_run(b)


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


def render(primary, results: list, as_json: bool) -> str:
    if as_json:
        import json

        data = json.loads(report.as_json(primary))
        data["ranks"] = [{"rank": r.rank, "verdict": r.verdict, "parting_step": r.parting_step,
                          "parting_kind": r.parting_kind, "jump_step": r.jump_step} for r in results]
        return json.dumps(data, indent=2) + "\n"
    text = report.terminal(primary)
    others = [r for r in results if r is not primary]
    for other in others:
        text += (f"rank {other.rank}: {other.verdict}"
                 + (f", jump at step {other.jump_step}" if other.jump_step is not None else "")
                 + (f", part at step {other.parting_step} ({other.parting_kind})"
                    if other.parting_step is not None else "") + "\n")
    return text


__all__ = ["is_fingerprints", "run", "render"]
