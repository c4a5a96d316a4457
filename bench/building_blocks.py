"""The multi-tensor building blocks a device bucket could use, measured before trusting them.

    python bench/building_blocks.py                 # on the CPU: ops, host reads, agreement
    python bench/building_blocks.py --device cuda   # on a GPU: also kernels per call

For each block, on a list of tensors like a bucket's (mixed sizes, one non-contiguous):
  ops        aten ops dispatched (bench/launch_count.py; the ones that launch a kernel)
  reads      ops that read a device number on the host (a wait for the device)
  kernels    with --device cuda: CUDA kernels of one call (torch.profiler), for 8, 110, 111,
             128, 770 and 1000 tensors (one launch covers how many?)
  error      largest |block - float64 reference| / max(|reference|, 1) over the tensors

The blocks: torch._foreach_norm with ord 1, 2 and inf and dtype=float64; torch._foreach_max;
min as -max(-x); the sum as 2 * ||max(x, 0)||_1 - ||x||_1 in float64; torch.cat of the flat
tensors; torch.segment_reduce over the rows of a padded arena with unsafe=True and without.
What the device bucket uses (device_bucket.py): one cat into a float64 arena, per-row
reductions and three segment_reduce calls with unsafe=True.
"""

from __future__ import annotations

import argparse
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

import torch  # noqa: E402

from bench import launch_count  # noqa: E402

F64 = torch.float64


def _tensors(count: int, device: str) -> list:
    generator = torch.Generator().manual_seed(0)
    sizes = [3, 251, 4016, 4017, 65_536, 1000]
    found = [torch.randn(sizes[i % len(sizes)], generator=generator) for i in range(count)]
    found[0] = torch.randn(64, 48, generator=generator).t()  # not contiguous
    return [t.to(device) for t in found]


def blocks(compat) -> dict:
    """name -> (function of a tensor list -> per-tensor float64 values, reference per tensor)."""
    def norms(order):
        return (lambda ts: torch.stack(list(compat.foreach_norm(ts, order, F64))),
                lambda t: torch.linalg.vector_norm(t.double(), order))
    return {
        "_foreach_norm ord 1": norms(1),
        "_foreach_norm ord 2": norms(2),
        "_foreach_norm ord inf": norms(float("inf")),
        "_foreach_max": (lambda ts: torch.stack(list(torch._foreach_max(ts))).double(),
                         lambda t: t.double().max()),
        "min as -max(-x)": (lambda ts: -torch.stack(list(torch._foreach_max(torch._foreach_neg(ts)))).double(),
                            lambda t: t.double().min()),
        "sum as 2 norm1(max(x, 0)) - norm1(x)": (
            lambda ts: 2 * torch.stack(list(compat.foreach_norm(torch._foreach_clamp_min(ts, 0.0), 1, F64)))
            - torch.stack(list(compat.foreach_norm(ts, 1, F64))),
            lambda t: t.double().sum()),
        "cat of the flat tensors": (lambda ts: torch.cat([t.reshape(-1) for t in ts]).double()[:len(ts)],
                                    None),
        "segment_reduce, unsafe=True": (lambda ts: _segment_sums(ts, True), lambda t: t.double().sum()),
        "segment_reduce, unsafe=False": (lambda ts: _segment_sums(ts, False), lambda t: t.double().sum()),
    }


_arenas: dict = {}


def _segment_sums(tensors: list, unsafe: bool) -> torch.Tensor:
    """Per-tensor sums of the row sums of a zero-padded float64 arena (rows of 4016 values,
    made once per tensor list: only segment_reduce is the block)."""
    found = _arenas.get(id(tensors))
    if found is None:
        span = 4016
        counts = [-(-t.numel() // span) for t in tensors]
        pieces = []
        for tensor, count in zip(tensors, counts):
            pieces += [tensor.reshape(-1).double(),
                       tensor.new_zeros(count * span - tensor.numel(), dtype=F64)]
        rows = torch.cat(pieces).view(-1, span).sum(1)
        found = _arenas[id(tensors)] = (tensors, rows, torch.tensor(counts, device=rows.device))
    _, rows, lengths = found
    return torch.segment_reduce(rows, "sum", lengths=lengths, axis=0, unsafe=unsafe)


def _kernels(function, tensors) -> int:
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    function(tensors)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        function(tensors)
        torch.cuda.synchronize()
    return sum(1 for event in prof.events() if event.device_type == DeviceType.CUDA)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device here")
    from probe import compat

    torch.set_num_threads(1)
    tensors = _tensors(12, args.device)
    counts = (8, 110, 111, 128, 770, 1000)
    header = "| block | ops | reads | error |" + ("".join(f" kernels ({n}) |" for n in counts)
                                                  if args.device == "cuda" else "")
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    for name, (function, reference) in blocks(compat).items():
        try:
            got = function(tensors)  # first: what a block prepares once is not counted
            counter = launch_count.count(lambda: function(tensors))
        except (RuntimeError, TypeError, AttributeError) as error:
            print(f"| {name} | - | - | fails: {str(error).splitlines()[0][:80]} |")
            continue
        error = "-"
        if reference is not None:
            worst = 0.0
            for value, tensor in zip(got.tolist(), tensors):
                want = float(reference(tensor))
                worst = max(worst, abs(value - want) / max(abs(want), 1.0))
            error = f"{worst:.1e}"
        row = f"| {name} | {counter.total} | {counter.host_reads} | {error} |"
        if args.device == "cuda":
            row += "".join(f" {_kernels(function, _tensors(n, 'cuda'))} |" for n in counts)
        print(row)
    print(f"\ntorch {torch.__version__}, device {args.device}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
