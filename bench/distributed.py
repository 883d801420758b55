"""Distributed benchmark (SPEC 12): ``DistributedCollector`` with 2 local nodes x 1 worker ("mp"
launcher) on CartPole, sync and async, against ``MultiSyncCollector`` / ``MultiAsyncCollector``
with 2 workers measured in the same run, and, with ``--torchrl-python PATH``, against torchrl's
``DistributedCollector`` (launcher "mp", run by that interpreter: bench/distributed_torchrl.py).

    python -m bench.distributed [--seconds 8] [--rounds 2] [--torchrl-python /path/to/python]
    python -m bench.distributed --auth-cost      # the control plane's HMAC, per message

Each round builds every collector afresh (the nodes and workers start in seconds), warms it up,
then counts the frames of whole batches for ``--seconds``; the best round counts (the machine
may be shared).  Both sides collect the same frames per batch: 1000 per node or worker.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from rlcollect import DistributedCollector, MultiAsyncCollector, MultiSyncCollector
from rlcollect.nets import ArgmaxMLP

CARTPOLE = "CartPole-v1"
NODES = 2
FRAMES_PER_PART = 1000
TORCHRL_SCRIPT = Path(__file__).with_name("distributed_torchrl.py")


def mlp() -> ArgmaxMLP:
    """The benchmark's policy (2 hidden layers of 64, tanh, argmax), the same every run."""
    torch.manual_seed(0)
    return ArgmaxMLP(obs_dim=4, num_actions=2, hidden=64, depth=2)


def _frames_per_batch(mode: str) -> int:
    # Sync: the whole stacked batch (each node or worker collects its share); async: one node's.
    return FRAMES_PER_PART * NODES if mode == "sync" else FRAMES_PER_PART


def make_multi(mode: str, policy: str):
    cls = MultiSyncCollector if mode == "sync" else MultiAsyncCollector
    return cls(CARTPOLE, mlp() if policy == "mlp" else None, num_workers=NODES,
               frames_per_batch=_frames_per_batch(mode), total_frames=-1)


def make_distributed(mode: str, policy: str):
    return DistributedCollector([CARTPOLE] * NODES, mlp() if policy == "mlp" else None,
                                frames_per_batch=_frames_per_batch(mode), total_frames=-1, sync=mode == "sync")


def rate(make: Callable[[], object], seconds: float, warmup: float = 1.0) -> float:
    """Frames per second of an endless collector over ``seconds``, after ``warmup`` seconds."""
    collector = make()
    try:
        batches = iter(collector)
        next(batches)
        end = time.perf_counter() + warmup
        while time.perf_counter() < end:
            next(batches)
        frames, start = 0, time.perf_counter()
        while True:
            frames += next(batches).numel()
            elapsed = time.perf_counter() - start
            if elapsed >= seconds:
                return frames / elapsed
    finally:
        collector.shutdown()


def torchrl_rate(python: str, mode: str, policy: str, seconds: float) -> float | None:
    command = [python, str(TORCHRL_SCRIPT), "--mode", mode, "--policy", policy, "--seconds", str(seconds),
               "--nodes", str(NODES), "--frames-per-batch", str(_frames_per_batch(mode))]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, env={
        k: v for k, v in os.environ.items() if k != "PYTHONPATH"})  # theirs only: no rlcollect on its path
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    if result.returncode or not lines:
        print(f"torchrl {mode} {policy} failed (exit {result.returncode}):\n{result.stderr[-3000:]}", file=sys.stderr)
        return None
    return json.loads(lines[-1])["fps"]


def auth_cost(repeats: int = 20000) -> dict[str, float]:
    """Microseconds to sign and to check-and-parse one control message: a batch notice (what
    every batch costs) and a command with a 1 MB payload (a ``load_state_dict``)."""
    from rlcollect.distributed.control import protocol as P
    from rlcollect.distributed.control.auth import Keys, new_secret

    keys = Keys(new_secret())
    out = {}
    for name, payload, fields, n in (
            ("ready notice", b"", dict(seq=1, slot=0, frames=1000, version=3, seconds=0.01), repeats),
            ("1 MB command", os.urandom(1 << 20), dict(id=1, name="load_state_dict", args={}),
             max(20, repeats // 200))):
        kind = "ready" if "seq" in fields else "command"
        start = time.perf_counter()
        for i in range(n):
            data = P.encode(kind, 1, keys.to_rank0, "t" * 32, i + 1, payload, to=0, **fields)
        signed = time.perf_counter() - start
        start = time.perf_counter()
        for _ in range(n):
            P.decode(data, keys.to_rank0, kinds=(kind,), to=0, ranks=range(1, 3))
        checked = time.perf_counter() - start
        out[name] = {"sign_us": signed / n * 1e6, "check_us": checked / n * 1e6}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.distributed", description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=8.0, help="measured seconds per collector and round")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds; the best counts (default: 2)")
    parser.add_argument("--policy", choices=("random", "mlp", "both"), default="both")
    parser.add_argument("--torchrl-python", default=None, help="a torchrl installation's python, to compare")
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the results to this JSON file")
    parser.add_argument("--auth-cost", action="store_true", help="only time the control plane's HMAC per message")
    args = parser.parse_args(argv)
    if args.auth_cost:
        costs = auth_cost()
        print("| message | sign (us) | check + parse (us) |")
        print("|---|---:|---:|")
        for name, c in costs.items():
            print(f"| {name} | {c['sign_us']:.1f} | {c['check_us']:.1f} |")
        return 0
    torch.set_num_threads(1)
    policies = ("random", "mlp") if args.policy == "both" else (args.policy,)
    results = []
    for policy in policies:
        for mode in ("sync", "async"):
            best = {"multi": 0.0, "distributed": 0.0}
            for i in range(args.rounds):
                print(f"{mode} {policy}: round {i + 1}/{args.rounds}", file=sys.stderr, flush=True)
                best["multi"] = max(best["multi"], rate(functools.partial(make_multi, mode, policy), args.seconds))
                best["distributed"] = max(best["distributed"],
                                          rate(functools.partial(make_distributed, mode, policy), args.seconds))
            theirs = None
            if args.torchrl_python:
                print(f"{mode} {policy}: torchrl", file=sys.stderr, flush=True)
                theirs = torchrl_rate(args.torchrl_python, mode, policy, args.seconds)
            results.append({"mode": mode, "policy": policy, **best, "torchrl": theirs})
    header = ("| config | Multi{Sync,Async} 2 workers fps | Distributed 2 nodes fps | ratio "
              "| torchrl Distributed fps | ours / torchrl |")
    print(header)
    print("|---|---:|---:|---:|---:|---:|")
    for r in results:
        ratio = r["distributed"] / r["multi"] if r["multi"] else float("nan")
        vs = f"{r['distributed'] / r['torchrl']:.1f}x" if r["torchrl"] else "-"
        theirs = f"{r['torchrl']:,.0f}" if r["torchrl"] else "-"
        print(f"| {CARTPOLE} {r['policy']}, {r['mode']} | {r['multi']:,.0f} | {r['distributed']:,.0f} | {ratio:.2f} "
              f"| {theirs} | {vs} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"cpus": os.cpu_count(), "seconds": args.seconds,
                                               "rounds": args.rounds, "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
