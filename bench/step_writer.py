"""What writing the step file costs the training thread: config writer "inline" vs "process".

    python bench/step_writer.py                          # MLP and DeepMLP, 12 rounds
    python bench/step_writer.py --models mlp,convnet,deepmlp,gpt --rounds 20
    python bench/step_writer.py --profile                # where one step file's time goes

A/B inside one process, torch.set_num_threads(1), task statistics at level api. The variants
(baseline, writer "inline", writer "process") run in blocks of --block consecutive steps,
in a new random order every round; the first step of a block is not timed, and a gc.collect()
precedes each block (as bench/dump_overhead.py does). Columns:

  step ms      median wall time of one step, start() to the return of step(): what the
               training loop waits for
  cpu ms       median CPU time of the training thread in that step (time.thread_time): the
               same without other processes' load
  amortized    wall time of the timed steps of a block plus the wait for the files still in
               flight at its end, per step: the cost when the writer process cannot keep up
               (then step() waits for the oldest step at background.MAX_IN_FLIGHT)
  ratio        over the baseline's median step

--profile times the phases of StepWriter for synthetic steps of 30, 1000 and 5000 records
(no torch) and the pickling that replaces them on the training thread.
Prints the load average before and after: the writer process needs a free core to help.
"""

from __future__ import annotations

import argparse
import gc
import os
import pickle
import random
import shutil
import statistics
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

MODELS = {"mlp": ("MLP", 32), "convnet": ("SmallConvNet", 32), "deepmlp": ("DeepMLP", 32),
          "gpt": ("TinyGPT", 8)}


def _load() -> str:
    return "load %.2f %.2f %.2f" % os.getloadavg()


class Variant:
    def __init__(self, name, model, optimizer, batch, dump_root, writer=None):
        from examples.models import train_step
        from probe.config import Config
        from probe.debugger.debugger import PrecisionDebugger

        self.name = name
        self._train = lambda: train_step(model, optimizer, *batch)
        self.model = model
        self.debugger = None
        if writer is not None:
            self.debugger = PrecisionDebugger(Config(
                dump_path=os.path.join(dump_root, name), level="api", writer=writer))
        self.wall, self.cpu, self.amortized = [], [], []

    def step(self) -> tuple[float, float]:
        debugger = self.debugger
        wall, cpu = time.perf_counter(), time.thread_time()
        if debugger is None:
            self._train()
        else:
            debugger.start(self.model)
            self._train()
            debugger.stop()
            debugger.step()
        return time.perf_counter() - wall, time.thread_time() - cpu

    def block(self, steps: int) -> None:
        gc.collect()
        self.step()  # untimed: pays for what the previous variant left behind
        begin = time.perf_counter()
        for _ in range(steps - 1):
            wall, cpu = self.step()
            self.wall.append(wall)
            self.cpu.append(cpu)
        if self.debugger is not None:
            self.debugger.wait()
        self.amortized.append((time.perf_counter() - begin) / (steps - 1))
        if self.debugger is not None:  # keep the disk small; not timed
            shutil.rmtree(self.debugger.config.dump_path, ignore_errors=True)


def bench_model(key: str, rounds: int, block: int, dump_root: str) -> list[dict]:
    import torch

    import examples.models as models

    constructor, batch_size = MODELS[key]
    torch.manual_seed(0)
    model = getattr(models, constructor)()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    batch = models.make_batch(key, batch_size, generator=torch.Generator().manual_seed(0))
    variants = [Variant("baseline", model, optimizer, batch, dump_root),
                Variant("inline", model, optimizer, batch, dump_root, writer="inline"),
                Variant("process", model, optimizer, batch, dump_root, writer="process")]
    for variant in variants:  # warm-up (and the writer process's start)
        variant.block(3)
        variant.wall.clear(), variant.cpu.clear(), variant.amortized.clear()
    order = random.Random(0)
    for _ in range(rounds):
        shuffled = list(variants)
        order.shuffle(shuffled)
        for variant in shuffled:
            variant.block(block)
    for variant in variants:
        if variant.debugger is not None:
            variant.debugger.close()
    base = statistics.median(variants[0].wall)
    return [{"model": key, "variant": v.name, "step_ms": statistics.median(v.wall) * 1e3,
             "cpu_ms": statistics.median(v.cpu) * 1e3,
             "amortized_ms": statistics.median(v.amortized) * 1e3,
             "ratio": statistics.median(v.wall) / base,
             "amortized_ratio": statistics.median(v.amortized) / base} for v in variants]


# ------------------------------------------------------------------ --profile

