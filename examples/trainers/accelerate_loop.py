"""An accelerate training loop captured with probe's AcceleratorCapture (two lines).

A small MLP (random init, data made here) is trained with ``Accelerator(cpu=True,
gradient_accumulation_steps=2)`` for 3 optimizer steps; each step file holds its 2
micro-batches.

    python examples/trainers/accelerate_loop.py

Without editing the loop at all: ``probe run -c config.json -- accelerate launch train.py``
(zero-edit capture, docs/trainers.md).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch
from torch import nn

from accelerate import Accelerator
from probe import load
from probe.integrations.accelerate import AcceleratorCapture


def train(dump_path: str, *, steps: int = 3, accumulation: int = 2, level: str = "mix") -> None:
    torch.manual_seed(0)
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=accumulation)
    model = nn.Sequential(nn.Linear(8, 32), nn.LayerNorm(32), nn.GELU(), nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    inputs = torch.randn(steps * accumulation * 4, 8)
    data = torch.utils.data.TensorDataset(inputs, inputs.sum(dim=1, keepdim=True))
    loader = torch.utils.data.DataLoader(data, batch_size=4)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

    capture = AcceleratorCapture(accelerator, {"dump_path": dump_path, "level": level,
                                               "overwrite": True})
    for batch_inputs, targets in loader:
        with accelerator.accumulate(model), capture.batch(model):
            loss = nn.functional.mse_loss(model(batch_inputs), targets)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
    capture.close()


def main() -> int:
    from examples._common import example_parser

    options = example_parser(__doc__, "trainers_accelerate", "the default size (3 steps)",
                             device=False).parse_args()
    train(options.out)
    print(f"steps dumped: {load(options.out).steps}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
