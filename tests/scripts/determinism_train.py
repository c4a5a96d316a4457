"""A tiny training loop for tests/analysis/test_determinism.py, run by `probe determinism`.

    python tests/scripts/determinism_train.py [--steps 2] [--unseeded-noise] [--hash-order]
                                              [--fail CODE] [--no-debugger] [--unedited]

--unseeded-noise adds noise from a torch.Generator seeded from os.urandom in block 1's
forward: a draw no seed reaches, so every run differs there, and from there on.
--hash-order shifts the input by where a str falls when a set of str is iterated: the same in
runs with the same PYTHONHASHSEED, different between PYTHONHASHSEED 1234 and 1235.
--fail CODE exits with CODE at once (a script that fails on its own).
--no-debugger stands for a script that does not train: it exits 0, never imports torch and
dumps nothing. --fail and --no-debugger exit before importing torch, to keep the tests quick.
--unedited trains the same way with no probe code at all (what zero-edit capture finds).
"""

import argparse
import os
import sys


def make_model(noisy):
    import torch
    import torch.nn as nn

    class Block(nn.Module):
        def __init__(self, noisy):
            super().__init__()
            self.fc = nn.Linear(8, 8)
            self.noisy = noisy
            self.generator = torch.Generator().manual_seed(int.from_bytes(os.urandom(8), "little") >> 1)

        def forward(self, x):
            x = torch.tanh(self.fc(x))
            if self.noisy:
                x = x + 0.01 * torch.randn(x.shape, generator=self.generator)  # unseeded on purpose
            return x

    return nn.Sequential(Block(False), Block(noisy), nn.Linear(8, 1))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--unseeded-noise", action="store_true")
    parser.add_argument("--hash-order", action="store_true")
    parser.add_argument("--fail", type=int, default=0)
    parser.add_argument("--no-debugger", action="store_true")
    parser.add_argument("--unedited", action="store_true")
    args = parser.parse_args()
    if args.fail:
        print("determinism_train: failing on purpose", file=sys.stderr)
        return args.fail
    if args.no_debugger:
        print("trained without probe")
        return 0
    import torch

    if args.unedited:
        debugger = None
    else:
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
        from probe import PrecisionDebugger

        debugger = PrecisionDebugger()  # no argument: the config probe determinism passes down
    model = make_model(args.unseeded_noise)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.linspace(-1, 1, 32).reshape(4, 8)
    if args.hash_order:
        names = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta"]
        x = x + 0.125 * list({*names}).index("alpha")  # where "alpha" falls in a set: hash order
    for _ in range(args.steps):
        if debugger is not None:
            debugger.start(model)
        optimizer.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        optimizer.step()
        if debugger is not None:
            debugger.stop()
            debugger.step()
        print(f"loss {loss.item():.6f}")  # the script's own output: must not reach our stdout
    return 0


if __name__ == "__main__":
    sys.exit(main())
