"""Tiny models and a training loop for the verdict tests: a fault at a chosen step, a
chosen activation or eps, a layer computed in a lower dtype, autocast (task "tensor" dumps)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from probe.config import from_dict
from probe.debugger.debugger import PrecisionDebugger


class SmallNet(nn.Module):
    """fc1 -> activation -> LayerNorm -> fc2; every choice a fault can change is an argument."""

    def __init__(self, act=None, approximate=None, eps=1e-5, fc1_dtype=None):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.ln = nn.LayerNorm(32, eps=eps)
        self.fc2 = nn.Linear(32, 4)
        self.act, self.approximate = act, approximate
        if fc1_dtype is not None:  # the model's own casts: fc1 computes in a lower dtype inside
            fc1 = self.fc1
            fc1.forward = lambda x: F.linear(x.to(fc1_dtype), fc1.weight.to(fc1_dtype),
                                             fc1.bias.to(fc1_dtype)).float()

    def forward(self, x):
        h = self.fc1(x)
        if self.act is not None:
            h = self.act(h)
        elif self.approximate is None:
            h = F.gelu(h)
        else:
            h = F.gelu(h, approximate=self.approximate)
        return self.fc2(self.ln(h))


def batch(size: int = 8):
    g = torch.Generator().manual_seed(0)
    return torch.randn(size, 16, generator=g), torch.randint(0, 4, (size,), generator=g)


def train(path, build=SmallNet, *, steps=1, fault=None, fault_step=0, level="mix", task="tensor",
          autocast=None, lr=1e-2, dtype=None, data=None):
    """Train build() with AdamW for `steps` steps under the debugger, one dump per step;
    fault(model) runs before the forward of step fault_step; data() gives the batch (x, y)."""
    torch.manual_seed(0)
    model = build()
    x, y = (data or batch)()
    if dtype is not None:
        model, x = model.to(dtype), (x.to(dtype) if x.is_floating_point() else x)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    debugger = PrecisionDebugger(from_dict({"task": task, "level": level, "dump_path": str(path),
                                            "step": list(range(steps))}))
    try:
        for step in range(steps):
            if fault is not None and step == fault_step:
                fault(model)
            debugger.start(model)
            optimizer.zero_grad()
            if autocast is not None:
                with torch.autocast("cpu", dtype=autocast):
                    loss = F.cross_entropy(model(x).float(), y)
            else:
                loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            debugger.stop()
            debugger.step()
    finally:
        debugger.close()
    return str(path)


def scale_fc1_weight(model):
    with torch.no_grad():
        model.fc1.weight.mul_(1.001)


class TinyAttention(nn.Module):
    """Embedding, one pre-norm attention block with an MLP, a head; attention by sdpa or eager."""

    def __init__(self, attn="sdpa", vocab=64, width=32, heads=4, grad_scale=None, upcast_norm=True,
                 sharpness=None):
        super().__init__()
        self.attn, self.heads, self.grad_scale, self.upcast_norm = attn, heads, grad_scale, upcast_norm
        self.sharpness = sharpness  # attention logits scaled by this (sharp attention amplifies)
        self.embed = nn.Embedding(vocab, width)
        self.norm1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.o_proj = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)
        self.head = nn.Linear(width, vocab)

    def forward(self, ids):
        x = self.embed(ids)
        batch, length, width = x.shape
        q, k, v = (t.view(batch, length, self.heads, -1).transpose(1, 2)
                   for t in self.qkv(self.norm1(x)).chunk(3, dim=-1))
        if self.attn == "sdpa":
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.sharpness)
        else:
            scores = q @ k.transpose(-1, -2) / (q.shape[-1] ** 0.5)
            mask = torch.ones(length, length, dtype=torch.bool).triu(1)
            y = torch.softmax(scores.masked_fill(mask, float("-inf")), dim=-1) @ v
        y = y.transpose(1, 2).reshape(batch, length, width)
        if self.grad_scale is not None and y.requires_grad:  # a gradient scaled inside the block
            y.register_hook(lambda grad: grad * self.grad_scale)
        x = x + self.o_proj(y)
        x = x + self.down(F.gelu(self.up(self.rms_norm(x))))
        return self.head(x).flatten(0, 1)


    def rms_norm(self, x):
        """Llama's RMSNorm: in float32 and back, or (the fault) in the activations' dtype."""
        h = x.float() if self.upcast_norm else x
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.norm2.weight * h.to(x.dtype)


def tokens(batch_size: int = 4, length: int = 16, vocab: int = 64):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (batch_size, length), generator=g)
    return ids, torch.randint(0, vocab, (batch_size * length,), generator=g)
