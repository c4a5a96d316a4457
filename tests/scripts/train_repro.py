"""Train a tiny model for a few steps and print each loss as float.hex, one per line.

Every random source a real training loop touches is in play: dropout, a shuffled DataLoader
with two workers that draw numpy and Python random numbers, and numpy/Python randomness in the
loop itself. Run by tests/seed/test_seed.py in separate processes.

    python tests/scripts/train_repro.py --runs none,3,4 --mode true --steps 20

prints one JSON line per run: {"run": "3", "losses": ["0x1.2p+0", ...]}. An unseeded run
("none") only means something before any seeded run in the same process.
"""

import argparse
import json
import os
import random
import sys

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from probe.seed.data import dataloader_kwargs  # noqa: E402
from probe.seed import seed_all  # noqa: E402


class NoisyDataset(torch.utils.data.Dataset):
    """Fixed features plus per-item noise drawn in the worker from numpy, random and torch."""

    def __init__(self, size=32, features=8):
        grid = torch.arange(size * features, dtype=torch.float32).reshape(size, features)
        self.x = torch.sin(grid)
        self.y = torch.arange(size) % 3

    def __len__(self):
        return len(self.y)

    def __getitem__(self, index):
        noise = np.random.randn(self.x.shape[1]).astype(np.float32) * 0.1
        jitter = random.random() * 0.1
        return self.x[index] + torch.from_numpy(noise) + jitter + torch.rand(1) * 0.1, self.y[index]


def train(seed, mode, steps):
    """One training run; seed None = no seed_all and no dataloader_kwargs. Returns float.hex losses."""
    loader_kwargs = {}
    if seed is not None:
        seed_all(seed, mode=mode)
        loader_kwargs = dataloader_kwargs(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = torch.utils.data.DataLoader(
        NoisyDataset(), batch_size=4, shuffle=True, num_workers=2, persistent_workers=True,
        **loader_kwargs,
    )
    losses = []
    while len(losses) < steps:
        for x, y in loader:
            # randomness in the loop itself, from the main process's numpy and random
            x = x * (1.0 + 0.01 * random.random()) + float(np.random.rand()) * 0.01
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            losses.append(loss.item().hex())
            if len(losses) == steps:
                break
    return losses


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", default="1234",
                        help="comma-separated seeds, 'none' = unseeded; run in this order")
    parser.add_argument("--mode", choices=["false", "true", "warn"], default="true")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)  # the test machine is small and shared; determinism needs no threads
    mode = {"false": False, "true": True, "warn": "warn"}[args.mode]
    for label in args.runs.split(","):
        seed = None if label == "none" else int(label)
        print(json.dumps({"run": label, "losses": train(seed, mode, args.steps)}), flush=True)


if __name__ == "__main__":
    main()
