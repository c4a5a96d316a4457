"""probe in one minute: a refactor changed one layer -- where do the two runs part?

Trains a small residual MLP for a few steps twice from the same seed: the reference as it was,
and a candidate after "a refactor" that switched blocks.2's GELU to the tanh approximation
(nn.GELU(approximate="tanh"), a common speed-up that is not numerically the same). Both runs
are dumped with probe's PrecisionDebugger, compared, and the verdict, the first op that
diverged and the HTML report's path are printed.

    python examples/quickstart/run.py               # writes ./out/quickstart
    python examples/quickstart/run.py --out /tmp/q  # somewhere else
"""

import os
import subprocess
import sys
import time

# Run as `python examples/quickstart/run.py` from anywhere: make `probe` and
# `examples.models` importable without installing anything.
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO_ROOT)

import torch
import torch.nn as nn

from probe import Config, PrecisionDebugger
from examples._common import example_parser
from examples.models import DeepMLP, make_batch, train_step

SEED = 1234
CHANGED_LAYER = "blocks.2.act"


def train_and_dump(dump_dir, refactored, steps, device):
    """Seeded training run; every step is dumped to dump_dir/step{N}/rank0.h5."""
    # Building the debugger calls seed_all(config.seed): both runs start from the same
    # weights. level "mix" records module calls and torch API calls.
    debugger = PrecisionDebugger(
        Config(task="statistics", level="mix", dump_path=dump_dir, seed=SEED, overwrite=True))
    model = DeepMLP(in_features=32, width=64, depth=4, out_features=10)
    if refactored:
        model.blocks[2].act = nn.GELU(approximate="tanh")
    model = model.to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = torch.Generator().manual_seed(SEED)
    losses = []
    for _ in range(steps):
        x, y = make_batch("deepmlp", 32, generator=data, device=device, in_features=32)
        debugger.start(model)
        losses.append(train_step(model, optimizer, x, y).item())
        debugger.stop()
        debugger.step()
    debugger.close()  # returns once every step file is on disk
    return losses


def main():
    parser = example_parser(__doc__, "quickstart", "2 steps")
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    if args.smoke:
        args.steps = 2
    started = time.perf_counter()
    reference, candidate = (os.path.join(args.out, name) for name in ("reference", "candidate"))

    print(f"1/3 training the reference ({args.steps} steps on {args.device}) -> {reference}")
    losses_ref = train_and_dump(reference, False, args.steps, args.device)
    print(f"2/3 training the candidate ({CHANGED_LAYER}: GELU -> tanh approximation) -> {candidate}")
    losses_cand = train_and_dump(candidate, True, args.steps, args.device)
    print(f"    last loss: reference {losses_ref[-1]:.7f}, candidate {losses_cand[-1]:.7f}")

    html = os.path.join(args.out, "report.html")
    command = [sys.executable, "-m", "probe.cli", "compare", reference, candidate, "--html", html]
    print(f"3/3 comparing: probe compare {reference} {candidate} --html {html}\n")
    # The same command a user types; its report goes straight to this terminal.
    sys.stdout.flush()
    search_path = os.pathsep.join(filter(None, [REPO_ROOT, os.environ.get("PYTHONPATH")]))
    code = subprocess.call(command, env=dict(os.environ, PYTHONPATH=search_path))
    if code not in (0, 1):
        print(f"probe compare failed (exit code {code})", file=sys.stderr)
        return 2
    print()
    print(f"verdict: {'diverged' if code == 1 else 'pass'} (probe compare exit code {code}); "
          f"the refactor changed {CHANGED_LAYER}")
    print(f"HTML report: {html}")
    print(f"({time.perf_counter() - started:.1f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
