"""The multi-process configurations of the suite (SPEC section 12): ``MultiSyncCollector`` and
``MultiAsyncCollector`` on CartPole, ``SleepEnv`` with 8 workers, ``BusyEnv`` with as many workers
as cores, and the time from constructor to first batch.

The ideal of a throughput configuration is ``workers ×`` the single-process rate of one worker's
work (the bare gymnasium loop measured in the same run, or ``1 / step_time``). Where the ideal is
``workers / step_time`` by definition, the suite also measures ``workers ×`` the rate of one bare
loop doing what the env does per step, alone in one process ("of workers × bare"): a 1 ms
``time.sleep`` takes a little longer than 1 ms, so that is the most the workers could reach even
on an idle machine, and the figure the acceptance target is stated in. Beside it, the
same bare loop runs in one process per worker at once: on a machine that other jobs share, that
is what the workers could get at best, and "collector / at once" is the collector's own
efficiency. Each round builds the collector once (its workers start in seconds) and measures it
for the round's share of ``--seconds × budget``.
"""

from __future__ import annotations

import functools
import os
import sys

from bench.config import CARTPOLE, Config, StartupConfig, Target, cartpole_mlp, torchrl_key
from bench.measure import Duration, Rate, at_once, collector_rate, gym_loop, run_json, timed_loop
from rlcollect import GymEnv, MultiAsyncCollector, MultiSyncCollector

#: Multi-process rounds measure this many times longer than single-process ones.
BUDGET = 2.0
#: Batches collected after the first one, before the clock starts (workers warming up).
WARMUP_S = 0.5
CLASSES = {"sync": MultiSyncCollector, "async": MultiAsyncCollector}
LABELS = {"sync": "MultiSync", "async": "MultiAsync"}


def _env_factory(num_envs: int):
    # A gymnasium id is wrapped in GymEnv by each worker; a partial pickles for "spawn".
    return functools.partial(GymEnv, CARTPOLE, num_envs=num_envs) if num_envs > 1 else CARTPOLE


def multi_cartpole_config(mode: str, workers: int, envs_per_worker: int, mlp: bool, frames_per_batch: int,
                          target: Target | None = None) -> Config:
    """``workers`` processes, each stepping ``envs_per_worker`` CartPoles with the random or MLP
    policy. ``frames_per_batch`` is what the collector is given: the whole batch for sync (each
    worker collects its share), one worker's batch for async (torchrl's meaning too)."""

    def policy():
        return cartpole_mlp() if mlp else None

    def ideal(seconds: float) -> Rate:
        one = gym_loop(CARTPOLE, envs_per_worker, policy(), seconds)
        return Rate(workers * one.frames_per_s, f"{workers} × {one.how}", cpu_per_kframe=one.cpu_per_kframe)

    def collector(seconds: float) -> Rate:
        make = functools.partial(
            CLASSES[mode], _env_factory(envs_per_worker), policy(), num_workers=workers,
            frames_per_batch=frames_per_batch, total_frames=-1,
        )
        return collector_rate(make, seconds, warmup=WARMUP_S)

    def bare_at_once(seconds: float) -> Rate:
        return at_once(functools.partial(gym_loop, CARTPOLE, envs_per_worker, policy()), workers, seconds)

    policy_name = "mlp 2x64" if mlp else "random"
    return Config(
        f"{CARTPOLE} {policy_name}, {workers} workers x {envs_per_worker} env(s), {LABELS[mode]}",
        ideal,
        collector,
        at_once=bare_at_once,
        torchrl=torchrl_key(mode, CARTPOLE, "mlp" if mlp else "random", workers=workers, envs=envs_per_worker,
                            frames_per_batch=frames_per_batch),
        budget=BUDGET,
        target=target,
    )


