"""PPO on CartPole-v1, collected by rlcollect's `MultiSyncCollector` (or `MultiAsyncCollector`).

Two worker processes each step several CartPole copies with the current actor; every batch
holds one contribution from every worker, all collected with the same weights. The learner
computes GAE on the batch, runs a few epochs of clipped PPO on it, and pushes the new actor
weights to the workers (shared memory) before the next batch.

    .venv/bin/python examples/ppo_cartpole.py --seed 1 --out ppo_cartpole.png

With `--collector async` each batch is one worker's, delivered as soon as it is ready: it may
have been collected by an older actor (its version is in `("collector", "policy_version")`),
and the probability ratio is taken against that actor (kept for the last versions).
`--max-policy-lag k --lag-policy drop|wait|tag` bounds how old (docs/staleness.md);
`--record path` writes the run's schedule and `--replay path` replays it exactly.

It prints one line per batch (frames, mean return of the episodes that finished in the batch,
losses, frames/s) and writes a learning curve (PNG, plus the same data as CSV next to it).
Only rlcollect's public API is used: copy this file and change it.
"""

from __future__ import annotations

import argparse
import ast
import copy
import csv
import dataclasses
import inspect
import logging
import math
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.distributions import Categorical

from rlcollect import GymEnv, MLflowLogger, MultiAsyncCollector, MultiSyncCollector, TensorBoardLogger, WandbLogger


@dataclass
class Args:
    seed: int = 1
    """seed of the run: network initialisation, environments and action sampling"""
    env_id: str = "CartPole-v1"
    """gymnasium id of the environment (discrete actions, vector observations)"""
    total_frames: int = 300_000
    """environment steps to collect over the whole run"""
    workers: int = 2
    """worker processes, each stepping `envs_per_worker` environments"""
    envs_per_worker: int = 8
    """environment copies per worker (batched in-process by `GymEnv(num_envs=...)`)"""
    frames_per_batch: int = 2000
    """frames in each batch, all workers together (the rollout length of one PPO update)"""
    learning_rate: float = 1e-3
    """Adam learning rate at the start; it decays linearly to 0 over `total_frames`"""
    gamma: float = 0.99
    """discount factor"""
    gae_lambda: float = 0.95
    """lambda of generalised advantage estimation"""
    epochs: int = 10
    """passes over each batch"""
    minibatch_size: int = 250
    """frames per gradient step"""
    clip_coef: float = 0.2
    """PPO's clipping of the probability ratio"""
    ent_coef: float = 0.01
    """weight of the entropy bonus"""
    vf_coef: float = 0.5
    """weight of the value loss"""
    max_grad_norm: float = 0.5
    """gradients are clipped to this global norm"""
    hidden: int = 64
    """width of the two hidden layers of the actor and of the critic"""
    torch_threads: int = 1
    """torch threads of the learner (the workers use one each)"""
    target_return: float | None = None
    """the return counted as solved, reported and drawn on the plot (default: the env's reward_threshold in
    gymnasium's registry: 475 for CartPole-v1, -100 for Acrobot-v1, 200 for LunarLander-v3; none if it has none)"""
    out: str = "ppo_cartpole.png"
    """where to write the learning curve (PNG); the same data goes to a .csv beside it"""
    collector: str = "sync"
    """"sync" (MultiSyncCollector) or "async" (MultiAsyncCollector: each batch is one worker's
    frames_per_batch / workers frames)"""
    max_policy_lag: int = -1
    """async: deliver no frame more than this many policy versions old (-1: no bound)"""
    lag_policy: str = "drop"
    """async, with max_policy_lag: "drop", "wait" or "tag" (docs/staleness.md)"""
    record: str = ""
    """async: write the run's schedule to this file (empty: none)"""
    replay: str = ""
    """async: replay the schedule recorded in this file (same seed and arguments)"""
    tensorboard: str = ""
    """a folder for TensorBoard event files: the collector's stats() and this script's return and losses
    after every batch (empty: none; needs pip install 'rlcollect[tensorboard]')"""
    wandb: str = ""
    """a Weights & Biases project to write the same to ($WANDB_MODE=offline keeps the run on disk; empty: none;
    needs pip install 'rlcollect[wandb]')"""
    mlflow: str = ""
    """an MLflow experiment to write the same to, at $MLFLOW_TRACKING_URI (empty: none; needs
    pip install 'rlcollect[mlflow]')"""


