"""Timing loops: the ideal (bare) loops and the collector loop, each run for a time budget."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import gymnasium as gym
import numpy as np
import torch

# Checking the clock every step would itself cost a measurable share of a CartPole step.
CLOCK_EVERY = 128


@dataclass(frozen=True)
class Rate:
    """Frames over seconds, with a word on how it was obtained."""

    frames_per_s: float
    how: str


def run_for(step: Callable[[], int], seconds: float) -> float:
    """Call ``step`` (which returns the frames it made) for ``seconds`` after a short warmup,
    and return frames per second."""
    warmup_end = time.perf_counter() + min(0.5, seconds / 10)
    while time.perf_counter() < warmup_end:
        step()
    frames = 0
    start = time.perf_counter()
    while True:
        for _ in range(CLOCK_EVERY):
            frames += step()
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return frames / elapsed


def gym_loop(env_id: str, num_envs: int, policy: torch.nn.Module | None, seconds: float) -> Rate:
    """A bare loop over ``num_envs`` gymnasium envs: sample (or ask ``policy``), step, reset on end.

    With a policy, the observations of all envs go through it as one batch per step.
    """
    envs = [gym.make(env_id) for _ in range(num_envs)]
    obs = [env.reset(seed=i)[0] for i, env in enumerate(envs)]
    for i, env in enumerate(envs):
        env.action_space.seed(i)

    def step_random() -> int:
        for i, env in enumerate(envs):
            obs[i], _, terminated, truncated, _ = env.step(env.action_space.sample())
            if terminated or truncated:
                obs[i], _ = env.reset()
        return num_envs

    def step_policy() -> int:
        with torch.no_grad():
            actions = policy(torch.from_numpy(np.stack(obs))).tolist()
        for i, env in enumerate(envs):
            obs[i], _, terminated, truncated, _ = env.step(actions[i])
            if terminated or truncated:
                obs[i], _ = env.reset()
        return num_envs

    try:
        fps = run_for(step_random if policy is None else step_policy, seconds)
    finally:
        for env in envs:
            env.close()
    what = "action_space.sample()" if policy is None else "the MLP on the stacked observations"
    return Rate(fps, f"bare loop over {num_envs} gymnasium env(s) with {what}")


def collector_rate(make_collector: Callable[[], object], seconds: float) -> Rate:
    """Iterate an endless collector for ``seconds`` after one warmup batch; frames per second."""
    collector = make_collector()
    try:
        batches = iter(collector)
        next(batches)  # warmup: first reset, buffer allocation, first policy call
        frames = 0
        start = time.perf_counter()
        while True:
            frames += next(batches).numel()
            elapsed = time.perf_counter() - start
            if elapsed >= seconds:
                return Rate(frames / elapsed, f"{type(collector).__name__}")
    finally:
        collector.shutdown()
