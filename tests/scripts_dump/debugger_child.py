"""python debugger_child.py CONFIG N: dump steps 0..N-1 of a tiny MLP through PrecisionDebugger
(each on disk before the next starts), then start step N, run its forward, print "in step N" and
hang there until the parent kills the process."""

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

from examples.models import MLP, make_batch, train_step  # noqa: E402
from probe import PrecisionDebugger  # noqa: E402


def main() -> None:
    config, steps = sys.argv[1], int(sys.argv[2])
    debugger = PrecisionDebugger(config)
    model = MLP(8, 16, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(0)
    for _ in range(steps):
        x, y = make_batch("mlp", 4, generator, in_features=8, out_features=4)
        debugger.start(model)
        train_step(model, optimizer, x, y)
        debugger.stop()
        debugger.step()
    wait = getattr(debugger, "wait", None)  # step() may finish files on another thread
    if wait is not None:
        wait()
    x, y = make_batch("mlp", 4, generator, in_features=8, out_features=4)
    debugger.start(model)
    model(x).sum().backward()
    print(f"in step {steps}", flush=True)
    while True:
        time.sleep(1)


if __name__ == "__main__":
    main()
