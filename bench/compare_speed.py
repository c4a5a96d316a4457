"""Speed and memory of ``probe compare``: the numbers docs/compare-rules.md quotes.

    python bench/compare_speed.py                 # 400 MB per dump (about a minute)
    python bench/compare_speed.py --mb 100 --runs 1

Measures, each in a fresh subprocess so nothing is cached in the interpreter:

  * torch is never imported by a compare (sys.modules checked after a real compare);
  * ``probe compare --help`` wall time, median of 5 (target < 0.5 s);
  * tensor-mode throughput: two synthetic tensor dumps of --mb MB each (B = A + noise, so
    every metric is computed), written with the project's StepWriter; MB/s counts the
    tensor bytes of both dumps, read from a warm page cache: over the command's wall time,
    interpreter start and imports included (target >= 500 MB/s), and per process, over the CPU
    seconds of the compare itself, every thread counted (target >= 1000 MB/s);
  * peak memory (VmHWM of the compare process; ru_maxrss where /proc is missing) against the bound
    3 x the largest tensor pair + 300 MB, for a dump of many tensors and for a dump with
    one large tensor, at two dump sizes: the peak must not grow with the dump.

Prints a table; exit 1 if a target is missed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

MB = 1 << 20


def make_dump(path: str, tensor_mb: float, count: int, noise: float, seed: int) -> int:
    """A chain of `count` float32 tensors (op k: input = tensor k-1, output = tensor k).

    Returns the bytes of tensor data stored."""
    import numpy as np
    import torch

    from probe.dump import schema
    from probe.dump.writer import StepWriter

    elements = int(tensor_mb * MB) // 4
    rng = np.random.default_rng(seed)
    base = np.random.default_rng(0)
    attrs = {
        "probe_version": "bench", "torch_version": torch.__version__, "world_size": 1, "task": "tensor",
        "level": "api", "device": "cpu", "config": {}, "seed_report": None, "determinism": {},
        "schema_version": schema.SCHEMA_VERSION, "step": 0, "rank": 0,
    }
    writer = StepWriter(path, 0, 0, attrs, buffer_bytes=256 * MB)
    rows, stored = [], 0
    previous = None
    for k in range(count):
        values = base.standard_normal(elements, dtype=np.float32)
        if noise:
            values += rng.standard_normal(elements, dtype=np.float32) * np.float32(noise)
        tensor_id = writer.add_tensor(torch.from_numpy(values))
        stored += values.nbytes
        stats = (float(values.min()), float(values.max()), float(values.mean()), float(np.linalg.norm(values)))
        for slot, tid in (("input.0", previous), ("output.0", tensor_id)):
            if tid is None:
                continue
            rows.append((
                schema.make_key("layers.%d" % k, "functional.linear", 0, "forward", slot), k, "api",
                "layers.%d" % k, "functional.linear", 0, "forward", slot, "in" if slot.startswith("input") else "out",
                "float32", json.dumps([elements]), "cpu", "", *stats, 0, 0, elements, "", tid, "bench.py:1",
            ))
        previous = tensor_id
        del values
    writer.add_rows(rows)
    writer.close()
    return stored


_CHILD = r"""
import json, resource, sys, time
sys.path.insert(0, {repo!r})
start = time.perf_counter()
from probe.comparison.api import compare
cpu = time.process_time()
result = compare({a!r}, {b!r})
cpu = time.process_time() - cpu  # every thread of the process (the read-ahead too), imports excluded
elapsed = time.perf_counter() - start
# VmHWM, not ru_maxrss: Linux carries ru_maxrss over fork+exec from the (big) parent
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
try:
    with open("/proc/self/status") as status:
        peak = next(int(line.split()[1]) / 1024 for line in status if line.startswith("VmHWM:"))
except (OSError, StopIteration):
    pass
print(json.dumps({{"seconds": elapsed, "cpu": cpu, "verdict": result.verdict, "torch": "torch" in sys.modules,
                  "maxrss_mb": peak, "matched": result.counts["matched"]}}))
