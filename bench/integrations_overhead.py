"""What the trainer integrations and zero-edit capture cost over the same capture by hand.

    python bench/integrations_overhead.py            # 20 optimizer steps per run, 7 repeats
    python bench/integrations_overhead.py 40 7       # steps, repeats

One process. For each setting, three runs of the same training are interleaved repeat after
repeat (gc.collect() before each): without probe, with the capture written by hand (PrecisionDebugger start/stop/step in
the loop, or a 6-line callback calling them), and with the integration. Each number is the
median over the repeats of a run's time per optimizer step (set-up included alike on every
side): wall clock, and the CPU time of the training thread (time.thread_time: what other
processes on a shared machine do not move; the step files are written by probe's writer
process on both sides alike). Level mix, task statistics, every step dumped. The last two
columns are the ones the integrations answer for: integration / by hand (1.00 = no cost of
its own).

  plain loop    a tiny GPT-2 trained by a plain loop; integration: zero-edit capture
                (probe.autoattach.session, what ``probe run -c`` attaches in the child)
  hf Trainer    the tiny GPT-2 of examples/trainers/hf_trainer.py; integration: ProbeCallback
  lightning     the MLP of examples/trainers/lightning_trainer.py; integration: ProbeCallback

Rows whose framework is not installed are left out.
"""

import contextlib
import gc
import io
import logging
import os
import statistics
import sys
import tempfile
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from probe import PrecisionDebugger

warnings.filterwarnings("ignore")
STEPS = int(sys.argv[1]) if len(sys.argv) > 1 else 20
REPEATS = int(sys.argv[2]) if len(sys.argv) > 2 else 7
LEVEL = "mix"


def config(folder: str) -> dict:
    return {"dump_path": folder, "level": LEVEL}


# ---------------------------------------------------------------------- plain loop / zero-edit

def plain_loop(debugger: PrecisionDebugger | None = None) -> None:
    from examples.trainers.hf_trainer import tiny_gpt2, token_data

    model = tiny_gpt2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = token_data(count=8)
    for step in range(STEPS):
        batch = data[step % len(data)]
        if debugger is not None:
            debugger.start(model)
        loss = model(input_ids=batch["input_ids"][None], labels=batch["labels"][None]).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if debugger is not None:
            debugger.stop()
            debugger.step()


def plain_by_hand(folder: str) -> None:
    debugger = PrecisionDebugger(config(folder))
    plain_loop(debugger)
    debugger.close()


def plain_zero_edit(folder: str) -> None:
    import json

    from probe.autoattach import session

    path = os.path.join(folder, "config.json")
    os.makedirs(folder, exist_ok=True)
    with open(path, "w") as handle:
        json.dump(config(os.path.join(folder, "dump")), handle)
    os.environ.update(PROBE_ATTACH="1", PROBE_CONFIG=path)
    try:
        attached = session.attach()
        plain_loop()
        attached.stand_down()
    finally:
        del os.environ["PROBE_ATTACH"], os.environ["PROBE_CONFIG"]


# ---------------------------------------------------------------------- trainers

def hand_callback(base, begin_event: str, end_event: str, model_of, rank_of):
    """The callback a user would write by hand: start at the step's first micro-batch,
    step() after the optimizer step, close() at the end."""

    class ByHand(base):
        def __init__(self, folder):
            self.debugger = PrecisionDebugger(config(folder))

        def begin(self, *args, **kwargs):
            self.debugger.rank = rank_of(*args)
            if not self.debugger.started:
                self.debugger.start(model_of(*args, **kwargs))

        def end(self, *args, **kwargs):
            self.debugger.step()

        def close(self, *args, **kwargs):
            self.debugger.close()

    setattr(ByHand, begin_event, ByHand.begin)
    setattr(ByHand, end_event, ByHand.end)
    setattr(ByHand, "on_train_end", ByHand.close)
    return ByHand


def hf_runs():
    from transformers import TrainerCallback

    from examples.trainers import hf_trainer

    ByHand = hand_callback(TrainerCallback, "on_step_begin", "on_step_end",
                           lambda args, state, control, model=None, **_: model,
                           lambda args, *rest: args.process_index)

    def run(folder, callbacks):
        hf_trainer.train(folder, os.path.join(folder, "trainer"), steps=STEPS, level=LEVEL,
                         callbacks=callbacks)

    return {"none": lambda folder: run(folder, []),
            "by hand": lambda folder: run(folder, [ByHand(folder)]),
            "integration": lambda folder: run(folder, None)}


def lightning_runs():
    from lightning.pytorch import Callback

    from examples.trainers import lightning_trainer

    ByHand = hand_callback(Callback, "on_train_batch_start", "on_train_batch_end",
                           lambda trainer, module, *rest: module,
                           lambda trainer, *rest: trainer.global_rank)

    def run(folder, callbacks):
        lightning_trainer.train(folder, os.path.join(folder, "trainer"), steps=STEPS,
                                level=LEVEL, callbacks=callbacks)

    return {"none": lambda folder: run(folder, []),
            "by hand": lambda folder: run(folder, [ByHand(folder)]),
            "integration": lambda folder: run(folder, None)}


def settings():
    yield "plain loop (zero-edit)", {"none": lambda folder: plain_loop(),
                                     "by hand": plain_by_hand, "integration": plain_zero_edit}
    for name, make in (("hf Trainer", hf_runs), ("lightning", lightning_runs)):
        try:
            yield name, make()
        except ImportError as error:
            print(f"{name}: left out ({error})", file=sys.stderr)


def main() -> None:
    torch.set_num_threads(1)
    for name in ("transformers", "lightning", "lightning.pytorch", "accelerate"):
        logging.getLogger(name).setLevel(logging.ERROR)
    print(f"torch {torch.__version__}, {STEPS} optimizer steps per run, median of {REPEATS} "
          f"repeats, level {LEVEL}; wall ms per optimizer step (set-up included)")
    print(f"{'setting':<24} {'no probe':>9} {'by hand':>9} {'integration':>12} "
          f"{'by hand/none':>13} {'integr./hand':>14} {'integr./hand cpu':>16}")
    for name, runs in settings():
        times = {kind: [] for kind in runs}
        cpu = {kind: [] for kind in runs}
        for repeat in range(REPEATS + 1):  # the first round warms up and is not counted
            for kind, run in runs.items():
                with tempfile.TemporaryDirectory() as folder:
                    gc.collect()  # the previous run's garbage is not this run's cost
                    start, start_cpu = time.perf_counter(), time.thread_time()
                    with contextlib.redirect_stdout(io.StringIO()):  # the trainers' chatter
                        run(folder)
                    elapsed = (time.perf_counter() - start) * 1e3 / STEPS
                    elapsed_cpu = (time.thread_time() - start_cpu) * 1e3 / STEPS
                if repeat:
                    times[kind].append(elapsed)
                    cpu[kind].append(elapsed_cpu)
        kinds = ("none", "by hand", "integration")
        none, hand, integration = (statistics.median(times[k]) for k in kinds)
        cpu_none, cpu_hand, cpu_integration = (statistics.median(cpu[k]) for k in kinds)
        print(f"{name:<24} {none:>9.2f} {hand:>9.2f} {integration:>12.2f} "
              f"{hand / none:>12.2f}x {integration / hand:>13.2f}x "
              f"{cpu_integration / cpu_hand:>15.2f}x", flush=True)


if __name__ == "__main__":
    main()
