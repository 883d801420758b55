"""Steps/s of Pong (84x84 grey, 4 stacked frames, frameskip 4, random actions) through the
vector-env adapters against the GymEnv path, in one process:

* ``envpool raw``: ``envpool.make_gymnasium("Pong-v5")`` stepped in a bare loop;
* ``EnvPoolEnv``: the same pool in a ``Collector``;
* ``ale vector raw`` / ``VectorEnv(AtariVectorEnv)``: ale-py's C++ vector env, bare and collected;
* ``GymEnv``: ``GymEnv`` batching gymnasium ``ALE/Pong-v5`` envs with ``AtariPreprocessing`` and
  ``FrameStackObservation(4)`` (the path of ``bench --only Pong``), in a ``Collector``.

Run: ``.venv/bin/python bench/vector_envs.py [--envs 8] [--seconds 5] [--threads N]``
(needs ``pip install 'rlcollect[atari,envpool]'``). Rounds alternate; the best round counts.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def gym_pong():
    import ale_py
    import gymnasium as gym

    gym.register_envs(ale_py)
    env = gym.make("ALE/Pong-v5", frameskip=1, repeat_action_probability=0.0)
    env = gym.wrappers.AtariPreprocessing(env, frame_skip=4, screen_size=84, grayscale_obs=True, noop_max=30)
    return gym.wrappers.FrameStackObservation(env, 4)


def bare(make, envs: int, seconds: float) -> float:
    pool = make(envs)
    pool.reset(seed=0) if not hasattr(pool, "config") else pool.reset()
    n = pool.single_action_space.n
    rng = np.random.default_rng(0)
    steps, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        pool.step(rng.integers(0, n, envs).astype(np.int32 if hasattr(pool, "config") else np.int64))
        steps += envs
    rate = steps / (time.perf_counter() - start)
    pool.close()
    return rate


def collected(make_env, envs: int, seconds: float) -> float:
    from rlcollect import Collector

    collector = Collector(make_env, policy=None, frames_per_batch=envs * 64)
    collector.set_seed(0)
    it = iter(collector)
    next(it)  # warm-up batch
    frames, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        frames += next(it).numel()
    rate = frames / (time.perf_counter() - start)
    collector.shutdown()
    return rate


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--envs", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=0, help="EnvPool/ALE threads (0: their default)")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    import torch

    torch.set_num_threads(1)
    import envpool
    from ale_py.vector_env import AtariVectorEnv

    from rlcollect import EnvPoolEnv, GymEnv, VectorEnv

    k, s, th = args.envs, args.seconds, args.threads
    configs = {
        "envpool raw": lambda: bare(lambda n: envpool.make_gymnasium("Pong-v5", num_envs=n, num_threads=th), k, s),
        "EnvPoolEnv in Collector": lambda: collected(lambda: EnvPoolEnv("Pong-v5", num_envs=k, num_threads=th), k, s),
        "ale vector raw": lambda: bare(lambda n: AtariVectorEnv("pong", n, num_threads=th), k, s),
        "VectorEnv(AtariVectorEnv) in Collector": lambda: collected(
            lambda: VectorEnv(AtariVectorEnv("pong", k, num_threads=th)), k, s),
        "GymEnv(AtariPreprocessing+FrameStack) in Collector": lambda: collected(
            lambda: GymEnv(gym_pong, num_envs=k), k, s),
    }
    best = dict.fromkeys(configs, 0.0)
    for _ in range(args.rounds):
        for name, run in configs.items():
            best[name] = max(best[name], run())
    print(f"Pong, {k} envs, random actions, best of {args.rounds} rounds of {s:g} s, cpus={os.cpu_count()}, "
          f"load={os.getloadavg()[0]:.1f}")
    for name, rate in best.items():
        print(f"  {name:52s} {rate:9,.0f} steps/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
