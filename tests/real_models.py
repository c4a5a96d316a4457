"""Tiny real models and one helper that trains them under the debugger, for the compare tests.

TinyResNet is a ResNet-like conv net with BatchNorm (conv biases before BatchNorm, as
ported models often keep them: their gradient is rounding noise that AdamW turns into an
lr-sized update). The transformers models are built from tiny random-init configs (no
download). ``dump_run`` trains any of them for some steps, one dump per step.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn
import torch.nn.functional as F

from probe.config import from_dict
from probe.debugger.debugger import PrecisionDebugger


class Block(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(x + self.bn2(self.conv2(y)))


class TinyResNet(nn.Module):
    def __init__(self, channels: int = 8, classes: int = 5):
        super().__init__()
        self.stem = nn.Conv2d(3, channels, 3, padding=1)
        self.bn = nn.BatchNorm2d(channels)
        self.block = Block(channels)
        self.fc = nn.Linear(channels, classes)

    def forward(self, x):
        x = F.relu(self.bn(self.stem(x)))
        x = self.block(x)
        return self.fc(x.mean(dim=(2, 3)))


def resnet_batch(batch: int = 8, size: int = 8, classes: int = 5):
    g = torch.Generator().manual_seed(0)
    return torch.randn(batch, 3, size, size, generator=g), torch.randint(0, classes, (batch,), generator=g)


@contextlib.contextmanager
def threads(count):
    """Run with `count` intra-op threads (None: as is), restored afterwards."""
    saved = torch.get_num_threads()
    if count is not None:
        torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


def dump_run(path, build, batch, *, steps=1, task="statistics", level="mix", dtype=None, n_threads=None,
             optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3), loss=None, variant=None):
    """Train build() for `steps` steps on `batch` under the debugger; returns path."""
    debugger = PrecisionDebugger(from_dict({"task": task, "level": level, "dump_path": str(path), "seed": 1,
                                            "step": list(range(steps))}))
    torch.manual_seed(0)
    model = build()
    if variant is not None:
        variant(model)
    inputs = batch()
    if dtype is not None:
        model.to(dtype)
        inputs = tuple(x.to(dtype) if x.is_floating_point() else x for x in inputs)
    opt = optimizer(model.parameters())
    loss = loss or (lambda model, x, y: F.cross_entropy(model(x), y))
    try:
        with threads(n_threads):
            for _ in range(steps):
                debugger.start(model)
                opt.zero_grad()
                loss(model, *inputs).backward()
                opt.step()
                debugger.stop()
                debugger.step()
    finally:
        debugger.close()
    return str(path)


# ---------------------------------------------------------------------------- transformers

def hf_model(family: str, attn: str = "eager", layers: int = 2, width: int = 32, vocab: int = 128):
    """A tiny random-init transformers model built from a config (no download); a test
    skips, naming what to install, where transformers cannot run."""
    from tests.torch_versions import transformers_or_skip

    T = transformers_or_skip()

    common = dict(vocab_size=vocab, num_hidden_layers=layers, num_attention_heads=4, hidden_size=width,
                  intermediate_size=2 * width, max_position_embeddings=64)
    if family == "llama":
        config = T.LlamaConfig(num_key_value_heads=2, **common)
        model = T.LlamaForCausalLM(config)
    elif family == "gpt2":
        config = T.GPT2Config(vocab_size=vocab, n_embd=width, n_layer=layers, n_head=4, n_positions=64)
        model = T.GPT2LMHeadModel(config)
    elif family == "bert":
        config = T.BertConfig(**common)
        model = T.BertForMaskedLM(config)
    else:
        raise ValueError(family)
    model.config._attn_implementation = attn
    model.set_attn_implementation(attn) if hasattr(model, "set_attn_implementation") else None
    return model


def token_batch(batch: int = 2, length: int = 16, vocab: int = 128):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (batch, length), generator=g)
    return ids, ids.clone()


def lm_loss(model, ids, labels):
    return model(input_ids=ids, labels=labels).loss
