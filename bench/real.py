"""Real workloads (issue 16): Pong pixels and HalfCheetah states, random actions and a policy,
through rlcollect's collectors and the vector envs people already use, against bare loops.

Every row is measured in a fresh interpreter (``python -m bench.real KEY SECONDS``, one JSON
line out), so that its main-process memory is its own and not what earlier rows left::

    python -m bench.real "runner=multisync workload=Pong policy=random" 3

The rows of one workload (``ENVS`` env loops in all: ``WORKERS`` processes × ``ENVS_PER_WORKER``
envs, or one vector env of ``ENVS`` sub-envs):

- ``bare``: one process stepping ``ENVS`` envs in a loop (the ideal of ``Collector``);
- ``bare-at-once``: ``WORKERS`` processes, each stepping ``ENVS_PER_WORKER`` envs in a bare loop,
  all at the same time, no collector (the ideal of everything else);
- ``collector``: rlcollect's ``Collector`` on ``GymEnv(make_env, num_envs=ENVS)``;
- ``multisync`` / ``multiasync``: ``MultiSyncCollector`` / ``MultiAsyncCollector``, ``WORKERS``
  workers × ``GymEnv(make_env, num_envs=ENVS_PER_WORKER)``, the policy in the workers;
- ``gym-async``: gymnasium's ``AsyncVectorEnv`` of ``ENVS`` envs (shared memory, one process
  per env), stepped in a loop, the policy in the main process;
- ``sb3``: Stable-Baselines3's ``SubprocVecEnv`` of ``ENVS`` envs, likewise;
- ``envpool``: ``envpool.make_gymnasium`` with ``ENVS`` envs on as many threads as cores;
- ``puffer-serial``: PufferLib's ``Serial`` backend, ``ENVS`` envs in the main process;
- ``puffer-mp`` / ``puffer-mp-async``: PufferLib's ``Multiprocessing`` backend, ``WORKERS``
  processes × ``ENVS_PER_WORKER`` envs, every env in each batch (``batch_size=ENVS``) or one
  worker's envs per batch while the other steps (``batch_size=ENVS_PER_WORKER``). PufferLib's
  workers and main process spin on shared flags; more workers than cores (``overwork=True``)
  were slower here (see docs/benchmarks.md).

Every row also reports the CPU seconds it spent (``cpu_per_kstep``: per 1,000 steps, the
process, its threads and its child processes, over the timed window) and the collectors the main
process's own CPU per delivered batch (``main_cpu_ms_per_batch``).

The policy, where there is one, sees the batch of observations of the envs of its process (or
of the vector env) at each step, with one torch thread; random actions are drawn for all envs
of a process in one call. A row whose library is not installed reports ``{"skip": why}``.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time

import numpy as np
import torch

from bench.config import Row, Target, WorkloadConfig, torchrl_key
from bench.measure import Rate, at_once, collector_rate, measure_for
from bench.policies import policy_actions
from bench.workloads import WORKLOADS, Workload, available, nbytes, rss, sample_actions, shm_bytes

WORKERS = 2
ENVS_PER_WORKER = 4
ENVS = WORKERS * ENVS_PER_WORKER
#: Batches collected after the first one before the clock starts (multi-process collectors).
WARMUP_S = 0.5
RUNNERS = ("bare", "bare-at-once", "collector", "multisync", "multiasync", "gym-async", "sb3", "envpool",
           "puffer-serial", "puffer-mp", "puffer-mp-async")
PUFFER = ("puffer-serial", "puffer-mp", "puffer-mp-async")
POLICIES = ("random", "policy")


def key(runner: str, workload: str, policy: str) -> str:
    """The key of one row for ``python -m bench.real``."""
    return f"runner={runner} workload={workload} policy={policy}"


def parse_key(text: str) -> dict:
    """``"runner=... workload=... policy=..."`` -> a dict, validated."""
    words = dict(word.split("=", 1) for word in text.split())
    if set(words) != {"runner", "workload", "policy"}:
        raise ValueError(f"key {text!r} needs exactly the words runner, workload, policy")
    if words["runner"] not in RUNNERS:
        raise ValueError(f"runner must be one of {RUNNERS}, got {words['runner']!r}")
    if words["workload"] not in WORKLOADS:
        raise ValueError(f"workload must be one of {sorted(WORKLOADS)}, got {words['workload']!r}")
    if words["policy"] not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {words['policy']!r}")
    return words


def frames_per_batch(workload: Workload, runner: str) -> int:
    """What the collector is given: each env contributes ``steps_per_worker_batch`` steps to a
    batch; a sync batch holds every worker's share, an async batch one worker's (as in torchrl)."""
    envs = {"collector": ENVS, "multisync": ENVS, "multiasync": ENVS_PER_WORKER}[runner]
    return envs * workload.steps_per_worker_batch


# -- the loops ---------------------------------------------------------------------------------
def bare_loop(name: str, num_envs: int, use_policy: bool, seconds: float) -> Rate:
    """One process stepping ``num_envs`` envs of workload ``name``: draw (or ask the policy for)
    the actions of all envs, step each, reset those that ended. Steps per second."""
    workload = WORKLOADS[name]
    envs = [workload.make_env() for _ in range(num_envs)]
    obs = [env.reset(seed=i)[0] for i, env in enumerate(envs)]
    space = envs[0].action_space
    rng = np.random.default_rng(0)
    policy = workload.make_policy() if use_policy else None

    def step() -> int:
        actions = policy_actions(policy, np.stack(obs)) if policy is not None else sample_actions(space, rng, num_envs)
        for i, env in enumerate(envs):
            obs[i], _, terminated, truncated, _ = env.step(actions[i])
            if terminated or truncated:
                obs[i], _ = env.reset()
        return num_envs

    try:
        window = measure_for(step, seconds)
    finally:
        for env in envs:
            env.close()
    return Rate(window.frames_per_s, f"bare loop over {num_envs} envs", cpu_per_kframe=window.cpu_per_kframe)


def _vector_loop(venv, space, num_envs: int, policy, seconds: float, first_obs, how: str) -> tuple[Rate, dict]:
    """Step a vector env in a loop (gymnasium's step API or SB3's: the observations first, the
    info last)."""
    rng = np.random.default_rng(0)
    state = {"obs": first_obs, "out": None}

    def step() -> int:
        actions = (policy_actions(policy, state["obs"]) if policy is not None
                   else sample_actions(space, rng, num_envs))
        out = venv.step(actions)
        state["obs"], state["out"] = out[0], out
        return num_envs

    window = measure_for(step, seconds)
    rate = Rate(window.frames_per_s, how, cpu_per_kframe=window.cpu_per_kframe)
    delivered = nbytes(list(state["out"][:-1]))  # observations, rewards, dones (not the info dicts)
    return rate, {"batch_bytes": delivered, "frames_per_delivery": num_envs}


def _puffer_loop(venv, space, policy, seconds: float, how: str) -> tuple[Rate, dict]:
    """Step a PufferLib vector env through its ``recv`` / ``send`` calls: each ``recv`` gives the
    observations of the envs of one batch (all ``ENVS``, or one worker's), ``send`` their actions."""
    rng = np.random.default_rng(0)
    venv.async_reset(0)
    state = {"obs": None}

    def step() -> int:
        obs, *_, env_ids, _ = venv.recv()
        state["obs"] = obs
        n = len(env_ids)
        venv.send(policy_actions(policy, obs) if policy is not None else sample_actions(space, rng, n))
        return n

    window = measure_for(step, seconds)
    rate = Rate(window.frames_per_s, how, cpu_per_kframe=window.cpu_per_kframe)
    obs = state["obs"]
    return rate, {"batch_bytes": nbytes(obs), "frames_per_delivery": len(obs)}


def _puffer(workload: Workload, runner: str, use_policy: bool, seconds: float, before: dict) -> dict:
    import pufferlib.emulation
    import pufferlib.vector

    policy = workload.make_policy() if use_policy else None
    make = functools.partial(pufferlib.emulation.GymnasiumPufferEnv, env_creator=workload.make_env)
    if runner == "puffer-serial":
        venv = pufferlib.vector.make(make, backend=pufferlib.vector.Serial, num_envs=ENVS)
        how = f"PufferLib Serial, {ENVS} envs"
    else:
        batch = ENVS if runner == "puffer-mp" else ENVS_PER_WORKER
        venv = pufferlib.vector.make(make, backend=pufferlib.vector.Multiprocessing, num_envs=ENVS,
                                     num_workers=WORKERS, batch_size=batch)
        how = f"PufferLib Multiprocessing, {WORKERS} workers × {ENVS_PER_WORKER} envs, batch_size={batch}"
    try:
        rate, extra = _puffer_loop(venv, venv.single_action_space, policy, seconds, how)
        return {"steps_per_s": rate.frames_per_s, "how": how, "cpu_per_kstep": rate.cpu_per_kframe,
                **_memory(before, extra)}
    finally:
        venv.close()


def _memory(before: dict, extra: dict) -> dict:
    return {"rss_before": before["VmRSS"], **{f"rss_{k}": v for k, v in rss().items()},
            "shm_bytes": shm_bytes(), **extra}


def measure(text: str, seconds: float) -> dict:
    """Measure one row for ``seconds``; a dict with ``steps_per_s``, ``how`` and the main
    process's memory at the end of the window (``rss_*``, ``shm_bytes``), or ``{"skip": why}``."""
    spec = parse_key(text)
    workload = WORKLOADS[spec["workload"]]
    runner, use_policy = spec["runner"], spec["policy"] == "policy"
    why = available(workload)
    if why is None and runner == "sb3":
        why = _missing("stable_baselines3", "stable-baselines3 (pip install 'rlcollect[bench]')")
    if why is None and runner == "envpool":
        why = _missing("envpool", "envpool (pip install 'rlcollect[envpool]')")
    if why is None and runner in PUFFER:
        why = _missing("pufferlib", "pufferlib (pip install --no-deps 'pufferlib-core==3.0.23' psutil: "
                                    "docs/benchmarks.md)") or _missing("psutil", "psutil (PufferLib needs it)")
    if why is not None:
        return {"skip": why}
    torch.set_num_threads(1)
    _import_runner(runner)  # before the baseline: the growth of RSS is the run's, not the imports'
    before = rss()
    if runner == "bare":
        rate = bare_loop(workload.name, ENVS, use_policy, seconds)
        return {"steps_per_s": rate.frames_per_s, "how": rate.how, "cpu_per_kstep": rate.cpu_per_kframe,
                **_memory(before, {})}
    if runner == "bare-at-once":
        rate = at_once(functools.partial(bare_loop, workload.name, ENVS_PER_WORKER, use_policy), WORKERS, seconds)
        return {"steps_per_s": rate.frames_per_s,
                "how": f"{WORKERS} processes × {ENVS_PER_WORKER} envs, bare loops at once",
                "cpu_per_kstep": rate.cpu_per_kframe, **_memory(before, {})}
    if runner in ("collector", "multisync", "multiasync"):
        return _collector(workload, runner, use_policy, seconds, before)
    if runner in PUFFER:
        return _puffer(workload, runner, use_policy, seconds, before)
    return _vector(workload, runner, use_policy, seconds, before)


def _import_runner(runner: str) -> None:
    if runner in ("collector", "multisync", "multiasync"):
        import rlcollect  # noqa: F401
        from rlcollect import Collector, MultiSyncCollector  # noqa: F401  (resolve the lazy imports)
    elif runner == "sb3":
        import stable_baselines3.common.vec_env  # noqa: F401
    elif runner == "envpool":
        import envpool  # noqa: F401
    elif runner in PUFFER:
        import pufferlib.vector  # noqa: F401


def _missing(module: str, what: str) -> str | None:
    import importlib.util

    return None if importlib.util.find_spec(module) is not None else f"{what} is not installed"


def _collector(workload: Workload, runner: str, use_policy: bool, seconds: float, before: dict) -> dict:
    from rlcollect import Collector, GymEnv, MultiAsyncCollector, MultiSyncCollector

    policy = workload.make_policy() if use_policy else None
    fpb = frames_per_batch(workload, runner)
    if runner == "collector":
        make = functools.partial(Collector, GymEnv(workload.make_env, num_envs=ENVS), policy,
                                 frames_per_batch=fpb, total_frames=-1)
        warmup = 0.0
    else:
        cls = MultiSyncCollector if runner == "multisync" else MultiAsyncCollector
        make = functools.partial(cls, functools.partial(GymEnv, workload.make_env, num_envs=ENVS_PER_WORKER), policy,
                                 num_workers=WORKERS, frames_per_batch=fpb, total_frames=-1)
        warmup = WARMUP_S

    def probe(batch, collector, stats: dict | None) -> dict:
        extra = {"batch_bytes": nbytes(batch), "frames_per_delivery": batch.numel()}
        if runner != "collector" and stats is not None and "wait_s" in stats:  # the multi-process collectors
            now = collector.stats()
            batches = now["batches"] - stats["batches"]
            window = now["elapsed_s"] - stats["elapsed_s"]
            waited = now["wait_s"] - stats["wait_s"]
            # What the main process did per batch besides waiting for the workers (delivering the
            # batch, and this loop), and the share of the window it waited.
            extra.update(batches=batches, main_wait_share=waited / window,
                         main_busy_ms_per_batch=(window - waited) / max(batches, 1) * 1e3)
        return _memory(before, extra)

    rate = collector_rate(make, seconds, warmup=warmup, probe=probe)
    return {"steps_per_s": rate.frames_per_s, "how": f"rlcollect {rate.how}, frames_per_batch={fpb}",
            "cpu_per_kstep": rate.cpu_per_kframe, "main_cpu_ms_per_batch": rate.main_cpu_ms_per_batch,
            **rate.probed}


def _vector(workload: Workload, runner: str, use_policy: bool, seconds: float, before: dict) -> dict:
    policy = workload.make_policy() if use_policy else None
    if runner == "gym-async":
        import gymnasium as gym

        venv = gym.vector.AsyncVectorEnv([workload.make_env] * ENVS)
        first, _ = venv.reset(seed=0)
        space, how = venv.single_action_space, f"gymnasium AsyncVectorEnv({ENVS})"
    elif runner == "sb3":
        from stable_baselines3.common.vec_env import SubprocVecEnv

        venv = SubprocVecEnv([workload.make_env] * ENVS)
        venv.seed(0)
        first = venv.reset()
        space, how = venv.action_space, f"SB3 SubprocVecEnv({ENVS}), its default start method (forkserver)"
    else:
        import envpool

        threads = os.cpu_count() or 1
        venv = envpool.make_gymnasium(workload.envpool_id, num_envs=ENVS, num_threads=threads, seed=0,
                                      **workload.envpool_kwargs)
        first, _ = venv.reset()
        space = venv.action_space
        how = f"envpool.make_gymnasium({workload.envpool_id!r}, num_envs={ENVS}, num_threads={threads})"
    try:
        rate, extra = _vector_loop(venv, space, ENVS, policy, seconds, first, how)
        return {"steps_per_s": rate.frames_per_s, "how": how, "cpu_per_kstep": rate.cpu_per_kframe,
                **_memory(before, extra)}
    finally:
        venv.close()


# -- the suite's configurations -------------------------------------------------------------------
AT_ONCE = f"bare loops at once: {WORKERS} processes × {ENVS_PER_WORKER} envs"
BARE = f"bare loop: 1 process × {ENVS} envs"
#: Issue 16's targets on 2 cores: of bare-at-once, against envpool on the same cores, and the
#: main process's memory against the batch it holds.
SYNC_TARGETS = (Target("ratio", at_least=0.9), Target("vs_envpool", at_least=1.0))
ASYNC_TARGETS = (Target("ratio", at_least=0.95), Target("vs_envpool", at_least=1.0))
#: The memory target of the pixel path (issue 16 item 2: the main process at most 1.25x the bytes of
#: the batches it holds, in flight included) is measured by ``python -m bench.pixels``, which
#: counts the storages of the batches alive and of the slots in flight at each batch. The
#: "+RSS/batch" column here is the growth of the whole process over the bytes of ONE batch (the
#: slots in flight, the workers' shared weights and the allocator's free lists all count in it):
#: a figure to compare between rows, not the target.
PIXEL_TARGETS: tuple[Target, ...] = ()
#: Real-workload rounds measure this many times longer than single-process ones (every row
#: starts its processes in each round).
BUDGET = 2.0


def workload_config(name: str, use_policy: bool) -> WorkloadConfig:
    """The rows of workload ``name`` with random actions or its policy (see the module's doc)."""
    workload = WORKLOADS[name]
    policy = "policy" if use_policy else "random"
    threads = os.cpu_count() or 1
    sync_fpb, async_fpb = frames_per_batch(workload, "multisync"), frames_per_batch(workload, "multiasync")
    trl_policy = workload.policy_key if use_policy else "random"
    each = f"{WORKERS} workers × {ENVS_PER_WORKER} envs"
    memory = PIXEL_TARGETS if name == "Pong" else ()
    rows = (
        Row(AT_ONCE, key("bare-at-once", name, policy)),
        Row(BARE, key("bare", name, policy)),
        Row(f"rlcollect Collector, {ENVS} envs", key("collector", name, policy), ideal=BARE, delivers_batches=True),
        Row(f"rlcollect MultiSync, {each}", key("multisync", name, policy), ideal=AT_ONCE, delivers_batches=True,
            targets=SYNC_TARGETS + memory),
        Row(f"rlcollect MultiAsync, {each}", key("multiasync", name, policy), ideal=AT_ONCE, delivers_batches=True,
            targets=ASYNC_TARGETS + memory),
        Row(f"gymnasium AsyncVectorEnv({ENVS})", key("gym-async", name, policy), ideal=AT_ONCE),
        Row(f"SB3 SubprocVecEnv({ENVS})", key("sb3", name, policy), ideal=AT_ONCE),
        Row(ENVPOOL.format(envs=ENVS, threads=threads), key("envpool", name, policy), ideal=AT_ONCE),
        Row(f"PufferLib Serial({ENVS})", key("puffer-serial", name, policy), ideal=BARE),
        Row(f"PufferLib Multiprocessing, {each}, sync", key("puffer-mp", name, policy), ideal=AT_ONCE),
        Row(f"PufferLib Multiprocessing, {each}, one worker per batch", key("puffer-mp-async", name, policy),
            ideal=AT_ONCE),
        Row(f"torchrl MultiSync, {each}", torchrl_key("sync", name, trl_policy, workers=WORKERS, envs=ENVS_PER_WORKER,
                                                      frames_per_batch=sync_fpb),
            side="torchrl", ideal=AT_ONCE, delivers_batches=True),
        Row(f"torchrl MultiAsync, {each}", torchrl_key("async", name, trl_policy, workers=WORKERS,
                                                       envs=ENVS_PER_WORKER, frames_per_batch=async_fpb),
            side="torchrl", ideal=AT_ONCE, delivers_batches=True),
    )
    policy_name = workload.policy_name if use_policy else "random"
    return WorkloadConfig(
        f"{name} {policy_name}, {WORKERS} workers x {ENVS_PER_WORKER} envs ({ENVS} envs in a vector env)",
        workload.title, workload.frames_per_step, rows, budget=BUDGET)


#: The envpool row's label (``WorkloadResult.vs_envpool`` finds it by its key).
ENVPOOL = "envpool({envs}), {threads} threads"


def real_configs() -> list[WorkloadConfig]:
    """Issue 16's real workloads: Pong and HalfCheetah, random actions and a policy."""
    return [workload_config(name, use_policy) for name in ("Pong", "HalfCheetah") for use_policy in (False, True)]


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(f"usage: python -m bench.real KEY SECONDS (KEY: {key('multisync', 'Pong', 'random')!r})", file=sys.stderr)
        return 2
    import warnings

    warnings.filterwarnings("ignore")
    started = time.perf_counter()
    out = measure(argv[0], float(argv[1]))
    out["wall_s"] = time.perf_counter() - started
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
