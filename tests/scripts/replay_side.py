"""Dump one training step of a small model for the replay tests (one side per process).

    python replay_side.py OUT KIND

KIND:
  fp32       the reference run
  npu        the same run where aten::addmm (what F.linear runs on the CPU) is replaced, in
             this process only, by an "NPU kernel" registered with torch.library: it computes
             the float64 product and rounds it to bfloat16 while claiming float32. A genuinely
             different kernel on the same inputs: replay must name it.
  gpt32      a tiny transformer (TinyGPT) in float32
  bf16       the same transformer under torch.autocast("cpu", dtype=torch.bfloat16)

A separate process because a torch.library override cannot be undone in the process that made it.
"""

import sys

import torch
import torch.nn.functional as F

from examples.models import TinyGPT, make_batch
from probe import PrecisionDebugger, seed_all


def npu_addmm(bias, mat1, mat2, *, beta=1, alpha=1):
    """The float64 product (elementwise, never calling mm/addmm again), rounded to bf16."""
    exact = (mat1.double().unsqueeze(-1) * mat2.double().unsqueeze(0)).sum(1)
    return (beta * bias.double() + alpha * exact).to(torch.bfloat16).to(mat1.dtype)


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(16, 32)
        self.fc2 = torch.nn.Linear(32, 4)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def main(out: str, kind: str) -> None:
    seed_all(0)
    if kind == "npu":
        library = torch.library.Library("aten", "IMPL")
        library.impl("addmm", npu_addmm, "CPU")
    if kind in ("fp32", "npu"):
        model = Net()
        x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    else:
        model = TinyGPT(vocab=50, d_model=32, n_layers=1, n_heads=2, max_len=8, dropout=0.0)
        x, y = make_batch("gpt", 2, vocab=50, max_len=8)
    debugger = PrecisionDebugger({"task": "tensor", "dump_path": out, "level": "api", "step": [0]})
    debugger.start(model)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=kind == "bf16"):
        logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
    loss.backward()
    debugger.stop()
    debugger.step()
    debugger.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