def mlp(in_dim: int, out_dim: int, hidden: int, out_std: float) -> nn.Sequential:
    """Two tanh hidden layers, orthogonal init (the output layer scaled by `out_std`)."""
    layers = [nn.Linear(in_dim, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(), nn.Linear(hidden, out_dim)]
    for layer in layers:
        if isinstance(layer, nn.Linear):
            nn.init.orthogonal_(layer.weight, out_std if layer is layers[-1] else math.sqrt(2))
            nn.init.zeros_(layer.bias)
    return nn.Sequential(*layers)


class Actor(nn.Module):
    """The policy. This module is what runs in the workers: `forward` samples an action.

    It is defined at module level so that it pickles by reference (workers may be started from a fresh interpreter).
    """

    def __init__(self, obs_dim: int, n_actions: int, hidden: int):
        super().__init__()
        self.net = mlp(obs_dim, n_actions, hidden, out_std=0.01)

    def distribution(self, observation: torch.Tensor) -> Categorical:
        return Categorical(logits=self.net(observation))

    def forward(self, observation: torch.Tensor) -> torch.Tensor:
        return self.distribution(observation).sample()


class Critic(nn.Module):
    """The state-value function V(s); it lives in the learner only."""

    def __init__(self, obs_dim: int, hidden: int):
        super().__init__()
        self.net = mlp(obs_dim, 1, hidden, out_std=1.0)

    def forward(self, observation: torch.Tensor) -> torch.Tensor:
        return self.net(observation).squeeze(-1)


def gae(reward, value, next_value, terminated, done, gamma: float, lam: float):
    """Generalised advantage estimation over tensors of shape (env streams, T).

    - A step that *terminated* has no future: its next value is 0.
    - A step that was *truncated* (CartPole's 500-step limit) still has one: we bootstrap from
      V(next observation), the true final observation the collector stores under "next".
    - Either way (done) the advantage does not flow back across the episode boundary.
    - The batch's last step is not an episode end: the trajectory continues in the next batch,
      so we bootstrap from V(next observation) there too.
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
            log_prob = dist.log_prob(data["action"][idx])
            log_ratio = log_prob - data["log_prob"][idx]
            ratio = log_ratio.exp()
            adv = data["advantage"][idx]
            adv = (adv - adv.mean()) / (adv.std() + 1e-8)
            policy_loss = torch.max(-adv * ratio, -adv * ratio.clamp(1 - args.clip_coef, 1 + args.clip_coef)).mean()
            value_loss = 0.5 * (critic(data["observation"][idx]) - data["return"][idx]).pow(2).mean()
            entropy = dist.entropy().mean()
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


def train(args: Args) -> list[dict]:
    torch.set_num_threads(args.torch_threads)
    torch.manual_seed(args.seed)
    probe = GymEnv(args.env_id)  # only to read the spaces
    obs_dim, n_actions = probe.observation_space.shape[0], probe.action_space.n
    probe.close()
    actor = Actor(obs_dim, n_actions, args.hidden)
    critic = Critic(obs_dim, args.hidden)
    optimizer = torch.optim.Adam([*actor.parameters(), *critic.parameters()], lr=args.learning_rate, eps=1e-5)
    start = time.perf_counter()  # the clock includes starting the workers

    env = partial(GymEnv, args.env_id, num_envs=args.envs_per_worker)
    logging.info("starting %d worker processes (each imports torch and makes its envs)", args.workers)
    if args.collector == "async":
        options = {}
        if args.max_policy_lag >= 0:
            options.update(max_policy_lag=args.max_policy_lag, lag_policy=args.lag_policy)
        if args.record:
            options["record"] = args.record
        if args.replay:
            options["replay"] = args.replay
        collector = MultiAsyncCollector(env, actor, num_workers=args.workers,
                                        frames_per_batch=args.frames_per_batch // args.workers,
                                        total_frames=args.total_frames, num_threads=args.torch_threads,
                                        track_policy_version=True, **options)
    else:
        collector = MultiSyncCollector(
            env,
            actor,  # sent to the workers once; later updates travel through shared memory
            num_workers=args.workers,
            frames_per_batch=args.frames_per_batch,
            total_frames=args.total_frames,
            num_threads=args.torch_threads,
        )
    collector.set_seed(args.seed)
    running_returns = torch.zeros(args.workers, args.envs_per_worker)  # one per env stream
    last_traj = torch.full((args.workers, args.envs_per_worker), -1, dtype=torch.long)  # each stream's last traj id
    behaviour = {0: copy.deepcopy(actor.state_dict())}  # async: the actors of the last versions
    old_actor = copy.deepcopy(actor)
    loggers = [make(name) for name, make in ((args.tensorboard, TensorBoardLogger), (args.wandb, WandbLogger),
                                             (args.mlflow, MLflowLogger)) if name]
    history = []
    frames = 0
    logging.info("%d worker processes started (%.1f s so far); waiting for the first batch", args.workers,
                 time.perf_counter() - start)
    with collector:
        for batch in collector:
            if args.collector == "async":  # one worker's (envs, T): its streams' running returns
                worker = int(batch["collector", "worker_id"].flatten()[0])
                version = int(batch["collector", "policy_version"].flatten()[0])
                streams = running_returns[worker]
            else:
                version, streams = None, running_returns.view(-1)
            # (workers, envs, T) -> (env streams, T): rows are independent streams, time is last.
            batch = batch.reshape(-1, batch.shape[-1])
            learning_rate = args.learning_rate * (1.0 - frames / args.total_frames)  # linear decay
            frames += batch.numel()
            obs, next_obs = batch["observation"], batch["next", "observation"]
            reward = batch["next", "reward"].squeeze(-1)
            terminated = batch["next", "terminated"].squeeze(-1)
            done = batch["next", "done"].squeeze(-1)

            # A stream whose episode went on in frames this learner never saw (a batch dropped for
            # its policy lag) does not know that episode's return: it is left out (-inf).
            rows = slice(worker, worker + 1) if version is not None else slice(None)
            traj, seen = batch["collector", "traj_ids"], last_traj[rows].reshape(-1)
            streams[(seen >= 0) & (traj[:, 0] != seen)] = -math.inf
            last_traj[rows] = traj[:, -1].reshape(last_traj[rows].shape)
            returns = [r for r in finished_episode_returns(reward, done, streams) if r != -math.inf]

            with torch.no_grad():
                # the weights that collected this batch: the workers act with exactly these
                acted = actor
                if version is not None and version != collector.policy_version:  # async: an older actor
                    old_actor.load_state_dict(behaviour[version])
                    acted = old_actor
                log_prob = acted.distribution(obs).log_prob(batch["action"])
                advantage, value_target = gae(
                    reward, critic(obs), critic(next_obs), terminated, done, args.gamma, args.gae_lambda
                )

            for group in optimizer.param_groups:
                group["lr"] = learning_rate
            data = {"observation": obs, "action": batch["action"], "log_prob": log_prob,
                    "advantage": advantage, "return": value_target}
            data = {key: value.flatten(0, 1) for key, value in data.items()}  # (streams, T) -> frames
            losses = ppo_update(actor, critic, optimizer, data, args)
            collector.update_policy_weights_()  # the next batch is collected with the new actor
            if args.collector == "async":
                behaviour[collector.policy_version] = copy.deepcopy(actor.state_dict())
                for old_version in [v for v in behaviour if v < collector.policy_version - 64]:
                    del behaviour[old_version]

            elapsed = time.perf_counter() - start
            row = {"frames": frames, "mean_return": float(np.mean(returns)) if returns else float("nan"),
                   "episodes": len(returns), **losses, "fps": frames / elapsed, "elapsed_s": elapsed}
            if args.collector == "async":
                stats = collector.stats()
                # episode ends seen (with or without their return): frames / ends estimates the mean
                # episode length (CartPole's return) also where batches were dropped
                row.update(worker=worker, policy_lag=collector.policy_version - 1 - version,
                           lag_dropped_frames=stats["lag_dropped_frames"], episode_ends=int(done.sum()))
            history.append(row)
            for logger in loggers:
                logger.log(collector, step=frames)  # env-step latency, policy lag, time waiting, ...
                logger.write({f"train/{key}": value for key, value in row.items()
                              if key != "frames" and not math.isnan(value)}, frames)
            print(f"frames {frames:>7,d}  return {row['mean_return']:6.1f} ({len(returns):3d} episodes)  "
                  f"policy {losses['policy_loss']:+.4f}  value {losses['value_loss']:8.3f}  "
                  f"entropy {losses['entropy']:.3f}  kl {losses['approx_kl']:.4f}  "
                  f"{row['fps']:,.0f} fps  {elapsed:5.1f} s", flush=True)
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
        kind = float if field.name == "target_return" else type(field.default)  # (its default: None)
        parser.add_argument(f"--{field.name.replace('_', '-')}", type=kind, default=field.default,
                            help=docs.get(field.name, ""))
    args = Args(**vars(parser.parse_args()))
    if args.target_return is None:  # the env's own threshold, where gymnasium's registry has one
        import gymnasium

        args.target_return = gymnasium.spec(args.env_id).reward_threshold
    return args


def summarize(history: list[dict], args: Args) -> None:
    last = history[-1]
    print(f"done: {last['frames']:,d} frames in {last['elapsed_s']:.1f} s ({last['fps']:,.0f} fps)")
    reached = None if args.target_return is None else next(
        (row for row in history if row["mean_return"] >= args.target_return), None)
    if args.target_return is None:
        print(f"no target return: {args.env_id} has no reward_threshold in gymnasium's registry (--target-return)")
    elif reached:
        print(f"mean return >= {args.target_return:g} first at {reached['frames']:,d} frames "
              f"({reached['elapsed_s']:.1f} s)")
        below = [i for i, row in enumerate(history) if row["mean_return"] < args.target_return]  # NaN: no episode ended
        if not below or below[-1] + 1 < len(history):
            stays = history[below[-1] + 1] if below else history[0]
            print(f"mean return >= {args.target_return:g} in every batch from {stays['frames']:,d} frames on")
    else:
        print(f"mean return never reached {args.target_return:g}")
    tail = [row["mean_return"] for row in history[-5:] if not math.isnan(row["mean_return"])]
    if tail:
        print(f"mean return over the last 5 batches: {np.mean(tail):.1f}")
    else:
        print("no episode ended in the last 5 batches")


def write_curve(history: list[dict], args: Args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_suffix(".csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(history[0]))
        writer.writeheader()
        writer.writerows(history)
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["frames"] for r in history], [r["mean_return"] for r in history], marker=".", label=f"seed {args.seed}")
    if args.target_return is not None:
        ax.axhline(args.target_return, color="grey", linestyle="--", linewidth=1, label=f"{args.target_return:g}")
    ax.set(xlabel="frames", ylabel="mean return of episodes finished in the batch",
           title=f"PPO on {args.env_id} (rlcollect {args.collector} collector, "
                 f"{args.workers}x{args.envs_per_worker} envs)")
    ax.legend(loc="lower right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    print(f"learning curve: {out} (data: {out.with_suffix('.csv')})")


if __name__ == "__main__":  # the guard matters: with the fork server or "spawn", workers import this file
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")  # the phases
    args = parse_args()
    history = train(args)
    summarize(history, args)
    write_curve(history, args)
