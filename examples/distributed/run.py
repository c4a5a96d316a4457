"""DDP on CPU: two torchrun jobs, per-rank dumps, compared rank by rank.

Launches ``torchrun --standalone --nproc_per_node 2 train_ddp.py`` (gloo backend, localhost
only) for a reference run and a candidate run in which rank 1 computes one GELU with the tanh
approximation. Every rank writes ``{dump}/step{N}/rank{R}.h5``; the script compares the two
runs file by file and prints, per rank, the verdict and the first divergence.

    python examples/distributed/run.py            # ~12 s on 2 CPU cores (two torchrun jobs at once)
    python examples/distributed/run.py --same     # candidate identical to the reference
    python examples/distributed/run.py --smoke    # CI size
"""

import os
import subprocess
import sys
import time

# Run as `python examples/distributed/run.py` from anywhere: make `probe` importable
# without installing anything.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from probe import compare
from examples._common import example_parser

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "train_ddp.py")
NPROC = 2


def torchrun(dump_dir, steps, bug_rank, device):
    """Start one DDP job (its output is collected, not interleaved with the other job's)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc_per_node", str(NPROC), WORKER, "--dump", dump_dir, "--steps", str(steps),
               "--device", device]
    if bug_rank is not None:
        command += ["--bug-rank", str(bug_rank)]
    # One thread per rank: the ranks share the machine's cores.
    env = dict(os.environ, OMP_NUM_THREADS="1")
    print("$ torchrun --standalone --nproc_per_node 2 examples/distributed/train_ddp.py "
          + " ".join(command[7:]), flush=True)
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def main():
    parser = example_parser(__doc__, "distributed", "1 step", device=False)
    parser.add_argument("--steps", type=int, default=3, help="training steps per job")
    parser.add_argument("--same", action="store_true",
                        help="candidate has no bug: shows that two DDP runs compare clean")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                        help="where each rank computes (auto: cuda when available); gloo either way")
    args = parser.parse_args()
    if args.smoke:
        args.steps = 1
    bug_rank = None if args.same else 1
    reference = os.path.join(args.out, "reference")
    candidate = os.path.join(args.out, "same" if args.same else "rank1_gelu_tanh")

    started = time.perf_counter()
    # The two jobs are independent: both at once (--standalone gives each its own port).
    jobs = [torchrun(dump_dir, args.steps, bug, args.device)
            for dump_dir, bug in ((reference, None), (candidate, bug_rank))]
    for name, job in zip(("reference", "candidate"), jobs):
        output, _ = job.communicate()
        print("\n".join(f"[{name}] {line}" for line in output.splitlines()), flush=True)
        if job.returncode != 0:
            print(f"torchrun failed with exit code {job.returncode}", file=sys.stderr)
            return 2
    print(f"two torchrun jobs of {NPROC} ranks, {args.steps} step(s) each: "
          f"{time.perf_counter() - started:.1f} s", file=sys.stderr)

    overall = compare(reference, candidate)
    print(f"\nreference: {reference}/step{{0..{args.steps - 1}}}/rank{{0,1}}.h5")
    print(f"candidate: {candidate} "
          f"({'no change' if args.same else 'rank 1 computes blocks.1 GELU with tanh'})")
    print("\nper-rank compare (all steps):")
    for rank in sorted({pair["rank"] for pair in overall.steps}):
        result = compare(reference, candidate, ranks=[rank])
        line = f"  rank {rank}: {result.verdict}"
        first = result.first_divergence
        if first is not None:
            line += f"; first divergence at step {first.step}: {first.key} ({first.origin})"
        print(line)
    print(f"\nwhole runs (all steps and ranks): verdict {overall.verdict}")
    if overall.first_divergence is not None:
        first = overall.first_divergence
        print(f"first divergence: step {first.step}, rank {first.rank}, {first.key} ({first.origin})")
    print(f"the full report: python -m probe compare {reference} {candidate}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
