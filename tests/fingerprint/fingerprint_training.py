"""The tiny training the fingerprint tests share: an MLP trained with Adam under a
PrecisionDebugger with "fingerprint": true. Runs in the test process, or as a script
(``python fingerprint_training.py DUMP STEPS [inject|reorder] [--kill-at N]``) for the test
that kills a run mid-training.

* ``inject``: at step INJECT_STEP one element of fc2.bias changes by 1e-3 inside the
  optimizer step (a per-optimizer post-hook, which torch runs before the global one that
  takes the fingerprint): one parameter, one step, the way an optimizer bug would.
* ``reorder``: fc1 is computed as (x[:, None, :] * W).sum(-1) + b instead of x @ W.T + b:
  the same math, summed in another order (what another device or thread count does).
"""

from __future__ import annotations

import os
import signal
import sys

import torch
import torch.nn.functional as F

INJECT_STEP = 1337
INJECTED = "param/fc2.bias"


class TinyMLP(torch.nn.Module):
    def __init__(self, reorder: bool = False) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 16)
        self.fc2 = torch.nn.Linear(16, 4)
        self.reorder = reorder

    def forward(self, x):
        if self.reorder:
            hidden = (x[:, None, :] * self.fc1.weight).sum(-1) + self.fc1.bias
        else:
            hidden = self.fc1(x)
        return self.fc2(torch.tanh(hidden))


def train(dump_path: str, steps: int, variant: str = "plain", lr: float = 3e-2, kill_at: int | None = None,
          **config) -> "probe.PrecisionDebugger":  # noqa: F821
    from probe import PrecisionDebugger

    torch.set_num_threads(1)
    debugger = PrecisionDebugger({"dump_path": dump_path, "fingerprint": True, "level": "module",
                                  "writer": "inline", **config})
    model = TinyMLP(reorder=variant == "reorder")
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    data = torch.Generator().manual_seed(7)
    inputs = torch.randn(64, 32, 8, generator=data)
    targets = torch.randn(64, 32, 4, generator=data)
    if variant == "inject":
        def bug(optimizer, args, kwargs):
            if debugger.current_step == INJECT_STEP:
                with torch.no_grad():
                    model.fc2.bias[1] += 1e-3
        optimizer.register_step_post_hook(bug)
    try:
        for step in range(steps):
            if step == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            debugger.start(model)
            loss = F.mse_loss(model(inputs[step % 64]), targets[step % 64])
            debugger.note_loss(loss)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            debugger.stop()
            debugger.step()
    finally:
        debugger.close()
    return debugger


if __name__ == "__main__":
    kill = int(sys.argv[sys.argv.index("--kill-at") + 1]) if "--kill-at" in sys.argv else None
    train(sys.argv[1], int(sys.argv[2]), sys.argv[3] if len(sys.argv) > 3 and not sys.argv[3].startswith("--") else "plain",
          kill_at=kill)
