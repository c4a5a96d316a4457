"""Capture never moves a bit, on tiny configs of real training libraries: a transformers
Llama (2 layers, width 32), trl's SFTTrainer through probe's transformers callback, litgpt's
GPT and stable-baselines3's PPO under zero-edit capture (what ``probe run`` attaches) train
with the same losses, gradients and parameters at every step with capture as without.

Before module-level grad_input was read at the autograd nodes the module's ops made, a tiny
Llama's RMSNorm (which reads its input twice while the input also feeds the residual) moved
15 of 21 gradients in float32 and 1 in bf16, trl's bf16 training loss went from
4.6391472816467285 to 4.639136950174968, and litgpt moved 45 of 51 gradients over 3 steps.
"""

import json
import os

import pytest
import torch
import torch.nn.functional as F

from neutral_training import CAPTURES, Trace, debuggers, moved
from tests.torch_versions import litgpt_or_skip

LABELS = [f"{level} {task}" for level, task in CAPTURES]
DTYPES = pytest.mark.parametrize("bf16", [False, True], ids=["float32", "bf16-autocast"])


def _loop(runs, model, batches, loss_of, bf16: bool) -> Trace:
    """One AdamW step per entry of runs (a PrecisionDebugger, or None for no capture)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    trace = Trace()
    for debugger, batch in zip(runs, batches):
        if debugger is not None:
            debugger.start(model)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = loss_of(model, batch)
        loss.backward()
        trace.step(loss, model.named_parameters())
        optimizer.step()
        optimizer.zero_grad()
        trace.stepped(model.named_parameters())
        if debugger is not None:
            debugger.stop()
            debugger.step()
    return trace


def _both(tmp_path, build, batches, loss_of, bf16):
    """The differences between the training without capture and the one under CAPTURES."""
    plain = [None] * len(debuggers(tmp_path / "plain"))  # seeds as the captured training does
    torch.manual_seed(0)
    reference = _loop(plain, build(), batches, loss_of, bf16)
    captured = debuggers(tmp_path / "captured")
    torch.manual_seed(0)
    return moved(reference, _loop(captured, build(), batches, loss_of, bf16), LABELS)


def _ids(vocab, shape):
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab, shape, generator=generator) for _ in CAPTURES]


def _tiny_llama_config(vocab):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                       pad_token_id=0, bos_token_id=1, eos_token_id=1)


@DTYPES
def test_a_transformers_llama_trains_bit_identically_under_every_capture(tmp_path, bf16):
    transformers = pytest.importorskip("transformers", reason="pip install transformers")

    def build():
        return transformers.LlamaForCausalLM(_tiny_llama_config(64))

    found = _both(tmp_path, build, _ids(64, (2, 12)),
                  lambda model, ids: model(input_ids=ids, labels=ids).loss, bf16)
    assert not found, found[:10]


@DTYPES
def test_a_litgpt_gpt_trains_bit_identically_under_every_capture(tmp_path, bf16):
    litgpt = litgpt_or_skip()

    def build():
        return litgpt.GPT(litgpt.Config(
            block_size=16, vocab_size=64, padded_vocab_size=64, n_layer=2, n_head=4, n_embd=32,
            n_query_groups=2, rotary_percentage=1.0, parallel_residual=False, bias=False,
            norm_class_name="RMSNorm", mlp_class_name="LLaMAMLP", intermediate_size=64))

    def loss_of(model, ids):
        logits = model(ids[:, :-1])
        return F.cross_entropy(logits.float().reshape(-1, 64), ids[:, 1:].reshape(-1))

    found = _both(tmp_path, build, _ids(64, (2, 16)), loss_of, bf16)
    assert not found, found[:10]


# ---------------------------------------------------------------------- trl, through the callback

_WORDS = "the a cat dog sat ran on under mat log red blue big small".split()


@pytest.fixture(scope="module")
def sft_data():
    """A word-level tokenizer built here and a few short texts: nothing downloaded."""
    pytest.importorskip("trl", reason="pip install trl")
    try:  # trl imports its trainers lazily: 1.16's needs torch >= 2.5 (CheckpointPolicy)
        from trl import SFTTrainer  # noqa: F401
    except (ImportError, RuntimeError) as error:
        pytest.skip(f"trl's SFTTrainer does not import with this torch ({error.__class__.__name__}); "
                    "pip install trl with torch >= 2.5")
    from datasets import Dataset
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {word: i for i, word in enumerate(["<pad>", "<eos>", "<unk>"] + _WORDS)}
    model = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    model.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=model, pad_token="<pad>", eos_token="<eos>",
                                        unk_token="<unk>")
    generator = torch.Generator().manual_seed(0)
    texts = [" ".join(_WORDS[i] for i in torch.randint(0, len(_WORDS), (int(n),), generator=generator))
             for n in torch.randint(4, 10, (8,), generator=generator)]
    return tokenizer, Dataset.from_dict({"text": texts})


def _sft(tmp_path, tokenizer, dataset, bf16: bool, config) -> Trace:
    """Two steps of trl's SFTTrainer on a tiny Llama; config: ProbeCallback's, or None."""
    from transformers import LlamaForCausalLM, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    from probe.integrations.hf import ProbeCallback

    trace = Trace()

    class Record(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            trace.step(None, model.named_parameters())

        def on_step_end(self, args, state, control, model=None, **kwargs):
            trace.stepped(model.named_parameters())

    callbacks = [ProbeCallback(config)] if config else []
    torch.manual_seed(0)
    model = LlamaForCausalLM(_tiny_llama_config(len(tokenizer)))
    args = SFTConfig(output_dir=str(tmp_path / "out"), max_steps=2, per_device_train_batch_size=4,
                     logging_steps=1, report_to=[], save_strategy="no", bf16=bf16, use_cpu=True, seed=0,
                     data_seed=0, dataloader_num_workers=0, learning_rate=1e-3, max_length=16,
                     disable_tqdm=True)
    trainer = SFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer,
                         callbacks=callbacks + [Record()])
    trainer.train()
    trace.losses = [torch.tensor(entry["loss"]) for entry in trainer.state.log_history if "loss" in entry]
    return trace


@pytest.fixture(scope="module")
def sft_runs(tmp_path_factory, sft_data):
    """{(dtype, run): (Trace, dump folder)}: without capture ("plain"), and twice under level mix
    through probe's callback ("a", "b"; "b" in float32 only)."""
    tokenizer, dataset = sft_data
    folder = tmp_path_factory.mktemp("sft")
    runs = {}
    for bf16, name in ((False, "plain"), (False, "a"), (False, "b"), (True, "plain"), (True, "a")):
        where = folder / f"{bf16}-{name}"
        config = None if name == "plain" else {"level": "mix", "task": "statistics", "writer": "inline",
                                               "dump_path": str(where / "dump")}
        runs[(bf16, name)] = (_sft(where, tokenizer, dataset, bf16, config), str(where / "dump"))
    return runs


