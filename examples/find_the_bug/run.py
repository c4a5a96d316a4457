"""Find the layer that changed: one bug injected into one layer, and probe names it.

The model is a residual MLP (stem, 6 blocks of LayerNorm -> Linear -> GELU, head). The
"reference" is the model as it was; the "candidate" has one of three realistic bugs in
blocks.3, with the same weights and data otherwise:

    eps        blocks.3.norm uses eps=1e-3 (Keras' LayerNorm default) instead of PyTorch's 1e-5
    gelu       blocks.3.act uses the tanh approximation of GELU instead of the exact erf form
    transpose  blocks.3.fc.weight was converted from an (in, out) checkpoint without transposing

One training step of each is dumped and compared; the script prints the layer probe points at
and checks it is the one that was changed (exit 1 if not).

    python examples/find_the_bug/run.py --bug gelu
    python examples/find_the_bug/run.py             # all three, one after the other
"""

import os
import sys

# Run as `python examples/find_the_bug/run.py` from anywhere: make `probe` and
# `examples.models` importable without installing anything.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch
import torch.nn as nn

from probe import Config, PrecisionDebugger, compare, seed_all
from examples._common import example_parser
from examples.models import DeepMLP, make_batch, train_step

SEED = 1234
SIZES = {"in_features": 32, "width": 64, "depth": 6, "out_features": 10}
BUGGY_BLOCK = 3
#: bug -> (the layer that was changed, what changed)
BUGS = {
    "eps": (f"blocks.{BUGGY_BLOCK}.norm", "LayerNorm eps 1e-5 -> 1e-3"),
    "gelu": (f"blocks.{BUGGY_BLOCK}.act", "GELU exact -> tanh approximation"),
    "transpose": (f"blocks.{BUGGY_BLOCK}.fc", "Linear weight loaded transposed"),
}


def build(bug, reference_state):
    """A model with the reference weights and, unless bug is None, the bug injected."""
    model = DeepMLP(**SIZES)
    state = dict(reference_state)
    if bug == "transpose":
        name = f"blocks.{BUGGY_BLOCK}.fc.weight"
        state[name] = state[name].t().contiguous()  # square, so it loads without complaint
    model.load_state_dict(state)
    block = model.blocks[BUGGY_BLOCK]
    if bug == "eps":
        block.norm.eps = 1e-3
    elif bug == "gelu":
        block.act = nn.GELU(approximate="tanh")
    return model


def dump_one_step(model, dump_dir, device, task):
    model = model.to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = make_batch("deepmlp", 16, generator=torch.Generator().manual_seed(SEED),
                      device=device, in_features=SIZES["in_features"])
    debugger = PrecisionDebugger(
        Config(task=task, level="mix", dump_path=dump_dir, seed=SEED, overwrite=True))
    debugger.start(model)
    train_step(model, optimizer, x, y)
    debugger.stop()
    debugger.step()
    debugger.close()  # returns once the step file is on disk


def hunt(bug, out, device, task):
    """Dump reference and buggy step, compare; returns True when probe names the right layer."""
    seed_all(SEED)
    reference_state = DeepMLP(**SIZES).state_dict()
    expected, change = BUGS[bug]
    dumps = [os.path.join(out, bug, side) for side in ("reference", "candidate")]
    dump_one_step(build(None, reference_state), dumps[0], device, task)
    dump_one_step(build(bug, reference_state), dumps[1], device, task)
    result = compare(*dumps)
    html = os.path.join(out, bug, "report.html")
    result.write_html(html)
    first = result.first_divergence
    print(f"--bug {bug} ({change} in {expected})")
    print(f"  verdict: {result.verdict}")
    if first is None:
        print(f"  probe found no divergence; expected {expected}: WRONG")
        return False
    found = first.module == expected or first.module.startswith(expected + ".")
    print(f"  first divergence: {first.key} ({first.origin})")
    if first.cause:
        print(f"  cause: {first.cause}")
    print(f"  probe points at layer: {first.module} -- expected {expected}: "
          f"{'CORRECT' if found else 'WRONG'}")
    print(f"  report: {html}")
    return found


def main():
    parser = example_parser(__doc__, "find_the_bug", "already tiny: same run")
    parser.add_argument("--bug", choices=[*BUGS, "all"], default="all")
    parser.add_argument("--task", choices=["statistics", "checksum", "tensor"], default="statistics",
                        help="what the dumps record per tensor (tensor: full values)")
    args = parser.parse_args()
    bugs = list(BUGS) if args.bug == "all" else [args.bug]
    located = [hunt(bug, args.out, args.device, args.task) for bug in bugs]
    print(f"RESULT: probe located {sum(located)} of {len(bugs)} injected bug(s)")
    return 0 if all(located) else 1


if __name__ == "__main__":
    sys.exit(main())
