"""``probe compare`` at the scale of a job: time and peak memory against the number of rank files.

    python bench/compare_scale.py                       # 1, 16 and 128 rank files, --jobs 1 and 2
    python bench/compare_scale.py --ranks 1 16 128 1024 --jobs 1 2 4

Two one-step statistics dumps of a 16-block LayerNorm/Linear stack (level mix), B with one
weight nudged by 0.1%, are made once; each dump of N rank files is N hard links of those
files (a rank file is a rank file; what differs between real ranks costs the same). Each
``probe compare A B --json --jobs J`` runs in a fresh process; the table gives per row:

  * wall: seconds, the command's whole life (import, plan, compare, report);
  * cpu: user + system seconds of the command and its worker processes (wait4);
  * rec/s/cpu: records compared per CPU second (the per-process speed);
  * peak MB: the most resident memory of the command and its workers together (sampled
    every 20 ms from /proc: a peak shorter than that can be missed), and the largest peak of
    one process (VmHWM; ru_maxrss would count the bench process the command was forked from);
  * x1: peak over the one-rank figure of the same --jobs (flat memory: <= 1.5).

The same report from every --jobs is checked (the JSON byte for byte). Prints the table.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from tests import rounding_pairs as P  # noqa: E402 (the runs, and rank files as hard links)


def make_runs(root: str) -> tuple[str, str]:
    import torch

    def nudge(model):
        with torch.no_grad():
            next(model.parameters()).mul_(1.001)

    def build():
        return P.DeepStack(depth=16)

    return (P.run(os.path.join(root, "a1"), build=build, steps=1, task="statistics"),
            P.run(os.path.join(root, "b1"), build=build, steps=1, task="statistics", fault=nudge))


def _tree_memory(pid: int, largest: dict) -> int:
    """Resident bytes of pid and every process under it now (0 once it is gone); largest:
    pid -> its peak resident bytes so far (VmHWM), updated."""
    total, todo = 0, [pid]
    while todo:
        current = todo.pop()
        try:
            with open(f"/proc/{current}/status", encoding="ascii") as handle:
                fields = dict(line.split(":", 1) for line in handle if ":" in line)
            with open(f"/proc/{current}/task/{current}/children", encoding="ascii") as handle:
                todo += [int(child) for child in handle.read().split()]
        except (OSError, ValueError):
            continue
        if "VmRSS" not in fields:  # a process that has ended, not yet waited for
            continue
        total += int(fields["VmRSS"].split()[0]) * 1024
        largest[current] = int(fields["VmHWM"].split()[0]) * 1024
    return total


def run(a: str, b: str, jobs: int) -> dict:
    """One ``probe compare --json --jobs`` in a fresh process: its figures and its stdout."""
    import subprocess

    out = tempfile.TemporaryFile()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    start = time.perf_counter()
    process = subprocess.Popen([sys.executable, "-m", "probe", "compare", a, b, "--json", "--jobs", str(jobs)],
                               stdout=out, stderr=subprocess.DEVNULL, env=env, cwd=REPO)
    peak, largest = 0, {}
    while True:
        done, status, usage = os.wait4(process.pid, os.WNOHANG)
        if done:
            break
        peak = max(peak, _tree_memory(process.pid, largest))
        time.sleep(0.02)
    wall = time.perf_counter() - start
    process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode not in (0, 1):
        raise SystemExit(f"probe compare --jobs {jobs} failed with exit code {process.returncode}")
    out.seek(0)
    report = out.read()
    import json

    counts = json.loads(report)["counts"]
    records = counts["matched"] + counts["only_a"] + counts["only_b"]
    return {"wall": wall, "cpu": usage.ru_utime + usage.ru_stime, "records": records, "report": report,
            "peak": peak, "largest": max(largest.values(), default=0)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 16, 128])
    parser.add_argument("--jobs", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args()
    root = tempfile.mkdtemp(prefix="compare_scale_")
    try:
        one_a, one_b = make_runs(root)
        print(f"load: {os.getloadavg()[0]:.2f} (1 min), {len(os.sched_getaffinity(0))} cores")
        print(f"{'ranks':>6} {'jobs':>4} {'records':>9} {'wall s':>8} {'cpu s':>8} {'rec/s/cpu':>10} "
              f"{'peak MB':>8} {'largest MB':>10} {'x1':>5}")
        first: dict = {}
        for ranks in args.ranks:
            a = P.rank_files(one_a, os.path.join(root, f"a{ranks}x"), ranks)
            b = P.rank_files(one_b, os.path.join(root, f"b{ranks}x"), ranks)
            reports = set()
            for jobs in args.jobs:
                found = run(a, b, jobs)
                reports.add(found["report"])
                first.setdefault(jobs, found["peak"])
                print(f"{ranks:>6} {jobs:>4} {found['records']:>9,} {found['wall']:>8.2f} {found['cpu']:>8.2f} "
                      f"{found['records'] / found['cpu']:>10,.0f} {found['peak'] / 2**20:>8.0f} "
                      f"{found['largest'] / 2**20:>10.0f} {found['peak'] / first[jobs]:>5.2f}", flush=True)
            if len(reports) != 1:
                raise SystemExit(f"{ranks} rank files: the --jobs {args.jobs} reports differ")
            shutil.rmtree(a)
            shutil.rmtree(b)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
