"""A learning rate too high: the loss turns Inf/NaN; probe stops the run and names the first op.

An MLP regression trained with SGD at lr 0.8 on inputs of size ~10 diverges: the weights grow
every step until a value no longer fits in float32. The debugger runs with
``stop_on_nonfinite``: the step in which a NaN/Inf first appears is written to disk and
``step()`` raises NonfiniteError, so training stops with the evidence on disk. Then
``probe.first_nonfinite`` (the same as ``probe nonfinite DUMP``) names the first record that
held NaN/Inf, whether its op introduced it or inherited it, its source line and its counts.

    python examples/reproducibility/nan_hunt.py                    # float32, ~3 s
    python examples/reproducibility/nan_hunt.py --dtype float16    # overflows at 65504, sooner
    python examples/reproducibility/nan_hunt.py --smoke            # CI size (same run)
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch
import torch.nn.functional as F

import probe
from probe import Config, NonfiniteError, PrecisionDebugger
from examples._common import example_parser
from examples.models import MLP

LEARNING_RATE = 0.8


def main():
    parser = example_parser(__doc__, "nan_hunt", "the same run (it is already small)", device=False)
    parser.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default="float32")
    parser.add_argument("--max-steps", type=int, default=200)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    dump = os.path.join(args.out, f"dump_{args.dtype}")

    debugger = PrecisionDebugger(Config(task="statistics", level="mix", dump_path=dump,
                                        stop_on_nonfinite=True, seed=1234, overwrite=True))
    model = MLP(in_features=16, hidden=32, out_features=1).to(dtype)
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    fixed = torch.Generator().manual_seed(0)
    x = (10 * torch.randn(64, 16, generator=fixed)).to(dtype)
    y = x.sum(dim=1, keepdim=True)
    stopped_at = None
    for step in range(args.max_steps):
        debugger.start(model)
        optimizer.zero_grad()
        # the mean squared error written out: F.mse_loss has no float16 backward on CPU before torch 2.5
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        optimizer.step()
        debugger.stop()
        try:
            debugger.step()
        except NonfiniteError as error:
            stopped_at = step
            print(f"training stopped at step {step}: loss {loss.item():.4g}", file=sys.stderr)
            print(f"  {error}", file=sys.stderr)
            break
    debugger.close()
    if stopped_at is None:
        print(f"no NaN/Inf in {args.max_steps} steps at lr {LEARNING_RATE}")
        return 1

    print(f"MLP regression, SGD lr {LEARNING_RATE}, {args.dtype}: NaN/Inf appeared at step {stopped_at}")
    finding = probe.first_nonfinite(dump)
    print(finding.describe())
    print(f"same from the command line: probe nonfinite {dump}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
