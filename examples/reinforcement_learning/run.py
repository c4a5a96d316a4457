"""PPO on CartPole: seeded training repeats exactly; one update step dumped and compared.

1. Two PPO trainings in fresh processes, each with seed_all + env.reset(seed=...) +
   env.action_space.seed(...): the episode returns must repeat exactly, episode by episode.
2. One PPO update step (one minibatch: forward, clipped loss, backward, Adam step) is dumped
   in two configurations from the same weights and minibatch and compared. The candidate is a
   float64 "high-precision bench" by default (--candidate threads: 1 thread vs the default).
3. Cross-device: the training on the CPU and on --device, both launched by `probe run` with the
   config key random_on_cpu, so the policy's action sampling on the device draws from the CPU
   generator; the episode returns must stay identical. On a GPU it also trains without the key
   and says for how many episodes CPU and GPU agree then.

    python examples/reinforcement_learning/run.py           # ~12 s on 2 CPU cores
    python examples/reinforcement_learning/run.py --smoke   # CI size
Needs gymnasium (pip install 'precision-probe[examples]').
"""

import argparse
import copy
import json
import os
import subprocess
import sys
import time

# Run as `python examples/reinforcement_learning/run.py` from anywhere: make `probe` and
# `examples` importable without installing anything.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch

from probe import Config, PrecisionDebugger, compare, seed_all
from probe.commands.run import build_env
from probe.config import load as load_config
from examples._common import example_parser, print_compare_summary
from examples.reinforcement_learning.ppo import (
    ActorCritic, make_env, EpisodeTracker, PPOSettings, collect, minibatches, train, update_step,
)

SEED = 1234


def settings_for(smoke):
    return PPOSettings(rollout_steps=128, minibatch=64) if smoke else PPOSettings()


def seeded_training(updates, smoke, device, via_probe_run=False):
    """A full seeded PPO training; returns the return of every finished episode.

    via_probe_run: the config comes from `probe run` ($PROBE_CONFIG); PrecisionDebugger()
    seeds and, with random_on_cpu, redirects device draws to the CPU for the whole run. It
    never starts a capture here."""
    if via_probe_run:
        PrecisionDebugger()
    else:
        seed_all(SEED)
    env = make_env()
    tracker = EpisodeTracker(env, SEED)
    model = ActorCritic().to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=settings_for(smoke).lr)
    returns = train(model, optimizer, tracker, settings_for(smoke), updates, device)
    env.close()
    return returns


def dump_update(model, batch, settings, dump_dir, dtype, threads):
    """One update step of a copy of model on batch, dumped to dump_dir."""
    model = copy.deepcopy(model).to(dtype)
    optimizer = torch.optim.Adam(model.parameters(), lr=settings.lr)
    debugger = PrecisionDebugger(
        Config(task="statistics", level="mix", dump_path=dump_dir, seed=SEED, overwrite=True))
    threads_before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        debugger.start(model)
        loss = update_step(model, optimizer, batch.to(dtype=dtype), settings)
        debugger.stop()
        debugger.step()
    finally:
        torch.set_num_threads(threads_before)
    debugger.close()  # returns once the step file is on disk
    return loss


def compare_update_step(args):
    """Dump one PPO minibatch update in two configurations and compare them."""
    settings = settings_for(args.smoke)
    seed_all(SEED)
    env = make_env()
    model = ActorCritic().to(args.device)
    rollout = collect(model, EpisodeTracker(env, SEED), settings, args.device).to(args.device)
    batch = next(minibatches(rollout, settings))
    env.close()

    threads = torch.get_num_threads()
    if args.candidate == "fp64":
        sides = [("fp32", torch.float32, threads), ("fp64", torch.float64, threads)]
        words = "float32 vs float64 high-precision bench"
    else:
        other = 1 if threads > 1 else 2
        sides = [(f"{threads}threads", torch.float32, threads),
                 (f"{other}threads", torch.float32, other)]
        words = f"{threads} vs {other} CPU thread(s), float32"
    dumps, losses = [], []
    for name, dtype, n_threads in sides:
        dumps.append(os.path.join(args.out, f"update_{name}"))
        losses.append(dump_update(model, batch, settings, dumps[-1], dtype, n_threads))
    result = compare(*dumps)
    html = os.path.join(args.out, "report.html")
    result.write_html(html)
    print(f"\n2. one PPO update step ({len(batch.actions)} samples), {words}")
    print(f"   loss: {losses[0]!r} vs {losses[1]!r}")
    print_compare_summary(result, dumps, html)


