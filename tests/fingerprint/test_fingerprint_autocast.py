"""Fingerprints of steps computed under bf16 autocast are judged with bf16's rounding: a tiny
transformers Llama (random init, nothing downloaded) trained under
``torch.autocast("cpu", dtype=torch.bfloat16)``, sdpa vs eager attention (rounding only) and
an RMSNorm eps 10x larger (a bug)."""

import json

import numpy as np
import pytest
import torch

from probe import PrecisionDebugger
from probe.fingerprint import compare, file

pytest.importorskip("transformers", reason="pip install 'precision-probe[hf]'")

STEPS = 2


def train(path: str, attention: str, eps: float = 1e-6, autocast: bool = True) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=32,
                         rms_norm_eps=eps, attn_implementation=attention)
    model = LlamaForCausalLM(config)
    debugger = PrecisionDebugger({"dump_path": path, "fingerprint": True, "writer": "inline"})
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 64, (STEPS, 4, 16), generator=torch.Generator().manual_seed(1))
    for step in range(STEPS):
        debugger.start(model)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(input_ids=ids[step], labels=ids[step]).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        debugger.stop()
        debugger.step()
    debugger.close()
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("autocast")
    return {name: file.read(file.find_file(train(str(folder / name), *args)))
            for name, args in {"eager": ("eager",), "sdpa": ("sdpa",), "eps": ("eager", 1e-5),
                               "fp32": ("eager", 1e-6, False)}.items()}


def test_the_dtype_autocast_computed_each_step_in_is_in_the_file(runs):
    assert runs["eager"].compute_unit.tolist() == [2.0 ** -8] * STEPS
    assert runs["fp32"].compute_unit.tolist() == [0.0] * STEPS
    assert runs["eager"].attrs["fingerprint_version"] == 2


def test_sdpa_and_eager_attention_under_bf16_autocast_differ_by_rounding_only(runs):
    result = compare.compare(runs["eager"], runs["sdpa"])
    assert result.verdict == "pass" and result.jump_step is None, [
        (t.name, t.gap, t.allowed) for t in result.jumped[:3]]
    assert result.compute == {"a": ["bfloat16"], "b": ["bfloat16"]}


def test_an_rms_norm_eps_bug_under_bf16_autocast_still_jumps_at_step_0(runs):
    result = compare.compare(runs["eager"], runs["eps"])
    assert result.verdict == "diverged" and result.jump_step == 0
    assert all(t.allowed == pytest.approx(8 * 2.0 ** -8) for t in result.jumped)


def test_files_that_do_not_record_the_compute_dtype_are_judged_as_before(runs, tmp_path):
    """A version 1 file (no compute dtype in its step rows) reads as NaN: not known, and its
    tensors keep their own dtype's allowance, as before the dtype was recorded."""
    eager, sdpa = runs["eager"], runs["sdpa"]
    unknown = [file.Fingerprints(**{**vars(prints), "compute_unit": np.full(STEPS, np.nan)})
               for prints in (eager, sdpa)]
    result = compare.compare(*unknown)
    assert result.compute == {"a": [], "b": []}
    assert result.jump_step == 0 and result.jumped[0].allowed < 1e-4  # float32's allowance
    assert json.loads(json.dumps(result.to_dict()))["compute_dtypes"] == {"a": [], "b": []}
