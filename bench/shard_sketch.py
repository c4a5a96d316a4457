"""What sketching a DTensor shard at its logical positions costs, against the plain sketch of
a tensor of the same size: the numbers probe/capture/numbers/shard_sketch.py is chosen by.

    python bench/shard_sketch.py              # about 2 s
    python bench/shard_sketch.py --repeats 15 --threads 2

One process, one thread by default, median of --repeats, CPU tensors of float32 (the host
path: the shard's sketch as packed bytes). Each layout is one shard of about 1M values of a
logical tensor split as named (the last one small: the per-call cost). Columns: "plain" the
plain sketch of the shard's values (capture's own sketch of any tensor); "first" the
shard's first sketch (the per-layout tables are made then); "shard" a later one (a
parameter's shard is recorded every step); ratio = shard / plain; "record" what capture's
statistics and sketch of the shard cost together (host_stats_and_sketch), the cost the
shard sketch adds to.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from probe.capture.numbers import shard_sketch as shards  # noqa: E402
from probe.capture.numbers.sketch import host_sketch  # noqa: E402
from probe.capture.numbers.stats import host_stats_and_sketch  # noqa: E402

#: (name, logical shape, local shape, offset)
LAYOUTS = [
    ("rows: Shard(0) of 2048x1024 / 2", (2048, 1024), (1024, 1024), (1024, 0)),
    ("columns: Shard(1) of 1024x2048 / 2", (1024, 2048), (1024, 1024), (0, 1024)),
    ("columns: Shard(1) of 4096x512 / 2", (4096, 512), (4096, 256), (0, 256)),
    ("columns: Shard(1) of 256x8000 / 2", (256, 8000), (256, 4000), (0, 4000)),
    ("columns: Shard(1) of 128x16384 / 2", (128, 16384), (128, 8192), (0, 8192)),
    ("block: S(0) x S(1) of 2048x2048 / 2x2", (2048, 2048), (1024, 1024), (1024, 1024)),
    ("block: Shard(1) of 1000x3000 / 3", (1000, 3000), (1000, 1000), (0, 2000)),
    ("3-D: Shard(1) of 4x512x1024 / 2", (4, 512, 1024), (4, 256, 1024), (0, 256, 0)),
    ("small: Shard(1) of 64x64 / 2", (64, 64), (64, 32), (0, 32)),
]


def timed_ms(work, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--k", type=int, default=16, help="sketch size (the config default)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"{'layout':40} {'numel':>8} {'plain ms':>9} {'first ms':>9} {'shard ms':>9} {'ratio':>6}"
          f" {'record ms':>10}"
          f"   (float32, {args.threads} thread(s), median of {args.repeats}, k={args.k})")
    for name, whole, shape, offset in LAYOUTS:
        local = torch.randn(*shape)
        placement = json.dumps({"placements": ["S(0)"], "shape": list(whole), "offset": list(offset)})
        layout = shards.shard_layout(placement, shape)
        start = time.perf_counter()
        shards.shard_sketch(local, layout, args.k)
        first = (time.perf_counter() - start) * 1e3
        plain = timed_ms(lambda: host_sketch(local, args.k), args.repeats)
        shard = timed_ms(lambda: shards.shard_sketch(local, layout, args.k), args.repeats)
        record = timed_ms(lambda: host_stats_and_sketch(local, args.k), args.repeats)
        print(f"{name:40} {local.numel():>8} {plain:>9.3f} {first:>9.3f} {shard:>9.3f} {shard / plain:>6.1f}"
              f" {record:>10.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
