"""Per-call capture cost of two probe source trees, A/B in one process.

    git archive main | tar -x -C /tmp/probe-main
    python bench/call_overhead.py /tmp/probe-main . deepmlp,mlp api stub 12

Both trees' probe packages are imported whole into this one process (each under its own
module objects, swapped into sys.modules before that tree runs, so that a lazy import inside
a function finds its own tree's module) and run on the same model, interleaved in blocks of 3 steps in a random order per
round (the first step of a block untimed, gc.collect() before each block), timed with
time.thread_time(); each number is a median. "stub" replaces the CPU statistics and sketch
of tensors computed alone (recorder.host_stats_and_sketch) by a constant; small float
tensors still go through the host batch. What is left is mostly the per-call path: the
mode, names, records, the statistics cache, source lines, backward hooks. "real" keeps them.
A captured step is start(model), the training step, stop(); the step file is not written.
us/call = (captured - plain) / captured calls.
"""
import gc
import importlib
import os
import pkgutil
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
_OURS = ("probe", "examples")
#: never imported eagerly: running it is the CLI, or it is a start-up hook of another process
_SKIP = (".__main__", ".bootstrap")


def _ours(name):
    return name.split(".", 1)[0] in _OURS


def load(path):
    """Every module of the tree at path, imported now: {name: module}.

    Code imports lazily (``from probe.dump.writer import make_folder`` inside a function),
    and such an import reads sys.modules at call time. Each tree's snapshot is therefore
    complete, and use(tree) puts it in sys.modules before the tree runs."""
    for k in [k for k in sys.modules if _ours(k)]:
        del sys.modules[k]
    sys.path.insert(0, path)
    try:
        importlib.import_module("examples.models")
        package = importlib.import_module("probe")
        for info in pkgutil.walk_packages(package.__path__, "probe.", onerror=lambda name: None):
            if info.name.endswith(_SKIP) or any(part + "." in info.name for part in _SKIP):
                continue
            try:
                importlib.import_module(info.name)
            except ImportError:  # an optional dependency this venv lacks (transformers, ...)
                pass
    finally:
        sys.path.remove(path)
    modules = {k: m for k, m in sys.modules.items() if _ours(k)}
    for k in modules:
        del sys.modules[k]
    outside = [k for k, m in modules.items()
               if getattr(m, "__file__", None) and not os.path.abspath(m.__file__).startswith(path + os.sep)]
    if outside:
        raise SystemExit(f"{path}: modules loaded from elsewhere: {outside[:5]}")
    if stub:
        modules["probe.capture.recorder"].host_stats_and_sketch = lambda t, k: _Z
    return modules


def use(modules):
    """Make sys.modules hold this tree's modules, and none of the other tree's."""
    for k in [k for k in sys.modules if _ours(k) and k not in modules]:
        del sys.modules[k]
    sys.modules.update(modules)


def lazy_import_check(modules, path):
    """A lazy import inside a tree's code resolves to that tree."""
    use(modules)
    found = importlib.import_module("probe.dump.writer").__file__
    if not os.path.abspath(found).startswith(path + os.sep):
        raise SystemExit(f"lazy import of probe.dump.writer gave {found}, not {path}")
    return found


A = load(base_dir)
B = load(branch_dir)
for tree, path in ((A, base_dir), (B, branch_dir)):
    print("lazy imports resolve to", os.path.relpath(lazy_import_check(tree, path)), flush=True)
models = B["examples.models"]
cls_of = {tree_name: (m["probe.config"].Config, m["probe.debugger.debugger"].PrecisionDebugger)
          for tree_name, m in (("base", A), ("branch", B))}
trees = {"base": A, "branch": B}
torch.set_num_threads(1)
ctor = {"mlp": ("MLP", 32), "convnet": ("SmallConvNet", 32), "deepmlp": ("DeepMLP", 32), "gpt": ("TinyGPT", 8)}
for name in names:
    torch.manual_seed(0)
    cls, bs = ctor[name]
    model = getattr(models, cls)()
    batch = models.make_batch(name, bs)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    dbgs = {}
    for v, (config, debugger) in cls_of.items():
        use(trees[v])
        dbgs[v] = debugger(config(dump_path=tempfile.mkdtemp(), level=level, sketch_size=0 if stub else 16))
    calls = {}
    def run(v):
        if v == "plain":
            models.train_step(model, opt, *batch); return
        d = dbgs[v]
        d.start(model); models.train_step(model, opt, *batch); d.stop()
        r = d._recorder; calls[v] = r.calls; r.rows = []; r.calls = 0; r.end_step()
    vs = ["plain", "base", "branch"]
    for _ in range(2):
        for v in vs:
            if v != "plain":
                use(trees[v])
            run(v)
    times = {v: [] for v in vs}
    for _ in range(rounds):
        random.shuffle(vs)
        for v in vs:
            if v != "plain":
                use(trees[v])  # outside the timed steps
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
