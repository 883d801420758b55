"""PPO with a Nature-CNN on an Atari game (Breakout), collected by `MultiSyncCollector`.

Each of two worker processes steps ale-py's C++ `AtariVectorEnv` (84x84 grey frames, 4 stacked,
frameskip 4, no-op starts, FIRE on reset) through rlcollect's `VectorEnv`, acting with the current
actor. Every batch holds one contribution from every worker, all collected with the same weights.
The learner computes GAE on the batch, runs a few epochs of clipped PPO on it, and pushes the new
weights to the workers before the next batch.

    .venv/bin/python examples/ppo_atari.py --seed 1 --out ppo_breakout.png

Needs `pip install 'rlcollect[atari]'` (ale-py bundles the ROMs). A *frame* here is one agent
step, as everywhere in rlcollect (4 emulator frames with frameskip 4). It prints one line per
batch (frames, mean game score of the episodes that finished in the batch, losses, frames/s of
collection and of training) and writes a learning curve (PNG, plus the same data as CSV next to
it). Only rlcollect's public API is used: copy this file and change it.
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

import numpy as np
import torch
from torch import nn
from torch.distributions import Categorical

from rlcollect import MLflowLogger, MultiSyncCollector, TensorBoardLogger, VectorEnv, WandbLogger


@dataclass
class Args:
    seed: int = 1
    """seed of the run: network initialisation, environments and action sampling"""
    game: str = "breakout"
    """ale-py ROM name (breakout, pong, ...)"""
    total_frames: int = 204_800
    """agent steps to collect over the whole run (x4 emulator frames)"""
    workers: int = 2
    """worker processes, each stepping an `AtariVectorEnv` of `envs_per_worker` games"""
    envs_per_worker: int = 4
    """games per worker (stepped by ale-py's C++ vector env, one thread)"""
    frames_per_batch: int = 1024
    """frames in each batch, all workers together (the rollout length of one PPO update)"""
    learning_rate: float = 2.5e-4
    """Adam learning rate at the start; it decays linearly to 0 over `total_frames`"""
    gamma: float = 0.99
    """discount factor"""
    gae_lambda: float = 0.95
    """lambda of generalised advantage estimation"""
    epochs: int = 2
    """passes over each batch (CleanRL uses 4; 2 halves the learner's share of 2 CPU cores)"""
    minibatch_size: int = 256
    """frames per gradient step"""
    clip_coef: float = 0.1
    """PPO's clipping of the probability ratio"""
    ent_coef: float = 0.01
    """weight of the entropy bonus"""
    vf_coef: float = 0.5
    """weight of the value loss"""
    max_grad_norm: float = 0.5
    """gradients are clipped to this global norm"""
    torch_threads: int = 1
    """torch threads of the learner (the workers use one each)"""
    out: str = "ppo_breakout.png"
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


def make_env(game: str, num_envs: int) -> VectorEnv:
    """One worker's games. Rewards stay the game's own (the learner clips them to their sign), so
    the returns reported are game scores; an episode is a whole game (all lives)."""
    from ale_py.vector_env import AtariVectorEnv

    return VectorEnv(AtariVectorEnv(game, num_envs=num_envs, num_threads=1, reward_clipping=False))


def layer_init(layer: nn.Module, std: float = math.sqrt(2)) -> nn.Module:
    nn.init.orthogonal_(layer.weight, std)
    nn.init.zeros_(layer.bias)
    return layer


class Agent(nn.Module):
    """The Nature-CNN (Mnih et al. 2015) trunk with a policy head and a value head.

    This module is what runs in the workers: `forward` samples an action (the value head travels
    with the weights but only the learner uses it). It is defined at module level so that it
    pickles by reference (workers may be started from a fresh interpreter).
    """

    def __init__(self, n_actions: int):
        super().__init__()
        self.trunk = nn.Sequential(
            layer_init(nn.Conv2d(4, 32, 8, stride=4)), nn.ReLU(),
            layer_init(nn.Conv2d(32, 64, 4, stride=2)), nn.ReLU(),
            layer_init(nn.Conv2d(64, 64, 3, stride=1)), nn.ReLU(),
            nn.Flatten(), layer_init(nn.Linear(64 * 7 * 7, 512)), nn.ReLU(),
        )
        self.policy = layer_init(nn.Linear(512, n_actions), std=0.01)
        self.value = layer_init(nn.Linear(512, 1), std=1.0)
        self.to(memory_format=torch.channels_last)  # faster CPU convolutions (oneDNN)

    def features(self, observation: torch.Tensor) -> torch.Tensor:
        """(..., 4, 84, 84) uint8 frames -> (..., 512) features."""
        lead = observation.shape[:-3]
        x = observation.reshape(-1, *observation.shape[-3:]).float().div_(255.0)
        return self.trunk(x.contiguous(memory_format=torch.channels_last)).reshape(*lead, 512)

    def forward(self, observation: torch.Tensor) -> torch.Tensor:
        return Categorical(logits=self.policy(self.features(observation))).sample()


def gae(reward, value, next_value, terminated, done, gamma: float, lam: float):
    """Generalised advantage estimation over tensors of shape (env streams, T).

    A step that *terminated* (game over) has no future: its next value is 0. A truncated step
    (ale-py's 108,000-frame limit) and the batch's last step bootstrap from V(next observation),
    the true final observation the collector stores under "next". The advantage does not flow
    back across an episode boundary (done).
    """
    advantages = torch.zeros_like(reward)
    running = torch.zeros_like(reward[:, 0])
    for t in reversed(range(reward.shape[1])):
        delta = reward[:, t] + gamma * next_value[:, t] * (~terminated[:, t]) - value[:, t]
        running = delta + gamma * lam * (~done[:, t]) * running
        advantages[:, t] = running
    return advantages, advantages + value


def next_values(agent: Agent, value: torch.Tensor, next_obs: torch.Tensor, done: torch.Tensor) -> torch.Tensor:
    """V(next observation) for every step. Within an episode the next observation is the next
    row's observation, whose value is already known; only the steps that ended an episode (their
    next observation is the final one, the next row holds a reset) and the batch's last step need
    a forward pass of their own."""
    out = torch.empty_like(value)
    out[:, :-1] = value[:, 1:]
    own = done.clone()
    own[:, -1] = True
    out[own] = agent.value(agent.features(next_obs[own])).squeeze(-1)
    return out


def finished_episode_returns(reward: torch.Tensor, done: torch.Tensor, running: torch.Tensor) -> list[float]:
    """Returns of the episodes that end in this batch. `running` (one entry per env stream)
    carries the partial sums of unfinished episodes from one batch to the next."""
    finished = []
    for t in range(reward.shape[1]):
        running += reward[:, t]
        finished += running[done[:, t]].tolist()
        running[done[:, t]] = 0.0
    return finished


def ppo_update(agent, optimizer, data: dict[str, torch.Tensor], args: Args) -> dict[str, float]:
    """Clipped PPO on one flattened batch; returns the mean of each loss over all minibatches."""
    n = data["observation"].shape[0]
    sums = {"policy_loss": 0.0, "value_loss": 0.0, "entropy": 0.0, "approx_kl": 0.0}
    steps = 0
    for _ in range(args.epochs):
        for idx in torch.randperm(n).split(args.minibatch_size):
            features = agent.features(data["observation"][idx])
            dist = Categorical(logits=agent.policy(features))
            log_prob = dist.log_prob(data["action"][idx])
            log_ratio = log_prob - data["log_prob"][idx]
            ratio = log_ratio.exp()
            adv = data["advantage"][idx]
            adv = (adv - adv.mean()) / (adv.std() + 1e-8)
            policy_loss = torch.max(-adv * ratio, -adv * ratio.clamp(1 - args.clip_coef, 1 + args.clip_coef)).mean()
            value_loss = 0.5 * (agent.value(features).squeeze(-1) - data["return"][idx]).pow(2).mean()
            entropy = dist.entropy().mean()
            loss = policy_loss - args.ent_coef * entropy + args.vf_coef * value_loss

            optimizer.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(agent.parameters(), args.max_grad_norm)
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
    probe = make_env(args.game, 1)  # only to read the action space
    n_actions = int(probe.single_action_space.n)
    probe.close()
    agent = Agent(n_actions)
    optimizer = torch.optim.Adam(agent.parameters(), lr=args.learning_rate, eps=1e-5)
    start = time.perf_counter()  # the clock includes starting the workers

    logging.info("starting %d worker processes (each imports torch and makes its envs)", args.workers)
    collector = MultiSyncCollector(
        partial(make_env, args.game, args.envs_per_worker),
        agent,  # sent to the workers once; later updates travel through shared memory
        num_workers=args.workers,
        frames_per_batch=args.frames_per_batch,
        total_frames=args.total_frames,
        num_threads=args.torch_threads,
    )
    collector.set_seed(args.seed)
    running_returns = torch.zeros(args.workers * args.envs_per_worker)  # one per env stream
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
            obs = batch["observation"]  # (streams, T, 4, 84, 84) uint8
            reward = batch["next", "reward"].squeeze(-1)
            terminated = batch["next", "terminated"].squeeze(-1)
            done = batch["next", "done"].squeeze(-1)

            returns = finished_episode_returns(reward, done, running_returns)

            with torch.no_grad():
                # the weights that collected this batch: the workers act with exactly these
                features = agent.features(obs)
                log_prob = Categorical(logits=agent.policy(features)).log_prob(batch["action"])
                value = agent.value(features).squeeze(-1)
                next_value = next_values(agent, value, batch["next", "observation"], done)
                advantage, value_target = gae(reward.sign(), value, next_value, terminated, done,
                                              args.gamma, args.gae_lambda)  # clipped rewards

            for group in optimizer.param_groups:
                group["lr"] = learning_rate
            data = {"observation": obs, "action": batch["action"], "log_prob": log_prob,
                    "advantage": advantage, "return": value_target}
            data = {key: value.flatten(0, 1) for key, value in data.items()}  # (streams, T) -> frames
            losses = ppo_update(agent, optimizer, data, args)
            collector.update_policy_weights_()  # the next batch is collected with the new weights
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
            print(f"frames {frames:>9,d}  return {row['mean_return']:6.1f} ({len(returns):2d} episodes)  "
                  f"policy {losses['policy_loss']:+.4f}  value {losses['value_loss']:7.4f}  "
                  f"entropy {losses['entropy']:.3f}  kl {losses['approx_kl']:.4f}  "
                  f"{row['fps']:,.0f} fps  {elapsed:7.1f} s", flush=True)
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


def smoothed(history: list[dict], window: int = 20) -> list[float]:
    """Mean game score over the last `window` batches' episodes (few games end in one batch)."""
    out = []
    for i in range(len(history)):
        rows = history[max(0, i - window + 1):i + 1]
        n = sum(r["episodes"] for r in rows)
        out.append(sum(r["mean_return"] * r["episodes"] for r in rows if r["episodes"]) / n if n else float("nan"))
    return out


def summarize(history: list[dict], args: Args) -> None:
    last = history[-1]
    print(f"done: {last['frames']:,d} frames ({4 * last['frames']:,d} emulator frames) in {last['elapsed_s']:.1f} s "
          f"({last['fps']:,.0f} fps); waiting for batches {last['collect_s']:.1f} s "
          f"({last['frames'] / last['collect_s']:,.0f} frames/s), training {last['train_s']:.1f} s "
          f"({last['frames'] / last['train_s']:,.0f} frames/s)")
    smooth = [s for s in smoothed(history) if not math.isnan(s)]
    if smooth:
        print(f"mean score over 20 batches: first {smooth[0]:.2f}, best {max(smooth):.2f}, last {smooth[-1]:.2f}")


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
    ax.plot(frames, smoothed(history), label="mean over 20 batches")
    ax.set(xlabel="frames (agent steps)", ylabel="game score of episodes finished",
           title=f"PPO on {args.game} (rlcollect MultiSyncCollector, {args.workers}x{args.envs_per_worker} envs)")
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
