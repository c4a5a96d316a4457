"""(step, rank) pairs in words: "steps 0-4, rank 0"."""

from __future__ import annotations


def _ranges(numbers: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2, 5"."""
    parts, start, previous = [], None, None
    for number in sorted(set(numbers)):
        if start is None:
            start = previous = number
        elif number == previous + 1:
            previous = number
        else:
            parts.append(f"{start}-{previous}" if previous != start else f"{start}")
            start = previous = number
    if start is not None:
        parts.append(f"{start}-{previous}" if previous != start else f"{start}")
    return ", ".join(parts)


def _counted(word: str, numbers: list[int]) -> str:
    return f"{word}{'s' if len(set(numbers)) > 1 else ''} {_ranges(numbers)}"


def where_text(pairs) -> str:
    """(step, rank) pairs -> "steps 0-4, rank 0"; "steps 0-1, ranks 0-1; step 3, rank 0"."""
    by_step: dict[int, list[int]] = {}
    for step, rank in pairs:
        by_step.setdefault(step, []).append(rank)
    by_ranks: dict[tuple, list[int]] = {}
    for step in sorted(by_step):
        by_ranks.setdefault(tuple(sorted(set(by_step[step]))), []).append(step)
    segments = sorted(by_ranks.items(), key=lambda item: item[1][0])
    return "; ".join(f"{_counted('step', steps)}, {_counted('rank', list(ranks))}" for ranks, steps in segments)
