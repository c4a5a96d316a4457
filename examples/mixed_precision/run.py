"""bf16 autocast vs fp32 on a tiny GPT: which ops introduce the most error?

Trains the same TinyGPT (2 blocks, d=64) from the same weights on the same batches twice:
in float32, and under torch.autocast(device, dtype=torch.bfloat16). The first step of each
is dumped at level "mix" (every torch call, and every module: a linear's backward is only
measured by its Linear module) and compared; the script prints the verdict and the ops
whose bf16 output moved furthest from fp32 beyond what their inputs carried, i.e. the ops
that *introduce* error, ranked. It also prints the two loss curves.

    python examples/mixed_precision/run.py            # CPU bf16 autocast works too
    python examples/mixed_precision/run.py --smoke    # CI size
"""

import copy
import os
import sys

# Run as `python examples/mixed_precision/run.py` from anywhere: make `probe` and
# `examples.models` importable without installing anything.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import contextlib

import torch
import torch.nn.functional as F

from probe import Config, PrecisionDebugger, compare, seed_all
from examples._common import example_parser
from examples.models import TinyGPT

SEED = 1234
SIZES = {"vocab": 128, "d_model": 64, "n_heads": 4, "n_layers": 2, "max_len": 32}


def counting_batch(generator, batch_size):
    """Sequences start, start+k, start+2k, ... (mod vocab): learnable, so the loss falls."""
    vocab, length = SIZES["vocab"], SIZES["max_len"]
    start = torch.randint(0, vocab, (batch_size, 1), generator=generator)
    stride = torch.randint(1, 8, (batch_size, 1), generator=generator)
    tokens = (start + stride * torch.arange(length + 1)) % vocab
    return tokens[:, :-1], tokens[:, 1:]


def train(initial, precision, steps, device, dump_dir):
    """Train a copy of `initial`; step 0 is dumped. Returns the losses."""
    model = copy.deepcopy(initial).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = torch.Generator().manual_seed(SEED)
    debugger = PrecisionDebugger(Config(
        task="tensor", level="mix", dump_path=dump_dir, step=[0], seed=SEED, overwrite=True))
    autocast = (torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16)
                if precision == "bf16" else contextlib.nullcontext())
    losses = []
    for _ in range(steps):
        x, y = (t.to(device) for t in counting_batch(data, 16))
        optimizer.zero_grad(set_to_none=True)
        # Capture forward and backward: that is where autocast changes the math. The
        # optimizer step runs in float32 either way and only carries the error on.
        debugger.start(model)
        with autocast:
            logits = model(x)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        loss.backward()
        debugger.stop()
        optimizer.step()
        debugger.step()
        losses.append(loss.item())
    debugger.close()  # returns once every step file is on disk
    return losses


def main():
    parser = example_parser(__doc__, "mixed_precision", "3 steps")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--top", type=int, default=5, help="how many ops to list")
    args = parser.parse_args()
    if args.smoke:
        args.steps = 3

    seed_all(SEED)
    initial = TinyGPT(**SIZES)
    dumps = {name: os.path.join(args.out, name) for name in ("fp32", "bf16")}
    losses = {name: train(initial, name, args.steps, args.device, dumps[name]) for name in dumps}
    print(f"TinyGPT {SIZES}, {args.steps} steps on {args.device}")
    for step in sorted({0, args.steps // 2, args.steps - 1}):
        print(f"  step {step:>3}: loss fp32 {losses['fp32'][step]:.6f}   bf16 autocast "
              f"{losses['bf16'][step]:.6f}")

    result = compare(dumps["fp32"], dumps["bf16"], top=args.top)
    html = os.path.join(args.out, "report.html")
    result.write_html(html)
    print("\nstep 0 compared (fp32 = reference, bf16 autocast = candidate)")
    print(f"verdict: {result.verdict}")
    first = result.first_divergence
    if first is not None:
        print(f"first divergence: {first.key} ({first.origin})")
    print(f"top {args.top} ops by the error they add to what their inputs carried "
          f"(1.0 x tolerance = the limit):")
    for number, op in enumerate(result.top_ops[:args.top], 1):
        print(f"  {number}. {op.module or '<root>'} {op.op}#{op.index} ({op.phase}): adds "
              f"{op.introduced:.2f} x tolerance; output rel L2 {op.output_rel_l2:.2e}, "
              f"inputs {op.input_rel_l2:.2e}")
    print(f"report: {html}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
