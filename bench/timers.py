"""Time what a step spends inside some functions, wrapped in place (the benchmarks' helper)."""

from __future__ import annotations


def time_calls(owner, names, total: list, clock) -> None:
    """Replace owner.<name> for each name with a wrapper adding the seconds spent in it (by
    ``clock``) to total[0]; nested calls of wrapped functions count once (the outermost).
    A function wrapped already is left as it is."""
    depth = [0]

    def timed(inner):
        def call(*args, **kwargs):
            depth[0] += 1
            began = clock()
            try:
                return inner(*args, **kwargs)
            finally:
                depth[0] -= 1
                if not depth[0]:
                    total[0] += clock() - began
        call.timed = True
        return call

    for name in names:
        found = getattr(owner, name)
        if not getattr(found, "timed", False):
            setattr(owner, name, timed(found))
