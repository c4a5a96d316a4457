"""Throughput of ``probe compare --replay``: the numbers docs/performance.md quotes.

    python bench/replay_throughput.py                  # convnet batch 32 and TinyGPT, 3 repeats
    python bench/replay_throughput.py --repeats 1 --batch 8

Dumps one training step (task "tensor", level "api") of two example models twice, with 1 and
2 threads (the two runs part by rounding), then replays, on both sides as compare does, every
api call of the step (each call three times: exact float64, nudged float64, the recorded
dtypes; see probe/replay/execute.py). Reports calls/s and MB/s (tensor bytes read from both
dumps per second), median of the repeats, and the time ``probe.compare(replay=20)`` adds to
the compare. Prints the 1-minute load average: the numbers are only comparable at equal load.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import torch  # noqa: E402

import probe  # noqa: E402
from examples.models import SmallConvNet, TinyGPT, make_batch, train_step  # noqa: E402
from probe import PrecisionDebugger, seed_all  # noqa: E402
from probe.replay.calls import StepSource  # noqa: E402
from probe.replay.execute import replay_call  # noqa: E402
from probe.replay.ops import NotReplayable  # noqa: E402


def dump(path: str, name: str, batch: int, threads: int) -> str:
    seed_all(0)
    if name == "convnet":
        model, data = SmallConvNet(), make_batch("convnet", batch)
    else:
        model = TinyGPT(vocab=500, d_model=128, n_layers=2, n_heads=4, max_len=64)
        data = make_batch("gpt", batch, vocab=500, max_len=64)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        debugger = PrecisionDebugger({"task": "tensor", "dump_path": path, "level": "api", "step": [0]})
        debugger.start(model)
        train_step(model, torch.optim.AdamW(model.parameters(), lr=1e-3), *data)
        debugger.stop()
        debugger.step()
        debugger.close()
    finally:
        torch.set_num_threads(before)
    return path


def api_calls(step_file: str) -> list[tuple]:
    source = StepSource(step_file)
    try:
        with_kind = []
        for prefix, rows in source._calls.items():
            if source._columns[2][rows[0]] != "api":
                continue
            op = prefix.rsplit("/", 3)[1].split("#")[0]
            phase = prefix.rstrip("/").rsplit("/", 1)[1]
            with_kind.append((prefix, op, phase))
        return with_kind
    finally:
        source.close()


def replay_all(file_a: str, file_b: str, calls: list[tuple]) -> tuple[int, int, float]:
    """(calls replayed on both sides, tensor bytes read, seconds)."""
    side_a, side_b = StepSource(file_a), StepSource(file_b)
    done = 0
    start = time.perf_counter()
    try:
        for prefix, op, phase in calls:
            try:
                replay_call(side_a, prefix, "api", op, phase)
                replay_call(side_b, prefix, "api", op, phase)
                done += 1
            except NotReplayable:
                pass
        return done, side_a.bytes_read + side_b.bytes_read, time.perf_counter() - start
    finally:
        side_a.close()
        side_b.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, load average (1 min) {os.getloadavg()[0]:.2f}")
    print(f"{'model':10s} {'calls':>6s} {'MB read':>8s} {'calls/s':>8s} {'MB/s':>7s} {'compare s':>10s} {'+replay=20 s':>13s}")
    with tempfile.TemporaryDirectory() as root:
        for name in ("convnet", "gpt"):
            a = dump(os.path.join(root, name + "1"), name, args.batch, 1)
            b = dump(os.path.join(root, name + "2"), name, args.batch, 2)
            file_a, file_b = (os.path.join(path, "step0", "rank0.h5") for path in (a, b))
            calls = api_calls(file_a)
            runs = [replay_all(file_a, file_b, calls) for _ in range(args.repeats)]
            done, read = runs[0][0], runs[0][1]
            seconds = statistics.median(run[2] for run in runs)
            plain = statistics.median(_timed(lambda: probe.compare(a, b)) for _ in range(args.repeats))
            replayed = statistics.median(_timed(lambda: probe.compare(a, b, replay=20)) for _ in range(args.repeats))
            print(f"{name:10s} {done:6d} {read / 1e6:8.1f} {done / seconds:8.1f} {read / 1e6 / seconds:7.1f} "
                  f"{plain:10.2f} {replayed:13.2f}")
    print(f"load average (1 min) at the end {os.getloadavg()[0]:.2f}")


def _timed(function) -> float:
    start = time.perf_counter()
    function()
    return time.perf_counter() - start


if __name__ == "__main__":
    main()
