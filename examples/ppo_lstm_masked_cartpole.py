"""Recurrent PPO (an LSTM policy) on CartPole-v1 with the velocities masked, collected by
rlcollect's `MultiSyncCollector`.

The agent sees only the cart position and the pole angle, never their velocities: a policy that
looks at one observation cannot tell a pole falling left from one rising right, so it needs memory.
The LSTM state is carried by the collector: the policy writes `("next", "h")` and `("next", "c")`,
and the collector feeds them back as the root `"h"`, `"c"` of the next step, row by row, zeros at
every episode start. The batch therefore holds, for every frame, the state the policy acted with;
the learner cuts each env stream into chunks of `seq_len` steps and replays each chunk from the
state stored at its first step (truncated backpropagation through time), and it checks that a
replay of the whole batch reproduces the stored states (`carry_error` in the output).

    .venv/bin/python examples/ppo_lstm_masked_cartpole.py --seed 1 --out lstm.png
    .venv/bin/python examples/ppo_lstm_masked_cartpole.py --memory none --out mlp.png   # no memory

Why a plain torch LSTM (a `tensordict` `TensorDictModuleBase`) and not torchrl's `LSTMModule`: it
runs with rlcollect alone (no torchrl), and the recurrence is all in this file, where you can see
exactly what the collector stores and what the learner replays. torchrl's `LSTMModule` also works
in our collectors (its `("next", "recurrent_state_h")` is carried the same way; see
docs/migrating-from-torchrl.md), and `examples/ppo_torchrl_cartpole.py` shows torchrl's objects.
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

import gymnasium
import numpy as np
import torch
from tensordict.nn import TensorDictModuleBase
from torch import nn
from torch.distributions import Categorical

from rlcollect import GymEnv, MLflowLogger, MultiSyncCollector, TensorBoardLogger, WandbLogger


@dataclass
class Args:
    seed: int = 1
    """seed of the run: network initialisation, environments and action sampling"""
    env_id: str = "CartPole-v1"
    """gymnasium id of the environment; its observation is masked to `keep` (CartPole: x, angle)"""
    keep: str = "0,2"
    """indices of the observation entries the agent sees (CartPole: 0 = cart position, 2 = pole angle)"""
    memory: str = "lstm"
    """`lstm`: an LSTM cell carries a state between steps; `none`: the same network with the cell
    replaced by a feed-forward layer (the baseline that cannot remember)"""
    total_frames: int = 400_000
    """environment steps to collect over the whole run"""
    workers: int = 2
    """worker processes, each stepping `envs_per_worker` environments"""
    envs_per_worker: int = 8
    """environment copies per worker (batched in-process by `GymEnv(num_envs=...)`)"""
    frames_per_batch: int = 2048
    """frames in each batch, all workers together; the sequence length is this / (workers * envs)"""
    learning_rate: float = 3e-3
    """Adam learning rate at the start; it decays linearly to 0 over `total_frames`"""
    gamma: float = 0.99
    """discount factor"""
    gae_lambda: float = 0.95
    """lambda of generalised advantage estimation"""
    epochs: int = 8
    """passes over each batch"""
    seq_len: int = 16
    """training sequence length: each stream's T steps are cut into chunks of `seq_len`, each
    replayed from the LSTM state the collector stored at its first step (backpropagation through
    `seq_len` steps; must divide T)"""
    minibatches: int = 4
    """gradient steps per epoch; a minibatch is a set of whole chunks"""
    clip_coef: float = 0.2
    """PPO's clipping of the probability ratio"""
    ent_coef: float = 0.01
    """weight of the entropy bonus"""
    vf_coef: float = 0.5
    """weight of the value loss"""
    max_grad_norm: float = 0.5
    """gradients are clipped to this global norm"""
    hidden: int = 64
    """width of each encoder and LSTM state (actor and critic each have one)"""
    torch_threads: int = 1
    """torch threads of the learner (the workers use one each)"""
    target_return: float | None = None
    """the return counted as solved, reported and drawn on the plot (default: the env's reward_threshold in
    gymnasium's registry: 475 for CartPole-v1, -100 for Acrobot-v1, 200 for LunarLander-v3; none if it has none)"""
    out: str = "ppo_lstm_masked_cartpole.png"
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


