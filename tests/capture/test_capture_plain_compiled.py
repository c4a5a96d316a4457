"""A plain torch.compile, unchanged, gives op-level evidence: while a capture at level api or
mix runs, its regions compile once more through probe's graph taps around the user's own
backend; stop() puts the user's compiled code back, and the steps between run it without a
recompile."""

import contextlib
import io
import os
import warnings

import pytest
import torch
from torch import nn

import probe
import torch_versions
from examples.models import TinyGPT
from probe import compat

pytestmark = [torch_versions.needs_compiled_capture(), torch_versions.needs_plain_compile_taps()]

VOCAB, LENGTH = 32, 8


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


FUSION_NOTE = "probe: a graph compiled by counting is recorded through values added to it"


class CountingBackend:
    """The user's backend (aot_eager), counting the graphs it compiles."""

    __name__ = "counting"

    def __init__(self) -> None:
        self.graphs = 0

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)


class CompileOnlyScale(nn.Module):
    """x * 1 in eager code, x * 1.01 in compiled code: stands in for a compiler bug."""

    def forward(self, x):
        return x * (1 + 1e-2 if torch.compiler.is_compiling() else 1.0)


def whole(model, backend):
    return torch.compile(model, backend=backend)


def per_block(model, backend):
    for index, block in enumerate(model.blocks):
        model.blocks[index] = torch.compile(block, backend=backend)
    return model


def block_method(model, backend):
    for block in model.blocks:
        block.compile(backend=backend)
    return model


def instance_forward(model, backend):
    """The idiom ``module.forward = torch.compile(module.forward)``, as Lightning's
    trainer.fit(torch.compile(module)) does it: compiled functions of the instance."""
    for block in model.blocks:
        block.forward = torch.compile(block.forward, backend=backend)
    return model


def whole_dynamic(model, backend):
    """Dynamic shapes: the forward is tapped; the gradients inside the graph are not (the
    zero inputs of grad_taps need static shapes)."""
    return torch.compile(model, backend=backend, dynamic=True)


COMPILES = [whole, per_block, block_method, instance_forward]


def _model(scale=None):
    torch.manual_seed(0)
    model = TinyGPT(vocab=VOCAB, d_model=16, n_heads=2, n_layers=2, max_len=LENGTH)
    block = model.blocks[1]
    if scale == "before LayerNorm":  # LayerNorm(1.01 x) = LayerNorm(x): the output hides it
        block.ln2 = nn.Sequential(CompileOnlyScale(), block.ln2)
    elif scale == "after LayerNorm":
        block.ln1 = nn.Sequential(block.ln1, CompileOnlyScale())
    return model


def _train(tmp_path, name, compile_model=None, scale=None, steps=2, captured=(1,)):
    """Train ``steps`` steps at level mix, capturing ``captured``; (step file, graphs the
    user's backend compiled after each step, graph breaks, messages, runnable)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    model = _model(scale)
    backend = CountingBackend()
    runnable = model if compile_model is None else compile_model(model, backend)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    debugger = probe.PrecisionDebugger({"level": "mix", "seed": 1, "writer": "inline",
                                        "dump_path": str(tmp_path / name),
                                        "step": list(captured)})
    idx = torch.randint(0, VOCAB, (2, LENGTH), generator=torch.Generator().manual_seed(2))
    counters.clear()
    graphs = []
    stderr = io.StringIO()
    with warnings.catch_warnings(record=True) as caught, contextlib.redirect_stderr(stderr):
        warnings.simplefilter("always")
        for _ in range(steps):
            with debugger.capture(runnable):
                loss = nn.functional.cross_entropy(runnable(idx).flatten(0, 1), idx.flatten())
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
            graphs.append(backend.graphs)
    debugger.close()
    # the note that a backend probe does not know may fuse the tapped graph differently is
    # right for "counting" (probe cannot see that it hands the graph to aot_eager): not a fault
    messages = [str(w.message) for w in caught if not str(w.message).startswith(FUSION_NOTE)]
    messages.append(stderr.getvalue())
    return (debugger.last_file, graphs, sum(counters["graph_break"].values()),
            [m for m in messages if m], runnable)


def _paired_both_ways(result) -> bool:
    counts = result.counts
    return counts["matched"] >= 0.95 * (counts["matched"] + counts["only_a"]) \
        and counts["matched"] >= 0.95 * (counts["matched"] + counts["only_b"])


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """Trainings that several tests of this module read, each made once, on first use:
    shared(name, *args, **kwargs) is _train's result for that name."""
    folder = tmp_path_factory.mktemp("plain_compiled")
    made = {}

    def train(name, *args, **kwargs):
        if name not in made:
            made[name] = _train(folder, name, *args, **kwargs)
        return made[name]

    return train


def _eager(shared, scale=None):
    """The eager reference: with a scale, its step 0 (the change alters every later step's
    parameters); without, its step 1, the step the compiled runs capture first."""
    if scale is None:
        return shared("eager", steps=2, captured=(1,))[0]
    return shared(f"eager {scale}", scale=scale, steps=1, captured=(0,))[0]


def _captured(shared, compile_model):
    """Four compiled steps, steps 1 and 3 captured: (step 1's file, graphs, breaks, messages,
    runnable)."""
    last, *rest = shared(f"captured {compile_model.__name__}", compile_model, steps=4, captured=(1, 3))
    return (os.path.join(os.path.dirname(os.path.dirname(last)), "step1", os.path.basename(last)),
            *rest)


