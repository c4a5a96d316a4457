"""What capture costs a step of FSDP2 training, next to the same model under DDP.

    python bench/sharded_overhead.py                 # 2 ranks (torchrun, gloo, CPU), 15 repeats
    python bench/sharded_overhead.py --repeats 30 --width 256 --depth 8

Launches itself under ``torchrun --standalone --nproc_per_node 2``. Each rank trains the same
MLP (``depth`` Linear + GELU blocks of ``width``) wrapped two ways, DDP and FSDP2
(``fully_shard`` on every Linear and on the root), with one torch thread per rank. For each
stack the variants (no probe; statistics at level api; statistics at level mix) are
interleaved in blocks of 3 steps in a new random order every round; the first step of a block
is not timed. A captured step includes start(), stop() and step() (handing the step file to
the writer). Rank 0 prints the median step time of each variant and the ratios:

    stack  baseline ms  stats api  stats mix  calls/step (api)
    ddp         ...        1.9x       2.4x          ...
    fsdp2       ...        1.7x       2.2x          ...

and the last lines divide FSDP2's stats-api overhead (captured minus baseline, ms) by DDP's,
per step and per recorded call (FSDP2 records its collectives too, forward and backward,
which DDP runs in its C++ reducer where no API call is seen).
"""

import argparse
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def _model(width, depth):
    import torch.nn as nn

    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.GELU()]
    return nn.Sequential(*layers)


def _wrap(stack, model):
    if stack == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model)
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:  # torch < 2.6
        from torch.distributed._composable.fsdp import fully_shard
    import torch.nn as nn

    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return model


def _rank_main(args):
    import torch
    import torch.distributed as dist

    import probe

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    out = tempfile.mkdtemp(prefix="probe-sharded-bench-")
    results = {}
    for stack in ("ddp", "fsdp2"):
        torch.manual_seed(0)
        model = _wrap(stack, _model(args.width, args.depth))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        x = torch.randn(args.batch, args.width, generator=torch.Generator().manual_seed(rank))
        debuggers = {"baseline": None}
        for level in ("api", "mix"):
            debuggers[f"stats {level}"] = probe.PrecisionDebugger(probe.Config(
                dump_path=os.path.join(out, f"{stack}-{level}"), level=level, rank=[], step=[]))
        times = {name: [] for name in debuggers}
        calls = 0
        rng = random.Random(7)  # the same order on every rank: collectives must line up
        for round_ in range(args.repeats + 2):
            order = list(debuggers)
            rng.shuffle(order)
            for name in order:
                debugger = debuggers[name]
                for position in range(3):
                    start = time.perf_counter()
                    if debugger is not None:
                        debugger.start(model)
                    optimizer.zero_grad()
                    model(x).square().mean().backward()
                    optimizer.step()
                    if debugger is not None:
                        debugger.stop()
                        debugger.step()
                        if name == "stats api":
                            calls = debugger.last_step_calls
                    if position and round_ >= 2:
                        times[name].append(time.perf_counter() - start)
        for debugger in debuggers.values():
            if debugger is not None:
                debugger.close()
        results[stack] = ({name: statistics.median(found) * 1e3 for name, found in times.items()}, calls)
    dist.barrier()
    if rank == 0:
        print(f"{args.depth} x Linear({args.width}) + GELU, batch {args.batch}, 2 ranks, gloo, "
              f"1 thread per rank, medians of {2 * args.repeats} steps")
        print(f"{'stack':6} {'baseline ms':>12} {'stats api':>10} {'stats mix':>10} {'calls/step':>11}")
        for stack, (medians, calls) in results.items():
            base = medians["baseline"]
            print(f"{stack:6} {base:12.2f} {medians['stats api'] / base:9.2f}x "
                  f"{medians['stats mix'] / base:9.2f}x {calls:11d}")
        added = {stack: medians["stats api"] - medians["baseline"]
                 for stack, (medians, _) in results.items()}
        print(f"fsdp2 / ddp capture cost (stats api, ms added per step): "
              f"{added['fsdp2']:.2f} / {added['ddp']:.2f} = {added['fsdp2'] / added['ddp']:.2f}")
        per_call = {stack: added[stack] / max(calls, 1) for stack, (_, calls) in results.items()}
        print(f"fsdp2 / ddp capture cost per recorded call (ms): "
              f"{per_call['fsdp2']:.3f} / {per_call['ddp']:.3f} = {per_call['fsdp2'] / per_call['ddp']:.2f}")
    shutil.rmtree(out, ignore_errors=True)
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # gloo's threads can outlive the process group (tests/capture/test_distributed.py)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank:
        _rank_main(args)
        return
    env = dict(os.environ, OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               os.path.abspath(__file__), "--rank", "--repeats", str(args.repeats),
               "--width", str(args.width), "--depth", str(args.depth), "--batch", str(args.batch)]
    sys.exit(subprocess.run(command, env=env).returncode)


if __name__ == "__main__":
    main()
