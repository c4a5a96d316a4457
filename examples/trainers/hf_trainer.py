"""A transformers Trainer captured with one line: ``callbacks=[ProbeCallback(config)]``.

A tiny GPT-2 (2 layers, width 32, random init from a GPT2Config, nothing downloaded) is
trained for 3 optimizer steps on token data made here, three times: twice the same way,
and once with ``layer_norm_epsilon`` 1e-2 instead of 1e-5. probe compares the dumps: the
identical runs pass, and the changed one is named at a LayerNorm (``ln_...``).

    python examples/trainers/hf_trainer.py
    python examples/trainers/hf_trainer.py --accumulation 4    # 4 micro-batches per step file
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch

from probe import compare, load
from probe.integrations.hf import ProbeCallback

VOCAB, LENGTH = 64, 16


def token_data(count: int = 32, seed: int = 0) -> list[dict]:
    """``count`` random sequences; labels are the inputs (the model shifts them)."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (count, LENGTH), generator=generator)
    return [{"input_ids": row, "labels": row.clone()} for row in ids]


def tiny_gpt2(layer_norm_epsilon: float = 1e-5):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=VOCAB, n_positions=LENGTH, n_embd=32, n_layer=2, n_head=2,
                        layer_norm_epsilon=layer_norm_epsilon, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config)


def train(dump_path: str, workdir: str, *, layer_norm_epsilon: float = 1e-5,
          accumulation: int = 1, steps: int = 3, level: str = "mix", callbacks=None):
    """Train the tiny GPT-2 for ``steps`` optimizer steps with the Trainer; with
    ``callback`` the ProbeCallback dumps every step into dump_path."""
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(
        output_dir=workdir, max_steps=steps, per_device_train_batch_size=2,
        gradient_accumulation_steps=accumulation, learning_rate=1e-3, report_to="none",
        use_cpu=True, save_strategy="no", logging_strategy="no", disable_tqdm=True,
        dataloader_num_workers=0, seed=0)
    if callbacks is None:  # else the caller's (the benchmark's)
        callbacks = [ProbeCallback({"dump_path": dump_path, "level": level, "overwrite": True})]
    trainer = Trainer(model=tiny_gpt2(layer_norm_epsilon), args=args,
                      train_dataset=token_data(), callbacks=callbacks)
    trainer.train()
    return trainer


def main() -> int:
    from examples._common import example_parser

    parser = example_parser(__doc__, "trainers_hf", "the default size (3 steps)", device=False)
    parser.add_argument("--accumulation", type=int, default=1)
    options = parser.parse_args()
    runs = {}
    for name, epsilon in (("a", 1e-5), ("b", 1e-5), ("eps", 1e-2)):
        runs[name] = os.path.join(options.out, name)
        train(runs[name], os.path.join(options.out, "trainer", name),
              layer_norm_epsilon=epsilon, accumulation=options.accumulation)
    print(f"steps dumped: {load(runs['a']).steps}")
    same = compare(runs["a"], runs["b"])
    print(f"same config twice: {same.verdict}")
    changed = compare(runs["a"], runs["eps"])
    first = changed.first_divergence
    print(f"layer_norm_epsilon 1e-5 -> 1e-2: {changed.verdict} at {first.module} {first.op} "
          f"(step {first.step}, {first.phase})")
    return 0 if same.verdict == "pass" and "ln_" in first.module else 1


if __name__ == "__main__":
    sys.exit(main())