def synthetic_rows(count: int, sketch: int = 16) -> list[tuple]:
    """Rows shaped like a DeepMLP step's: unique keys, few distinct modules and ops."""
    nan = float("nan")
    rows = []
    for i in range(count):
        module, op = f"blocks.{i % 48}.fc", ("functional.linear", "functional.gelu", "Tensor.add")[i % 3]
        slot = ("input.0", "output.0", "param.weight")[i % 3]
        rows.append((f"{module}/{op}#{i}/forward/{slot}", i, "api", module, op, i, "forward", slot,
                     "in", "float32", "[32, 256]", "cpu", "", -1.5 + i, 2.5, 0.01 * i, 40.0 + i, 0,
                     0, 8192, "", -1, f"examples/models.py:{60 + i % 20}", "",
                     tuple(float(j + i) for j in range(sketch)) if i % 7 else None))
        if i % 11 == 0:
            rows[-1] = rows[-1][:12] + ("1e-05", nan, nan, nan, nan, 0, 0, 0, "", -1,
                                        rows[-1][22], "", None)
    return rows


def profile(repeats: int = 30) -> None:
    import h5py

    from probe.dump import layout, writer

    attrs = {name: "x" for name in writer.REQUIRED_ATTRS}
    attrs.update(schema_version=2, step=0, rank=0, world_size=1, config={"task": "statistics"},
                 seed_report={"seed": 1234}, determinism={"num_threads": 1}, run_id="0" * 16)
    timers: dict[str, float] = {}

    def timed(name, function):
        def wrapper(*args, **kwargs):
            begin = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                timers[name] = timers.get(name, 0.0) + time.perf_counter() - begin
        return wrapper

    layout.create_partial = timed("create file", layout.create_partial)
    layout.create_array = timed("datasets", layout.create_array)
    layout.set_attr = timed("attributes", layout.set_attr)
    writer.StepWriter._reserve = timed("reserve", writer.StepWriter._reserve)
    writer.StepWriter._write_records = timed("records", writer.StepWriter._write_records)
    writer.StepWriter.close = timed("close", writer.StepWriter.close)
    root = tempfile.mkdtemp(prefix="probe-writer-profile-")
    print(f"StepWriter phases, median of {repeats} files (ms); {_load()}; h5py {h5py.__version__}")
    print("| records | total | create file | datasets (28) | attributes (16) | rows to columns | "
          "flush, close, rename | pickle rows (process path) | file KiB |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    try:
        for count in (30, 1000, 5000):
            rows = synthetic_rows(count)
            samples: dict[str, list[float]] = {}
            for step in range(repeats):
                timers.clear()
                begin = time.perf_counter()
                step_writer = writer.StepWriter(root, step, 0, attrs)
                step_writer.add_rows(rows)
                path = step_writer.close({"device": "cpu"})
                total = time.perf_counter() - begin
                pickled = time.perf_counter()
                pickle.dumps(rows, protocol=pickle.HIGHEST_PROTOCOL)
                pickled = time.perf_counter() - pickled
                phases = {
                    "total": total, "create file": timers["create file"],
                    "datasets": timers["datasets"], "attributes": timers["attributes"],
                    "rows to columns": timers["records"] - timers["datasets"]
                    - timers["attributes"] - timers.get("reserve", 0.0),
                    "finish": timers["close"] - timers["records"], "pickle": pickled}
                for name, value in phases.items():
                    samples.setdefault(name, []).append(value)
                size = os.path.getsize(path)
                os.remove(path)
            cells = " | ".join(f"{statistics.median(values) * 1e3:.2f}" for values in samples.values())
            print(f"| {count} | {cells} | {size / 1024:.0f} |")
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="mlp,deepmlp", help=f"comma list of {', '.join(MODELS)}")
    parser.add_argument("--rounds", type=int, default=12, help="blocks per variant")
    parser.add_argument("--block", type=int, default=12, help="consecutive steps per block (>= 2)")
    parser.add_argument("--profile", action="store_true", help="StepWriter phases instead")
    args = parser.parse_args(argv)
    if args.profile:
        profile()
        return 0
    import torch

    torch.set_num_threads(1)
    print(f"before: {_load()}; cpus usable: {len(os.sched_getaffinity(0))}")
    dump_root = tempfile.mkdtemp(prefix="probe-writer-bench-")
    results = []
    try:
        for key in args.models.split(","):
            results += bench_model(key.strip(), args.rounds, max(args.block, 2), dump_root)
    finally:
        shutil.rmtree(dump_root, ignore_errors=True)
    print("| model | writer | step ms | ratio | cpu ms | amortized ms | amortized ratio |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for row in results:
        print(f"| {row['model']} | {row['variant']} | {row['step_ms']:.2f} | {row['ratio']:.2f}x | "
              f"{row['cpu_ms']:.2f} | {row['amortized_ms']:.2f} | {row['amortized_ratio']:.2f}x |")
    print(f"after: {_load()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
