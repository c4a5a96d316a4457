"""A Lightning Trainer captured with one line: ``callbacks=[ProbeCallback(config)]``.

A small regression MLP (random init, data made here) is trained for 3 optimizer steps on the
CPU, twice; probe dumps steps 0, 1 and 2 of each and the two runs compare as a pass.

    python examples/trainers/lightning_trainer.py
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch
from torch import nn

from probe import compare, load
from probe.integrations.lightning import ProbeCallback
from lightning.pytorch import LightningModule, Trainer


class Regressor(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 1))

    def training_step(self, batch, batch_idx):
        inputs, targets = batch
        return nn.functional.mse_loss(self.net(inputs), targets)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def loader(count: int = 64, batch: int = 8):
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(count, 8, generator=generator)
    data = torch.utils.data.TensorDataset(inputs, inputs.sum(dim=1, keepdim=True))
    return torch.utils.data.DataLoader(data, batch_size=batch)


def train(dump_path: str, workdir: str, *, steps: int = 3, accumulation: int = 1,
          level: str = "mix", callbacks=None) -> Trainer:
    torch.manual_seed(0)
    model = Regressor()
    if callbacks is None:  # else the caller's (the benchmark's)
        callbacks = [ProbeCallback({"dump_path": dump_path, "level": level, "overwrite": True})]
    trainer = Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, accumulate_grad_batches=accumulation,
                      default_root_dir=workdir, callbacks=callbacks)
    trainer.fit(model, loader())
    return trainer


def main() -> int:
    from examples._common import example_parser

    options = example_parser(__doc__, "trainers_lightning", "the default size (3 steps)",
                             device=False).parse_args()
    runs = [os.path.join(options.out, name) for name in ("a", "b")]
    for run in runs:
        train(run, os.path.join(options.out, "trainer"))
    print(f"steps dumped: {load(runs[0]).steps}")
    result = compare(*runs)
    print(f"same config twice: {result.verdict}")
    return 0 if result.verdict == "pass" else 1


if __name__ == "__main__":
    sys.exit(main())