def timed_env_multi_config(env_class: type, step_time: float, workers: int, frames_per_batch: int,
                           target: Target | None = None) -> Config:
    """``workers`` processes each stepping one env that spends ``step_time`` per step: the
    ideal is ``workers / step_time`` by definition (for a sleeping env, whatever the cores);
    ``bare`` is ``workers ×`` what one bare loop spending ``step_time`` per step gets alone."""
    kind = env_class.__name__.removesuffix("Env").lower()

    def ideal(seconds: float) -> Rate:
        return Rate(workers / step_time, f"{workers} / step_time")

    def bare(seconds: float) -> Rate:
        one = timed_loop(step_time, kind == "busy", seconds)
        return Rate(workers * one.frames_per_s, f"{workers} × {one.how}, one process alone")

    def collector(seconds: float) -> Rate:
        make = functools.partial(
            MultiSyncCollector, functools.partial(env_class, step_time=step_time), None, num_workers=workers,
            frames_per_batch=frames_per_batch, total_frames=-1,
        )
        return collector_rate(make, seconds, warmup=WARMUP_S)

    def bare_at_once(seconds: float) -> Rate:
        return at_once(functools.partial(timed_loop, step_time, kind == "busy"), workers, seconds)

    return Config(
        f"{env_class.__name__}(step_time={step_time:g}) random, {workers} workers x 1 env, MultiSync",
        ideal,
        collector,
        at_once=bare_at_once,
        bare=bare,
        torchrl=torchrl_key("sync", kind, workers=workers, frames_per_batch=frames_per_batch, step_time=step_time),
        budget=BUDGET,
        target=target,
    )


# The clock starts after the imports: what is timed is the collector's own start-up (spawning
# the workers, which import what they need, building the envs, the first batch).
_COLD_START = """
import json, time
from rlcollect import MultiSyncCollector
MultiSyncCollector  # resolve the lazy import (and tensordict) before the clock starts
if __name__ == "__main__":
    start = time.perf_counter()
    collector = MultiSyncCollector([{env!r}] * {workers}, None, frames_per_batch={fpb}, total_frames=-1,
                                   mp_start_method="spawn")
    built = time.perf_counter()
    next(iter(collector))
    first = time.perf_counter()
    collector.shutdown()
    print(json.dumps({{"first_batch_s": first - start, "construct_s": built - start}}))
"""


def first_batch_config(workers: int, frames_per_batch: int, target: Target | None = None) -> StartupConfig:
    """Seconds from ``MultiSyncCollector(...)`` to its first batch, ``workers`` CartPole workers
    started with "spawn", random policy, each run in a fresh interpreter."""

    def measure() -> Duration:
        script = _COLD_START.format(env=CARTPOLE, workers=workers, fpb=frames_per_batch)
        out = run_json([sys.executable, "-c", script], timeout=300)
        return Duration(out["first_batch_s"], f"cold interpreter; construction {out['construct_s']:.2f} s")

    return StartupConfig(
        f"first batch, {CARTPOLE} random, {workers} workers (spawn), MultiSync",
        measure,
        torchrl=torchrl_key("first-batch", CARTPOLE, workers=workers, frames_per_batch=frames_per_batch),
        target=target,
    )


def multi_configs() -> list[Config | StartupConfig]:
    """SPEC 12's multi-process configurations, with the targets of the acceptance criteria.
    Sync batches are 1000 (1024 with 8 envs) frames per worker; async batches are one worker's."""
    from rlcollect import BusyEnv, SleepEnv

    random_vs_torchrl = Target("vs_torchrl", at_least=5.0)
    cores = os.cpu_count() or 1
    return [
        multi_cartpole_config("sync", 2, 1, False, 2000, random_vs_torchrl),
        multi_cartpole_config("async", 2, 1, False, 1000, random_vs_torchrl),
        multi_cartpole_config("sync", 2, 1, True, 2000),
        multi_cartpole_config("async", 2, 1, True, 1000),
        multi_cartpole_config("sync", 2, 8, False, 2048),
        multi_cartpole_config("async", 2, 8, False, 1024),
        multi_cartpole_config("sync", 2, 8, True, 2048, Target("ratio", at_least=0.6)),
        multi_cartpole_config("async", 2, 8, True, 1024),
        # 200 steps per worker per batch: 0.2 s of stepping, so the per-batch exchange is small.
        # The issue states this one against "8 × the single-env rate" (a bare sleeping loop), not 8 / step_time.
        timed_env_multi_config(SleepEnv, 1e-3, 8, 8 * 200, Target("of_bare", at_least=0.9)),
        timed_env_multi_config(BusyEnv, 1e-3, cores, cores * 200, Target("ratio", at_least=0.85)),
        first_batch_config(4, 1000, Target("vs_torchrl", at_most=0.5)),
    ]
