"""Small real models shared by the examples, the tests and the benchmarks.

The four benchmark models are the ones DESIGN.md measures msprobe on; sizes are
parameters so tests can use tiny versions.
"""


import torch
import torch.nn as nn
import torch.nn.functional as F


class MLP(nn.Module):
    """Linear(in, hidden) -> ReLU -> Linear(hidden, out). The benchmark uses 256-512-10."""

    def __init__(self, in_features=256, hidden=512, out_features=10, dropout=0.0):
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden)
        self.act = nn.ReLU()
        self.drop = nn.Dropout(dropout)
        self.fc2 = nn.Linear(hidden, out_features)

    def forward(self, x):
        return self.fc2(self.drop(self.act(self.fc1(x))))


class SmallConvNet(nn.Module):
    """conv3->16, BN, ReLU, pool, conv16->32, BN, ReLU, pool, fc 2048->128, fc 128->10 (3x32x32)."""

    def __init__(self, num_classes=10):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(16)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(32)
        self.pool = nn.MaxPool2d(2)
        self.fc1 = nn.Linear(32 * 8 * 8, 128)
        self.fc2 = nn.Linear(128, num_classes)

    def forward(self, x):
        x = self.pool(F.relu(self.bn1(self.conv1(x))))
        x = self.pool(F.relu(self.bn2(self.conv2(x))))
        x = torch.flatten(x, 1)
        return self.fc2(F.relu(self.fc1(x)))


class ResidualBlock(nn.Module):
    """x + GELU(Linear(LayerNorm(x)))."""

    def __init__(self, width, approximate="none", eps=1e-5):
        super().__init__()
        self.norm = nn.LayerNorm(width, eps=eps)
        self.fc = nn.Linear(width, width)
        self.act = nn.GELU(approximate=approximate)

    def forward(self, x):
        return x + self.act(self.fc(self.norm(x)))


class DeepMLP(nn.Module):
    """fc in->width, `depth` residual blocks of LayerNorm -> Linear -> GELU, head width->out."""

    def __init__(self, in_features=256, width=256, depth=48, out_features=10):
        super().__init__()
        self.stem = nn.Linear(in_features, width)
        self.blocks = nn.ModuleList(ResidualBlock(width) for _ in range(depth))
        self.head = nn.Linear(width, out_features)

    def forward(self, x):
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model, n_heads, dropout=0.0):
        super().__init__()
        self.n_heads = n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.dropout = dropout

    def forward(self, x):
        batch, length, width = x.shape
        q, k, v = self.qkv(x).split(width, dim=2)
        shape = (batch, length, self.n_heads, width // self.n_heads)
        q, k, v = (t.view(shape).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        return self.proj(y.transpose(1, 2).reshape(batch, length, width))


class GPTBlock(nn.Module):
    def __init__(self, d_model, n_heads, dropout=0.0):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads, dropout)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model)
        )
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.drop(self.mlp(self.ln2(x)))


class TinyGPT(nn.Module):
    """Decoder-only transformer. The benchmark's GPT-small: 4 blocks, d=256, 4 heads, T=128, vocab 1000."""

    def __init__(self, vocab=1000, d_model=256, n_heads=4, n_layers=4, max_len=128, dropout=0.0):
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(max_len, d_model)
        self.blocks = nn.ModuleList(GPTBlock(d_model, n_heads, dropout) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)

    def forward(self, idx):
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def make_batch(model_name, batch_size, generator=None, device="cpu", **sizes):
    """A random (input, target) pair that fits the named model."""
    g = generator
    if model_name == "mlp":
        x = torch.randn(batch_size, sizes.get("in_features", 256), generator=g)
        y = torch.randint(0, sizes.get("out_features", 10), (batch_size,), generator=g)
    elif model_name == "convnet":
        x = torch.randn(batch_size, 3, 32, 32, generator=g)
        y = torch.randint(0, 10, (batch_size,), generator=g)
    elif model_name == "deepmlp":
        x = torch.randn(batch_size, sizes.get("in_features", 256), generator=g)
        y = torch.randint(0, sizes.get("out_features", 10), (batch_size,), generator=g)
    elif model_name == "gpt":
        vocab, length = sizes.get("vocab", 1000), sizes.get("max_len", 128)
        x = torch.randint(0, vocab, (batch_size, length), generator=g)
        y = torch.randint(0, vocab, (batch_size, length), generator=g)
    else:
        raise ValueError(f"unknown model {model_name!r}")
    return x.to(device), y.to(device)


def train_step(model, optimizer, x, y):
    """forward + cross-entropy + backward + optimizer step; returns the loss tensor."""
    optimizer.zero_grad(set_to_none=True)
    logits = model(x)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
    loss.backward()
    optimizer.step()
    return loss.detach()


def gelu_tanh_error_bound():
    """Largest |GELU_exact - GELU_tanh| (about 4.7e-4): what a changed approximation injects."""
    x = torch.linspace(-6, 6, 10001, dtype=torch.float64)
    return float((F.gelu(x) - F.gelu(x, approximate="tanh")).abs().max())


__all__ = [
    "MLP", "SmallConvNet", "DeepMLP", "ResidualBlock", "TinyGPT", "make_batch", "train_step",
    "gelu_tanh_error_bound",
]
