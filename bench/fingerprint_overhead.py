"""What fingerprints cost a training step: ``"fingerprint": true`` against no probe at all.

    python bench/fingerprint_overhead.py                      # four models, SGD and Adam, 15 repeats
    python bench/fingerprint_overhead.py --models mlp --optimizers adam --repeats 30
    python bench/fingerprint_overhead.py --device cuda        # on a GPU (a step's time includes its kernels)
    python bench/fingerprint_overhead.py --json

One training step = examples.models.train_step (forward, cross-entropy, backward, optimizer
step) on the benchmark models of bench/dump_overhead.py, with torch's SGD (lr 0.01: no
optimizer state) and Adam (two state tensors per parameter). Variants, all in this one
process, torch.set_num_threads(1), interleaved in short blocks in a new random order every
round (the first step of a block untimed, gc.collect() before each block), each number the
median of --repeats timed steps:

  baseline      no probe
  debugger      a PrecisionDebugger without fingerprints whose step list selects nothing
                (start()/stop()/step() around each step: the loop the fingerprints ride on)
  fingerprint   the same debugger with "fingerprint": true: every optimizer step's statistics
                and sketches of every parameter, gradient and state tensor, written to the
                fingerprint file (one append and flush per step)

Columns: baseline ms, the two ratios to baseline, cpu (fingerprint / baseline in the training
thread's own CPU time, time.thread_time: insensitive to other jobs on the machine), tensors per step, bytes per step (the rows
a step adds, schema.row_bytes) and file/step (the file's size over its steps: HDF5 allocates
chunks of 256 rows ahead, so this falls to bytes/step as a run grows). Target (the issue): fingerprint <= 1.05x.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

MODELS = {  # as bench/dump_overhead.py
    "mlp": ("MLP", 32, "MLP 256-512-10 (batch 32)"),
    "convnet": ("SmallConvNet", 32, "SmallConvNet (batch 32)"),
    "deepmlp": ("DeepMLP", 32, "DeepMLP 48 blocks (batch 32)"),
    "gpt": ("TinyGPT", 8, "TinyGPT (batch 8)"),
}


class Variant:
    """One way of running a step, with a model and optimizer of its own: the fingerprints'
    optimizer hook sees every optimizer of the process, so variants must not share one."""

    def __init__(self, name, make, batch, folder, config=None, synchronize=None):
        from examples.models import train_step
        from probe import PrecisionDebugger

        self.name = name
        if config is not None:  # first: the debugger seeds, as in a user's script
            self.debugger = PrecisionDebugger(dict(config, dump_path=os.path.join(folder, name), overwrite=True,
                                                   step=[10 ** 9]))
        model, optimizer = make()
        self._train = lambda: train_step(model, optimizer, *batch)
        self._sync = synchronize or (lambda: None)
        self.model = model
        if config is None:
            self.debugger = None
        else:  # the debugger knows its model before any variant's optimizer steps
            self.debugger.start(model)
            self.debugger.stop()

    def run(self) -> tuple[float, float]:
        """(wall seconds, the training thread's CPU seconds) of one step."""
        debugger = self.debugger
        start, start_cpu = time.perf_counter(), time.thread_time()
        if debugger is not None:
            debugger.start(self.model)
            self._train()
            debugger.stop()
            debugger.step()
        else:
            self._train()
        self._sync()
        return time.perf_counter() - start, time.thread_time() - start_cpu


def bench(key: str, optimizer_name: str, repeats: int, root: str, device: str) -> dict:
    import torch

    import examples.models as models

    constructor, batch_size, label = MODELS[key]

    def make():
        torch.manual_seed(0)
        model = getattr(models, constructor)().to(device)
        if optimizer_name == "adam":
            return model, torch.optim.Adam(model.parameters(), lr=1e-4)
        return model, torch.optim.SGD(model.parameters(), lr=0.01)

    batch = models.make_batch(key, batch_size, generator=torch.Generator().manual_seed(0), device=device)
    sync = torch.cuda.synchronize if device == "cuda" else None
    folder = os.path.join(root, f"{key}_{optimizer_name}")
    variants = [Variant("baseline", make, batch, folder, synchronize=sync),
                Variant("debugger", make, batch, folder, config={}, synchronize=sync),
                Variant("fingerprint", make, batch, folder, config={"fingerprint": True}, synchronize=sync)]
    times = {variant.name: [] for variant in variants}
    cpu = {variant.name: [] for variant in variants}
    for _ in range(2):
        for variant in variants:
            variant.run()
    block = 4 if variants[0].run()[0] < 0.05 else 2
    order = random.Random(0)
    for _ in range(-(-repeats // (block - 1))):
        shuffled = list(variants)
        order.shuffle(shuffled)
        for variant in shuffled:
            gc.collect()
            variant.run()
            for _ in range(block - 1):
                wall, thread = variant.run()
                times[variant.name].append(wall)
                cpu[variant.name].append(thread)
    fingerprinted = variants[2].debugger
    steps = fingerprinted.current_step
    fingerprinted.close()
    variants[1].debugger.close()
    from probe.fingerprint import schema

    recorder = fingerprinted.fingerprints.recorder
    path = recorder.path
    base = statistics.median(times["baseline"])
    return {"model": key, "optimizer": optimizer_name, "label": label, "device": device,
            "baseline_ms": base * 1e3,
            "debugger": statistics.median(times["debugger"]) / base,
            "fingerprint": statistics.median(times["fingerprint"]) / base,
            "fingerprint_cpu": statistics.median(cpu["fingerprint"]) / statistics.median(cpu["baseline"]),
            "tensors": len(recorder.described),
            "bytes_per_step": (len(recorder.described) + 1) * schema.row_bytes(recorder.k),
            "file_bytes_per_step": os.path.getsize(path) / max(steps, 1), "steps": steps, "repeats": repeats}


def table(results: list[dict]) -> str:
    lines = [f"{'model':<30} {'optimizer':<9} {'baseline ms':>11} {'debugger':>9} {'fingerprint':>11} "
             f"{'cpu':>7} {'tensors':>8} {'bytes/step':>10} {'file/step':>10}"]
    for r in results:
        lines.append(f"{r['label']:<30} {r['optimizer']:<9} {r['baseline_ms']:>11.2f} {r['debugger']:>8.3f}x "
                     f"{r['fingerprint']:>10.3f}x {r['fingerprint_cpu']:>6.3f}x {r['tensors']:>8} {r['bytes_per_step']:>10.0f} "
                     f"{r['file_bytes_per_step']:>10.0f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--optimizers", default="sgd,adam")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", action="store_true")
    options = parser.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    root = tempfile.mkdtemp(prefix="probe-fingerprint-bench-")
    try:
        results = [bench(key, name, options.repeats, root, options.device)
                   for key in options.models.split(",") for name in options.optimizers.split(",")]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(results, indent=2) if options.json else table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