class MaskObservation(gymnasium.ObservationWrapper):
    """Keeps only the observation entries `keep` (module level, so that it pickles)."""

    def __init__(self, env: gymnasium.Env, keep: list[int]):
        super().__init__(env)
        self.keep = np.asarray(keep)
        space = env.observation_space
        self.observation_space = gymnasium.spaces.Box(space.low[self.keep], space.high[self.keep], dtype=space.dtype)

    def observation(self, observation):
        return observation[self.keep]


def make_masked_env(env_id: str, keep: list[int]) -> gymnasium.Env:
    return MaskObservation(gymnasium.make(env_id), keep)


def layer_init(layer: nn.Linear, std: float) -> nn.Linear:
    nn.init.orthogonal_(layer.weight, std)
    nn.init.zeros_(layer.bias)
    return layer


class Agent(TensorDictModuleBase):
    """An actor and a critic, each an encoder -> LSTM cell -> head (separate networks: a shared
    trunk let the critic's large CartPole value errors drown the policy's gradient). The state
    `"h"`, `"c"` holds both cells' states side by side, `[actor | critic]`. The same module runs in
    the workers (`forward`: one step, reads the root `"h"`, `"c"`, writes the next state under
    `"next"`) and in the learner (`replay`: whole sequences, for the PPO loss)."""

    in_keys = ["observation", "h", "c"]
    out_keys = ["action", ("next", "h"), ("next", "c")]

    def __init__(self, obs_dim: int, n_actions: int, hidden: int, memory: str):
        super().__init__()
        self.hidden, self.memory = hidden, memory

        def core() -> nn.ModuleDict:
            encoder = nn.Sequential(layer_init(nn.Linear(obs_dim, hidden), math.sqrt(2)), nn.Tanh())
            if memory == "lstm":
                cell = nn.LSTMCell(hidden, hidden)
            else:  # same depth and width, no state
                cell = nn.Sequential(layer_init(nn.Linear(hidden, hidden), math.sqrt(2)), nn.Tanh())
            return nn.ModuleDict({"encoder": encoder, "cell": cell})

        self.actor_core, self.critic_core = core(), core()
        self.actor = layer_init(nn.Linear(hidden, n_actions), 0.01)
        self.critic = layer_init(nn.Linear(hidden, 1), 1.0)

    def _cell(self, core, obs, h, c):
        x = core["encoder"](obs)
        if self.memory == "lstm":
            h, c = core["cell"](x, (h, c))
            return h, h, c
        return core["cell"](x), h, c  # h, c stay zeros

    def step(self, obs, h, c):
        """One step: actor and critic features of `obs` given the state `(h, c)`, and the next state."""
        H = self.hidden
        fa, ha, ca = self._cell(self.actor_core, obs, h[..., :H], c[..., :H])
        fc, hc, cc = self._cell(self.critic_core, obs, h[..., H:], c[..., H:])
        return fa, fc, torch.cat([ha, hc], -1), torch.cat([ca, cc], -1)

    def forward(self, td):
        obs = td.get("observation")
        zeros = torch.zeros(*obs.shape[:-1], 2 * self.hidden)
        h, c = td.get("h", zeros), td.get("c", zeros)  # absent only in the collector's dry run
        actor_features, _, h, c = self.step(obs, h, c)
        td.set("action", Categorical(logits=self.actor(actor_features)).sample())
        td.set(("next", "h"), h)
        td.set(("next", "c"), c)
        return td

    def replay(self, obs, start, h0, c0):
        """Logits, values and input states of whole sequences: `obs` (sequences, T, obs_dim),
        `start` (sequences, T) True where an episode starts (the state is zeroed there, as the
        collector does), `h0`, `c0` the stored state at t = 0. Gradients flow through time."""
        logits, values, hs = [], [], []
        h, c = h0, c0
        for t in range(obs.shape[1]):
            if t > 0:
                keep = (~start[:, t]).float().unsqueeze(-1)
                h, c = h * keep, c * keep
            hs.append(h)
            fa, fc, h, c = self.step(obs[:, t], h, c)
            logits.append(self.actor(fa))
            values.append(self.critic(fc).squeeze(-1))
        return torch.stack(logits, 1), torch.stack(values, 1), torch.stack(hs, 1)

    def value_after(self, next_obs, next_h, next_c):
        """V of each frame's next observation, from the state the collector stored with it
        (all frames at once: (streams, T) flattened, since `nn.LSTMCell` takes 2-D input)."""
        lead = next_obs.shape[:-1]
        fc = self.step(next_obs.flatten(0, -2), next_h.flatten(0, -2), next_c.flatten(0, -2))[1]
        return self.critic(fc).squeeze(-1).reshape(lead)