def agreeing_episodes(a, b):
    """How many leading episodes have the same return in both runs."""
    count = 0
    for x, y in zip(a, b):
        if x != y:
            break
        count += 1
    return count


def launch_training(args, device, result, config=None):
    """One training in a fresh process; with config, launched as `probe run -c config` does."""
    command = [sys.executable, os.path.abspath(__file__), "--updates", str(args.updates),
               "--device", device, "--out", args.out, "--child", result]
    command += ["--smoke"] if args.smoke else []
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if config is not None:
        command.append("--via-probe-run")
        env = build_env(load_config(config), None, env)
    return subprocess.Popen(command, env=env)


def cross_device(args):
    """3. PPO on the CPU and on args.device, both with random_on_cpu; returns True when equal."""
    config = os.path.join(args.out, "random_on_cpu.json")
    with open(config, "w") as handle:
        json.dump({"seed": SEED, "random_on_cpu": True, "dump_path": os.path.join(args.out, "unused")}, handle)
    sides = [("reference", "cpu", True), ("candidate", args.device, True)]
    if args.device != "cpu":
        sides += [("reference_plain", "cpu", False), ("candidate_plain", args.device, False)]
    started = time.perf_counter()
    jobs = {}
    for name, device, with_key in sides:
        result = os.path.join(args.out, f"cross_{name}_{device}.json")
        jobs[name] = (result, launch_training(args, device, result, config if with_key else None))
    runs = {}
    for name, (result, job) in jobs.items():
        if job.wait() != 0:
            print(f"the {name} training failed", file=sys.stderr)
            return False
        with open(result) as handle:
            runs[name] = json.load(handle)
    reference, candidate = runs["reference"], runs["candidate"]
    same = agreeing_episodes(reference, candidate)
    print(f"\n3. cross-device: PPO on cpu vs on {args.device}, both with \"random_on_cpu\": true "
          f"(launched by probe run; {time.perf_counter() - started:.0f} s)")
    print(f"   episodes: {len(reference)} and {len(candidate)}; identical returns: {same} of "
          f"{min(len(reference), len(candidate))} episodes")
    equal = reference == candidate
    print(f"   episode returns identical across devices: {'yes' if equal else 'NO'}")
    if args.device != "cpu":
        plain = agreeing_episodes(runs["reference_plain"], runs["candidate_plain"])
        print(f"   without random_on_cpu: identical for the first {plain} episodes")
    return equal


def main():
    parser = example_parser(__doc__, "reinforcement_learning", "2 updates of 128 steps")
    parser.add_argument("--updates", type=int, default=8, help="PPO rollouts+updates per training")
    parser.add_argument("--candidate", choices=["fp64", "threads"], default="fp64")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--via-probe-run", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.smoke:
        args.updates = 2
    os.makedirs(args.out, exist_ok=True)

    if args.child:
        with open(args.child, "w") as handle:
            json.dump(seeded_training(args.updates, args.smoke, args.device, args.via_probe_run), handle)
        return 0

    files = [os.path.join(args.out, f"returns_run{run}.json") for run in (1, 2)]
    command = [sys.executable, os.path.abspath(__file__), "--updates", str(args.updates),
               "--device", args.device, "--out", args.out] + (["--smoke"] if args.smoke else [])
    # Both trainings at once, each in a fresh interpreter: nothing is shared but the seed.
    # One thread each: they share the machine's cores (small matmuls gain nothing from more).
    env = dict(os.environ, OMP_NUM_THREADS="1")
    jobs = [subprocess.Popen(command + ["--child", path], env=env) for path in files]
    if any(job.wait() != 0 for job in jobs):
        print("a training run failed", file=sys.stderr)
        return 2
    runs = []
    for path in files:
        with open(path) as handle:
            runs.append(json.load(handle))
    same = runs[0] == runs[1]
    print(f"1. PPO on CartPole-v1, {args.updates} updates, twice in fresh processes on {args.device}")
    print(f"   episodes: {len(runs[0])} and {len(runs[1])}; last 5 returns run 1: "
          f"{runs[0][-5:]}, run 2: {runs[1][-5:]}")
    print(f"   episode returns repeat exactly: {'yes' if same else 'NO'}")

    compare_update_step(args)
    cross_same = cross_device(args)
    return 0 if same and cross_same else 1


if __name__ == "__main__":
    sys.exit(main())
