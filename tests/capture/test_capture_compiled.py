"""Compiled models are captured as they run: no graph break, recompile or dynamo warning from
probe, the user's names, values from inside the graph (probe.compile), and a compile-only
difference named at its module and op."""

import contextlib
import io
import types
import warnings

import pytest
import torch
from torch import nn

import probe
from probe import compat
from probe.compat import version_gaps
import torch_versions
from probe.capture.eager.values import SourceLocator

pytestmark = torch_versions.needs_compiled_capture()

BACKEND = "aot_eager"  # compiles through AOTAutograd like inductor, without a C++ compiler


class Block(nn.Module):
    def __init__(self, width=8):
        super().__init__()
        self.ln = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 2 * width)
        self.fc2 = nn.Linear(2 * width, width)

    def forward(self, x):
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln(x))))


class Drifting(nn.Module):
    """Stands in for a compiler bug: differs from eager only when compiled."""

    def __init__(self, width=8):
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x):
        y = self.fc(x)
        if torch.compiler.is_compiling():
            y = y * (1 + 1e-3)
        return y


class TinyGPT(nn.Module):
    def __init__(self, drift=False, vocab=12, width=8):
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList([Block(width), Drifting(width) if drift else Block(width)])
        self.head = nn.Linear(width, vocab)

    def forward(self, idx):
        x = self.emb(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _train(tmp_path, name, level, wrap, drift=False, steps=2):
    """Train a few steps, capture the last; (step file, stderr text, warnings, counters)."""
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    model = TinyGPT(drift)
    runnable = wrap(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    debugger = probe.PrecisionDebugger({"task": "statistics", "level": level, "seed": 1,
                                        "dump_path": str(tmp_path / name), "writer": "inline",
                                        "step": [steps - 1]})
    idx = torch.randint(0, 12, (2, 5), generator=torch.Generator().manual_seed(2))
    counters.clear()
    stderr = io.StringIO()
    with warnings.catch_warnings(record=True) as caught, contextlib.redirect_stderr(stderr):
        warnings.simplefilter("always")
        for _ in range(steps):
            with debugger.capture(runnable):
                loss = torch.nn.functional.cross_entropy(runnable(idx).flatten(0, 1),
                                                         idx.flatten())
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
    debugger.close()
    seen = {"graph_breaks": sum(counters["graph_break"].values()),
            "graphs": counters["stats"].get("unique_graphs", 0)}
    return debugger.last_file, stderr.getvalue(), [str(w.message) for w in caught], seen


def _eager(tmp_path, level, drift=False):
    # a drift changes the gradients, so the parameters of every later step: compare step 0
    return _train(tmp_path, "eager", level, lambda model: model, drift, 1 if drift else 2)[0]


def _keys(path):
    return [record["key"] for record in probe.load(path).records()]


def _rows(result, status):
    return [row["key"] for row in result.to_dict(rows=True)["rows"] if row["status"] == status]


def test_a_compiled_model_runs_compiled_under_capture_without_breaks_recompiles_or_warnings(
        tmp_path):
    plain = _train(tmp_path, "plain", "mix", lambda m: torch.compile(m, backend=BACKEND))
    torch._dynamo.reset()
    with contextlib.ExitStack():
        path, stderr, caught, seen = _train(tmp_path, "captured", "mix",
                                            lambda m: torch.compile(m, backend=BACKEND))
    # same compiled run without any capture: the graphs it compiles
    torch._dynamo.reset()
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    model = torch.compile(TinyGPT(), backend=BACKEND)
    counters.clear()
    idx = torch.randint(0, 12, (2, 5), generator=torch.Generator().manual_seed(2))
    for _ in range(2):
        model(idx).sum().backward()
    graphs_without_probe = counters["stats"].get("unique_graphs", 0)

    assert seen["graph_breaks"] == 0
    # the user's graphs, and their copies with graph taps for the captured step (where a plain
    # compile gets taps: torch_versions.plain_compile_has_taps)
    copies = 2 if torch_versions.plain_compile_has_taps() else 1
    assert seen["graphs"] == copies * graphs_without_probe
    assert "dynamo" not in stderr.lower() and "recompile" not in stderr.lower()
    assert not [message for message in caught if "dynamo" in message.lower()]
    assert plain[0] is not None
    keys = _keys(path)
    assert keys and not any("_orig_mod" in key for key in keys)
    # the boundary of the compiled region: the model's own call, forward and backward
    assert "/TinyGPT#0/forward/input.0" in keys
    assert "/TinyGPT#0/backward/grad_output.0" in keys
    assert "emb/Embedding#0/backward/param_grad.weight" in keys


def test_graph_taps_name_every_call_and_gradient_as_the_eager_run_does(tmp_path):
    eager = _eager(tmp_path, "mix")
    compiled, stderr, caught, seen = _train(
        tmp_path, "compiled", "mix", lambda m: probe.compile(m, backend=BACKEND))
    assert seen["graph_breaks"] == 0 and not caught
    result = probe.compare(eager, compiled)
    assert result.verdict == "pass"
    counts = result.counts
    assert counts["matched"] >= 0.95 * (counts["matched"] + counts["only_a"])
    assert counts["matched"] >= 0.95 * (counts["matched"] + counts["only_b"])
    keys = set(_keys(compiled))
    # gradients of calls inside the graph, per call, as the eager hooks record them
    assert "blocks.0.fc1/functional.linear#0/backward/grad_output.0" in keys
    assert "blocks.0.fc1/functional.linear#0/backward/grad_input.1" in keys
    assert "blocks.0/Tensor.add#0/backward/grad_input.0" in keys
    assert "blocks.0.ln/functional.layer_norm#0/backward/grad_input.weight" in keys
    assert "blocks.0.fc2/Linear#0/backward/grad_input.0" in keys
    keys = _keys(compiled)
    assert "blocks.0.fc1/functional.linear#0/forward/kwarg.bias" not in keys  # as eager: input.2
    assert "blocks.0.fc1/functional.linear#0/forward/input.2" in keys
    assert "blocks.0/Tensor.add#0/forward/output.0" in keys
    assert "blocks.0.ln/functional.layer_norm#0/forward/kwarg.eps" in keys


def test_a_compile_only_difference_is_named_at_its_module_and_op(tmp_path):
    eager = _eager(tmp_path, "mix", drift=True)
    compiled = _train(tmp_path, "compiled", "mix", lambda m: probe.compile(m, backend=BACKEND),
                      drift=True, steps=1)[0]
    first = probe.compare(eager, compiled).to_dict()["first_divergence"]
    assert first is not None
    assert first["module"] == "blocks.1"
    assert first["origin"] == "introduced"
    only_b = _rows(probe.compare(eager, compiled), "only_b")
    # the op only the compiled graph has: its records have no partner, with its source line
    assert {key.split("/")[1] for key in only_b} == {"Tensor.mul#0"}
    assert "blocks.1/Tensor.mul#0/forward/output.0" in only_b


def _regional(model):
    for index, block in enumerate(model.blocks):
        model.blocks[index] = torch.compile(block, backend=BACKEND)
    return model


def _regional_method(model):
    for block in model.blocks:
        block.compile(backend=BACKEND)
    return model


@pytest.mark.parametrize("compile_blocks", [_regional, _regional_method],
                         ids=["torch.compile(block)", "block.compile()"])
def test_regional_compilation_is_captured_at_each_block(tmp_path, compile_blocks):
    eager = _eager(tmp_path, "module")
    compiled, stderr, caught, seen = _train(tmp_path, "compiled", "module", compile_blocks)
    assert seen["graph_breaks"] == 0 and not caught
    assert probe.compare(eager, compiled).verdict == "pass"
    keys = _keys(compiled)
    assert "blocks.1/Block#0/forward/output.0" in keys
    assert "blocks.1/Block#0/backward/grad_input.0" in keys
    assert "blocks.1.fc1/Linear#0/backward/param_grad.weight" in keys
    assert "blocks.1.fc1/Linear#0/forward/param.weight" in keys  # recorded at the boundary
    assert "head/Linear#0/forward/output.0" in keys
    assert not any("_orig_mod" in key for key in keys)
    model = TinyGPT()
    compile_blocks(model)
    debugger = probe.PrecisionDebugger({"level": "module", "dump_path": str(tmp_path / "x")})
    debugger.start(model)
    debugger.stop()
    assert all(getattr(block, "_compiled_call_impl", None) is None or
               getattr(block._compiled_call_impl, "__name__", "") != "boundary"
               for block in model.blocks)  # stop() put back what it wrapped


def test_a_compile_only_difference_in_a_compiled_block_is_named_at_that_block(tmp_path):
    eager = _eager(tmp_path, "module", drift=True)
    compiled = _train(tmp_path, "compiled", "module", _regional, drift=True, steps=1)[0]
    first = probe.compare(eager, compiled).to_dict()["first_divergence"]
    assert first is not None and first["module"] == "blocks.1"
    assert first["origin"] == "introduced"


def test_the_source_lookup_survives_code_objects_with_unhashable_constants():
    locate = SourceLocator()

    def caller():
        return locate(1)

    # dynamo's resumed frames keep slices among their constants (unhashable before 3.12)
    code = caller.__code__.replace(co_consts=caller.__code__.co_consts + (slice(0, 1),))
    odd = types.FunctionType(code, caller.__globals__, "caller", None, caller.__closure__)
    assert odd().startswith("tests")


def test_start_warns_once_where_this_torch_lacks_what_compiled_capture_needs(tmp_path,
                                                                                monkeypatch):
    monkeypatch.setattr(version_gaps, "compiled_capture_gap",
                        lambda: "torch 9.9 lacks torch.compiler.is_compiling")
    monkeypatch.setattr(version_gaps, "_warned_compiled", False)
    model = torch.compile(TinyGPT(), backend=BACKEND)
    debugger = probe.PrecisionDebugger({"level": "module", "dump_path": str(tmp_path / "d")})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            debugger.start(model)
            debugger.stop()
            debugger.step()
    debugger.close()
    said = [w for w in caught if issubclass(w.category, version_gaps.TorchVersionWarning)]
    assert len(said) == 1 and "is_compiling" in str(said[0].message)


def test_blocks_compiled_one_by_one_share_one_graph_and_keep_their_own_names(tmp_path):
    def tapped_blocks(model):
        for index, block in enumerate(model.blocks):
            model.blocks[index] = probe.compile(block, backend=BACKEND)
        return model

    eager = _eager(tmp_path, "mix")
    compiled, _, caught, seen = _train(tmp_path, "compiled", "mix", tapped_blocks)
    assert seen["graphs"] == 1 and seen["graph_breaks"] == 0 and not caught
    result = probe.compare(eager, compiled)
    assert result.verdict == "pass"
    assert result.counts["only_a"] == result.counts["only_b"] == 0


def test_a_graph_nodes_module_path_text_is_the_users_path():
    from probe.capture.compiled.graph_names import _path_text

    assert _path_text("L['self'].blocks[0]._orig_mod.fc") == "blocks.0.fc"
    assert _path_text("L['args'][0].model.layers[1].self_attn") == "model.layers.1.self_attn"
    assert _path_text("L['self']._modules['head']") == "head"
    assert _path_text("L['self']") == ""
