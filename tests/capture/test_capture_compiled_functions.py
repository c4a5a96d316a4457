"""A function compiled with @torch.compile and called from an eager model is a compiled region:
probe's modes are off the stack while it runs, so capture causes no graph break, recompile or
dynamo warning there, the eager code around it is recorded as usual, and the calls inside it
through graph taps."""

import contextlib
import io
import warnings

import pytest
import torch
from torch import nn

import probe
import torch_versions

pytestmark = torch_versions.needs_compiled_capture()


@torch.compile(backend="aot_eager")
def gated_gelu(x, weight):
    return torch.nn.functional.gelu(x) * weight + x.sin()


class Net(nn.Module):
    def __init__(self, width=8):
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x):
        return self.fc(gated_gelu(self.fc(x), self.weight)).sum()


def _train(tmp_path, level, captured):
    """Three steps, the middle one captured; (step file, graph breaks, graphs, messages)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = Net()
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    debugger = probe.PrecisionDebugger({"level": level, "dump_path": str(tmp_path / level),
                                        "writer": "inline", "step": [1]})
    stderr = io.StringIO()
    with warnings.catch_warnings(record=True) as caught, contextlib.redirect_stderr(stderr):
        warnings.simplefilter("always")
        for _ in range(3):
            with debugger.capture(model) if captured else contextlib.nullcontext():
                model(x).backward()
    debugger.close()
    messages = [str(w.message) for w in caught] + [stderr.getvalue()]
    return (debugger.last_file, sum(counters["graph_break"].values()),
            counters["stats"].get("unique_graphs", 0), messages)


@pytest.mark.parametrize("level", ["api", "mix"])
def test_a_compiled_function_called_by_an_eager_model_runs_compiled_under_capture(tmp_path,
                                                                                  level):
    _, _, graphs_without_probe, _ = _train(tmp_path / "plain", level, captured=False)
    path, breaks, graphs, messages = _train(tmp_path, level, captured=True)
    torch._dynamo.reset()
    assert breaks == 0
    # the user's graph, and its copy with graph taps for the captured step: the mode's coming
    # and going recompiles nothing (one graph only where a plain compile gets no taps)
    copies = 2 if torch_versions.plain_compile_has_taps() else 1
    assert graphs == copies * graphs_without_probe == copies
    assert not [m for m in messages if "dynamo" in m.lower() or "recompil" in m.lower()]
    keys = {record["key"] for record in probe.load(path).records()}
    assert "fc/functional.linear#1/forward/output.0" in keys  # the eager code after the call
    # the calls inside the compiled function, through graph taps, named as in eager code (a
    # torch without taps for a plain compile records the function's boundary only)
    inside = {"/functional.gelu#0/forward/output.0", "/Tensor.sin#0/backward/grad_output.0"}
    assert inside <= keys if torch_versions.plain_compile_has_taps() else not inside & keys


def test_the_gate_on_a_compiled_function_is_removed_at_stop(tmp_path):
    from probe.capture.eager import compiled_functions

    model = Net()
    contexts = compiled_functions.find(model)
    assert len(contexts) == 1
    before = list(contexts[0].enter_exit_hooks)
    debugger = probe.PrecisionDebugger({"level": "api", "dump_path": str(tmp_path / "d")})
    debugger.start(model)
    assert len(contexts[0].enter_exit_hooks) == len(before) + 1
    debugger.stop()
    debugger.close()
    assert contexts[0].enter_exit_hooks == before


def test_a_function_compiled_after_an_earlier_start_is_found_at_the_next_one():
    """start() remembers what it found per set of module classes; a function compiled into
    the defining file's globals later is found all the same."""
    import types

    from probe.capture.eager.compiled_functions import find

    namespace = types.ModuleType("late_compiled_model")
    exec("import torch\n"
         "class Late(torch.nn.Module):\n"
         "    def forward(self, x):\n"
         "        return helper(x)\n"
         "def helper(x):\n"
         "    return x + 1\n", namespace.__dict__)
    model = namespace.Late()
    assert find(model) == []
    namespace.helper = torch.compile(namespace.helper, backend="aot_eager")
    assert len(find(model)) == 1
    assert len(find(model, list(model.modules()))) == 1


class HeldFunction(nn.Module):
    """Holds a compiled free function as its own attribute (not a method of its own)."""

    def __init__(self, width=8):
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.act = torch.compile(torch.nn.functional.gelu, backend="aot_eager")

    def forward(self, x):
        return self.fc(self.act(self.fc(x))).sum()


def test_a_compiled_function_held_by_a_module_is_gated_and_the_module_keeps_its_records(tmp_path):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = HeldFunction()
    debugger = probe.PrecisionDebugger({"level": "mix", "dump_path": str(tmp_path / "d"),
                                        "writer": "inline"})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with debugger.capture(model):
            model(torch.randn(4, 8)).backward()
    debugger.close()
    torch._dynamo.reset()
    assert sum(counters["graph_break"].values()) == 0
    assert not [str(w.message) for w in caught if "dynamo" in str(w.message).lower()]
    keys = {record["key"] for record in probe.load(str(tmp_path / "d")).records()}
    # the module is no compiled region: its own and its submodule's forward hooks record
    assert {"/HeldFunction#0/forward/output.0", "fc/Linear#1/forward/output.0"} <= keys
