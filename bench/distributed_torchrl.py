"""torchrl's side of bench/distributed.py, run by a torchrl installation's interpreter (never
imports rlcollect): frames/s of ``torchrl.collectors.distributed.DistributedCollector`` with the
"mp" launcher, 2 nodes x 1 worker, on CartPole with the benchmark's MLP policy (2 hidden layers of
64, tanh, argmax: rlcollect's ``ArgmaxMLP``) or a random one.

    /path/to/torchrl-venv/bin/python bench/distributed_torchrl.py --mode sync --seconds 10

torchrl's DistributedCollector fails with ``policy=None`` (its weight sync scheme calls a
missing policy factory), so the random policy is a module that draws actions.

Prints one JSON line: ``{"mode": ..., "fps": ..., "frames": ..., "seconds": ...}``.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import time

import torch
from torch import nn


def make_env():
    from torchrl.envs import GymEnv

    return GymEnv("CartPole-v1", categorical_action_encoding=True)  # int actions, like rlcollect's


class ArgmaxMLP(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 2))

    def forward(self, observation):
        return self.net(observation).argmax(-1)


class RandomActions(nn.Module):
    def __init__(self):
        super().__init__()
        self.unused = nn.Parameter(torch.zeros(1))  # torchrl's weight sync wants some

    def forward(self, observation):
        return torch.randint(0, 2, observation.shape[:-1])


def make_policy(kind: str):
    from tensordict.nn import TensorDictModule

    module = ArgmaxMLP() if kind == "mlp" else RandomActions()
    return TensorDictModule(module, in_keys=["observation"], out_keys=["action"])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(mode: str, policy: str, nodes: int, frames_per_batch: int, seconds: float, warmup: float) -> dict:
    from torchrl.collectors.distributed import DistributedCollector

    collector = DistributedCollector(
        [make_env] * nodes, make_policy(policy), frames_per_batch=frames_per_batch, total_frames=10**12,
        sync=mode == "sync", launcher="mp", tcp_port=free_port(),
    )
    try:
        batches = iter(collector)
        next(batches)
        end_warmup = time.perf_counter() + warmup
        while time.perf_counter() < end_warmup:
            next(batches)
        frames, start = 0, time.perf_counter()
        while True:
            frames += next(batches).numel()
            elapsed = time.perf_counter() - start
            if elapsed >= seconds:
                return {"mode": mode, "policy": policy, "fps": frames / elapsed, "frames": frames, "seconds": elapsed}
    finally:
        collector.shutdown()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("sync", "async"), required=True)
    parser.add_argument("--policy", choices=("mlp", "random"), default="mlp")
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--frames-per-batch", type=int, default=None,
                        help="default: 1000 per node (sync: the whole batch is nodes x 1000)")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--warmup", type=float, default=1.0)
    args = parser.parse_args(argv)
    fpb = args.frames_per_batch or (1000 * args.nodes if args.mode == "sync" else 1000)
    print(json.dumps(measure(args.mode, args.policy, args.nodes, fpb, args.seconds, args.warmup)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
