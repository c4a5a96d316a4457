"""What ``random_on_cpu`` costs on the CPU side: the numbers docs/seeding.md quotes.

    python bench/random_on_cpu.py            # about 10 s
    python bench/random_on_cpu.py --repeats 9

One process, median of --repeats, ratios against the same loop without the mode:

  * a torch call that draws nothing (torch.add on 4 floats): while the mode is active every
    torch call passes through its Python __torch_function__ (a dict lookup, then the call);
  * a draw aimed at the CPU (torch.randn(256), passed through untouched);
  * a training step of a small MLP with dropout on the CPU (forward, backward, SGD).

What it cannot measure here: the host-to-device copy per redirected draw on an accelerator
(no GPU was available to measure it); that cost is the size of the drawn tensor over the host-to-device
bandwidth, plus one synchronisation.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from probe.seed.random_on_cpu import RandomOnCpu  # noqa: E402
from examples.models import MLP  # noqa: E402


def per_call_us(work, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        work()
    return (time.perf_counter() - start) / calls * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    x = torch.ones(4)
    model = MLP(in_features=64, hidden=128, out_features=10, dropout=0.3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    batch, target = torch.randn(32, 64), torch.randint(0, 10, (32,))

    def train_step():
        optimizer.zero_grad()
        F.cross_entropy(model(batch), target).backward()
        optimizer.step()

    cases = [("torch.add, 4 floats", lambda: torch.add(x, x), 20000),
             ("torch.randn(256) on the CPU", lambda: torch.randn(256), 20000),
             ("MLP+dropout training step", train_step, 300)]
    print(f"{'case':32} {'off us':>9} {'on us':>9} {'ratio':>7}   (median of {args.repeats}, 1 thread, "
          f"load {os.getloadavg()[0]:.1f})")
    for name, work, calls in cases:
        off, on = [], []
        for _ in range(args.repeats):
            off.append(per_call_us(work, calls))
            with RandomOnCpu():
                on.append(per_call_us(work, calls))
        off_us, on_us = statistics.median(off), statistics.median(on)
        print(f"{name:32} {off_us:9.2f} {on_us:9.2f} {on_us / off_us:7.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
