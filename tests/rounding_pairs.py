"""Pairs of runs that differ only in rounding (another thread count, other_rounding()'s
reductions summed in another order) and the same pairs with a real fault in run B: the
envelope tests (tests/test_envelope_verdicts.py) and bench/detection_limit.py use them."""

from __future__ import annotations

import contextlib
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

from probe.config import from_dict
from probe.debugger import PrecisionDebugger
from probe.perturb import other_rounding


class DeepStack(nn.Module):
    """`depth` pre-norm blocks of LayerNorm -> Linear -> GELU with a residual, then a head."""

    def __init__(self, depth=8, width=64, classes=8, eps=1e-5, approximate="none", softmax_dtype=torch.float32):
        super().__init__()
        self.softmax_dtype = softmax_dtype  # the head's softmax: the fault computes it in bfloat16
        self.blocks = nn.ModuleList(nn.ModuleDict({"ln": nn.LayerNorm(width, eps=eps), "fc": nn.Linear(width, width)})
                                    for _ in range(depth))
        self.head = nn.Linear(width, classes)
        self.approximate = approximate

    def forward(self, x):
        for block in self.blocks:
            x = x + F.gelu(block["fc"](block["ln"](x)), approximate=self.approximate)
        logits = self.head(x)
        return torch.log(torch.softmax(logits.to(self.softmax_dtype), dim=-1).float())


def stack_batch(size=32, width=64, classes=8):
    g = torch.Generator().manual_seed(0)
    return torch.randn(size, width, generator=g), torch.randint(0, classes, (size,), generator=g)


def run(path, build=DeepStack, batch=stack_batch, *, steps=3, task="tensor", level="mix", perturb=False,
        fault=None, autocast=None, threads=None, lr=1e-3, dtype=None, loss=None):
    """Train build() with AdamW for `steps` steps under the debugger, one dump per step;
    perturb: under other_rounding() (another device's summation order); fault(model) before the
    first step; autocast: a dtype to run the forward under; dtype: the model's and data's dtype;
    loss(model, x, y): the loss (default: cross entropy of model(x), NLL for DeepStack)."""
    torch.manual_seed(0)
    model = build()
    if dtype is not None:
        model.to(dtype)
    if fault is not None:
        fault(model)
    x, y = batch()
    if dtype is not None and x.is_floating_point():
        x = x.to(dtype)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    debugger = PrecisionDebugger(from_dict({"task": task, "level": level, "dump_path": str(path), "seed": 1,
                                            "step": list(range(steps))}))
    before = torch.get_num_threads()
    try:
        if threads is not None:
            torch.set_num_threads(threads)
        with other_rounding() if perturb else contextlib.nullcontext():
            for _ in range(steps):
                debugger.start(model)
                optimizer.zero_grad()
                with torch.autocast("cpu", dtype=autocast) if autocast else contextlib.nullcontext():
                    value = (loss or _default_loss)(model, x, y)
                value.backward()
                optimizer.step()
                debugger.stop()
                debugger.step()
    finally:
        torch.set_num_threads(before)
        debugger.close()
    return str(path)


def _default_loss(model, x, y):
    out = model(x).float()
    return F.nll_loss(out, y) if isinstance(model, DeepStack) else F.cross_entropy(out, y)


def scale_mlp_gradient(layer=0, factor=1.003):
    """A hook that scales the gradient of one transformers decoder layer's MLP output."""
    def fault(model):
        def hook(module, inputs, output):
            if output.requires_grad:
                output.register_hook(lambda grad: grad * factor)
        model.model.layers[layer].mlp.register_forward_hook(hook)
    return fault


def eps_in_block(index, eps=1e-3):
    def fault(model):
        model.blocks[index]["ln"].eps = eps
    return fault


def scale_weight(index, factor=1.001):
    def fault(model):
        with torch.no_grad():
            model.blocks[index]["fc"].weight.mul_(factor)
    return fault


def tanh_gelu(model):
    model.approximate = "tanh"


def softmax_in_bf16(model):
    model.softmax_dtype = torch.bfloat16


def rank_files(one_rank: str, folder: str, ranks: int) -> str:
    """A dump of `ranks` rank files per step under folder, each a hard link of the one-rank
    dump's file of that step (what a compare at the scale of a job reads; tests and
    bench/compare_scale.py)."""
    for step in sorted(os.listdir(one_rank)):
        os.makedirs(os.path.join(folder, step))
        for rank in range(ranks):
            os.link(os.path.join(one_rank, step, "rank0.h5"), os.path.join(folder, step, f"rank{rank}.h5"))
    return str(folder)
