"""random_on_cpu stays out of compiled code: dynamo traces its mode as a pass-through, so a
compiled model stays one graph, with its random ops inside it, in every step."""

import contextlib
import io
import warnings

import pytest
import torch
from torch import nn

import probe
import torch_versions

pytestmark = torch_versions.needs_compiled_capture()


class Noisy(nn.Module):
    def __init__(self, width=8):
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        return self.drop(self.fc(x)).sum() + torch.randn(3).sum()


@pytest.mark.parametrize("level", ["module", "mix"])
def test_random_on_cpu_leaves_a_compiled_model_one_graph_in_every_step(tmp_path, level):
    from torch._dynamo.utils import counters

    graphs = []

    def backend(gm, example_inputs):
        # an nn module dynamo does not inline (torch 2.4) is one call_module node: its class
        graphs.append({type(gm.get_submodule(node.target)).__name__.lower()
                       if node.op == "call_module"
                       else str(getattr(node.target, "__name__", node.target))
                       for node in gm.graph.nodes})
        return gm.forward

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = torch.compile(Noisy(), backend=backend)
    x = torch.randn(4, 8)
    debugger = probe.PrecisionDebugger({"level": level, "dump_path": str(tmp_path / level),
                                        "writer": "inline", "step": [1],
                                        "random_on_cpu": True})
    stderr = io.StringIO()
    with warnings.catch_warnings(record=True) as caught, contextlib.redirect_stderr(stderr):
        warnings.simplefilter("always")
        for _ in range(3):  # uncaptured, captured, uncaptured: the same compiled code
            with debugger.capture(model):
                model(x).backward()
    debugger.close()
    torch._dynamo.reset()
    assert sum(counters["graph_break"].values()) == 0
    # not cut around the random ops, not recompiled: the user's graph, and at level mix its
    # copy with graph taps for the captured step (where a plain compile gets taps)
    tapped = level == "mix" and torch_versions.plain_compile_has_taps()
    assert len(graphs) == (2 if tapped else 1)
    assert all({"dropout", "randn"} <= graph for graph in graphs)
    messages = [str(w.message) for w in caught] + [stderr.getvalue()]
    assert not [m for m in messages if "dynamo" in m.lower() or "recompil" in m.lower()]
    assert debugger.last_file is not None
