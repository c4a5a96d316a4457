"""Repeatable runs: seeding and determinism (seed.py), DataLoader helpers (data.py), and the
random numbers of every device drawn on the CPU (random_on_cpu.py).

``probe.seed.seed_all``, ``probe.seed.restore_dropout`` and the other names of seed.py stay
importable from ``probe.seed``.
"""

from probe.seed.seed import (
    CUBLAS_DETERMINISTIC_WORKSPACE,
    ENV_VARS,
    SEED_MAX,
    DropoutRemover,
    SeedReport,
    check_seed,
    determinism_state,
    dropout_removed,
    remove_dropout_now,
    restore_dropout,
    seed_all,
)

__all__ = [
    "seed_all", "SeedReport", "determinism_state", "check_seed", "restore_dropout", "dropout_removed",
    "remove_dropout_now", "DropoutRemover",
]