@pytest.mark.parametrize("compile_model", COMPILES, ids=lambda f: f.__name__)
def test_a_plain_compiled_model_pairs_with_eager_op_by_op(shared, compile_model):
    compiled, _, breaks, messages, _ = _captured(shared, compile_model)
    assert breaks == 0 and not messages, messages
    result = probe.compare(_eager(shared), compiled)
    assert result.verdict == "pass"
    assert _paired_both_ways(result), result.counts
    keys = {row["key"] for row in result.to_dict(rows=True)["rows"] if row["status"] == "match"}
    # calls and gradients inside the compiled graph, named as eager names them
    assert "blocks.1.attn.qkv/functional.linear#0/forward/output.0" in keys
    assert "blocks.1.ln2/functional.layer_norm#0/backward/grad_input.0" in keys
    assert "blocks.0.mlp.0/Linear#0/forward/output.0" in keys


@pytest.mark.parametrize("compile_model", COMPILES, ids=lambda f: f.__name__)
@pytest.mark.parametrize("scale, module", [("before LayerNorm", "blocks.1.ln2.0"),
                                           ("after LayerNorm", "blocks.1.ln1.1")])
def test_a_compile_only_change_is_named_at_its_module_and_op(tmp_path, shared, compile_model, scale,
                                                              module):
    compiled = _train(tmp_path, "compiled", compile_model, scale, steps=1, captured=(0,))[0]
    first = probe.compare(_eager(shared, scale), compiled).to_dict()["first_divergence"]
    assert first is not None
    assert (first["module"], first["op"], first["origin"]) == (module, "Tensor.mul", "introduced")


@pytest.mark.parametrize("compile_model", COMPILES, ids=lambda f: f.__name__)
def test_captured_steps_compile_the_tapped_graphs_once_and_the_steps_between_none(
        tmp_path, shared, compile_model):
    plain_graphs = _train(tmp_path, "plain", compile_model, steps=4, captured=())[1]
    _, graphs, breaks, messages, runnable = _captured(shared, compile_model)
    assert breaks == 0 and not messages, messages
    user_graphs = plain_graphs[-1]
    assert plain_graphs == [user_graphs] * 4
    # step 1 compiles the tapped copies once; steps 2 (not captured) and 3 (captured) reuse
    # what is in dynamo's cache
    assert graphs == [user_graphs] + [2 * user_graphs] * 3
    # stop() gave every region its user's compiled code back
    for function in _compiled_callables(runnable):
        cell, _ = compat.dynamo_callback_cell(function)
        assert compat.dynamo_backend(cell.cell_contents).__class__.__name__ != "TapBackend"


def _compiled_callables(runnable):
    if isinstance(runnable, torch._dynamo.eval_frame.OptimizedModule):
        return [runnable.forward]
    blocks = runnable.blocks
    return [block.forward if isinstance(block, torch._dynamo.eval_frame.OptimizedModule)
            or "forward" in vars(block) else block._compiled_call_impl for block in blocks]


@pytest.mark.parametrize("scale, module", [(None, None), ("after LayerNorm", "blocks.1.ln1.1")])
def test_dynamic_shapes_tap_the_forward_and_name_a_compile_only_change(tmp_path, shared, scale, module):
    eager = _train(tmp_path, "eager", steps=1, captured=(0,))[0] if scale is None else _eager(shared, scale)
    compiled, _, breaks, messages, _ = _train(tmp_path, "compiled", whole_dynamic, scale,
                                              steps=1, captured=(0,))
    # dynamo restarts its analysis of a dynamic graph from inside the backend: the taps let
    # that through instead of compiling the graph without them
    assert breaks == 0 and not messages, messages
    result = probe.compare(eager, compiled)
    if scale is None:
        assert result.verdict == "pass"
        rows = result.to_dict(rows=True)["rows"]
        inside = [row for row in rows if row["phase"] == "forward"
                  and row["key"].split("/")[1].startswith("functional.")]
        assert len(inside) > 20 and all(row["status"] == "match" for row in inside)
    else:
        first = result.to_dict()["first_divergence"]
        assert (first["module"], first["op"], first["origin"]) == (module, "Tensor.mul", "introduced")


def test_a_probe_compiled_model_is_not_tapped_twice(tmp_path):
    def probe_compiled(model, backend):
        return probe.compile(model, backend=backend)

    _, graphs, breaks, messages, _ = _train(tmp_path, "probe", probe_compiled, steps=3,
                                            captured=(1,))
    assert breaks == 0 and not messages, messages
    assert graphs == [graphs[0]] * 3


def test_a_region_near_dynamos_recompile_limit_keeps_its_boundary_records(tmp_path):
    config = compat.dynamo_config()
    with config.patch(recompile_limit=1):
        compiled, graphs, breaks, messages, _ = _train(tmp_path, "limited", whole, steps=3,
                                                       captured=(1,))
    assert graphs == [graphs[0]] * 3 and breaks == 0 and not messages, messages
    keys = [record["key"] for record in probe.load(compiled).records()]
    assert "/TinyGPT#0/forward/output.0" in keys
    assert not any("functional.linear" in key for key in keys)


def test_a_region_that_cannot_be_tapped_warns_once_and_keeps_its_boundary_records(
        tmp_path, monkeypatch):
    from probe.capture.compiled import region_taps

    def refuse(backend, fullgraph):
        raise RuntimeError("this dynamo builds no callback")

    monkeypatch.setattr(compat, "dynamo_callback", refuse)
    monkeypatch.setattr(region_taps, "_warned", False)
    compiled, graphs, breaks, messages, _ = _train(tmp_path, "refused", whole, steps=3,
                                                   captured=(1, 2))
    assert graphs == [graphs[0]] * 3 and breaks == 0
    assert len(messages) == 1 and "cannot give a compiled region graph taps" in messages[0]
    keys = [record["key"] for record in probe.load(compiled).records()]
    assert "/TinyGPT#0/forward/output.0" in keys
