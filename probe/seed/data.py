"""DataLoader helpers: make shuffling and per-worker randomness repeat exactly.

Usage::

    loader = DataLoader(dataset, shuffle=True, num_workers=2, **probe.dataloader_kwargs(1234))

The generator fixes the shuffle order and the base seed handed to the workers; each worker's
torch seed is then ``base_seed + worker_id`` and seed_worker derives numpy's and Python's seeds
from it, so augmentations drawn with numpy or ``random`` inside a worker repeat too.
"""

from __future__ import annotations

import random
from typing import Any

import torch

from probe.seed.seed import SEED_MAX, check_seed


def seed_worker(worker_id: int) -> None:
    """DataLoader ``worker_init_fn``: seed numpy and ``random`` from this worker's torch seed."""
    worker_seed = torch.initial_seed() % 2**32
    random.seed(worker_seed)
    try:
        import numpy
    except ImportError:
        return
    numpy.random.seed(worker_seed)


def make_generator(seed: int) -> torch.Generator:
    """A CPU torch.Generator seeded with ``seed`` (0 .. 2**32-1; SeedError otherwise)."""
    generator = torch.Generator()
    generator.manual_seed(check_seed(seed, "make_generator"))
    return generator


def dataloader_kwargs(seed: int) -> dict[str, Any]:
    """``worker_init_fn`` and ``generator`` for a DataLoader, so its randomness repeats."""
    return {"worker_init_fn": seed_worker, "generator": make_generator(seed)}


__all__ = ["seed_worker", "make_generator", "dataloader_kwargs", "SEED_MAX"]
