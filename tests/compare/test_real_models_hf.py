"""probe on tiny random-init transformers models (built from configs, no download): clean
pairs pass, and capture records what each call computed."""

import pytest
from torch_versions import transformers_or_skip

transformers = transformers_or_skip()

import torch  # noqa: E402

from probe.comparison import result as R  # noqa: E402
from probe import compare  # noqa: E402
from probe.dump.reader import load  # noqa: E402
from real_models import dump_run, hf_model, lm_loss, token_batch  # noqa: E402


def _dump(path, family, **options):
    attn = options.pop("attn", "eager")
    return dump_run(path, lambda: hf_model(family, attn=attn), token_batch, loss=lm_loss, **options)


def _records(path):
    dump = load(path)
    with dump.open(*next(iter(dump.files))) as step:
        table = step.records
        return [dict(zip(("key", "module", "op", "phase", "slot"), values)) for values in zip(
            *(table.column(name).tolist() for name in ("key", "module", "op", "phase", "slot")))]


@pytest.fixture(scope="module")
def llama_fp32(tmp_path_factory):
    return _dump(tmp_path_factory.mktemp("llama") / "fp32", "llama")


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_float32_and_float64_runs_of_a_transformers_model_pass(tmp_path, llama_fp32, family):
    a = llama_fp32 if family == "llama" else _dump(tmp_path / "a", family, steps=2)
    b = _dump(tmp_path / "b", family, dtype=torch.float64, steps=1 if family == "llama" else 2)
    result = compare(a, b)
    assert result.verdict == "pass", result.to_text()


def test_a_call_that_returns_its_input_records_no_backward(llama_fp32):
    """RMSNorm's hidden_states.to(torch.float32) is a no-op in a float32 model: it returns its
    input, so a gradient hook there would see the gradient summed over every use of that
    tensor. It records its forward and no backward."""
    records = _records(llama_fp32)
    to_calls = {(r["module"], r["key"].split("/")[1]) for r in records
                if r["module"].endswith("input_layernorm") and r["op"] == "Tensor.to" and r["phase"] == "forward"}
    assert to_calls
    backward = [r for r in records if r["module"].endswith("input_layernorm") and r["op"] == "Tensor.to"
                and r["phase"] == "backward"]
    assert backward == []


def test_a_module_under_no_grad_records_no_backward(llama_fp32):
    """The rotary embedding runs under torch.no_grad(): no backward records, never ranked."""
    records = _records(llama_fp32)
    assert any(r["module"] == "model.rotary_emb" and r["phase"] == "forward" for r in records)
    assert not any(r["module"] == "model.rotary_emb" and r["phase"] == "backward" for r in records)


def test_a_harmless_clone_in_one_bert_layer_leaves_every_grad_input_equal(tmp_path):
    """The module grad_input is the gradient through that call only: a clone of the input
    before layer 0's intermediate block (whose input also feeds the residual) changes nothing."""
    def clone_first_intermediate(model):
        block = model.bert.encoder.layer[0].intermediate
        forward = block.forward
        block.forward = lambda hidden_states: forward(hidden_states.clone())

    a = _dump(tmp_path / "a", "bert", task="tensor")
    b = _dump(tmp_path / "b", "bert", task="tensor", variant=clone_first_intermediate)
    result = compare(a, b)
    assert result.verdict == "pass", result.to_text()
    grad_in = [r for r in result.rows if r.key == "bert.encoder.layer.0.intermediate.dense/Linear#0/backward/grad_input.0"]
    assert grad_in and grad_in[0].status == R.MATCH and grad_in[0].metrics.bit_equal
    assert {r.op for r in result.rows if r.status == R.ONLY_B} == {"Tensor.clone"}


def test_eager_and_sdpa_attention_pass_and_missing_attention_weights_are_absent(tmp_path, llama_fp32):
    result = compare(llama_fp32, _dump(tmp_path / "sdpa", "llama", attn="sdpa"))
    assert result.verdict == "pass", result.to_text()
    weights = [r for r in result.rows if r.key == "model.layers.0.self_attn/LlamaAttention#0/forward/output.1"]
    assert weights and weights[0].status == R.ONLY_A and "absent on one side" in weights[0].reasons[0]
    output = [r for r in result.rows if r.key == "model.layers.0.self_attn/LlamaAttention#0/forward/output.0"]
    assert output and output[0].status == R.MATCH
