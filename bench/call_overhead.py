"""Per-call capture cost of two probe source trees, A/B in one process.

    git archive main | tar -x -C /tmp/probe-main
    python bench/call_overhead.py /tmp/probe-main . deepmlp,mlp api stub 12

Both trees' probe packages are imported into this one process (each under its own module
objects) and run on the same model, interleaved in blocks of 3 steps in a random order per
round (the first step of a block untimed, gc.collect() before each block), timed with
time.thread_time(); each number is a median. "stub" replaces the CPU statistics and sketch
(stats.host_stats_and_sketch) by a constant, so what is left is the per-call path: the
mode, names, records, the statistics cache, source lines, backward hooks. "real" keeps them.
A captured step is start(model), the training step, stop(); the step file is not written.
us/call = (captured - plain) / captured calls.
"""
import gc
import importlib
import os
import random
import statistics
import sys
import tempfile
import time

import torch

base_dir, branch_dir = os.path.abspath(sys.argv[1]), os.path.abspath(sys.argv[2])
names, level, mode, rounds = sys.argv[3].split(","), sys.argv[4], sys.argv[5], int(sys.argv[6])
stub = mode == "stub"
_Z = ((0.0, 0.0, 0.0, 0.0, 0, 0), None)
def load(path):
    for k in [k for k in sys.modules if k == "probe" or k.startswith("probe.") or k == "examples" or k.startswith("examples.")]:
        del sys.modules[k]
    sys.path.insert(0, path)
    mods = {}
    mods["Config"] = importlib.import_module("probe.config").Config
    mods["Debugger"] = importlib.import_module("probe.debugger").PrecisionDebugger
    rec = importlib.import_module("probe.capture.recorder")
    importlib.import_module("probe.capture.api_mode"); importlib.import_module("probe.capture.module_hooks")
    importlib.import_module("probe.capture.values"); importlib.import_module("probe.dump.writer")
    if stub:
        rec.host_stats_and_sketch = lambda t, k: _Z
    mods["models"] = importlib.import_module("examples.models")
    sys.path.remove(path)
    return mods
A = load(base_dir)
B = load(branch_dir)
models = B["models"]
torch.set_num_threads(1)
ctor = {"mlp": ("MLP", 32), "convnet": ("SmallConvNet", 32), "deepmlp": ("DeepMLP", 32), "gpt": ("TinyGPT", 8)}
for name in names:
    torch.manual_seed(0)
    cls, bs = ctor[name]
    model = getattr(models, cls)()
    batch = models.make_batch(name, bs)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    dbgs = {v: m["Debugger"](m["Config"](dump_path=tempfile.mkdtemp(), level=level, sketch_size=0 if stub else 16)) for v, m in (("base", A), ("branch", B))}
    calls = {}
    def run(v):
        if v == "plain":
            models.train_step(model, opt, *batch); return
        d = dbgs[v]
        d.start(model); models.train_step(model, opt, *batch); d.stop()
        r = d._recorder; calls[v] = r.calls; r.rows = []; r.calls = 0; r.end_step()
    vs = ["plain", "base", "branch"]
    for _ in range(2):
        for v in vs: run(v)
    times = {v: [] for v in vs}
    for _ in range(rounds):
        random.shuffle(vs)
        for v in vs:
            gc.collect()
            for i in range(3):
                t = time.thread_time(); run(v); dt = time.thread_time() - t
                if i: times[v].append(dt)
    p = statistics.median(times["plain"]) * 1e3
    out = [f"{name:8s} {level:6s} {mode}: plain {p:7.2f} ms"]
    for v in ("base", "branch"):
        c = statistics.median(times[v]) * 1e3
        out.append(f"{v} {c:7.2f} ms {c/p:5.2f}x {(c-p)*1e3/calls[v]:6.1f} us/call")
    print(" | ".join(out), f"| calls {calls['branch']} load {os.getloadavg()[0]:.2f}", flush=True)
