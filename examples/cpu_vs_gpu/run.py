"""Where do a CPU run and a GPU run part? Two classic cases, then a dump and a compare.

1. ValueNet (Linear(10,20) -> ReLU -> Linear(20,1)) on 100 inputs: the forward difference.
2. Linear(1,1) fitted by full-batch SGD to y = 3x + 5 + noise (100 samples): the fitted weight
   and bias after 1,000 and 10,000 epochs. Tiny rounding differences per step add up.
3. One ValueNet training step dumped on both sides with probe and compared.

The reference is always CPU float32. The candidate is the GPU when there is one; on a CPU-only
machine it is one of: a float64 "high-precision bench" (default), a different thread count, or
oneDNN (mkldnn) switched off -- the script prints which.

    python examples/cpu_vs_gpu/run.py                       # cuda if available, else fp64 bench
    python examples/cpu_vs_gpu/run.py --candidate threads   # CPU-only alternatives
    python examples/cpu_vs_gpu/run.py --smoke               # CI size
"""

import contextlib
import os
import sys
from dataclasses import dataclass

# Run as `python examples/cpu_vs_gpu/run.py` from anywhere: make `probe` importable
# without installing anything.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch
import torch.nn as nn
import torch.nn.functional as F

from probe import Config, PrecisionDebugger, compare
from examples._common import example_parser, print_compare_summary

SEED = 1234


class ValueNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(10, 20)
        self.relu = nn.ReLU()
        self.fc2 = nn.Linear(20, 1)

    def forward(self, x):
        return self.fc2(self.relu(self.fc1(x)))


@dataclass
class Side:
    """Where and how one side of the comparison runs."""

    name: str
    device: str
    dtype: torch.dtype
    threads: int
    mkldnn: bool
    description: str

    @contextlib.contextmanager
    def applied(self):
        threads_before, mkldnn_before = torch.get_num_threads(), torch.backends.mkldnn.enabled
        torch.set_num_threads(self.threads)
        torch.backends.mkldnn.enabled = self.mkldnn
        try:
            yield
        finally:
            torch.set_num_threads(threads_before)
            torch.backends.mkldnn.enabled = mkldnn_before

    def take(self, tensor_or_module):
        return tensor_or_module.to(device=self.device, dtype=self.dtype)


def make_sides(device, candidate):
    threads = torch.get_num_threads()
    reference = Side("cpu_fp32", "cpu", torch.float32, threads, True,
                     f"CPU float32, {threads} threads")
    if candidate == "auto":
        candidate = "cuda" if device.startswith("cuda") else "fp64"
    if candidate == "cuda":
        name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cuda"
        other = Side("cuda_fp32", device if device.startswith("cuda") else "cuda", torch.float32,
                     threads, True, f"GPU float32 ({name})")
    elif candidate == "fp64":
        other = Side("cpu_fp64", "cpu", torch.float64, threads, True,
                     "CPU float64, the high-precision bench (no GPU used)")
    elif candidate == "threads":
        other_threads = 1 if threads > 1 else 2
        other = Side(f"cpu_{other_threads}threads", "cpu", torch.float32, other_threads, True,
                     f"CPU float32, {other_threads} thread(s) instead of {threads}")
    else:
        other = Side("cpu_no_mkldnn", "cpu", torch.float32, threads, False,
                     "CPU float32 with oneDNN (mkldnn) switched off")
    return reference, other


def value_net_forward(reference, candidate):
    torch.manual_seed(SEED)
    net, x = ValueNet(), torch.randn(100, 10)
    outputs = []
    for side in (reference, candidate):
        with side.applied(), torch.no_grad():
            outputs.append(side.take(net)(side.take(x)).double().cpu())
    diff = (outputs[0] - outputs[1]).abs()
    return float(diff.max()), float(diff.mean())


def fit_line(side, epochs, x, y):
    """Full-batch SGD on Linear(1,1); returns {epoch: (weight, bias)} at the requested epochs."""
    torch.manual_seed(SEED)
    model = side.take(nn.Linear(1, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = side.take(x), side.take(y)
    wanted, fitted = set(epochs), {}
    with side.applied():
        for epoch in range(1, max(epochs) + 1):
            optimizer.zero_grad(set_to_none=True)
            F.mse_loss(model(x), y).backward()
            optimizer.step()
            if epoch in wanted:  # .item() syncs a GPU: only at the checkpoints
                fitted[epoch] = (model.weight.item(), model.bias.item())
    return fitted


def dump_value_net_step(side, dump_dir):
    torch.manual_seed(SEED)
    net = side.take(ValueNet())
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01)
    x, target = side.take(torch.randn(100, 10)), side.take(torch.randn(100, 1))
    debugger = PrecisionDebugger(Config(task="statistics", level="mix",
                                                    dump_path=dump_dir, seed=SEED, overwrite=True))
    with side.applied():
        debugger.start(net)
        optimizer.zero_grad()
        F.mse_loss(net(x), target).backward()
        optimizer.step()
        debugger.stop()
        debugger.step()
    debugger.close()  # returns once the step file is on disk


def main():
    parser = example_parser(__doc__, "cpu_vs_gpu", "epochs 100 and 1000")
    parser.add_argument("--candidate", default="auto",
                        choices=["auto", "cuda", "fp64", "threads", "mkldnn-off"],
                        help="auto = cuda when --device is cuda, else fp64")
    parser.add_argument("--epochs", type=int, nargs="+", default=[1000, 10000],
                        help="report the regression fit after these epochs")
    args = parser.parse_args()
    if args.smoke:
        args.epochs = [100, 1000]
    if args.candidate == "cuda" and not torch.cuda.is_available():
        parser.error("--candidate cuda needs a GPU; this machine has none (try fp64)")

    reference, candidate = make_sides(args.device, args.candidate)
    print(f"reference: {reference.description}")
    print(f"candidate: {candidate.description}")

    max_diff, mean_diff = value_net_forward(reference, candidate)
    print(f"\n1. ValueNet forward on 100 inputs: max |diff| {max_diff:.3e}, mean |diff| {mean_diff:.3e}")

    torch.manual_seed(0)
    x = torch.rand(100, 1) * 10
    y = 3 * x + 5 + torch.randn(100, 1)
    fits = [fit_line(side, args.epochs, x, y) for side in (reference, candidate)]
    print("\n2. Linear(1,1) SGD fit of y = 3x + 5 + noise (100 samples, lr 0.01)")
    print(f"   {'epochs':>7}  {'weight ' + reference.name:>22} {'weight ' + candidate.name:>22}"
          f"  {'|diff w|':>9}  {'|diff b|':>9}")
    for epoch in sorted(args.epochs):
        (w_ref, b_ref), (w_cand, b_cand) = fits[0][epoch], fits[1][epoch]
        print(f"   {epoch:>7}  {w_ref:>22.9f} {w_cand:>22.9f}  {abs(w_ref - w_cand):9.2e}"
              f"  {abs(b_ref - b_cand):9.2e}")

    dumps = [os.path.join(args.out, side.name) for side in (reference, candidate)]
    for side, dump_dir in zip((reference, candidate), dumps):
        dump_value_net_step(side, dump_dir)
    result = compare(*dumps)
    html = os.path.join(args.out, "report.html")
    result.write_html(html)
    print("\n3. one ValueNet training step dumped on both sides and compared")
    print_compare_summary(result, dumps, html)
    print(f"   the full report: python -m probe compare {dumps[0]} {dumps[1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