@DTYPES
def test_trl_sft_through_the_transformers_callback_trains_bit_identically(sft_runs, bf16):
    plain, captured = sft_runs[(bf16, "plain")][0], sft_runs[(bf16, "a")][0]
    assert [loss.item() for loss in plain.losses] == [loss.item() for loss in captured.losses]
    found = moved(plain, captured)
    assert not found, found[:10]


def test_two_identical_trl_runs_compare_as_a_pass_though_its_log_prob_kernel_reads_empty_memory(sft_runs):
    """trl's chunked log-probabilities slice a torch.empty buffer before writing it: those
    records are uninitialized, not the first divergence of two identical runs."""
    import probe

    result = probe.compare(sft_runs[(False, "a")][1], sft_runs[(False, "b")][1])
    assert result.verdict == "pass", result.to_text()[:2000]
    assert "hold memory nothing had written yet" in result.to_text()


# ---------------------------------------------------------------------- stable-baselines3, zero-edit


def _ppo(config_path, monkeypatch) -> Trace:
    """PPO on CartPole for 64 environment steps (4 updates), under the automatic capture
    ``probe run -c config_path`` attaches (None: without)."""
    from stable_baselines3 import PPO

    from probe.autoattach import session

    session_now = None
    if config_path is not None:
        monkeypatch.setenv("PROBE_CONFIG", str(config_path))
        monkeypatch.setenv("PROBE_ATTACH", "1")
        session_now = session.attach()
        assert session_now is not None
    try:
        agent = PPO("MlpPolicy", "CartPole-v1", n_steps=32, batch_size=16, n_epochs=2, seed=0,
                    device="cpu", policy_kwargs={"net_arch": [16, 16]})
        trace = Trace()
        policy = agent.policy
        policy.optimizer.register_step_pre_hook(
            lambda optimizer, args, kwargs: trace.step(None, policy.named_parameters()))
        policy.optimizer.register_step_post_hook(
            lambda optimizer, args, kwargs: trace.stepped(policy.named_parameters()))
        agent.learn(total_timesteps=64)
    finally:
        if session_now is not None:
            session_now.stand_down()
    trace.losses = [None] * len(trace.grads)
    return trace


@pytest.mark.parametrize("level", ["module", "mix"])
def test_sb3_ppo_under_zero_edit_capture_trains_bit_identically(tmp_path, monkeypatch, level):
    pytest.importorskip("stable_baselines3", reason="pip install stable-baselines3 gymnasium")
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"level": level, "writer": "inline", "dump_path": str(tmp_path / "dump")}))
    plain = _ppo(None, monkeypatch)
    captured = _ppo(config, monkeypatch)
    assert os.listdir(tmp_path / "dump"), "nothing was captured"
    found = moved(plain, captured)
    assert not found, found[:10]
