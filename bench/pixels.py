"""The pixel path on Pong: frames/s, main-process memory per batch held, and bytes copied per frame.

Run: ``python -m bench.pixels [--seconds 10] [--batch-steps 128] [--only Collector,MultiSync,...]``
(needs ``pip install 'rlcollect[atari]'``). The env is gymnasium ``ALE/Pong-v5`` (``frameskip=1``)
with ``AtariPreprocessing`` (frame skip 4, 84x84 grey, 30 no-op resets) and
``FrameStackObservation(4)``: 84x84x4 uint8 observations (28,224 bytes). Random actions.
``Collector`` steps 8 envs in one process; ``MultiSync`` / ``MultiAsync`` run 2 workers x 4 envs;
``bare at once`` is 2 forked processes each stepping 4 envs in a bare gymnasium loop (the ideal of
the multi-process collectors on this machine now).

What is measured, precisely:

* **fps**: frames delivered per second over ``--seconds`` after ``--warmup`` seconds of batches.
  The loop is ``for batch in collector:`` reading one byte of every page of each batch (as a
  trainer reading it would: shared pages count in a process's RSS only once it touches them).
* **Main-process memory** (each collector runs in a fresh interpreter; the baseline is taken
  after the imports and, for ``Collector``, after building the env the user hands it, before
  the collector is built): ``peak RSS`` is ``VmHWM`` of ``/proc/self/status`` minus the
  baseline's ``VmRSS`` (the highest resident memory at any instant, inside ``next()`` included).
  ``steady`` is ``VmRSS`` minus the baseline sampled right after each batch (the largest
  sample), split into private memory (``RssAnon``) and shared memory the main process touched
  (``RssShmem``: the batch slots).
* **Bytes held**: the distinct memory blocks (tensor storages) of the batches alive at once in
  the main process plus the shared slots in flight (a worker is filling them, or they are
  filled and not yet delivered). ``peak held`` is its largest value, counted right after
  ``next()`` returns and before the previous batch is released: the batch the user still holds
  during ``next()``, the new one, and the slots in flight. ``ratio`` = peak RSS / peak held: the
  target is at most 1.25. ``held`` (steady) counts the user's batch and the slots in flight after
  the previous batch is released; the steady ratio also counts memory kept for the next batch
  (MultiSync's second stacked slot, the allocator's free lists).
* **Bytes copied per frame by stage**: what each stage of the data path writes per frame, from
  the layout (observation bytes per frame) and the path each collector takes (see
  docs/multiprocess.md, "Memory and copies"); the gather stage is counted: the share of
  batches delivered as a copy instead of a view of the slot the workers wrote.

The machine is shared: the load average is printed with the table; compare ratios of one run.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time

NAMES = ("Collector", "MultiSync", "MultiAsync", "bare at once")
WORKERS, ENVS_PER_WORKER = 2, 4


def gym_pong():
    """Pong as the issue measures it: 84x84x4 uint8 stacks."""
    import ale_py
    import gymnasium as gym

    gym.register_envs(ale_py)
    env = gym.make("ALE/Pong-v5", frameskip=1, repeat_action_probability=0.0)
    env = gym.wrappers.AtariPreprocessing(env, frame_skip=4, screen_size=84, grayscale_obs=True, noop_max=30)
    return gym.wrappers.FrameStackObservation(env, 4)


def _status() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssShmem"):
                out[key] = int(value.split()[0]) * 1024
    return out


def _td_bytes(td) -> int:
    return sum(t.numel() * t.element_size() for t in td.values(include_nested=True, leaves_only=True))


def _in_flight_bytes(collector) -> int:
    """Bytes of the shared slots whose batch is in flight (being filled, or filled and queued)."""
    from rlcollect.multiprocess.shm import slot_bytes

    slots = getattr(collector, "_in_flight", None)
    if slots is None:
        return 0
    total = sum(len(s) * slot_bytes(collector.layouts[i]) for i, s in enumerate(slots))
    return total + sum(slot_bytes(collector.layouts[i]) for i, _ in collector._ready)


def _build(name: str, batch_steps: int, env=None):
    from rlcollect import Collector, GymEnv, MultiAsyncCollector, MultiSyncCollector

    if name == "Collector":
        n = WORKERS * ENVS_PER_WORKER
        return Collector(env, None, frames_per_batch=n * batch_steps, total_frames=-1)
    factory = functools.partial(GymEnv, gym_pong, num_envs=ENVS_PER_WORKER)
    if name == "MultiSync":
        return MultiSyncCollector(factory, None, num_workers=WORKERS, total_frames=-1,
                                  frames_per_batch=WORKERS * ENVS_PER_WORKER * batch_steps)
    return MultiAsyncCollector(factory, None, num_workers=WORKERS, total_frames=-1,
                               frames_per_batch=ENVS_PER_WORKER * batch_steps)


def copy_stages(name: str, obs_bytes: int, copied: float) -> list[tuple[str, int]]:
    """Bytes written per frame by each stage of the path ``name`` takes (observations only: the
    other fields of a Pong frame are 30 bytes); ``copied``: the share of batches copied out of
    the slots in the main process (the others were views)."""
    stages = [("env -> batch ('next', obs)[:, t], strided", obs_bytes),
              ("('next', obs)[:, t] -> obs[:, t + 1]", obs_bytes)]
    if name != "Collector":
        stages.append((f"slot -> user in main: {copied:.0%} of batches copied, the rest views",
                       round(copied * 2 * obs_bytes)))
    return stages


def _storages(td) -> dict[int, int]:
    """The distinct memory blocks behind ``td``'s tensors: {data pointer: bytes}."""
    out = {}
    for t in td.values(include_nested=True, leaves_only=True):
        storage = t.untyped_storage()
        out[storage.data_ptr()] = storage.nbytes()
    return out


