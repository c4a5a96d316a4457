"""A small PPO (clipped surrogate, GAE) for CartPole, in plain torch.

Every random draw goes through torch's global generator (action sampling, minibatch order)
or through the environment's own seeded generators, so seed_all plus env.reset(seed=...) and
action_space.seed(...) make a whole training run repeat exactly.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.distributions import Categorical


class ActorCritic(nn.Module):
    """Separate policy and value MLPs (tanh), the usual PPO shape for classic control."""

    def __init__(self, obs_dim: int = 4, n_actions: int = 2, hidden: int = 64):
        super().__init__()
        self.policy = nn.Sequential(
            nn.Linear(obs_dim, hidden), nn.Tanh(),
            nn.Linear(hidden, hidden), nn.Tanh(),
            nn.Linear(hidden, n_actions),
        )
        self.value = nn.Sequential(
            nn.Linear(obs_dim, hidden), nn.Tanh(),
            nn.Linear(hidden, hidden), nn.Tanh(),
            nn.Linear(hidden, 1),
        )

    def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.policy(obs), self.value(obs).squeeze(-1)


@dataclass
class Rollout:
    obs: torch.Tensor
    actions: torch.Tensor
    log_probs: torch.Tensor
    advantages: torch.Tensor
    returns: torch.Tensor

    def to(self, device=None, dtype=None) -> "Rollout":
        """A copy on another device; float tensors also cast to dtype (actions stay integer)."""
        def move(t: torch.Tensor) -> torch.Tensor:
            if t.is_floating_point() and dtype is not None:
                return t.to(device=device, dtype=dtype)
            return t.to(device=device)

        return Rollout(*(move(t) for t in (
            self.obs, self.actions, self.log_probs, self.advantages, self.returns)))


@dataclass
class PPOSettings:
    rollout_steps: int = 512
    epochs: int = 4
    minibatch: int = 128
    gamma: float = 0.99
    gae_lambda: float = 0.95
    clip: float = 0.2
    value_coef: float = 0.5
    entropy_coef: float = 0.01
    lr: float = 3e-3


class EpisodeTracker:
    """Keeps the environment's current observation and the return of every finished episode."""

    def __init__(self, env, seed: int):
        self.env = env
        # Seeding reset() once seeds the environment's generator for all later resets;
        # the action space has its own generator, used by anything that calls sample().
        self.obs, _ = env.reset(seed=seed)
        env.action_space.seed(seed)
        self.running = 0.0
        self.returns: list[float] = []

    def step(self, action: int) -> tuple[float, bool]:
        obs, reward, terminated, truncated, _ = self.env.step(action)
        self.running += float(reward)
        if terminated or truncated:
            self.returns.append(self.running)
            self.running = 0.0
            obs, _ = self.env.reset()
        self.obs = obs
        # A truncated episode is not a terminal state for the value target, but CartPole's
        # 500-step cap is rare here; treating it as terminal keeps the example short.
        return float(reward), bool(terminated or truncated)


@torch.no_grad()
def collect(model: ActorCritic, tracker: EpisodeTracker, settings: PPOSettings,
            device: torch.device) -> Rollout:
    """Run the current policy for settings.rollout_steps steps; returns GAE advantages."""
    n = settings.rollout_steps
    obs_dim = len(tracker.obs)
    obs_buf = torch.zeros(n, obs_dim)
    actions = torch.zeros(n, dtype=torch.long)
    log_probs, values, rewards, dones = (torch.zeros(n) for _ in range(4))
    for t in range(n):
        obs = torch.as_tensor(tracker.obs, dtype=torch.float32)
        logits, value = model(obs.to(device))
        dist = Categorical(logits=logits)
        action = dist.sample()
        obs_buf[t], actions[t] = obs, action.cpu()
        log_probs[t], values[t] = dist.log_prob(action).cpu(), value.cpu()
        rewards[t], dones[t] = tracker.step(int(action))
    _, last_value = model(torch.as_tensor(tracker.obs, dtype=torch.float32).to(device))
    advantages = gae(rewards, values, dones, float(last_value), settings)
    return Rollout(obs_buf, actions, log_probs, advantages, advantages + values)


def gae(rewards, values, dones, last_value, settings: PPOSettings) -> torch.Tensor:
    advantages = torch.zeros_like(rewards)
    running = 0.0
    for t in reversed(range(len(rewards))):
        next_value = last_value if t == len(rewards) - 1 else float(values[t + 1])
        alive = 1.0 - float(dones[t])
        delta = float(rewards[t]) + settings.gamma * next_value * alive - float(values[t])
        running = delta + settings.gamma * settings.gae_lambda * alive * running
        advantages[t] = running
    return advantages


def ppo_loss(model: ActorCritic, batch: Rollout, settings: PPOSettings) -> torch.Tensor:
    logits, values = model(batch.obs)
    dist = Categorical(logits=logits)
    ratio = torch.exp(dist.log_prob(batch.actions) - batch.log_probs)
    adv = (batch.advantages - batch.advantages.mean()) / (batch.advantages.std() + 1e-8)
    surrogate = torch.min(ratio * adv, torch.clamp(ratio, 1 - settings.clip, 1 + settings.clip) * adv)
    value_loss = (values - batch.returns).pow(2).mean()
    return -surrogate.mean() + settings.value_coef * value_loss - settings.entropy_coef * dist.entropy().mean()


def minibatches(rollout: Rollout, settings: PPOSettings):
    order = torch.randperm(len(rollout.actions))
    for start in range(0, len(order), settings.minibatch):
        index = order[start:start + settings.minibatch]
        yield Rollout(*(t[index] for t in (
            rollout.obs, rollout.actions, rollout.log_probs, rollout.advantages, rollout.returns)))


def update_step(model: ActorCritic, optimizer, batch: Rollout, settings: PPOSettings) -> float:
    """One gradient step on one minibatch: the unit the example dumps."""
    optimizer.zero_grad(set_to_none=True)
    loss = ppo_loss(model, batch, settings)
    loss.backward()
    nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    optimizer.step()
    return float(loss.detach())


def train(model, optimizer, tracker, settings: PPOSettings, updates: int, device) -> list[float]:
    """`updates` rounds of collect + settings.epochs passes of minibatch steps."""
    for _ in range(updates):
        rollout = collect(model, tracker, settings, device).to(device)
        for _ in range(settings.epochs):
            for batch in minibatches(rollout, settings):
                update_step(model, optimizer, batch, settings)
    return tracker.returns


def make_env():
    """CartPole-v1; a clear message, not a traceback, where gymnasium is missing."""
    try:
        import gymnasium
    except ImportError:
        sys.exit("this example needs gymnasium: pip install 'precision-probe[examples]'")
    return gymnasium.make("CartPole-v1")
