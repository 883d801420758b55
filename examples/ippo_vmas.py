"""IPPO on VMAS `navigation` (4 agents), collected by rlcollect's `MultiSyncCollector`.

Two worker processes each step `instances` copies of the VMAS scenario in one call
(`rlcollect.envs.VmasEnv`); every batch holds both workers' `(instances, T)` steps of every
agent, in the grouped layout (`("agents", "observation")`, `("next", "agents", "reward")`, ...:
docs/multi-agent.md). The agents share one Gaussian actor and one critic, each acting on its
own observation (independent PPO with shared parameters); the learner computes GAE per agent
and pushes the new actor weights to the workers before the next batch.

    .venv/bin/python examples/ippo_vmas.py --seed 1 --out ippo_vmas.png

It prints one line per batch (frames, mean reward per agent-step, losses, frames/s) and writes
the learning curve (PNG, and the same data as CSV next to it). Only rlcollect's public API and
`rlcollect.envs.VmasEnv` are used: copy this file and change it.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
from tensordict.nn import TensorDictModule
from torch import nn
from torch.distributions import Normal

from rlcollect import Collector, MultiSyncCollector
from rlcollect.envs import VmasEnv


@dataclass
class Args:
    seed: int = 1
    """seed of the run: networks, VMAS and action sampling"""
    total_frames: int = 600_000
    """instance-steps to collect over the whole run (each is 4 agent-steps)"""
    instances: int = 100
    """VMAS instances per worker, stepped in one call"""
    steps: int = 50
    """steps per instance in each batch"""
    max_steps: int = 100
    """steps of a VMAS episode"""
    learning_rate: float = 1e-3
    """Adam learning rate"""
    gamma: float = 0.99
    """discount factor"""
    gae_lambda: float = 0.9
    """lambda of generalised advantage estimation"""
    epochs: int = 4
    """passes over each batch"""
    minibatches: int = 4
    """gradient steps per epoch"""
    clip_coef: float = 0.2
    """PPO's clipping of the probability ratio"""
    hidden: int = 64
    """width of the hidden layers"""
    out: str = "ippo_vmas.png"
    """where the learning curve goes (the CSV next to it)"""


# -- the algorithm -------------------------------------------------------------------------------
class Actor(nn.Module):
    """A Gaussian policy per agent: the mean from the agent's observation, a learnt log-std."""

    def __init__(self, obs: int, act: int, hidden: int):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(obs, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(),
                                 nn.Linear(hidden, act))
        self.log_std = nn.Parameter(torch.full((act,), -0.5))

    def dist(self, observation: torch.Tensor) -> Normal:
        return Normal(self.net(observation), self.log_std.exp())

    def forward(self, observation: torch.Tensor):
        dist = self.dist(observation)
        action = dist.sample()
        return action.clamp(-1, 1), dist.log_prob(action).sum(-1)


def make_policy(actor: Actor) -> TensorDictModule:
    return TensorDictModule(actor, in_keys=[("agents", "observation")],
                            out_keys=[("agents", "action"), ("agents", "sample_log_prob")])


def gae(reward, value, next_value, done, gamma: float, lam: float) -> torch.Tensor:
    """Advantages over the time dim (dim -2 of ``(..., T, agents)``)."""
    adv = torch.zeros_like(reward)
    last = torch.zeros_like(reward[..., 0, :])
    for t in reversed(range(reward.shape[-2])):
        live = 1.0 - done[..., t, :]
        delta = reward[..., t, :] + gamma * next_value[..., t, :] * live - value[..., t, :]
        last = delta + gamma * lam * live * last
        adv[..., t, :] = last
    return adv


