"""A plain PyTorch training loop with no probe code at all: capture it with ``probe run -c``.

    probe run -c examples/trainers/config.json -- python examples/trainers/plain_loop.py

probe attaches by itself (docs/trainers.md): the model is found at its first training
forward and each ``optimizer.step()`` ends a step, so ``out/trainers_plain`` holds
``step0``, ``step1`` and ``step2``. The evaluation at the end runs under ``torch.no_grad()``
and is not a step. ``--accumulation N`` makes N forward/backward passes per optimizer step
(all N are in that step's file).
"""

import argparse

import torch
from torch import nn


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--accumulation", type=int, default=1)
    options = parser.parse_args()

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.LayerNorm(32), nn.GELU(), nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    inputs = torch.randn(64, 8)
    targets = inputs.sum(dim=1, keepdim=True)
    for step in range(options.steps):
        optimizer.zero_grad()
        for micro in range(options.accumulation):
            rows = slice((step * options.accumulation + micro) * 4 % 64, None)
            loss = nn.functional.mse_loss(model(inputs[rows][:4]), targets[rows][:4])
            (loss / options.accumulation).backward()
        optimizer.step()
        print(f"step {step}: loss {loss.item():.4f}")
    with torch.no_grad():
        print(f"eval loss {nn.functional.mse_loss(model(inputs), targets).item():.4f}")


if __name__ == "__main__":
    main()
