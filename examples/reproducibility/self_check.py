"""Is my training deterministic? `probe determinism` runs it twice and compares bit for bit.

Two checks of the same small training (an MLP with dropout, SGD, a few steps), each made by
``probe determinism -- python self_check.py --train ...``:

1. as written: seed_all (through the debugger) reaches every draw, so the runs are
   bit-identical (exit 0);
2. with input noise from a ``torch.Generator`` seeded from the clock, a draw no seed reaches:
   the runs differ and probe names that draw as the nondeterministic op, with its line (exit 1).

    python examples/reproducibility/self_check.py            # ~15 s on 2 CPU cores (4 runs)
    python examples/reproducibility/self_check.py --smoke    # CI size (2 steps)
"""

import argparse
import os
import subprocess
import sys
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO_ROOT)

from examples._common import example_parser  # noqa: E402


def train(steps, unseeded):
    """The training probe determinism runs; PrecisionDebugger() reads the config it passes."""
    import torch
    import torch.nn.functional as F

    from probe import PrecisionDebugger
    from examples.models import MLP

    debugger = PrecisionDebugger()  # seeds, and dumps checksums where probe determinism says
    model = MLP(in_features=16, hidden=32, out_features=4, dropout=0.3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    clock = torch.Generator().manual_seed(time.time_ns() % 2**63)  # no seed reaches this one
    data = torch.Generator().manual_seed(0)
    x, y = torch.randn(32, 16, generator=data), torch.randint(0, 4, (32,), generator=data)
    for _ in range(steps):
        debugger.start(model)
        inputs = x + 0.05 * torch.randn(x.shape, generator=clock) if unseeded else x
        optimizer.zero_grad()
        F.cross_entropy(model(inputs), y).backward()
        optimizer.step()
        debugger.stop()
        debugger.step()


def check(args, unseeded):
    """probe determinism on the training; returns (exit code, its report)."""
    command = [sys.executable, "-m", "probe.cli", "determinism", "--",
               sys.executable, os.path.abspath(__file__), "--train", "--steps", str(args.steps)]
    if unseeded:
        command.append("--unseeded")
    env = dict(os.environ, PYTHONPATH=REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode == 2:
        sys.stderr.write(done.stderr)
    return done.returncode, done.stdout


def main():
    parser = example_parser(__doc__, "reproducibility", "2 steps", device=False)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--train", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--unseeded", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.smoke:
        args.steps = 2
    if args.train:
        train(args.steps, args.unseeded)
        return 0

    results = []
    for label, unseeded in (("1. as written", False), ("2. with clock-seeded input noise", True)):
        code, report = check(args, unseeded)
        if code == 2:
            return 2
        print(f"{label}: probe determinism exit code {code}")
        print("\n".join("   " + line for line in report.splitlines()))
        results.append(code)
    as_expected = results == [0, 1]
    print("RESULT: the seeded training repeats bit for bit; the unseeded draw was found"
          if as_expected else "RESULT: unexpected exit codes " + str(results))
    return 0 if as_expected else 1


if __name__ == "__main__":
    sys.exit(main())