def gae(reward, value, next_value, terminated, done, gamma: float, lam: float):
    """Generalised advantage estimation over (env streams, T); see examples/ppo_cartpole.py:
    no future after a termination, bootstrap after a truncation and at the batch's end."""
    advantages = torch.zeros_like(reward)
    running = torch.zeros_like(reward[:, 0])
    for t in reversed(range(reward.shape[1])):
        delta = reward[:, t] + gamma * next_value[:, t] * (~terminated[:, t]) - value[:, t]
        running = delta + gamma * lam * (~done[:, t]) * running
        advantages[:, t] = running
    return advantages, advantages + value


def finished_episode_returns(reward: torch.Tensor, done: torch.Tensor, running: torch.Tensor) -> list[float]:
    """Returns of the episodes that end in this batch (`running` carries unfinished sums)."""
    finished = []
    for t in range(reward.shape[1]):
        running += reward[:, t]
        finished += running[done[:, t]].tolist()
        running[done[:, t]] = 0.0
    return finished


def ppo_update(agent, optimizer, data: dict[str, torch.Tensor], args: Args) -> dict[str, float]:
    """Clipped PPO on chunks (chunks, seq_len): a minibatch is a set of whole chunks, each replayed
    from its stored first state."""
    chunks = data["observation"].shape[0]
    sums = {"policy_loss": 0.0, "value_loss": 0.0, "entropy": 0.0, "approx_kl": 0.0}
    steps = 0
    for _ in range(args.epochs):
        for idx in torch.randperm(chunks).chunk(args.minibatches):
            logits, value, _ = agent.replay(data["observation"][idx], data["start"][idx],
                                            data["h0"][idx], data["c0"][idx])
            dist = Categorical(logits=logits)
            log_prob = dist.log_prob(data["action"][idx])
            log_ratio = log_prob - data["log_prob"][idx]
            ratio = log_ratio.exp()
            adv = data["advantage"][idx]
            adv = (adv - adv.mean()) / (adv.std() + 1e-8)
            policy_loss = torch.max(-adv * ratio, -adv * ratio.clamp(1 - args.clip_coef, 1 + args.clip_coef)).mean()
            value_loss = 0.5 * (value - data["return"][idx]).pow(2).mean()
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