def _storage_ptr(td) -> int:
    return td["collector", "traj_ids"].untyped_storage().data_ptr()


def _touch(td) -> None:
    """Read one byte of every page of every field, as a trainer reading the batch would (shared
    pages count in a process's RSS only once it touches them)."""
    for t in td.values(include_nested=True, leaves_only=True):
        flat = t.reshape(-1)
        flat[:: max(1, 4096 // t.element_size())].sum()


def child(name: str, seconds: float, warmup: float, batch_steps: int) -> dict:
    import torch

    torch.set_num_threads(1)
    import tensordict  # noqa: F401  (imports before the baseline)

    import rlcollect  # noqa: F401
    from rlcollect import Collector, GymEnv, MultiAsyncCollector, MultiSyncCollector  # noqa: F401

    env = GymEnv(gym_pong, num_envs=WORKERS * ENVS_PER_WORKER) if name == "Collector" else None
    base = _status()  # after the imports and the user's env (Collector), before the collector
    collector = _build(name, batch_steps, env)
    profile: list[tuple[float, list[float]]] = []  # MultiSync: (collect wall, each worker's seconds) per batch
    if name == "MultiSync":
        collect_all = collector._collect_all

        def timed_collect_all(*args, **kwargs):
            started = time.perf_counter()
            infos = collect_all(*args, **kwargs)
            profile.append((time.perf_counter() - started, [info["seconds"] for info in infos]))
            return infos

        collector._collect_all = timed_collect_all
    try:
        batches = iter(collector)
        batch = next(batches)
        end = time.perf_counter() + warmup
        while time.perf_counter() < end:
            batch = next(batches)
            _touch(batch)
        profile.clear()
        samples, frames, peak_held, copies, count = [], 0, 0, 0, 0
        slots = {f.untyped_storage().data_ptr() for flats in (getattr(collector, "_slots", None) or [])
                 for f in flats if isinstance(f, torch.Tensor)}
        slots |= {f.untyped_storage().data_ptr() for f, _ in getattr(collector, "_sets", [])}
        start = time.perf_counter()
        while time.perf_counter() - start < seconds:
            new = next(batches)  # the user still holds ``batch`` while this one is collected
            # Held at the peak: the previous batch (still the user's during next()), the new one,
            # and the slots in flight.
            held_now = sum({**_storages(batch), **_storages(new)}.values()) + _in_flight_bytes(collector)
            peak_held = max(peak_held, held_now)
            batch = new
            del new
            count += 1
            copies += _storage_ptr(batch) not in slots
            _touch(batch)
            frames += batch.numel()
            st = _status()
            held = sum(_storages(batch).values()) + _in_flight_bytes(collector)
            samples.append((st["VmRSS"] - base["VmRSS"], st["RssAnon"] - base["RssAnon"],
                            st["RssShmem"] - base["RssShmem"], held))
        elapsed = time.perf_counter() - start
        peak = _status()["VmHWM"] - base["VmRSS"]
        frame = batch[(0,) * batch.batch_dims]
        obs_bytes = max(t.numel() * t.element_size() for k, t in frame.items(include_nested=True, leaves_only=True)
                        if not (isinstance(k, tuple) and k[0] == "next"))
        batch_bytes = sum(t.numel() * t.element_size() for t in batch.values(include_nested=True, leaves_only=True))
    finally:
        collector.shutdown()
    top = max(samples, key=lambda s: s[0])
    return {
        "fps": frames / elapsed,
        "rss": top[0], "anon": top[1], "shm": top[2], "held": top[3],
        "steady_ratio": top[0] / top[3],
        "peak": peak, "peak_held": peak_held, "ratio": peak / peak_held,
        "batch_bytes": batch_bytes,
        "obs_bytes": obs_bytes,
        "copied": copies / max(1, count),
        # MultiSync: the share of the run spent inside the workers' collect calls (the rest is the
        # main process between batches), and of that, the share each worker spent collecting
        # (the rest: waiting for the slowest worker, and the messages)
        "in_collect": sum(w for w, _ in profile) / elapsed if profile else None,
        "busy": (sum(sum(s) / len(s) for _, s in profile) / sum(w for w, _ in profile)) if profile else None,
        "slowest": (sum(max(s) for _, s in profile) / sum(w for w, _ in profile)) if profile else None,
    }


def _bare_loop(seconds: float):
    import numpy as np

    from bench.measure import Rate, run_for

    envs = [gym_pong() for _ in range(ENVS_PER_WORKER)]
    for i, env in enumerate(envs):
        env.reset(seed=i)
        env.action_space.seed(i)
    rng = np.random.default_rng(0)

    def step() -> int:
        for env in envs:
            _, _, terminated, truncated, _ = env.step(int(rng.integers(6)))
            if terminated or truncated:
                env.reset()
        return len(envs)

    return Rate(run_for(step, seconds), "bare Pong loop")


def bare_at_once(seconds: float) -> float:
    from bench.measure import at_once

    return at_once(_bare_loop, WORKERS, seconds).frames_per_s


def _mb(nbytes: float) -> str:
    return f"{nbytes / 2**20:7.1f} MiB"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--warmup", type=float, default=2.0)
    parser.add_argument("--batch-steps", type=int, default=128, help="time steps per env row per batch")
    parser.add_argument("--rounds", type=int, default=1, help="rounds (alternating); the best fps counts")
    parser.add_argument("--only", default=",".join(NAMES))
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    import warnings

    warnings.filterwarnings("ignore")
    if args.child:
        print(json.dumps(child(args.child, args.seconds, args.warmup, args.batch_steps)))
        return 0
    from bench.measure import run_json

    names = [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = set(names) - set(NAMES)
    if unknown:
        parser.error(f"--only: unknown {sorted(unknown)}; choose from {list(NAMES)}")
    results: dict[str, dict] = {}
    loads = []
    for _ in range(args.rounds):
        for name in names:
            loads.append(os.getloadavg()[0])
            if name == "bare at once":
                out = {"fps": bare_at_once(args.seconds)}
            else:
                out = run_json([sys.executable, "-m", "bench.pixels", "--child", name, "--seconds", str(args.seconds),
                                "--warmup", str(args.warmup), "--batch-steps", str(args.batch_steps)],
                               timeout=300 + 3 * args.seconds)
            if name not in results or out["fps"] > results[name]["fps"]:
                results[name] = out
    print(f"Pong 84x84x4 uint8, random actions, {WORKERS} workers x {ENVS_PER_WORKER} envs (Collector: 1 x "
          f"{WORKERS * ENVS_PER_WORKER}), {args.batch_steps} steps per row per batch, {args.seconds:g} s per "
          f"collector, best of {args.rounds}; cpus={os.cpu_count()}, load {min(loads):.1f}-{max(loads):.1f}")
    bare = results.get("bare at once", {}).get("fps")
    print(f"  {'':12s} {'frames/s':>9s} {'of bare':>7s} {'peak RSS':>11s} {'peak held':>11s} {'ratio':>5s} | "
          f"{'steady RSS':>11s} {'anon':>11s} {'shm':>11s} {'held':>11s} {'ratio':>5s}")
    for name in names:
        r = results[name]
        of_bare = f"{r['fps'] / bare:7.2f}" if bare and name != "bare at once" else ""
        if "rss" not in r:
            print(f"  {name:12s} {r['fps']:9,.0f} {of_bare:>7s}")
            continue
        print(f"  {name:12s} {r['fps']:9,.0f} {of_bare:>7s} {_mb(r['peak'])} {_mb(r['peak_held'])} {r['ratio']:5.2f} | "
              f"{_mb(r['rss'])} {_mb(r['anon'])} {_mb(r['shm'])} {_mb(r['held'])} {r['steady_ratio']:5.2f}")
    first = results[names[0]]
    print(f"  (one batch: {_mb(first.get('batch_bytes', 0)).strip()})" if "batch_bytes" in first else "")
    sync = results.get("MultiSync", {})
    if sync.get("in_collect") is not None:
        print(f"MultiSync profile: {sync['in_collect']:.1%} of the run inside the collect round (the rest is the main "
              f"process between batches); in the round, the workers collect {sync['busy']:.1%} of the time on "
              f"average and the slowest {sync['slowest']:.1%} (the rest: waiting for the slowest, messages)")
    print("bytes copied per frame, by stage (observation and next observation; 84x84x4 = 28,224 bytes):")
    for name in names:
        if name == "bare at once" or results[name].get("obs_bytes") is None:
            continue
        stages = copy_stages(name, results[name]["obs_bytes"], results[name]["copied"])
        total = sum(b for _, b in stages)
        print(f"  {name}: {total:,} bytes/frame = " + " + ".join(f"{b:,} ({what})" for what, b in stages))
    return 0


if __name__ == "__main__":
    sys.exit(main())
