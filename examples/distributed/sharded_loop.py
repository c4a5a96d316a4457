"""The training loop train_fsdp2.py and train_tp.py share: SGD on the mean square of the
output, a PrecisionDebugger (level mix, every step) around each step, and the torchrun exit."""

import os
import sys

import torch

from probe import Config, PrecisionDebugger


def train(model, dump, steps, rank, data_seed):
    """Train ``steps`` steps on batches drawn from ``data_seed``, capturing each into ``dump``."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    debugger = PrecisionDebugger(Config(dump_path=dump, level="mix", step=[], rank=[]))
    data = torch.Generator().manual_seed(data_seed)
    for step in range(steps):
        x = torch.randn(8, 16, generator=data)
        debugger.start(model)
        optimizer.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
        optimizer.step()
        debugger.stop()
        debugger.step()
        print(f"rank {rank} step {step} loss {loss.item():.6f}")
    debugger.close()


def leave_job():
    """End a torchrun rank: gloo's threads can outlive the process group and abort the
    interpreter's exit (examples/distributed/README.md), so flush and leave without it."""
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
