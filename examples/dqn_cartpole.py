"""DQN on CartPole-v1: rlcollect's `MultiAsyncCollector` runs free into a `ReplayBuffer`.

`collector.start()` makes the worker processes collect continuously, each writing its batches
straight into a shared-memory replay buffer, while this process samples from the buffer and
trains a Q-network. Every few gradient steps the new weights (and the current exploration rate,
a buffer of the policy module) are pushed to the workers, which pick them up at their next batch.

    .venv/bin/python examples/dqn_cartpole.py --seed 1 --out dqn_cartpole.png

It prints a line every `log_every` gradient steps (frames written, mean return of the episodes
that ended since the last line, loss, exploration rate, frames/s) and writes a learning curve
(PNG, plus the same data as CSV next to it). Only rlcollect's public API is used.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
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
import torch.nn.functional as F
from torch import nn

from rlcollect import GymEnv, MultiAsyncCollector, ReplayBuffer


@dataclass
class Args:
    seed: int = 1
    """seed of the run: network initialisation, environments, exploration and sampling"""
    env_id: str = "CartPole-v1"
    """gymnasium id of the environment (discrete actions, vector observations)"""
    total_frames: int = 200_000
    """the run stops once the workers have written this many frames to the buffer"""
    workers: int = 2
    """worker processes, each stepping `envs_per_worker` environments"""
    envs_per_worker: int = 4
    """environment copies per worker (batched in-process by `GymEnv(num_envs=...)`)"""
    frames_per_batch: int = 128
    """frames a worker writes at once; new weights reach a worker between two of its batches"""
    buffer_size: int = 10_000
    """replay buffer capacity in frames (the oldest are overwritten)"""
    learning_rate: float = 2.5e-4
    """Adam learning rate"""
    gamma: float = 0.99
    """discount factor"""
    batch_size: int = 128
    """frames sampled from the buffer per gradient step"""
    learning_starts: int = 10_000
    """frames in the buffer before the first gradient step"""
    frames_per_update: float = 10.0
    """frames collected per gradient step: the learner waits when it is ahead, and pauses the
    collection to catch up when it falls behind by more than `max_lag` steps"""
    max_lag: int = 500
    """gradient steps the learner may fall behind `frames_per_update` before it pauses collection"""
    target_update_every: int = 500
    """gradient steps between copies of the Q-network into the target network"""
    policy_update_every: int = 50
    """gradient steps between pushes of the weights (and exploration rate) to the workers"""
    start_epsilon: float = 1.0
    """exploration rate (probability of a random action) at the start"""
    end_epsilon: float = 0.05
    """exploration rate at the end of the decay"""
    exploration_fraction: float = 0.5
    """fraction of `total_frames` over which the exploration rate decays linearly"""
    hidden: int = 128
    """width of the two hidden layers of the Q-network"""
    log_every: int = 1000
    """gradient steps between progress lines (and points of the learning curve)"""
    torch_threads: int = 1
    """torch threads of the learner (the workers use one each)"""
    out: str = "dqn_cartpole.png"
    """where to write the learning curve (PNG); the same data goes to a .csv beside it"""


class EpsilonGreedy(nn.Module):
    """The acting policy, run by the workers: a Q-network and an exploration rate.

    `epsilon` is a registered buffer, so it travels with the weights on every
    `update_policy_weights_()`. Defined at module level so that it pickles by reference.
    """

    def __init__(self, obs_dim: int, n_actions: int, hidden: int):
        super().__init__()
        self.q = nn.Sequential(nn.Linear(obs_dim, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                               nn.Linear(hidden, n_actions))
        self.register_buffer("epsilon", torch.tensor(1.0))

    def forward(self, observation: torch.Tensor) -> torch.Tensor:
        q_values = self.q(observation)
        greedy = q_values.argmax(-1)
        random = torch.randint(q_values.shape[-1], greedy.shape)
        return torch.where(torch.rand(greedy.shape) < self.epsilon, random, greedy)


def epsilon_at(frames: int, args: Args) -> float:
    progress = min(1.0, frames / (args.exploration_fraction * args.total_frames))
    return args.start_epsilon + progress * (args.end_epsilon - args.start_epsilon)


def dqn_loss(q_net: nn.Module, target_net: nn.Module, batch, gamma: float) -> torch.Tensor:
    """One-step TD error. A terminated step has no future; a truncated one (the 500-step limit)
    does, so the target bootstraps from the next observation unless the step *terminated*."""
    with torch.no_grad():
        next_q = target_net(batch["next", "observation"]).max(-1).values
        not_terminated = (~batch["next", "terminated"].squeeze(-1)).float()
        target = batch["next", "reward"].squeeze(-1) + gamma * not_terminated * next_q
    q = q_net(batch["observation"]).gather(-1, batch["action"].unsqueeze(-1)).squeeze(-1)
    return F.mse_loss(q, target)


def finished_episode_returns(rb: ReplayBuffer, start: int, stop: int, running: dict[int, float]) -> list[float]:
    """Returns of the episodes that ended among the frames written `start .. stop - 1` (in
    `write_count` order; call it before the ring wraps over them). A worker writes a
    trajectory's frames in order, so its last frame (done) comes after all the others;
    `running` keeps the partial sums by trajectory id."""
    start = max(start, stop - rb.capacity)  # overwritten frames are lost (read often enough)
    frames = rb[torch.arange(start, stop) % rb.capacity]
    traj_ids = frames["collector", "traj_ids"]
    ids, where = traj_ids.unique(return_inverse=True)
    sums = torch.zeros(len(ids)).index_add_(0, where, frames["next", "reward"].squeeze(-1))
    for traj, partial_sum in zip(ids.tolist(), sums.tolist()):
        running[traj] = running.get(traj, 0.0) + partial_sum
    return [running.pop(traj) for traj in traj_ids[frames["next", "done"].squeeze(-1)].tolist()]


def train(args: Args) -> list[dict]:
    torch.set_num_threads(args.torch_threads)
    torch.manual_seed(args.seed)
    probe = GymEnv(args.env_id)  # only to read the spaces
    obs_dim, n_actions = probe.observation_space.shape[0], probe.action_space.n
    probe.close()
    policy = EpsilonGreedy(obs_dim, n_actions, args.hidden)
    q_net = policy.q  # trained here; the workers act with a copy, refreshed by each push
    target_net = copy.deepcopy(q_net)
    optimizer = torch.optim.Adam(q_net.parameters(), lr=args.learning_rate)
    start = time.perf_counter()  # the clock includes starting the workers

    rb = ReplayBuffer(args.buffer_size)
    logging.info("starting %d worker processes (each imports torch and makes its envs)", args.workers)
    collector = MultiAsyncCollector(
        partial(GymEnv, args.env_id, num_envs=args.envs_per_worker),
        policy,
        num_workers=args.workers,
        frames_per_batch=args.frames_per_batch,
        replay_buffer=rb,  # the workers write into it themselves
        num_threads=args.torch_threads,
    )
    collector.set_seed(args.seed)
    collector.start()  # collection runs free from here on; this loop only trains
    logging.info("%d worker processes started (%.1f s so far); collecting into the replay buffer", args.workers,
                 time.perf_counter() - start)
    history, losses, returns = [], [], []
    running, counted = {}, 0  # partial episode returns by trajectory id; frames counted so far
    updates, pauses = 0, 0
    try:
        while (written := rb.write_count) < args.total_frames:
            if written - counted >= rb.capacity // 4:  # read new frames before the ring overwrites them
                returns += finished_episode_returns(rb, counted, written, running)
                counted = written
            due = int((written - args.learning_starts) / args.frames_per_update) - updates
            if due <= 0:  # not enough new frames for the next gradient step: let the workers run
                time.sleep(0.001)
                continue
            # One step at a time while the workers run. Far behind (a busy machine, a slow
            # learner), hold the workers while we catch up, so that the run makes one gradient
            # step per `frames_per_update` frames whatever the relative speeds.
            if due > args.max_lag:
                steps, hold = due, collector.pause()
                pauses += 1
            else:
                steps, hold = 1, contextlib.nullcontext()
            with hold:
                for _ in range(steps):
                    updates += 1
                    losses.append(gradient_step(q_net, optimizer, target_net, rb, args))
                    if updates % args.target_update_every == 0:
                        target_net.load_state_dict(q_net.state_dict())
                    if updates % args.policy_update_every == 0:
                        policy.epsilon.fill_(epsilon_at(rb.write_count, args))
                        collector.update_policy_weights_()  # reaches each worker at its next batch
                    if updates % args.log_every == 0:
                        history.append(log_row(counted, returns, losses, policy, updates, pauses, start))
                        losses, returns = [], []
    finally:
        collector.async_shutdown()
    frames = rb.write_count
    returns += finished_episode_returns(rb, counted, frames, running)
    history.append(log_row(frames, returns, losses, policy, updates, pauses, start))
    rb.close()
    return history


def gradient_step(q_net: nn.Module, optimizer, target_net: nn.Module, rb: ReplayBuffer, args: Args) -> float:
    loss = dqn_loss(q_net, target_net, rb.sample(args.batch_size), args.gamma)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss.item()


# ================================================================================================
# The plumbing: progress lines, command line, summary, learning curve. Nothing about DQN below.
# ================================================================================================


def log_row(frames: int, returns: list[float], losses: list[float], policy: EpsilonGreedy, updates: int,
            pauses: int, start: float) -> dict:
    elapsed = time.perf_counter() - start
    row = {"frames": frames, "mean_return": float(np.mean(returns)) if returns else float("nan"),
           "episodes": len(returns), "loss": float(np.mean(losses)) if losses else float("nan"),
           "epsilon": policy.epsilon.item(), "updates": updates, "pauses": pauses,
           "fps": frames / elapsed, "elapsed_s": elapsed}
    print(f"frames {frames:>7,d}  return {row['mean_return']:6.1f} ({len(returns):3d} episodes)  "
          f"loss {row['loss']:8.4f}  epsilon {row['epsilon']:.3f}  updates {updates:>6,d}  "
          f"{row['fps']:,.0f} fps  {elapsed:5.1f} s", flush=True)
    return row


def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of a dataclass (Python keeps none at run time)."""
    docs, body = {}, ast.parse(inspect.getsource(cls)).body[0].body
    for node, after in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def parse_args() -> Args:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    docs = field_docs(Args)
    for field in dataclasses.fields(Args):
        parser.add_argument(f"--{field.name.replace('_', '-')}", type=type(field.default),
                            default=field.default, help=docs.get(field.name, ""))
    return Args(**vars(parser.parse_args()))


def summarize(history: list[dict]) -> None:
    last = history[-1]
    print(f"done: {last['frames']:,d} frames, {last['updates']:,d} gradient steps in {last['elapsed_s']:.1f} s "
          f"({last['fps']:,.0f} fps; collection paused {last['pauses']} times for the learner to catch up)")
    returns = [row["mean_return"] for row in history if not math.isnan(row["mean_return"])]
    if returns:
        print(f"mean return: first {returns[0]:.1f}, best {max(returns):.1f}, "
              f"last 5 lines {np.mean(returns[-5:]):.1f}")


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
    ax.set(xlabel="frames written to the replay buffer", ylabel="mean return of episodes ended",
           title=f"DQN on {args.env_id} (rlcollect MultiAsyncCollector, {args.workers}x{args.envs_per_worker} envs)")
    ax.legend(loc="lower right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    print(f"learning curve: {out} (data: {out.with_suffix('.csv')})")


if __name__ == "__main__":  # the guard matters: with the fork server or "spawn", workers import this file
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")  # the phases
    args = parse_args()
    history = train(args)
    summarize(history)
    write_curve(history, args)
