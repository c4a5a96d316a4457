"""probe.compile names a submodule's keyword arguments and its several outputs inside the graph
as the eager run names them, and never pairs one tensor with another (a rotary embedding's cos
and sin, computed and used in the opposite order of their names)."""

import pytest
import torch
from torch import nn

import probe
import torch_versions

pytestmark = torch_versions.needs_compiled_capture()


class Rotary(nn.Module):
    def __init__(self, width=8):
        super().__init__()
        self.register_buffer("inv", torch.linspace(0.1, 1.0, width))

    def forward(self, x, position_ids=None, scale=1.0, use_cache=True):
        angles = position_ids[:, :, None].float() * self.inv + x
        sin = angles.sin() * scale  # made first, returned second
        cos = angles.cos() * scale
        return cos, sin


class Attention(nn.Module):
    def __init__(self, width=8):
        super().__init__()
        self.q = nn.Linear(width, width)
        self.o = nn.Linear(width, width)

    def forward(self, hidden, mask=None, *, position_embeddings):
        cos, sin = position_embeddings
        q = self.q(hidden)
        mixed = q * sin + q.flip(-1) * cos  # sin read before cos
        if mask is not None:
            mixed = mixed * mask
        return self.o(mixed), q


class Model(nn.Module):
    def __init__(self, width=8):
        super().__init__()
        self.inp = nn.Linear(width, width)
        self.rotary = Rotary(width)
        self.attn = Attention(width)

    def forward(self, x, positions):
        hidden = self.inp(x)
        cos, sin = self.rotary(hidden, position_ids=positions, scale=0.5, use_cache=False)
        out, _ = self.attn(hidden, None, position_embeddings=(cos, sin))
        return out


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _run(tmp_path, name, wrap):
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    model = Model()
    runnable = wrap(model)
    x = torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(1))
    positions = torch.arange(3).repeat(2, 1)
    debugger = probe.PrecisionDebugger({"task": "statistics", "level": "mix", "seed": 1,
                                        "dump_path": str(tmp_path / name), "writer": "inline"})
    counters.clear()
    with debugger.capture(runnable):
        runnable(x, positions).square().mean().backward()
    debugger.close()
    return debugger.last_file, sum(counters["graph_break"].values())


def _means(path) -> dict:
    return {record["key"]: record.get("mean") for record in probe.load(path).records()}


@pytest.mark.skipif(torch_versions.dynamo_breaks_at_graph_marks() is not None,
                    reason=str(torch_versions.dynamo_breaks_at_graph_marks()))
def test_keyword_inputs_and_several_outputs_pair_with_the_eager_tensors_they_were(tmp_path):
    eager, _ = _run(tmp_path, "eager", lambda model: model)
    compiled, breaks = _run(tmp_path, "compiled",
                            lambda model: probe.compile(model, backend="aot_eager"))
    assert breaks == 0
    result = probe.compare(eager, compiled)
    assert result.verdict == "pass"
    status = {row["key"]: row["status"] for row in result.to_dict(rows=True)["rows"]}
    named = ["rotary/Rotary#0/forward/kwarg.position_ids",
             "rotary/Rotary#0/forward/kwarg.scale",
             "rotary/Rotary#0/forward/kwarg.use_cache",
             "rotary/Rotary#0/forward/output.0",
             "rotary/Rotary#0/forward/output.1",
             "attn/Attention#0/forward/input.0",
             "attn/Attention#0/forward/input.1",
             "attn/Attention#0/forward/kwarg.position_embeddings.0",
             "attn/Attention#0/forward/kwarg.position_embeddings.1",
             "attn/Attention#0/forward/output.0",
             "attn/Attention#0/forward/output.1",
             "attn/Attention#0/backward/grad_input.0",
             "attn/Attention#0/backward/grad_input.position_embeddings.0",
             "attn/Attention#0/backward/grad_input.position_embeddings.1",
             "attn/Attention#0/backward/grad_output.0",
             "rotary/Rotary#0/backward/grad_output.1"]
    assert {key: status.get(key) for key in named} == {key: "match" for key in named}
    assert result.counts["only_a"] == result.counts["only_b"] == 0
    # cos and sin differ, so a swapped pairing would be a divergence, not a pass
    means = _means(compiled)
    assert means["rotary/Rotary#0/forward/output.0"] != means["rotary/Rotary#0/forward/output.1"]
    grads = ("attn/Attention#0/backward/grad_input.position_embeddings.0",
             "attn/Attention#0/backward/grad_input.position_embeddings.1")
    assert means[grads[0]] != means[grads[1]]


def test_marks_leave_no_trace_in_the_compiled_graph_nor_in_eager_calls(tmp_path):
    seen = []

    def backend(gm, example_inputs):
        seen.append([str(node.target) for node in gm.graph.nodes])
        return gm.forward

    from probe.capture.compiled.graph_taps import TapBackend

    model = Model()
    probe.compile(model, backend=backend)  # registers the marks on model's submodules
    tapped = torch.compile(model, backend=TapBackend(backend))
    x, positions = torch.randn(2, 3, 8), torch.arange(3).repeat(2, 1)
    expected = model(x, positions)  # eager: the marks do nothing
    assert torch.equal(tapped(x, positions), expected)
    assert seen and not any("probe_graph" in target for graph in seen for target in graph)


def test_probe_compile_itself_warns_nothing():
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        probe.compile(Model(), backend="aot_eager")
    assert [str(w.message) for w in caught] == []


class Residual(nn.Module):
    """An nn.Identity whose input also feeds a residual: two uses of one tensor."""

    def __init__(self, width=8):
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.idn = nn.Identity()
        self.out = nn.Linear(width, width)

    def forward(self, x):
        h = self.fc(x)
        return self.out(self.idn(h) * 2 + h)


def test_an_identity_on_a_residual_records_no_backward_compiled_or_eager_and_the_pair_passes(tmp_path):
    def dump(name, wrap):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = wrap(Residual())
        debugger = probe.PrecisionDebugger({"task": "tensor", "level": "mix", "seed": 1, "writer": "inline",
                                            "dump_path": str(tmp_path / name)})
        with debugger.capture(model):
            model(torch.randn(4, 8, generator=torch.Generator().manual_seed(1))).square().mean().backward()
        debugger.close()
        return debugger.last_file

    result = probe.compare(dump("eager", lambda model: model),
                           dump("compiled", lambda model: probe.compile(model, backend="aot_eager")))
    assert result.verdict == "pass", result.to_text()[:1500]
    rows = {row.key: row.status for row in result.rows}
    # where dynamo cuts the graph at graph marks (torch 2.4) they are left off, and the
    # compiled side records no module call inside the graph: the eager record has no partner
    marks = torch_versions.dynamo_breaks_at_graph_marks() is None
    assert rows["idn/Identity#0/forward/output.0"] == ("match" if marks else "only_a")
    # it returned its input as it was: its gradient is every use's, nothing the call made (a
    # node of its own for it would change the order autograd sums the tensor's gradients in)
    assert not [key for key in rows if key.startswith("idn/") and "/backward/" in key]
