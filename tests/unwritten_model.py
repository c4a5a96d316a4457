"""A model that reads memory nothing has written yet, as trl's chunked log-probabilities do,
with leftovers the test chooses: the tests of uninitialized records share it."""

import torch
import torch.nn as nn

from probe import Config, PrecisionDebugger


class ChunkedLogits(nn.Module):
    """``buf = torch.empty(...)``, then per chunk ``tile = buf[:n, :w]`` and
    ``torch.mm(..., out=tile)``: each slice is recorded before mm writes it (the first one
    while the whole of buf is unwritten, the second while part of it is).

    ``leftover``: what buf's memory holds before anything writes it, put there through numpy
    (no torch call sees it, as no torch call made the bytes an allocation returns)."""

    def __init__(self, leftover: float = 1e38):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.head = nn.Linear(8, 16, bias=False)
        self.leftover = leftover

    def forward(self, x):
        h = self.fc(x)
        buf = torch.empty(16, 16)
        buf.numpy()[:] = self.leftover
        chunks = []
        for start in (0, 8):
            tile = buf[: h.shape[0], :8]
            torch.mm(h.detach(), self.head.weight[start:start + 8].detach().t(), out=tile)
            chunks.append(tile.logsumexp(-1))
        return h.square().mean() + torch.stack(chunks).mean()


def capture(dump_path, leftover: float = 1e38, level: str = "api", task: str = "statistics",
            steps: int = 1) -> str:
    """steps SGD steps of ChunkedLogits under capture; returns dump_path."""
    debugger = PrecisionDebugger(Config(dump_path=str(dump_path), level=level, task=task,
                                        writer="inline"))
    torch.manual_seed(0)
    model = ChunkedLogits(leftover)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.Generator().manual_seed(1)
    for _ in range(steps):
        with debugger.capture(model):
            model(torch.randn(4, 8, generator=data)).backward()
            optimizer.step()
            optimizer.zero_grad()
    debugger.close()
    return str(dump_path)
