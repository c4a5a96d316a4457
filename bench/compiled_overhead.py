"""Cost of capturing a compiled training step: captured / plain compiled step, one process.

    python bench/compiled_overhead.py [backend] [repeats] [models] [levels]
    python bench/compiled_overhead.py inductor 30 mlp,deepmlp,gpt module,mix

For each example model (examples/models.py), compiled whole (torch.compile(model)) and, for
the GPT, per block (regional, as torchtitan does), after warm-up steps (compilation, the first
captured step), steps without capture and captured steps (task statistics: start(), the step,
stop(), step(); files written by the writer process) alternate; each number is the median
wall time of ``repeats`` steps. ratio = captured / plain; cpu ratio = the same for the
training thread's own CPU time (time.thread_time): what capture costs that thread, without
the writer process's CPU (the step files' HDF5 work) or other jobs, which land on the wall
time when no core is idle. Level module records the compiled
regions at their boundaries; level mix runs them through graph taps while captured (the
plain torch.compile's graphs compiled once more with probe's taps around the same backend),
and the steps without capture run the user's compiled graphs.
"""
import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import probe  # noqa: E402
from examples import models  # noqa: E402

_parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
_parser.add_argument("backend", nargs="?", default="inductor",
                     help="the torch.compile backend (inductor, aot_eager, eager; default inductor)")
_parser.add_argument("repeats", nargs="?", type=int, default=30, help="steps per median (default 30)")
_parser.add_argument("models", nargs="?", default="mlp,deepmlp,gpt", help="comma-separated: mlp, deepmlp, gpt")
_parser.add_argument("levels", nargs="?", default="module,mix", help="comma-separated capture levels")
_args = _parser.parse_args()
backend, repeats = _args.backend, _args.repeats
names, levels = _args.models.split(","), _args.levels.split(",")
CONSTRUCTORS = {"mlp": ("MLP", 32), "deepmlp": ("DeepMLP", 32), "gpt": ("TinyGPT", 8)}


def whole(model):
    return torch.compile(model, backend=backend)


def regional(model):
    for index, block in enumerate(model.blocks):
        model.blocks[index] = torch.compile(block, backend=backend)
    return model


def measure(name, how, level):
    torch._dynamo.reset()
    torch.manual_seed(0)
    cls, batch_size = CONSTRUCTORS[name]
    model = getattr(models, cls)()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    runnable = how(model)
    batch = models.make_batch(name, batch_size)
    debugger = probe.PrecisionDebugger({"task": "statistics", "level": level,
                                        "dump_path": tempfile.mkdtemp(prefix="probe-bench-")})

    def plain():
        models.train_step(runnable, optimizer, *batch)

    def captured():
        debugger.start(runnable)
        models.train_step(runnable, optimizer, *batch)
        debugger.stop()
        debugger.step()

    for _ in range(3):
        plain()
        captured()
    times = {"plain": [], "captured": []}
    cpu = {"plain": [], "captured": []}  # the training thread's own CPU time
    for _ in range(repeats):
        for label, step in (("plain", plain), ("captured", captured)):
            start, start_cpu = time.perf_counter(), time.thread_time()
            step()
            times[label].append(time.perf_counter() - start)
            cpu[label].append(time.thread_time() - start_cpu)
    debugger.close()
    return (statistics.median(times["plain"]), statistics.median(times["captured"]),
            statistics.median(cpu["captured"]) / statistics.median(cpu["plain"]))


print(f"torch {torch.__version__}, backend {backend}, {torch.get_num_threads()} threads, "
      f"median of {repeats} steps")
print(f"{'model':10} {'compiled':9} {'level':7} {'plain ms':>9} {'captured ms':>12} {'ratio':>6} {'cpu ratio':>9}")
for name in names:
    variants = [("whole", whole)] + ([("regional", regional)] if name == "gpt" else [])
    for label, how in variants:
        for level in levels:
            plain_s, captured_s, cpu_ratio = measure(name, how, level)
            print(f"{name:10} {label:9} {level:7} {plain_s * 1e3:9.2f} {captured_s * 1e3:12.2f} "
                  f"{captured_s / plain_s:6.2f} {cpu_ratio:9.2f}", flush=True)
