"""PPO on CartPole-v1 written with torchrl (env, actor, value operator, GAE, `ClipPPOLoss`, replay
buffer), collected by rlcollect's `MultiSyncCollector`.

This is the training loop of torchrl's PPO tutorial, for a discrete action space, with one change:
the collector is imported from rlcollect instead of torchrl. Everything the collector is given
(a list of torchrl env factories, one per worker; a torchrl `ProbabilisticActor`; the frame
counts) and everything it delivers (a `(workers, T)` TensorDict with `"action_log_prob"`,
`("next", "episode_reward")`, ...) is what torchrl's own `MultiSyncCollector` takes and gives;
docs/migrating-from-torchrl.md shows the diff.

    .venv-torchrl/bin/python examples/ppo_torchrl_cartpole.py --seed 1 --out ppo_torchrl.png

It needs torchrl (`pip install torchrl`, then rlcollect; `make test-torchrl` builds such a venv,
`.venv-torchrl`). It prints one line per batch and writes a learning curve (PNG + CSV).
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
from tensordict.nn import TensorDictModule
from torch import nn
from torchrl.data import LazyTensorStorage, ReplayBuffer, SamplerWithoutReplacement
from torchrl.envs import GymEnv, RewardSum, TransformedEnv
from torchrl.modules import MLP, ProbabilisticActor, ValueOperator
from torchrl.objectives import ClipPPOLoss
from torchrl.objectives.value import GAE

from rlcollect import MultiSyncCollector  # was: from torchrl.collectors import MultiSyncCollector


@dataclass
class Args:
    seed: int = 1
    """seed of the run: network initialisation, environments and action sampling"""
    env_id: str = "CartPole-v1"
    """gymnasium id of the environment (discrete actions, vector observations)"""
    total_frames: int = 60_000
    """environment steps to collect over the whole run"""
    workers: int = 2
    """worker processes, one torchrl env each"""
    frames_per_batch: int = 1000
    """frames in each batch, all workers together (the rollout of one PPO update)"""
    learning_rate: float = 1e-3
    """Adam learning rate at the start; it decays linearly to 0 over the run"""
    gamma: float = 0.99
    """discount factor"""
    gae_lambda: float = 0.95
    """lambda of generalised advantage estimation"""
    epochs: int = 5
    """passes over each batch (GAE is recomputed before each, as in torchrl's tutorial)"""
    minibatch_size: int = 200
    """frames per gradient step, sampled without replacement from the batch"""
    clip_coef: float = 0.2
    """PPO's clipping of the probability ratio (`ClipPPOLoss(clip_epsilon=...)`)"""
    ent_coef: float = 0.01
    """weight of the entropy bonus (`ClipPPOLoss(entropy_coeff=...)`)"""
    max_grad_norm: float = 0.5
    """gradients are clipped to this global norm"""
    hidden: int = 64
    """width of the two hidden layers of the actor and of the critic"""
    torch_threads: int = 1
    """torch threads of the learner (the workers use one each)"""
    target_return: float | None = None
    """the return counted as solved, reported and drawn on the plot (default: the env's reward_threshold in
    gymnasium's registry: 475 for CartPole-v1, -100 for Acrobot-v1, 200 for LunarLander-v3; none if it has none)"""
    out: str = "ppo_torchrl_cartpole.png"
    """where to write the learning curve (PNG); the same data goes to a .csv beside it"""


def make_env(env_id: str = "CartPole-v1") -> TransformedEnv:
    """A torchrl env: CartPole with an index action and the episode return as `"episode_reward"`.
    Module level, so that it pickles to the workers by reference."""
    return TransformedEnv(GymEnv(env_id, categorical_action_encoding=True), RewardSum())


def train(args: Args) -> list[dict]:
    torch.set_num_threads(args.torch_threads)
    torch.manual_seed(args.seed)
    probe = make_env(args.env_id)  # only to read the specs
    obs_dim = probe.observation_spec["observation"].shape[-1]
    n_actions = probe.action_spec.space.n
    probe.close()

    actor_net = TensorDictModule(MLP(in_features=obs_dim, out_features=n_actions, num_cells=[args.hidden] * 2,
                                     activation_class=nn.Tanh), in_keys=["observation"], out_keys=["logits"])
    actor = ProbabilisticActor(actor_net, in_keys=["logits"], distribution_class=torch.distributions.Categorical,
                               return_log_prob=True)
    critic = ValueOperator(MLP(in_features=obs_dim, out_features=1, num_cells=[args.hidden] * 2,
                               activation_class=nn.Tanh), in_keys=["observation"])
    advantage_module = GAE(gamma=args.gamma, lmbda=args.gae_lambda, value_network=critic, average_gae=True)
    loss_module = ClipPPOLoss(actor, critic, clip_epsilon=args.clip_coef, entropy_coeff=args.ent_coef)
    optimizer = torch.optim.Adam(loss_module.parameters(), lr=args.learning_rate)
    scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, 1.0, 0.0,
                                                  total_iters=args.total_frames // args.frames_per_batch)
    replay_buffer = ReplayBuffer(storage=LazyTensorStorage(args.frames_per_batch),
                                 sampler=SamplerWithoutReplacement(), batch_size=args.minibatch_size)
    start = time.perf_counter()  # the clock includes starting the workers

    # torchrl's construction, unchanged: only the import of MultiSyncCollector differs.
    logging.info("starting %d worker processes (each imports torch and makes its envs)", args.workers)
    collector = MultiSyncCollector(
        [partial(make_env, args.env_id)] * args.workers,  # one env factory per worker
        actor,
        frames_per_batch=args.frames_per_batch,
        total_frames=args.total_frames,
    )
    collector.set_seed(args.seed)
    history = []
    frames = 0
    logging.info("%d worker processes started (%.1f s so far); waiting for the first batch", args.workers,
                 time.perf_counter() - start)
    for batch in collector:  # (workers, T)
        frames += batch.numel()
        done = batch["next", "done"].squeeze(-1)
        returns = batch["next", "episode_reward"].squeeze(-1)[done].tolist()  # episodes ended in the batch
        sums = {"loss_objective": 0.0, "loss_critic": 0.0, "loss_entropy": 0.0}
        steps = 0
        for _ in range(args.epochs):
            with torch.no_grad():
                advantage_module(batch)  # GAE along the time dim; bootstraps after truncation
            replay_buffer.extend(batch.reshape(-1))
            for _ in range(args.frames_per_batch // args.minibatch_size):
                losses = loss_module(replay_buffer.sample())
                loss = losses["loss_objective"] + losses["loss_critic"] + losses["loss_entropy"]
                loss.backward()
                nn.utils.clip_grad_norm_(loss_module.parameters(), args.max_grad_norm)
                optimizer.step()
                optimizer.zero_grad()
                for key in sums:
                    sums[key] += losses[key].item()
                steps += 1
        scheduler.step()
        collector.update_policy_weights_()  # the next batch is collected with the new actor

        elapsed = time.perf_counter() - start
        row = {"frames": frames, "mean_return": float(np.mean(returns)) if returns else float("nan"),
               "episodes": len(returns), **{key: value / steps for key, value in sums.items()},
               "fps": frames / elapsed, "elapsed_s": elapsed}
        history.append(row)
        print(f"frames {frames:>7,d}  return {row['mean_return']:6.1f} ({len(returns):3d} episodes)  "
              f"objective {row['loss_objective']:+.4f}  critic {row['loss_critic']:8.3f}  "
              f"entropy {row['loss_entropy']:+.4f}  {row['fps']:,.0f} fps  {elapsed:5.1f} s", flush=True)
    collector.shutdown()
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
           title=f"torchrl PPO on {args.env_id}, rlcollect MultiSyncCollector ({args.workers} workers)")
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