def update(args: Args, actor: Actor, critic: nn.Module, optim, batch) -> dict:
    obs = batch["agents", "observation"]
    reward = batch["next", "agents", "reward"][..., 0]
    done = batch["next", "done"].float().expand(*reward.shape[:-1], 1).expand_as(reward)
    with torch.no_grad():
        value = critic(obs)[..., 0]
        next_value = critic(batch["next", "agents", "observation"])[..., 0]
        adv = gae(reward, value, next_value, done, args.gamma, args.gae_lambda)
        ret = adv + value
    flat = {"obs": obs.reshape(-1, obs.shape[-1]), "act": batch["agents", "action"].reshape(-1, 2),
            "logp": batch["agents", "sample_log_prob"].reshape(-1), "adv": adv.reshape(-1), "ret": ret.reshape(-1)}
    n = flat["adv"].numel()
    for _ in range(args.epochs):
        for idx in torch.randperm(n).chunk(args.minibatches):
            a = flat["adv"][idx]
            a = (a - a.mean()) / (a.std() + 1e-8)
            ratio = (actor.dist(flat["obs"][idx]).log_prob(flat["act"][idx]).sum(-1) - flat["logp"][idx]).exp()
            pg = -torch.min(ratio * a, ratio.clamp(1 - args.clip_coef, 1 + args.clip_coef) * a).mean()
            vf = (critic(flat["obs"][idx])[..., 0] - flat["ret"][idx]).pow(2).mean()
            optim.zero_grad()
            (pg + 0.5 * vf).backward()
            nn.utils.clip_grad_norm_([*actor.parameters(), *critic.parameters()], 1.0)
            optim.step()
    return {"policy_loss": float(pg.detach()), "value_loss": float(vf.detach())}


# -- the plumbing ----------------------------------------------------------------------------------
def make_env(instances: int, max_steps: int, seed: int) -> VmasEnv:
    return VmasEnv(scenario="navigation", num_envs=instances, max_steps=max_steps, seed=seed)


def random_baseline(args: Args) -> float:
    """The mean reward per agent-step of uniformly random actions (the curve's reference)."""
    collector = Collector(make_env(args.instances, args.max_steps, args.seed + 100), None,
                          frames_per_batch=args.instances * args.max_steps,
                          total_frames=4 * args.instances * args.max_steps)
    try:
        return sum(float(b["next", "agents", "reward"].mean()) for b in collector) / 4
    finally:
        collector.shutdown()


def main(args: Args) -> list[dict]:
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    baseline = random_baseline(args)
    probe = make_env(1, args.max_steps, args.seed)
    obs_dim = probe.fake_tensordict()["agents", "observation"].shape[-1]
    actor = Actor(obs_dim, 2, args.hidden)
    critic = nn.Sequential(nn.Linear(obs_dim, args.hidden), nn.Tanh(), nn.Linear(args.hidden, args.hidden), nn.Tanh(),
                           nn.Linear(args.hidden, 1))
    optim = torch.optim.Adam([*actor.parameters(), *critic.parameters()], lr=args.learning_rate)
    policy = make_policy(actor)
    makers = [partial(make_env, args.instances, args.max_steps, args.seed + i) for i in range(2)]
    collector = MultiSyncCollector(makers, policy, frames_per_batch=2 * args.instances * args.steps,
                                   total_frames=args.total_frames)
    collector.set_seed(args.seed)
    rows, frames, start = [], 0, time.perf_counter()
    try:
        for batch in collector:
            frames += batch.numel()
            mean_reward = float(batch["next", "agents", "reward"].mean())
            losses = update(args, actor, critic, optim, batch)
            collector.update_policy_weights_()
            row = {"frames": frames, "mean_reward": mean_reward, "random_mean_reward": baseline, **losses,
                   "fps": frames / (time.perf_counter() - start)}
            rows.append(row)
            print(" ".join(f"{k}={v:.4g}" for k, v in row.items()), flush=True)
    finally:
        collector.shutdown()
    write_curve(rows, Path(args.out))
    return rows


def write_curve(rows: list[dict], out: Path) -> None:
    with open(out.with_suffix(".csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([r["frames"] for r in rows], [r["mean_reward"] for r in rows], label="IPPO")
    ax.axhline(rows[0]["random_mean_reward"], color="grey", linestyle="--", label="random actions")
    ax.legend()
    ax.set_xlabel("instance-steps collected")
    ax.set_ylabel("mean reward per agent-step")
    ax.set_title("IPPO on VMAS navigation (4 agents)")
    fig.tight_layout()
    fig.savefig(out)


def parse(argv=None) -> Args:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for field in dataclasses.fields(Args):
        parser.add_argument(f"--{field.name.replace('_', '-')}", type=type(field.default), default=field.default)
    return Args(**vars(parser.parse_args(argv)))


if __name__ == "__main__":
    main(parse())
