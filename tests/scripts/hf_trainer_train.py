"""A transformers Trainer script with no probe code, for ``probe determinism`` and ``probe run``.

    python tests/scripts/hf_trainer_train.py [--steps 2] [--planted-noise]
                                             [--callback-config JSON]

A tiny Llama (2 layers, width 16, random init from a LlamaConfig; nothing downloaded) trained
with the transformers Trainer on token data made here, on the CPU.
--planted-noise adds noise drawn from a torch.Generator seeded from os.urandom after layer 0's
MLP (a forward hook the script registers): a draw no seed reaches, so every run differs there.
--callback-config JSON: the script adds probe's ProbeCallback with this config of its own
(what a script written for probe's callback does).
"""

import argparse
import json
import os
import sys

import torch

VOCAB, LENGTH = 32, 8


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=LENGTH,
                         attn_implementation="eager")
    return LlamaForCausalLM(config)


def plant_noise(model) -> None:
    generator = torch.Generator().manual_seed(int.from_bytes(os.urandom(8), "little") >> 1)

    def noisy(module, args, output):
        return output + 0.01 * torch.randn(output.shape, generator=generator)  # unseeded on purpose

    model.model.layers[0].mlp.register_forward_hook(noisy)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--planted-noise", action="store_true")
    parser.add_argument("--callback-config", default=None)
    parser.add_argument("--out", default="trainer_out")
    options = parser.parse_args()
    from transformers import Trainer, TrainingArguments

    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (8, LENGTH), generator=generator)
    data = [{"input_ids": row, "labels": row.clone()} for row in ids]
    model = tiny_llama()
    if options.planted_noise:
        plant_noise(model)
    callbacks = []
    if options.callback_config is not None:
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
        from probe.integrations.hf import ProbeCallback

        callbacks.append(ProbeCallback(json.loads(options.callback_config)))
    args = TrainingArguments(
        output_dir=options.out, max_steps=options.steps, per_device_train_batch_size=2,
        learning_rate=1e-3, report_to="none", use_cpu=True, save_strategy="no",
        logging_strategy="no", disable_tqdm=True, dataloader_num_workers=0, seed=0)
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=callbacks)
    result = trainer.train()
    print(f"training loss {result.training_loss}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
