"""torchrl's side of the benchmark suite: measure one configuration on torchrl's collectors.

Runs under an interpreter that has torchrl (``python -m bench --torchrl-python PATH`` calls it);
it never imports rlcollect, and rlcollect never imports it::

    PATH/python bench/torchrl_side.py "collector=sync env=CartPole-v1 policy=random workers=2 envs=1 fpb=2000" 2

prints one JSON line: ``{"fps": ..., "how": ...}``, or for ``collector=first-batch``
``{"first_batch_s": ..., "construct_s": ..., "how": ...}``. The key's words (built by
``bench/config.py:torchrl_key`` from the numbers rlcollect's side uses):

- ``collector``: ``single`` (``Collector``), ``sync`` / ``async`` (``MultiSyncCollector`` /
  ``MultiAsyncCollector``), or ``first-batch`` (seconds from ``MultiSyncCollector(...)`` to its
  first batch, "spawn"; the imports are done before the clock starts).
- ``env``: a gymnasium id (``torchrl.envs.GymEnv(..., categorical_action_encoding=True)``, so
  that an index is the action), ``busy`` / ``sleep`` with ``step_time`` (the gymnasium envs
  below, wrapped with ``GymWrapper``), or a real workload of ``bench/workloads.py`` (``Pong``,
  ``HalfCheetah``: its env factory, wrapped the same way).
- ``envs``: envs per collector / worker. Several are one ``GymWrapper`` around a gymnasium
  ``SyncVectorEnv`` (stepped in-process, as rlcollect's ``GymEnv(num_envs=N)`` does; torchrl's
  ``GymEnv(num_envs=N)`` starts an ``AsyncVectorEnv`` with a process per env, and a
  ``SerialEnv`` was slower in our trials).
- ``policy``: ``random`` (torchrl's default, ``RandomPolicy`` on the env's action spec, built
  where the env is), ``mlp`` (the suite's 2x64 tanh MLP with argmax, same seed, in a
  ``TensorDictModule``), or a real workload's (``nature-cnn``, ``tanh-mlp``: the modules of
  ``bench/policies.py``, same seed, in a ``TensorDictModule``).
- ``workers``, ``fpb`` (``frames_per_batch``, with torchrl's meaning: the whole batch for sync,
  one worker's for async, as in rlcollect).

Throughput: one construction, one warmup batch and more until 0.5 s (multi-process) have
passed, then frames over ``seconds``; one torch thread in the main process, as on our side.
The JSON also holds the main process's memory at the end of the window, read as on our side
(``rss_*``, ``shm_bytes``, ``batch_bytes``; ``rss_before`` just before the collector is built),
and the CPU of the window as on our side (``cpu_per_kframe``: the process and its workers, per
1,000 frames; ``main_cpu_ms_per_batch``: the main process alone, per batch).
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time

import gymnasium as gym
import numpy as np
import torch
from torch import nn

WARMUP_S = 0.5
# bench/workloads.py and bench/policies.py (neither imports rlcollect) are found from the repository root.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _workloads():
    from bench import workloads

    return workloads


# -- the work: envs and policies (module level, so that "spawn" workers can unpickle them) ------
class TimedEnv(gym.Env):
    """A gymnasium env that spends ``step_time`` per step, sleeping (``busy=False``) or spinning
    (``busy=True``); it never ends. Mirrors rlcollect's ``SleepEnv`` / ``BusyEnv``."""

    observation_space = gym.spaces.Box(-np.inf, np.inf, (4,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def __init__(self, step_time: float, busy: bool):
        self.step_time = step_time
        self.busy = busy
        self._count = 0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self._count = 0
        return np.zeros(4, np.float32), {}

    def step(self, action):
        if self.busy:
            deadline = time.perf_counter() + self.step_time
            while time.perf_counter() < deadline:
                pass
        else:
            time.sleep(self.step_time)
        self._count += 1
        return np.full(4, self._count, np.float32), 1.0, False, False, {}


def make_env(env: str, envs: int, step_time: float | None):
    from torchrl.envs import GymEnv, GymWrapper

    if env in ("busy", "sleep"):
        if envs != 1:
            raise ValueError(f"env={env} supports envs=1 only, got {envs}")
        return GymWrapper(TimedEnv(step_time, busy=env == "busy"), categorical_action_encoding=True)
    workloads = _workloads().WORKLOADS
    if env in workloads:
        make = workloads[env].make_env
        if envs == 1:
            return GymWrapper(make(), categorical_action_encoding=True)
    elif envs == 1:
        return GymEnv(env, categorical_action_encoding=True)
    else:
        make = functools.partial(gym.make, env)
    # torchrl wraps vector envs only with same-step auto-reset.
    vector = gym.vector.SyncVectorEnv([make] * envs, autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)
    return GymWrapper(vector, categorical_action_encoding=True)


class ArgmaxMLP(nn.Module):
    """Observation -> 2 tanh layers of 64 -> action logits -> argmax: the same module, built in
    the same order under the same seed, as the suite's ``cartpole_mlp()``."""

    def __init__(self, obs_dim: int = 4, num_actions: int = 2, hidden: int = 64, depth: int = 2):
        super().__init__()
        layers: list[nn.Module] = []
        width = obs_dim
        for _ in range(depth):
            layers += [nn.Linear(width, hidden), nn.Tanh()]
            width = hidden
        layers.append(nn.Linear(width, num_actions))
        self.net = nn.Sequential(*layers)

    def forward(self, observation: torch.Tensor) -> torch.Tensor:
        return self.net(observation).argmax(-1)


def make_policy(name: str):
    """None for random: torchrl's collectors then build ``RandomPolicy(env.full_action_spec)``
    where the env is (in each worker), without an env in the main process."""
    if name == "random":
        return None
    from tensordict.nn import TensorDictModule

    real = {w.policy_key: w for w in _workloads().WORKLOADS.values()}
    if name in real:
        return TensorDictModule(real[name].make_policy(), in_keys=["observation"], out_keys=["action"])
    if name != "mlp":
        raise ValueError(f"policy must be 'random', 'mlp' or one of {sorted(real)}, got {name!r}")
    torch.manual_seed(0)
    return TensorDictModule(ArgmaxMLP(), in_keys=["observation"], out_keys=["action"])


# -- the key ---------------------------------------------------------------------------------------
COLLECTORS = ("single", "sync", "async", "first-batch")


def parse_key(key: str) -> dict:
    """``"collector=sync env=CartPole-v1 ..."`` -> a dict with typed values, validated."""
    words = dict(word.split("=", 1) for word in key.split())
    missing = {"collector", "env", "fpb"} - set(words)
    if missing:
        raise ValueError(f"key {key!r} lacks {sorted(missing)}")
    spec = {
        "collector": words.pop("collector"),
        "env": words.pop("env"),
        "policy": words.pop("policy", "random"),
        "workers": int(words.pop("workers", 1)),
        "envs": int(words.pop("envs", 1)),
        "fpb": int(words.pop("fpb")),
        "step_time": float(words.pop("step_time")) if "step_time" in words else None,
    }
    if words:
        raise ValueError(f"key {key!r}: unknown words {sorted(words)}")
    if spec["collector"] not in COLLECTORS:
        raise ValueError(f"collector must be one of {COLLECTORS}, got {spec['collector']!r}")
    if spec["env"] in ("busy", "sleep") and spec["step_time"] is None:
        raise ValueError(f"env={spec['env']} needs step_time")
    return spec


# -- measuring -----------------------------------------------------------------------------------
def build(spec: dict):
    from torchrl.collectors import Collector, MultiAsyncCollector, MultiSyncCollector

    env_fn = functools.partial(make_env, spec["env"], spec["envs"], spec["step_time"])
    policy = make_policy(spec["policy"])
    common = {"frames_per_batch": spec["fpb"], "total_frames": -1}
    if spec["collector"] == "single":
        env = env_fn()
        if policy is None:
            from torchrl.envs.utils import RandomPolicy

            policy = RandomPolicy(env.action_spec)
        return Collector(env, policy, **common)
    cls = MultiAsyncCollector if spec["collector"] == "async" else MultiSyncCollector
    return cls([env_fn] * spec["workers"], policy, **common)


def measure_fps(spec: dict, seconds: float) -> dict:
    workloads = _workloads()
    before = workloads.rss()
    collector = build(spec)
    try:
        batches = iter(collector)
        warmup_end = time.perf_counter() + (WARMUP_S if spec["collector"] != "single" else 0.0)
        next(batches)
        while time.perf_counter() < warmup_end:
            next(batches)
        frames = delivered = 0
        cpu = workloads.cpu_seconds()["total"]
        main_cpu = time.process_time()
        start = time.perf_counter()
        while True:
            batch = next(batches)
            frames += batch.numel()
            delivered += 1
            elapsed = time.perf_counter() - start
            if elapsed >= seconds:
                main_cpu = time.process_time() - main_cpu
                cpu = workloads.cpu_seconds()["total"] - cpu
                memory = {"cpu_per_kframe": cpu / frames * 1e3, "main_cpu_ms_per_batch": main_cpu / delivered * 1e3,
                          "rss_before": before["VmRSS"], **{f"rss_{k}": v for k, v in workloads.rss().items()},
                          "shm_bytes": workloads.shm_bytes(), "batch_bytes": workloads.nbytes(batch),
                          "frames_per_delivery": batch.numel()}
                return {"fps": frames / elapsed, "how": f"torchrl {type(collector).__name__}", **memory}
    finally:
        collector.shutdown()


def measure_first_batch(spec: dict) -> dict:
    from torchrl.collectors import MultiSyncCollector

    env_fn = functools.partial(make_env, spec["env"], spec["envs"], spec["step_time"])
    start = time.perf_counter()
    collector = MultiSyncCollector([env_fn] * spec["workers"], make_policy(spec["policy"]),
                                   frames_per_batch=spec["fpb"], total_frames=-1)
    built = time.perf_counter()
    next(iter(collector))
    first = time.perf_counter()
    collector.shutdown()
    return {"first_batch_s": first - start, "construct_s": built - start,
            "how": f"torchrl MultiSyncCollector, cold interpreter; construction {built - start:.2f} s"}


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(f"usage: {sys.argv[0]} KEY SECONDS", file=sys.stderr)
        return 2
    spec = parse_key(argv[0])
    seconds = float(argv[1])
    workloads = _workloads()
    if spec["env"] in workloads.WORKLOADS:
        why = workloads.available(workloads.WORKLOADS[spec["env"]])
        if why is not None:  # e.g. ale-py missing from torchrl's interpreter: no figure, said why
            print(json.dumps({"skip": f"{why} (in {sys.executable})"}), flush=True)
            return 0
    import multiprocessing

    multiprocessing.set_start_method("spawn")  # torchrl's default too; said out loud
    import torchrl.collectors  # noqa: F401  (imported before any clock starts)
    import torchrl.envs  # noqa: F401

    torch.set_num_threads(1)
    out = measure_first_batch(spec) if spec["collector"] == "first-batch" else measure_fps(spec, seconds)
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