"""


def run_compare(a: str, b: str) -> dict:
    code = _CHILD.format(repo=REPO, a=a, b=b)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    if done.returncode != 0:
        raise SystemExit(f"compare failed: {done.stderr.strip()}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def help_time() -> float:
    times = []
    for _ in range(5):
        start = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "probe.cli", "compare", "--help"], capture_output=True, cwd=REPO)
        times.append(time.perf_counter() - start)
        if done.returncode != 0:
            raise SystemExit("probe compare --help failed")
    return statistics.median(times)


def cli_never_imports_torch(a: str, b: str) -> bool:
    code = (
        f"import sys; sys.path.insert(0, {REPO!r}); import probe.cli\n"
        f"try:\n    probe.cli.main(['compare', {a!r}, {b!r}, '--json'])\nexcept SystemExit:\n    pass\n"
        "sys.stderr.write(str('torch' in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    return done.stderr.strip().endswith("False")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="probe compare speed and memory")
    parser.add_argument("--mb", type=float, default=400.0, help="tensor data per dump (MB)")
    parser.add_argument("--tensor-mb", type=float, default=4.0, help="size of each tensor in the many-tensor dump")
    parser.add_argument("--runs", type=int, default=3, help="timed compares (median)")
    parser.add_argument("--keep", help="folder to keep the dumps in (default: a temporary folder)")
    args = parser.parse_args(argv)

    work = args.keep or tempfile.mkdtemp(prefix="probe-bench-")
    rows, failures = [], []

    def record(name, value, target, ok):
        rows.append((name, value, target, "ok" if ok else "MISSED"))
        if not ok:
            failures.append(name)

    try:
        count = max(2, int(args.mb / args.tensor_mb))
        small = max(2, count // 4)
        dumps = {}
        for label, n, size in (("many", count, args.tensor_mb), ("many_small", small, args.tensor_mb),
                               ("one", 1, args.mb / 2), ("one_small", 1, args.mb / 8)):
            a, b = os.path.join(work, label, "a"), os.path.join(work, label, "b")
            stored = make_dump(a, size, n, 0.0, 1) + make_dump(b, size, n, 1e-6, 2)
            dumps[label] = (a, b, stored, size)

        record("compare imports torch", "no" if cli_never_imports_torch(*dumps["many_small"][:2]) else "yes", "no",
               cli_never_imports_torch(*dumps["many_small"][:2]))
        seconds = help_time()
        record("probe compare --help, median of 5", f"{seconds:.3f} s", "< 0.5 s", seconds < 0.5)

        a, b, stored, size = dumps["many"]
        runs = [run_compare(a, b) for _ in range(args.runs)]
        best = statistics.median(r["seconds"] for r in runs)
        rate = stored / MB / best
        record(f"throughput, {stored / MB:.0f} MB of tensors ({count} x {size:g} MB per dump, A+B)",
               f"{rate:.0f} MB/s ({best:.2f} s)", ">= 500 MB/s", rate >= 500)
        cpu = statistics.median(r["cpu"] for r in runs)
        rate = stored / MB / cpu
        record("per process: the same MB over the compare's CPU seconds (imports excluded)",
               f"{rate:.0f} MB/s ({cpu:.2f} s)", ">= 1000 MB/s", rate >= 1000)
        for label in ("many_small", "many", "one_small", "one"):
            a, b, stored, size = dumps[label]
            peak = run_compare(a, b)["maxrss_mb"]
            bound = 3 * 2 * size + 300
            record(f"peak RSS, {stored / MB / 2:.0f} MB per dump, largest tensor {size:g} MB",
                   f"{peak:.0f} MB", f"< {bound:.0f} MB", peak < bound)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)

    width = max(len(r[0]) for r in rows)
    print(f"{'measure':<{width}}  {'result':>22}  {'target':>12}  status")
    for name, value, target, status in rows:
        print(f"{name:<{width}}  {value:>22}  {target:>12}  {status}")
    print(f"(machine: {os.cpu_count()} cores; warm page cache; python {sys.version.split()[0]})")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