def train(args: Args) -> list[dict]:
    if args.memory not in ("lstm", "none"):
        raise ValueError(f"--memory must be 'lstm' or 'none', got {args.memory!r}")
    streams = args.workers * args.envs_per_worker
    if args.frames_per_batch % (streams * args.seq_len):
        raise ValueError(f"--frames-per-batch ({args.frames_per_batch}) must be a multiple of "
                         f"workers * envs_per_worker * seq_len ({streams * args.seq_len})")
    torch.set_num_threads(args.torch_threads)
    torch.manual_seed(args.seed)
    keep = [int(i) for i in args.keep.split(",")]
    make_env = partial(make_masked_env, args.env_id, keep)
    probe = make_env()  # only to read the spaces
    obs_dim, n_actions = probe.observation_space.shape[0], probe.action_space.n
    probe.close()
    agent = Agent(obs_dim, n_actions, args.hidden, args.memory)
    optimizer = torch.optim.Adam(agent.parameters(), lr=args.learning_rate, eps=1e-5)
    start = time.perf_counter()  # the clock includes starting the workers

    logging.info("starting %d worker processes (each imports torch and makes its envs)", args.workers)
    collector = MultiSyncCollector(
        partial(GymEnv, make_env, num_envs=args.envs_per_worker),
        agent,  # sent to the workers once; later updates travel through shared memory
        num_workers=args.workers,
        frames_per_batch=args.frames_per_batch,
        total_frames=args.total_frames,
        num_threads=args.torch_threads,
    )
    collector.set_seed(args.seed)
    running_returns = torch.zeros(args.workers * args.envs_per_worker)  # one per env stream
    history = []
    frames = 0
    logging.info("%d worker processes started (%.1f s so far); waiting for the first batch", args.workers,
                 time.perf_counter() - start)
    loggers = [make(name) for name, make in ((args.tensorboard, TensorBoardLogger), (args.wandb, WandbLogger),
                                             (args.mlflow, MLflowLogger)) if name]
    with collector:
        for batch in collector:
            # (workers, envs, T) -> (env streams, T): rows are independent streams, time is last.
            batch = batch.reshape(-1, batch.shape[-1])
            learning_rate = args.learning_rate * (1.0 - frames / args.total_frames)  # linear decay
            frames += batch.numel()
            obs = batch["observation"]
            reward = batch["next", "reward"].squeeze(-1)
            terminated = batch["next", "terminated"].squeeze(-1)
            done = batch["next", "done"].squeeze(-1)
            # An episode starts at t where the step before ended (t = 0 uses the stored state,
            # which the collector already zeroed if an episode starts there).
            episode_start = torch.zeros_like(done)
            episode_start[:, 1:] = done[:, :-1]

            returns = finished_episode_returns(reward, done, running_returns)

            with torch.no_grad():
                # the weights that collected this batch: the workers acted with exactly these
                logits, value, replayed_h = agent.replay(obs, episode_start, batch["h"][:, 0], batch["c"][:, 0])
                carry_error = (replayed_h - batch["h"]).abs().max().item()  # the collector's carry, checked
                log_prob = Categorical(logits=logits).log_prob(batch["action"])
                next_value = agent.value_after(batch["next", "observation"], batch["next", "h"], batch["next", "c"])
                advantage, value_target = gae(reward, value, next_value, terminated, done, args.gamma, args.gae_lambda)

            for group in optimizer.param_groups:
                group["lr"] = learning_rate
            # (streams, T) -> (chunks, seq_len); each chunk starts from the state stored at its head
            # (the collector's carry), so backpropagation runs through seq_len steps, not T.
            data = {"observation": obs, "start": episode_start, "action": batch["action"], "log_prob": log_prob,
                    "advantage": advantage, "return": value_target}
            data = {key: value.reshape(-1, args.seq_len, *value.shape[2:]) for key, value in data.items()}
            data["h0"] = batch["h"][:, ::args.seq_len].flatten(0, 1)
            data["c0"] = batch["c"][:, ::args.seq_len].flatten(0, 1)
            losses = ppo_update(agent, optimizer, data, args)
            collector.update_policy_weights_()  # the next batch is collected with the new weights

            elapsed = time.perf_counter() - start
            row = {"frames": frames, "mean_return": float(np.mean(returns)) if returns else float("nan"),
                   "episodes": len(returns), **losses, "carry_error": carry_error,
                   "fps": frames / elapsed, "elapsed_s": elapsed}
            history.append(row)
            for logger in loggers:
                logger.log(collector, step=frames)  # env-step latency, policy lag, time waiting, ...
                logger.write({f"train/{key}": value for key, value in row.items()
                              if key != "frames" and isinstance(value, (int, float)) and not math.isnan(value)},
                             frames)
            print(f"frames {frames:>7,d}  return {row['mean_return']:6.1f} ({len(returns):3d} episodes)  "
                  f"policy {losses['policy_loss']:+.4f}  value {losses['value_loss']:8.3f}  "
                  f"entropy {losses['entropy']:.3f}  kl {losses['approx_kl']:.4f}  carry {carry_error:.1e}  "
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
    print(f"largest carry error (replayed vs stored LSTM state): {max(r['carry_error'] for r in history):.1e}")
    reached = None if args.target_return is None else next(
        (row for row in history if row["mean_return"] >= args.target_return), None)
    if args.target_return is None:
        print(f"no target return: {args.env_id} has no reward_threshold in gymnasium's registry (--target-return)")
    elif reached:
        print(f"mean return >= {args.target_return:g} first at {reached['frames']:,d} frames "
              f"({reached['elapsed_s']:.1f} s)")
    else:
        print(f"mean return never reached {args.target_return:g}")
    best = max((row["mean_return"] for row in history if not math.isnan(row["mean_return"])), default=float("nan"))
    print(f"best batch mean return: {best:.1f}")
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
    ax.plot([r["frames"] for r in history], [r["mean_return"] for r in history], marker=".",
            label=f"memory={args.memory}, seed {args.seed}")
    if args.target_return is not None:
        ax.axhline(args.target_return, color="grey", linestyle="--", linewidth=1, label=f"{args.target_return:g}")
    ax.set(xlabel="frames", ylabel="mean return of episodes finished in the batch",
           title=f"PPO on {args.env_id}, velocities masked ({args.workers}x{args.envs_per_worker} envs)")
    ax.legend(loc="upper left")
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
