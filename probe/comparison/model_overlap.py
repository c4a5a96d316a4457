"""Do the two dumps describe the same model? Their share of module paths in common.

Comparing a conv net with a Llama still pairs some calls (a linear here, a loss there) and
gives a plausible DIVERGED; a user who gave the wrong folder must hear that the dumps do not
describe one model. The share is |paths of A and B| / |paths of A or B| over the module paths
(the ``module`` column, every level of each dotted path) of the first compared step files.
Below SAME_MODEL_SHARE the compare says "A and B look like different models (12% of module
paths in common)". Skipped with a name mapping (the user renamed modules on purpose) and when
either dump has no module path at all (an api-level dump of functions). Torch-free.
"""

from __future__ import annotations

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
