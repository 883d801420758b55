"""PPO with a Gaussian policy on a MuJoCo task (Hopper-v5), collected by `MultiSyncCollector`.

Two worker processes each step several MuJoCo copies with the current actor, a diagonal Gaussian
over the actions. Every batch holds one contribution from every worker, all collected with the
same weights. The learner computes GAE on the batch, runs a few epochs of clipped PPO on it, and
pushes the new actor (weights and its observation normaliser) to the workers before the next batch.

    .venv/bin/python examples/ppo_mujoco.py --seed 1 --out ppo_hopper.png

Needs `pip install 'rlcollect[mujoco]'`. It prints one line per batch (frames, mean return of the
episodes that finished in the batch, losses, frames/s of collection and of training) and writes a
learning curve (PNG, plus the same data as CSV next to it). Only rlcollect's public API is used:
copy this file and change it.
"""

from __future__ import annotations

import argparse
import ast
import csv
import dataclasses
import inspect
import logging
import math
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import gymnasium as gym
import numpy as np
import torch
from torch import nn
from torch.distributions import Normal

from rlcollect import GymEnv, MLflowLogger, MultiSyncCollector, TensorBoardLogger, WandbLogger


@dataclass
class Args:
    seed: int = 1
    """seed of the run: network initialisation, environments and action sampling"""
    env_id: str = "Hopper-v5"
    """gymnasium id of the MuJoCo task (continuous actions in [-1, 1], vector observations)"""
    total_frames: int = 500_000
    """environment steps to collect over the whole run"""
    workers: int = 2
    """worker processes, each stepping `envs_per_worker` environments"""
    envs_per_worker: int = 4
    """environment copies per worker (batched in-process by `GymEnv(num_envs=...)`)"""
    frames_per_batch: int = 2000
    """frames in each batch, all workers together (the rollout length of one PPO update)"""
    learning_rate: float = 3e-4
    """Adam learning rate at the start; it decays linearly to 0 over `total_frames`"""
    gamma: float = 0.99
    """discount factor"""
    gae_lambda: float = 0.95
    """lambda of generalised advantage estimation"""
    epochs: int = 10
    """passes over each batch"""
    minibatch_size: int = 64
    """frames per gradient step"""
    clip_coef: float = 0.2
    """PPO's clipping of the probability ratio"""
    ent_coef: float = 0.0
    """weight of the entropy bonus"""
    vf_coef: float = 0.5
    """weight of the value loss"""
    max_grad_norm: float = 0.5
    """gradients are clipped to this global norm"""
    hidden: int = 64
    """width of the two hidden layers of the actor and of the critic"""
    torch_threads: int = 1
    """torch threads of the learner (the workers use one each)"""
    out: str = "ppo_hopper.png"
    """where to write the learning curve (PNG); the same data goes to a .csv beside it"""
    tensorboard: str = ""
    """a folder for TensorBoard event files: the collector's stats() and this script's return and losses
    after every batch (empty: none; needs pip install 'rlcollect[tensorboard]')"""
    wandb: str = ""
    """a Weights & Biases project to write the same to ($WANDB_MODE=offline keeps the run on disk; empty: none;
    needs pip install 'rlcollect[wandb]')"""
    mlflow: str = ""
    """an MLflow experiment to write the same to, at $MLFLOW_TRACKING_URI (empty: none; needs
    pip install 'rlcollect[mlflow]')"""


def make_env(env_id: str) -> gym.Env:
    """One MuJoCo env; actions outside [-1, 1] (a Gaussian's tails) are clipped by the env wrapper,
    while the batch keeps the action the policy sampled (its log-probability is the one PPO needs)."""
    return gym.wrappers.ClipAction(gym.make(env_id))


