"""PPO on CartPole (examples/reinforcement_learning/ppo.py) under a PrecisionDebugger: the
chaotic training the fingerprint and whole-run compare tests share. The plain CPU run, the
same run with another device's rounding (probe.perturb.other_rounding), and either with a
planted fault. A policy trained on its own rollouts: once the two runs' weights drift apart,
their policies sample other actions and the data part too.

* ``fault=("weight", step)``: after the optimizer step of ``step`` the policy's middle
  Linear weight is multiplied by 1.001 (a per-optimizer post-hook, which torch runs before
  the global one that takes the fingerprint): one parameter, one step.
* ``fault=("eps", step)``: Adam's eps is 1e-6 instead of 1e-8 from the optimizer step of
  ``step`` on (a changed argument).
* ``fault=("tanh", step)``: from ``step`` on, the value network's first Tanh computes
  tanh(x) * 1.001 (a forward bug that begins mid-run).
"""

from __future__ import annotations

import contextlib

import torch

SEED = 1234


def train(dump_path: str, updates: int, lr: float = 3e-3, other: bool = False, fault: tuple | None = None,
          config: dict | None = None, rollout_steps: int = 128, epochs: int = 4, minibatch: int = 64) -> list:
    """``updates`` rollouts of ``rollout_steps`` environment steps, ``epochs`` passes of
    minibatch updates each, every update a debugger step (config: fingerprints only unless
    given); returns the episode returns."""
    from examples.reinforcement_learning.ppo import (
        ActorCritic, EpisodeTracker, PPOSettings, collect, make_env, minibatches, update_step,
    )
    from probe import PrecisionDebugger
    from probe.perturb import other_rounding

    settings = PPOSettings(rollout_steps=rollout_steps, epochs=epochs, minibatch=minibatch, lr=lr)
    kind, at = fault or ("", -1)
    with other_rounding() if other else contextlib.nullcontext():
        debugger = PrecisionDebugger({"dump_path": dump_path, "seed": SEED, "overwrite": True,
                                      **(config or {"fingerprint": True, "step": []})})
        env = make_env()
        tracker = EpisodeTracker(env, SEED)
        model = ActorCritic()
        optimizer = torch.optim.Adam(model.parameters(), lr=lr)
        if kind == "eps":
            def wider(optimizer, args, kwargs):
                if debugger.current_step >= at:
                    optimizer.param_groups[0]["eps"] = 1e-6
            optimizer.register_step_pre_hook(wider)
        if kind == "weight":
            def bug(optimizer, args, kwargs):
                if debugger.current_step == at:
                    with torch.no_grad():
                        model.policy[2].weight.mul_(1.001)
            optimizer.register_step_post_hook(bug)
        if kind == "tanh":
            def scaled(module, inputs, output):
                return output * 1.001 if debugger.current_step >= at and torch.is_grad_enabled() else output
            model.value[1].register_forward_hook(scaled)
        try:
            for _ in range(updates):
                rollout = collect(model, tracker, settings, torch.device("cpu"))
                for _ in range(settings.epochs):
                    for batch in minibatches(rollout, settings):
                        debugger.start(model)
                        update_step(model, optimizer, batch, settings)
                        debugger.stop()
                        debugger.step()
        finally:
            debugger.close()
            env.close()
    return tracker.returns
