"""The smallest weight scaling probe compare finds, at float32 and bfloat16, on two models.

Run A is a plain training step; run B computes with another device's rounding
(probe.perturb.other_rounding: every matmul, linear, sum and mean summed in another order) and
has one weight scaled by 1 + s. For each s the compare is run twice: with the fixed tolerances
alone (--strict) and with the rounding envelopes (the default). "found" means the likely cause
is the op that reads the scaled weight, introduced there; the clean pair (s = 0) must pass.
Prints one table row per model, dtype, task and rule: the smallest s found.

    PYTHONPATH=$PWD python bench/detection_limit.py [--task statistics] [--task tensor]

(docs/compare-rules.md, "Detection limit", holds the numbers.)
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

import probe
from tests.rounding_pairs import DeepStack, run, stack_batch
from tests.verdict_models import TinyAttention, tokens

SCALES = (1e-2, 3e-3, 1e-3, 3e-4, 1e-4, 3e-5, 1e-5, 3e-6, 1e-6, 3e-7)
MODELS = {
    # name: (build, batch, the module whose weight is scaled, its op)
    "DeepStack (8 x LayerNorm-Linear-GELU, width 64)": (DeepStack, stack_batch, "blocks.5.fc", "functional.linear"),
    "TinyAttention (embedding, attention, MLP, width 32)": (lambda: TinyAttention(attn="eager"), tokens, "up",
                                                           "functional.linear"),
}


def scaled(module: str, factor: float):
    def fault(model):
        with torch.no_grad():
            model.get_submodule(module).weight.mul_(factor)
    return fault


def found(result, module: str, op: str) -> bool:
    cause = result.likely_cause
    return cause is not None and (cause.module, cause.op, cause.origin) == (module, op, "introduced")


def smallest(folder: Path, build, batch, module, op, dtype, task) -> tuple:
    a = run(folder / "a", build, batch, steps=1, task=task, dtype=dtype)
    clean = run(folder / "clean", build, batch, steps=1, task=task, dtype=dtype, perturb=True)
    clean_ok = {strict: probe.compare(a, clean, strict=strict).verdict == "pass" for strict in (True, False)}
    best = {True: None, False: None}
    for scale in SCALES:
        b = run(folder / f"s{scale:g}", build, batch, steps=1, task=task, dtype=dtype, perturb=True,
                fault=scaled(module, 1 + scale))
        for strict in (True, False):
            if found(probe.compare(a, b, strict=strict), module, op):
                best[strict] = scale
    return best, clean_ok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", action="append", choices=("statistics", "tensor"))
    tasks = parser.parse_args().task or ["statistics", "tensor"]
    print("| model | dtype | task | fixed tolerance (--strict) | rounding envelope | clean pair passes |")
    print("| --- | --- | --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory() as tmp:
        for name, (build, batch, module, op) in MODELS.items():
            for dtype in (torch.float32, torch.bfloat16):
                for task in tasks:
                    folder = Path(tmp) / f"{len(list(Path(tmp).iterdir()))}"
                    best, clean = smallest(folder, build, batch, module, op, dtype, task)
                    show = {strict: (f"{best[strict]:g}" if best[strict] is not None else "not found")
                            for strict in (True, False)}
                    print(f"| {name} | {str(dtype).removeprefix('torch.')} | {task} | {show[True]} | {show[False]} | "
                          f"{'yes' if clean[False] else 'NO'} (strict: {'yes' if clean[True] else 'NO'}) |")


if __name__ == "__main__":
    main()
