"""Two training runs, bit-identical with seed_all, different without it.

The training job has every usual source of run-to-run noise: random weight init, a shuffled
DataLoader with 2 worker processes whose samples get random augmentation (torch and numpy
draws inside the workers), and dropout. The script launches the job four times in fresh
processes -- twice with seed_all + dataloader_kwargs, twice with neither -- and prints, per
pair, whether the losses and final weights match bit for bit, plus probe's own verdict on a
checksum dump of the last step.

    python examples/reproducibility/run.py            # ~11 s on 2 CPU cores
    python examples/reproducibility/run.py --smoke    # CI size
"""

import argparse
import contextlib
import hashlib
import json
import os
import subprocess
import sys

# Run as `python examples/reproducibility/run.py` from anywhere: make `probe` and
# `examples.models` importable without installing anything.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from probe import Config, PrecisionDebugger, compare, dataloader_kwargs, seed_all
from examples._common import example_parser
from examples.models import MLP

SEED = 1234


class NoisyDataset(Dataset):
    """Fixed samples plus per-access augmentation drawn from the worker's torch and numpy RNGs."""

    def __init__(self, size=256, features=32, classes=10):
        fixed = torch.Generator().manual_seed(0)  # the data itself is the same in every run
        self.x = torch.randn(size, features, generator=fixed)
        self.y = torch.randint(0, classes, (size,), generator=fixed)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        noise = 0.1 * torch.randn(self.x.shape[1])
        scale = float(np.random.uniform(0.9, 1.1))
        return self.x[i] * scale + noise, self.y[i]


def train(seeded, steps, device, dump_dir):
    """One training job; returns the per-step losses and a hash of the final weights."""
    capture = None
    if seeded:
        seed_all(SEED)
        loader_kwargs = dataloader_kwargs(SEED)
        # The seeded runs also dump their last step (checksums of every module's tensors) for
        # probe compare. Only they do: building a PrecisionDebugger calls seed_all itself.
        capture = PrecisionDebugger(Config(task="checksum", level="module", dump_path=dump_dir,
                                           step=[steps - 1], seed=SEED, overwrite=True))
    else:
        loader_kwargs = {}
    model = MLP(in_features=32, hidden=64, out_features=10, dropout=0.3).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loader = DataLoader(NoisyDataset(), batch_size=32, shuffle=True, num_workers=2,
                        **loader_kwargs)
    losses = []
    batches = iter(loader)
    for _ in range(steps):
        x, y = (t.to(device) for t in next(batches))
        with capture.capture(model) if capture else contextlib.nullcontext():
            optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
        losses.append(loss.item())
    if capture:
        capture.close()  # returns once the step file is on disk
    digest = hashlib.sha256()
    for tensor in model.state_dict().values():
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return {"losses": [v.hex() for v in losses], "weights_sha256": digest.hexdigest()}


def launch(seeded, run, args):
    """Start one training job in a fresh interpreter (nothing carried over between runs)."""
    name = f"{'seeded' if seeded else 'unseeded'}_run{run}"
    result_file = os.path.join(args.out, f"{name}.json")
    command = [sys.executable, os.path.abspath(__file__), "--child", name,
               "--steps", str(args.steps), "--device", args.device, "--out", args.out]
    if seeded:
        command.append("--seeded")
    # One thread each: the four jobs run at once and share the machine's cores.
    return name, result_file, subprocess.Popen(command, env=dict(os.environ, OMP_NUM_THREADS="1"))


def describe(a, b):
    """Bit-for-bit comparison of two jobs' results, in words."""
    losses_a = [float.fromhex(v) for v in a["losses"]]
    losses_b = [float.fromhex(v) for v in b["losses"]]
    if a == b:
        return True, f"bit-identical ({len(losses_a)} losses, final weights sha256 {a['weights_sha256'][:12]})"
    for step, (la, lb) in enumerate(zip(losses_a, losses_b)):
        if la != lb:
            return False, f"differ (first at step {step}: loss {la:.6f} vs {lb:.6f})"
    return False, "differ (same losses, different final weights)"


def main():
    parser = example_parser(__doc__, "reproducibility", "3 steps")
    parser.add_argument("--steps", type=int, default=8, help="training steps per run")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--seeded", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.smoke:
        args.steps = 3
    os.makedirs(args.out, exist_ok=True)

    if args.child:
        result = train(args.seeded, args.steps, args.device, os.path.join(args.out, args.child))
        with open(os.path.join(args.out, f"{args.child}.json"), "w") as handle:
            json.dump(result, handle)
        return 0

    print(f"4 runs of {args.steps} steps on {args.device}: MLP with dropout 0.3, DataLoader "
          f"with 2 workers and random augmentation", file=sys.stderr)
    jobs = [launch(seeded, run, args) for seeded in (True, False) for run in (1, 2)]
    results = {}
    for name, result_file, process in jobs:
        if process.wait() != 0:
            print(f"{name} failed with exit code {process.returncode}", file=sys.stderr)
            return 2
        with open(result_file) as handle:
            results[name] = json.load(handle)

    all_as_expected = True
    for label, prefix in (("with seed_all   ", "seeded"), ("without seed_all", "unseeded")):
        same, words = describe(results[f"{prefix}_run1"], results[f"{prefix}_run2"])
        line = f"{label}: run 1 vs run 2: {words}"
        if prefix == "seeded":
            verdict = compare(*(os.path.join(args.out, f"seeded_run{run}") for run in (1, 2))).verdict
            line += f"; probe compare of the last step's checksums: {verdict}"
            all_as_expected &= verdict == "pass"
        print(line)
        all_as_expected &= same == (prefix == "seeded")
    print(f"dumps: {args.out}/seeded_run1 {args.out}/seeded_run2")
    print("RESULT: seed_all made the runs repeat exactly" if all_as_expected
          else "RESULT: unexpected -- see above")
    return 0 if all_as_expected else 1


if __name__ == "__main__":
    sys.exit(main())
