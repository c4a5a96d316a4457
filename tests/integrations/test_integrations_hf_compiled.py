"""probe.integrations.hf.ProbeCallback with ``TrainingArguments(torch_compile=True)``: the
Trainer compiles its model after the callbacks are built, and the callback captures the
compiled model it runs (a one-layer GPT-2 from a config, backend aot_eager, CPU)."""

import pytest
import torch
from torch import nn

from tests.torch_versions import compiled_trainer_gap, needs_compiled_capture, needs_plain_compile_taps
from tests.torch_versions import transformers_or_skip

transformers_or_skip()
pytest.importorskip("accelerate", reason="the transformers Trainer needs accelerate: "
                    "pip install -e '.[hf]'")

import probe  # noqa: E402
from examples.trainers.hf_trainer import LENGTH, VOCAB, token_data  # noqa: E402
from probe.integrations.hf import ProbeCallback  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments  # noqa: E402

pytestmark = [needs_compiled_capture(),
              pytest.mark.skipif(compiled_trainer_gap() is not None, reason=str(compiled_trainer_gap()))]

#: the multiplier the marker passes to Tensor.mul, recorded as an argument
MARKER = "transformer.h.0.mlp.act.1/Tensor.mul#0/forward/input.1"


class DoubledWhenCompiled(nn.Module):
    """x * 2 in compiled code, x * 1 in eager code: its recorded multiplier says which ran."""

    def forward(self, x):
        return x * (2.0 if torch.compiler.is_compiling() else 1.0)


def one_layer_gpt2():
    """One GPT-2 block of width 16: compiling takes a third of the example's 2 x 32."""
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=LENGTH, n_embd=16,
                                       n_layer=1, n_head=2, bos_token_id=0, eos_token_id=0))
    model.transformer.h[0].mlp.act = nn.Sequential(model.transformer.h[0].mlp.act,
                                                   DoubledWhenCompiled())
    return model


class LossRecordingTrainer(Trainer):
    """The Trainer, keeping every micro-batch's loss as float.hex (bit-exact comparison)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.losses = []

    def training_step(self, *args, **kwargs):
        loss = super().training_step(*args, **kwargs)
        self.losses.append(float(loss).hex())
        return loss


def train_compiled(workdir, dump_path=None, steps=2):
    """Two optimizer steps of the one-layer GPT-2 with torch_compile=True; captured at level mix
    into dump_path when given. Returns (losses, graph breaks)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()  # every run compiles afresh: no run reuses another's graphs
    counters.clear()
    model = one_layer_gpt2()
    args = TrainingArguments(
        output_dir=str(workdir), max_steps=steps, per_device_train_batch_size=2,
        learning_rate=1e-3, report_to="none", use_cpu=True, save_strategy="no",
        logging_strategy="no", disable_tqdm=True, dataloader_num_workers=0, seed=0,
        torch_compile=True, torch_compile_backend="aot_eager")
    callbacks = [] if dump_path is None else [
        ProbeCallback({"dump_path": str(dump_path), "level": "mix", "overwrite": True})]
    trainer = LossRecordingTrainer(model=model, args=args, train_dataset=token_data(),
                                   callbacks=callbacks)
    trainer.train()
    assert type(trainer.model_wrapped).__name__ == "OptimizedModule"  # the Trainer compiled it
    return trainer.losses, sum(counters["graph_break"].values())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_compiled")
    plain = train_compiled(root / "plain")
    captured = train_compiled(root / "captured", root / "a")
    return root, plain, captured


@needs_plain_compile_taps()
def test_a_compiled_trainer_run_is_captured_op_by_op_from_inside_its_compiled_graph(runs):
    root, (_, plain_breaks), (_, captured_breaks) = runs
    assert captured_breaks == plain_breaks  # probe's hooks were not traced into the graph
    dump = probe.load(str(root / "a"))
    assert dump.steps == [0, 1]
    records = {record["key"]: record for record in dump.records(step=1)}
    assert records[MARKER]["value"] == "2.0"  # the compiled code's multiplier, not eager's
    inside = {record["module"] for record in records.values()
              if record["kind"] == "api" and record["module"].startswith("transformer.h.0.")}
    assert {"transformer.h.0.attn.c_attn", "transformer.h.0.mlp.c_proj"} <= inside


def test_capturing_a_compiled_trainer_run_keeps_its_losses_bit_identical(runs):
    _, (plain_losses, _), (captured_losses, _) = runs
    assert len(plain_losses) == 2 and captured_losses == plain_losses


def test_two_identical_compiled_trainer_runs_compare_as_pass(runs):
    root, _, (losses_a, _) = runs
    losses_b, _ = train_compiled(root / "b_trainer", root / "b")
    assert losses_b == losses_a
    result = probe.compare(str(root / "a"), str(root / "b"))
    assert result.verdict == "pass" and result.counts["matched"] > 0
