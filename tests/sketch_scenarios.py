"""Fault scenarios for the sketch tests: each makes a reference and a faulty training step
of a small model, dumped by the real debugger with a chosen task (tests/compare/test_sketch_compare.py)."""

import torch
import torch.nn as nn
import torch.nn.functional as F

from examples.models import DeepMLP, ResidualBlock, SmallConvNet, make_batch, train_step
from probe.config import from_dict
from probe.debugger.debugger import PrecisionDebugger

WIDTH = 32


class RMSNorm(nn.Module):
    def __init__(self, width, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


class Rotary(nn.Module):
    """Llama's rotary embedding; `dtype` is the precision its inverse frequencies are made in
    (a port computing them in bfloat16 is the fault)."""

    def __init__(self, head_dim, base=10000.0, dtype=torch.float32):
        super().__init__()
        self.head_dim, self.base, self.dtype = head_dim, base, dtype

    def forward(self, positions):
        exponent = torch.arange(0, self.head_dim, 2, dtype=self.dtype) / self.head_dim
        inv_freq = (1.0 / (self.base ** exponent)).float()
        freqs = torch.outer(positions.float(), inv_freq)
        angles = torch.cat((freqs, freqs), dim=-1)
        return angles.cos(), angles.sin()


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class LlamaBlock(nn.Module):
    """One Llama decoder layer: RMSNorm, attention with rotary positions, RMSNorm, SwiGLU MLP."""

    def __init__(self, width=64, heads=4, hidden=128):
        super().__init__()
        self.heads, self.head_dim = heads, width // heads
        self.input_norm = RMSNorm(width)
        self.q_proj = nn.Linear(width, width, bias=False)
        self.k_proj = nn.Linear(width, width, bias=False)
        self.v_proj = nn.Linear(width, width, bias=False)
        self.o_proj = nn.Linear(width, width, bias=False)
        self.rotary_emb = Rotary(self.head_dim)
        self.post_norm = RMSNorm(width)
        self.gate_proj = nn.Linear(width, hidden, bias=False)
        self.up_proj = nn.Linear(width, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, width, bias=False)

    def forward(self, x):
        batch, length, width = x.shape
        h = self.input_norm(x)
        q, k, v = (proj(h).view(batch, length, self.heads, self.head_dim).transpose(1, 2)
                   for proj in (self.q_proj, self.k_proj, self.v_proj))
        cos, sin = self.rotary_emb(torch.arange(length))
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o_proj(attn.transpose(1, 2).reshape(batch, length, width))
        h = self.post_norm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class TinyLlama(nn.Module):
    def __init__(self, vocab=64, width=64, length=64):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.layer = LlamaBlock(width)
        self.norm = RMSNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, idx):
        return self.head(self.norm(self.layer(self.embed(idx))))


def _deep():
    return DeepMLP(in_features=WIDTH, width=WIDTH, depth=3, out_features=4)


def replace_block(**options):
    """A variant that swaps blocks.1 for a ResidualBlock built with options (same weights)."""
    def variant(model):
        block = ResidualBlock(WIDTH, **options)
        block.load_state_dict(model.blocks[1].state_dict())
        model.blocks[1] = block
    return variant


def _conv_weight_noise(model):
    """Noise of 1e-3 of the weights' spread: min/max/mean/norm bound it at about 1e-5."""
    with torch.no_grad():
        weight = model.conv2.weight
        weight.add_(torch.randn(weight.shape, generator=torch.Generator().manual_seed(3)) * 1e-3 * weight.std())


def _fc_in_bf16(model):
    """blocks.1.fc computes in bfloat16 inside (a custom kernel, say): float32 in, float32 out."""
    fc = model.blocks[1].fc
    fc.forward = lambda x: F.linear(x.bfloat16(), fc.weight.bfloat16(), fc.bias.bfloat16()).float()


def _rotary_in_bf16(model):
    model.layer.rotary_emb.dtype = torch.bfloat16


def _deep_batch(g):
    return make_batch("deepmlp", 8, generator=g, in_features=WIDTH, out_features=4)


def _tokens(g):
    return torch.randint(0, 64, (1, 256), generator=g), torch.randint(0, 64, (1, 256), generator=g)


#: name -> (build model, variant, batch maker, capture level). The bf16 layer is dumped at
#: module level: an api-level dump shows its bfloat16 calls, and compare then rightly judges
#: everything after them with the bfloat16 tolerance (a dtype choice is not an error).
SCENARIOS = {
    "conv-weight-noise": (SmallConvNet, _conv_weight_noise, lambda g: make_batch("convnet", 4, generator=g), "mix"),
    "gelu-tanh": (_deep, replace_block(approximate="tanh"), _deep_batch, "mix"),
    "layernorm-eps": (_deep, replace_block(eps=1e-3), _deep_batch, "mix"),
    "layer-in-bf16": (_deep, _fc_in_bf16, _deep_batch, "module"),
    "rotary-in-bf16": (TinyLlama, _rotary_in_bf16, _tokens, "mix"),
}


def dump(path, scenario, faulty, task, level=None, sketch_size=16, threads=None, dtype=None):
    """One SGD step of the scenario's model (reference or faulty), captured to path."""
    build, variant, batch, default_level = SCENARIOS[scenario]
    level = level or default_level
    debugger = PrecisionDebugger(from_dict({"task": task, "level": level, "dump_path": str(path), "seed": 1,
                                            "sketch_size": sketch_size}))
    torch.manual_seed(0)
    model = build()
    if faulty:
        variant(model)
    x, y = batch(torch.Generator().manual_seed(0))
    if dtype is not None:
        model.to(dtype)
        x = x.to(dtype) if x.is_floating_point() else x
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    saved = torch.get_num_threads()
    try:
        if threads is not None:
            torch.set_num_threads(threads)
        debugger.start(model)
        train_step(model, optimizer, x, y)
        debugger.stop()
        debugger.step()
    finally:
        torch.set_num_threads(saved)
        debugger.close()
    return str(path)


def main(argv=None) -> int:
    """Write a scenario's reference and faulty dumps, for `probe compare OUT/a OUT/b`."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("scenario", choices=sorted(SCENARIOS))
    parser.add_argument("--task", default="statistics", choices=("statistics", "checksum", "tensor"))
    parser.add_argument("--sketch-size", type=int, default=16)
    parser.add_argument("--out", default="out/sketch")
    args = parser.parse_args(argv)
    for name, faulty in (("a", False), ("b", True)):
        print(dump(f"{args.out}/{name}", args.scenario, faulty, args.task, sketch_size=args.sketch_size))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
