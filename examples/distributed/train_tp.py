"""Tensor parallel (DTensor: ColwiseParallel then RowwiseParallel) on CPU (gloo), or the same
model on one device, dumped with probe.

    python -m torch.distributed.run --standalone --nproc_per_node 2 \\
        examples/distributed/train_tp.py --dump out/tp
    python examples/distributed/train_tp.py --one-device --dump out/one
    probe compare out/one out/tp

Both runs see the same global batch. Each tensor-parallel rank records its shard of every
DTensor with its placement; compare merges the shards into the logical tensors and pairs
them with the one-device run's. ``--bug-rank R`` scales rank R's shard of the first
Linear's weight by 1.001 before training.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch
import torch.nn as nn

from examples.distributed.sharded_loop import leave_job, train


def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dump", required=True)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--one-device", action="store_true", help="no parallelism, one process")
    parser.add_argument("--bug-rank", type=int, default=-1)
    return parser.parse_args(argv)


def run(args, rank=0):
    """Build the model, parallelize it over every rank of a started process group (unless
    --one-device) and train it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16))
    if not args.one_device:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
        parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
        if rank == args.bug_rank:
            with torch.no_grad():
                model[0].weight.to_local().mul_(1.001)
    train(model, args.dump, args.steps, rank, data_seed=100)  # the same global batch on every rank


def main():
    args = parse()
    torch.set_num_threads(1)
    if args.one_device:
        run(args)
        return
    import torch.distributed as dist

    dist.init_process_group("gloo")
    run(args, dist.get_rank())
    leave_job()


if __name__ == "__main__":
    main()
