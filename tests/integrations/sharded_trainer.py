"""The transformers Trainer on a model FSDP2 shards over 2 ranks (gloo, CPU), for
test_integrations_hf_fsdp2.py.

accelerate's FSDP2 plugin (``TrainingArguments(fsdp=..., fsdp_config={"version": 2})``)
does not shard on the CPU: accelerate 1.15 turns FSDP on only for GPU-like distributed types,
so with ``use_cpu=True`` the Trainer trains the model under DDP (docs/trainers.md). The
sharding that does run on the CPU inside the Trainer's flow is transformers' own:
``from_pretrained(..., distributed_config=DistributedConfig(fsdp_size=2))`` applies
``fully_shard`` at load time, and the Trainer then has accelerate prepare the optimizer and
the data loader without wrapping the model again.

Run under ``python -m torch.distributed.run --standalone --nproc_per_node 2`` with
``OUT_DIR RUN...``: each run trains a tiny GPT-2 (saved by rank 0 to OUT_DIR/checkpoint,
random init from a config) for STEPS optimizer steps and writes
``OUT_DIR/<run>.rank<R>.json`` (every micro-batch's loss as float.hex); a run named
``plain`` trains without probe, any other is captured at level mix into OUT_DIR/<run>.
Each rank ends with os._exit(0) once its output is flushed: gloo's threads otherwise abort
at interpreter exit.
"""

import json
import os
import sys

import torch

STEPS = 2


def sharded_gpt2(out_dir):
    """The tiny GPT-2 of examples/trainers/hf_trainer.py, loaded with FSDP2 over 2 ranks."""
    import torch.distributed as dist
    from transformers import GPT2LMHeadModel
    from transformers.distributed import DistributedConfig

    from examples.trainers.hf_trainer import tiny_gpt2

    checkpoint = os.path.join(out_dir, "checkpoint")
    if dist.get_rank() == 0 and not os.path.isdir(checkpoint):
        tiny_gpt2().save_pretrained(checkpoint)
    dist.barrier()
    return GPT2LMHeadModel.from_pretrained(checkpoint,
                                           distributed_config=DistributedConfig(fsdp_size=2))


def train(out_dir, run):
    from transformers import Trainer, TrainingArguments

    from examples.trainers.hf_trainer import token_data

    class LossRecordingTrainer(Trainer):
        losses: list

        def training_step(self, *args, **kwargs):
            loss = super().training_step(*args, **kwargs)
            self.losses.append(float(loss).hex())
            return loss

    args = TrainingArguments(
        output_dir=os.path.join(out_dir, "trainer", run), max_steps=STEPS,
        per_device_train_batch_size=2, learning_rate=1e-3, report_to="none", use_cpu=True,
        save_strategy="no", logging_strategy="no", disable_tqdm=True,
        dataloader_num_workers=0, seed=0)
    callbacks = []
    if run != "plain":
        from probe.integrations.hf import ProbeCallback

        callbacks.append(ProbeCallback({"dump_path": os.path.join(out_dir, run), "level": "mix",
                                        "overwrite": True}))
    trainer = LossRecordingTrainer(model=sharded_gpt2(out_dir), args=args,
                                   train_dataset=token_data(), callbacks=callbacks)
    trainer.losses = []
    trainer.train()
    kind = type(trainer.model_wrapped).__name__
    with open(os.path.join(out_dir, f"{run}.rank{args.process_index}.json"), "w") as out:
        json.dump({"losses": trainer.losses, "model_wrapped": kind}, out)


def main(out_dir, runs):
    from tests.two_ranks import end_rank

    torch.set_num_threads(1)
    for run in runs:
        train(out_dir, run)
    end_rank()


def launch(out_dir, runs, timeout=300):
    """Run ``runs`` in one 2-rank torchrun job; raise with its output when it fails."""
    from tests.two_ranks import launch as two_ranks

    return two_ranks(__file__, out_dir, runs, timeout)


def result(out_dir, run, rank):
    with open(os.path.join(out_dir, f"{run}.rank{rank}.json")) as found:
        return json.load(found)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