def mlp(in_dim: int, out_dim: int, hidden: int, out_std: float) -> nn.Sequential:
    """Two tanh hidden layers, orthogonal init (the output layer scaled by `out_std`)."""
    layers = [nn.Linear(in_dim, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(), nn.Linear(hidden, out_dim)]
    for layer in layers:
        if isinstance(layer, nn.Linear):
            nn.init.orthogonal_(layer.weight, out_std if layer is layers[-1] else math.sqrt(2))
            nn.init.zeros_(layer.bias)
    return nn.Sequential(*layers)


class Normalizer(nn.Module):
    """Running mean and variance of the observations, kept as buffers: `update_policy_weights_()`
    sends buffers with the weights, so the workers normalise exactly as the learner does."""

    def __init__(self, dim: int):
        super().__init__()
        self.register_buffer("mean", torch.zeros(dim))
        self.register_buffer("var", torch.ones(dim))
        self.register_buffer("count", torch.tensor(1e-4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ((x - self.mean) / torch.sqrt(self.var + 1e-8)).clamp(-10, 10)

    @torch.no_grad()
    def update(self, x: torch.Tensor) -> None:
        """Merge the statistics of a batch of observations (rows) into the running ones."""
        n, mean, var = x.shape[0], x.mean(0), x.var(0, unbiased=False)
        total = self.count + n
        delta = mean - self.mean
        self.var.copy_((self.var * self.count + var * n + delta.pow(2) * self.count * n / total) / total)
        self.mean.add_(delta * n / total)
        self.count.copy_(total)


class Actor(nn.Module):
    """The policy. This module is what runs in the workers: `forward` samples an action from a
    diagonal Gaussian (state-dependent mean, learned state-independent log-std).

    It is defined at module level so that it pickles by reference (workers may be started from a fresh interpreter).
    """

    def __init__(self, obs_dim: int, act_dim: int, hidden: int):
        super().__init__()
        self.normalize = Normalizer(obs_dim)
        self.mean = mlp(obs_dim, act_dim, hidden, out_std=0.01)
        self.log_std = nn.Parameter(torch.zeros(act_dim))

    def distribution(self, observation: torch.Tensor) -> Normal:
        mean = self.mean(self.normalize(observation))
        return Normal(mean, self.log_std.exp().expand_as(mean))

    def forward(self, observation: torch.Tensor) -> torch.Tensor:
        return self.distribution(observation).sample()


class Critic(nn.Module):
    """The state-value function V(s) of a normalised observation; it lives in the learner only."""

    def __init__(self, obs_dim: int, hidden: int):
        super().__init__()
        self.net = mlp(obs_dim, 1, hidden, out_std=1.0)

    def forward(self, observation: torch.Tensor) -> torch.Tensor:
        return self.net(observation).squeeze(-1)


class RewardScaler:
    """Divides rewards by the running standard deviation of the discounted return (what
    gymnasium's `NormalizeReward` does), here in the learner so that the batch keeps the true
    rewards and the reported returns are the task's own."""

    def __init__(self, streams: int, gamma: float):
        self.gamma, self.discounted = gamma, torch.zeros(streams)
        self.count, self.mean, self.var = 1e-4, 0.0, 1.0

    def __call__(self, reward: torch.Tensor, done: torch.Tensor) -> torch.Tensor:
        seen = []
        for t in range(reward.shape[1]):
            self.discounted = self.discounted * self.gamma + reward[:, t]
            seen.append(self.discounted.clone())
            self.discounted[done[:, t]] = 0.0
        seen = torch.stack(seen)
        n, mean, var = seen.numel(), seen.mean().item(), seen.var(unbiased=False).item()
        total = self.count + n
        delta = mean - self.mean
        self.var = (self.var * self.count + var * n + delta**2 * self.count * n / total) / total
        self.mean += delta * n / total
        self.count = total
        return (reward / math.sqrt(self.var + 1e-8)).clamp(-10, 10)


def gae(reward, value, next_value, terminated, done, gamma: float, lam: float):
    """Generalised advantage estimation over tensors of shape (env streams, T).

    A step that *terminated* (the hopper fell) has no future: its next value is 0. A step that
    was *truncated* (the 1,000-step limit) and the batch's last step bootstrap from
    V(next observation), the true final observation the collector stores under "next". The
    advantage does not flow back across an episode boundary (done).
    """
    advantages = torch.zeros_like(reward)
    running = torch.zeros_like(reward[:, 0])
    for t in reversed(range(reward.shape[1])):
        delta = reward[:, t] + gamma * next_value[:, t] * (~terminated[:, t]) - value[:, t]
        running = delta + gamma * lam * (~done[:, t]) * running
        advantages[:, t] = running
    return advantages, advantages + value


def finished_episode_returns(reward: torch.Tensor, done: torch.Tensor, running: torch.Tensor) -> list[float]:
    """Returns of the episodes that end in this batch. `running` (one entry per env stream)
    carries the partial sums of unfinished episodes from one batch to the next."""
    finished = []
    for t in range(reward.shape[1]):
        running += reward[:, t]
        finished += running[done[:, t]].tolist()
        running[done[:, t]] = 0.0
    return finished


def ppo_update(actor, critic, optimizer, data: dict[str, torch.Tensor], args: Args) -> dict[str, float]:
    """Clipped PPO on one flattened batch; returns the mean of each loss over all minibatches."""
    n = data["observation"].shape[0]
    sums = {"policy_loss": 0.0, "value_loss": 0.0, "entropy": 0.0, "approx_kl": 0.0}
    steps = 0
    for _ in range(args.epochs):
        for idx in torch.randperm(n).split(args.minibatch_size):
            dist = actor.distribution(data["observation"][idx])
            log_prob = dist.log_prob(data["action"][idx]).sum(-1)
            log_ratio = log_prob - data["log_prob"][idx]
            ratio = log_ratio.exp()
            adv = data["advantage"][idx]
            adv = (adv - adv.mean()) / (adv.std() + 1e-8)
            policy_loss = torch.max(-adv * ratio, -adv * ratio.clamp(1 - args.clip_coef, 1 + args.clip_coef)).mean()
            value_loss = 0.5 * (critic(data["normalized"][idx]) - data["return"][idx]).pow(2).mean()
            entropy = dist.entropy().sum(-1).mean()
            loss = policy_loss - args.ent_coef * entropy + args.vf_coef * value_loss

            optimizer.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_([*actor.parameters(), *critic.parameters()], args.max_grad_norm)
            optimizer.step()

            with torch.no_grad():
                approx_kl = ((ratio - 1) - log_ratio).mean()
            for key, value in zip(sums, (policy_loss, value_loss, entropy, approx_kl)):
                sums[key] += value.item()
            steps += 1
    return {key: value / steps for key, value in sums.items()}


def train(args: Args, log=lambda row: None) -> list[dict]:
    torch.set_num_threads(args.torch_threads)
    torch.manual_seed(args.seed)
    probe = make_env(args.env_id)  # only to read the spaces
    obs_dim, act_dim = probe.observation_space.shape[0], probe.action_space.shape[0]
    probe.close()
    actor = Actor(obs_dim, act_dim, args.hidden)
    critic = Critic(obs_dim, args.hidden)
    optimizer = torch.optim.Adam([*actor.parameters(), *critic.parameters()], lr=args.learning_rate, eps=1e-5)
    start = time.perf_counter()  # the clock includes starting the workers

    logging.info("starting %d worker processes (each imports torch and makes its envs)", args.workers)
    collector = MultiSyncCollector(
        partial(GymEnv, partial(make_env, args.env_id), num_envs=args.envs_per_worker),
        actor,  # sent to the workers once; later updates travel through shared memory
        num_workers=args.workers,
        frames_per_batch=args.frames_per_batch,
        total_frames=args.total_frames,
        num_threads=args.torch_threads,
    )
    collector.set_seed(args.seed)
    streams = args.workers * args.envs_per_worker
    running_returns = torch.zeros(streams)
    scale_reward = RewardScaler(streams, args.gamma)
    history = []
    frames, collect_s, train_s = 0, 0.0, 0.0
    logging.info("%d worker processes started (%.1f s so far); waiting for the first batch", args.workers,
                 time.perf_counter() - start)
    loggers = [make(name) for name, make in ((args.tensorboard, TensorBoardLogger), (args.wandb, WandbLogger),
                                             (args.mlflow, MLflowLogger)) if name]
    with collector:
        waited = time.perf_counter()
        for batch in collector:
            got = time.perf_counter()
            collect_s += got - waited
            # (workers, envs, T) -> (env streams, T): rows are independent streams, time is last.
            batch = batch.reshape(-1, batch.shape[-1])
            learning_rate = args.learning_rate * (1.0 - frames / args.total_frames)  # linear decay
            frames += batch.numel()
            obs, next_obs = batch["observation"], batch["next", "observation"]
            reward = batch["next", "reward"].squeeze(-1)
            terminated = batch["next", "terminated"].squeeze(-1)
            done = batch["next", "done"].squeeze(-1)

            returns = finished_episode_returns(reward, done, running_returns)
            scaled_reward = scale_reward(reward, done)

            with torch.no_grad():
                # the weights (and normaliser) that collected this batch: the workers act with exactly these
                log_prob = actor.distribution(obs).log_prob(batch["action"]).sum(-1)
                normalized, next_normalized = actor.normalize(obs), actor.normalize(next_obs)
                advantage, value_target = gae(scaled_reward, critic(normalized), critic(next_normalized),
                                              terminated, done, args.gamma, args.gae_lambda)

            for group in optimizer.param_groups:
                group["lr"] = learning_rate
            data = {"observation": obs, "normalized": normalized, "action": batch["action"],
                    "log_prob": log_prob, "advantage": advantage, "return": value_target}
            data = {key: value.flatten(0, 1) for key, value in data.items()}  # (streams, T) -> frames
            losses = ppo_update(actor, critic, optimizer, data, args)
            actor.normalize.update(data["observation"])
            collector.update_policy_weights_()  # the next batch is collected with the new actor
            waited = time.perf_counter()
            train_s += waited - got

            elapsed = waited - start
            row = {"frames": frames, "mean_return": float(np.mean(returns)) if returns else float("nan"),
                   "episodes": len(returns), **losses, "fps": frames / elapsed, "collect_s": collect_s,
                   "train_s": train_s, "elapsed_s": elapsed}
            history.append(row)
            for logger in loggers:
                logger.log(collector, step=frames)  # env-step latency, policy lag, time waiting, ...
                logger.write({f"train/{key}": value for key, value in row.items()
                              if key != "frames" and isinstance(value, (int, float)) and not math.isnan(value)},
                             frames)
            log(row)
            print(f"frames {frames:>9,d}  return {row['mean_return']:7.1f} ({len(returns):3d} episodes)  "
                  f"policy {losses['policy_loss']:+.4f}  value {losses['value_loss']:7.3f}  "
                  f"entropy {losses['entropy']:+.3f}  kl {losses['approx_kl']:.4f}  "
                  f"{row['fps']:,.0f} fps  {elapsed:6.1f} s", flush=True)
    for logger in loggers:
        logger.close()
    return history


# ================================================================================================
# The plumbing: command line, summary, learning curve. Nothing about PPO below this line.
# ================================================================================================


def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of a dataclass (Python keeps none at run time)."""
    docs, body = {}, ast.parse(inspect.getsource(cls)).body[0].body
    for node, after in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant):
            docs[node.target.id] = after.value.value
    return docs


def parse_args() -> Args:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    docs = field_docs(Args)
    for field in dataclasses.fields(Args):
        parser.add_argument(f"--{field.name.replace('_', '-')}", type=type(field.default),
                            default=field.default, help=docs.get(field.name, ""))
    return Args(**vars(parser.parse_args()))


def smoothed(history: list[dict], window: int = 10) -> list[float]:
    """Mean return over the last `window` batches' episodes (few episodes end in one batch)."""
    out = []
    for i in range(len(history)):
        rows = history[max(0, i - window + 1):i + 1]
        n = sum(r["episodes"] for r in rows)
        out.append(sum(r["mean_return"] * r["episodes"] for r in rows if r["episodes"]) / n if n else float("nan"))
    return out


def summarize(history: list[dict], args: Args) -> None:
    last = history[-1]
    print(f"done: {last['frames']:,d} frames in {last['elapsed_s']:.1f} s ({last['fps']:,.0f} fps); "
          f"waiting for batches {last['collect_s']:.1f} s ({last['frames'] / last['collect_s']:,.0f} frames/s), "
          f"training {last['train_s']:.1f} s ({last['frames'] / last['train_s']:,.0f} frames/s)")
    finite = [row["mean_return"] for row in history if not math.isnan(row["mean_return"])]
    if finite:
        first = finite[:3]
        print(f"mean return: first 3 batches {np.mean(first):.1f}, best batch {max(finite):.1f}, "
              f"last 10 batches {np.mean(finite[-10:]):.1f}")


class CsvLog:
    """Appends each batch's row to the CSV as it comes (a long run stopped early keeps its data)."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.file, self.writer = open(path, "w", newline=""), None

    def __call__(self, row: dict) -> None:
        if self.writer is None:
            self.writer = csv.DictWriter(self.file, fieldnames=list(row))
            self.writer.writeheader()
        self.writer.writerow(row)
        self.file.flush()


def write_curve(history: list[dict], args: Args) -> None:
    out = Path(args.out)
    try:
        import matplotlib
    except ImportError:
        print(f"matplotlib is not installed: no PNG; data: {out.with_suffix('.csv')}")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    frames = [r["frames"] for r in history]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(frames, [r["mean_return"] for r in history], ".", alpha=0.3, label=f"seed {args.seed}, per batch")
    ax.plot(frames, smoothed(history), label="mean over 10 batches")
    ax.set(xlabel="frames", ylabel="return of episodes finished",
           title=f"PPO on {args.env_id} (rlcollect MultiSyncCollector, {args.workers}x{args.envs_per_worker} envs)")
    ax.legend(loc="upper left")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    print(f"learning curve: {out} (data: {out.with_suffix('.csv')})")


if __name__ == "__main__":  # the guard matters: with the fork server or "spawn", workers import this file
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")  # the phases
    args = parse_args()
    history = train(args, log=CsvLog(Path(args.out).with_suffix(".csv")))
    summarize(history, args)
    write_curve(history, args)
