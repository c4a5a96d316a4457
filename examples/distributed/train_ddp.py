"""One rank of a DDP training job on CPU (gloo), dumped with probe. Started by torchrun:

    python -m torch.distributed.run --standalone --nproc_per_node 2 \\
        examples/distributed/train_ddp.py --dump out/distributed/reference

Each rank trains a small residual MLP on its own shard of data, averages its loss across ranks
with an explicit all_reduce (as a logging loop would), and writes its own dump file
``{dump}/step{N}/rank{R}.h5``. ``--bug-rank R`` makes rank R compute one GELU with the tanh
approximation, as if that rank's node had a different kernel library.
"""

import argparse
import os
import sys

# torchrun starts this file as a script: make `probe` and `examples.models` importable
# without installing anything.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from probe import Config, PrecisionDebugger, seed_all
from examples.models import DeepMLP, make_batch, train_step

SEED = 1234


def main():
    parser = argparse.ArgumentParser(description="One rank of the DDP example (run by torchrun).")
    parser.add_argument("--dump", required=True, help="dump folder for this run")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--bug-rank", type=int, default=None,
                        help="this rank computes blocks.1's GELU with the tanh approximation")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                        help="auto: cuda when available; on cuda rank R uses GPU R mod count")
    args = parser.parse_args()

    # gloo runs the collectives on CPU tensors and, for all_reduce/broadcast, on CUDA tensors
    # too, so the same job runs with 2 ranks on a machine with one GPU (NCCL would need two).
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cpu")
    if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available()):
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
        torch.cuda.set_device(device)
    seed_all(SEED)
    model = DeepMLP(in_features=32, width=64, depth=3, out_features=10)
    if rank == args.bug_rank:
        model.blocks[1].act = nn.GELU(approximate="tanh")
    model = model.to(device)
    ddp_model = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=0.05)
    data = torch.Generator().manual_seed(SEED + rank)  # each rank reads its own shard

    debugger = PrecisionDebugger(
        Config(task="statistics", level="mix", dump_path=args.dump, seed=SEED, overwrite=True))
    for step in range(args.steps):
        x, y = make_batch("mlp", 16, generator=data, device=device, in_features=32, out_features=10)
        debugger.start(ddp_model)
        loss = train_step(ddp_model, optimizer, x, y)
        mean_loss = loss.clone()
        dist.all_reduce(mean_loss)
        mean_loss /= world
        debugger.stop()
        debugger.step()
        if rank == 0:
            print(f"step {step}: mean loss over {world} ranks {mean_loss.item():.6f}", flush=True)
    debugger.close()  # every step file on disk before the process group goes away
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # gloo's threads can outlive destroy_process_group() when a DDP model exists and abort the
    # interpreter's exit (SIGABRT): leave without finalizing, once the output is out
    # (docs/howto.md, "Dump a distributed (DDP) job")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
