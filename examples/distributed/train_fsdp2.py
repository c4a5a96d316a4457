"""One rank of an FSDP2 (or, with --ddp, DDP) training job on CPU (gloo), dumped with probe.

    python -m torch.distributed.run --standalone --nproc_per_node 2 \\
        examples/distributed/train_fsdp2.py --dump out/fsdp2
    python -m torch.distributed.run --standalone --nproc_per_node 2 \\
        examples/distributed/train_fsdp2.py --ddp --dump out/ddp
    probe compare out/ddp out/fsdp2

``fully_shard`` goes on every Linear and on the root, as torchtitan applies it per block.
Each rank trains on its own batches (the same ones under DDP and FSDP2), so the two runs
should agree to rounding: probe pairs FSDP2's sharded parameters and gradients, recorded as
each rank's shard with its placement, with DDP's whole tensors. ``--bug-rank R`` makes rank R
compute its GELU with the tanh approximation; ``--bf16`` trains with
MixedPrecisionPolicy(param_dtype=torch.bfloat16).
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch
import torch.distributed as dist
import torch.nn as nn

from examples.distributed.sharded_loop import leave_job, train


def build(approximate):
    torch.manual_seed(0)  # the same initial weights on every rank and in every run
    return nn.Sequential(nn.Linear(16, 64), nn.GELU(approximate=approximate), nn.Linear(64, 16),
                         nn.GELU(), nn.Linear(16, 4))


def shard(model, bf16):
    try:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    except ImportError:  # torch < 2.6
        from torch.distributed._composable.fsdp import MixedPrecisionPolicy, fully_shard
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if bf16 else MixedPrecisionPolicy()
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mp_policy=policy)
    return fully_shard(model, mp_policy=policy)


def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dump", required=True)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--ddp", action="store_true", help="DistributedDataParallel instead of FSDP2")
    parser.add_argument("--bf16", action="store_true", help="FSDP2 parameters in bfloat16")
    parser.add_argument("--bug-rank", type=int, default=-1)
    return parser.parse_args(argv)


def run(args, rank):
    """Build, wrap and train the model on this rank of a started process group."""
    model = build("tanh" if rank == args.bug_rank else "none")
    if args.ddp:
        model = nn.parallel.DistributedDataParallel(model)
    else:
        model = shard(model, args.bf16)
    train(model, args.dump, args.steps, rank, data_seed=100 + rank)  # each rank its own batches


def main():
    args = parse()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    run(args, dist.get_rank())
    leave_job()


if __name__ == "__main__":
    main()
