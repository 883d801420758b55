"""Timing loops: the ideal (bare) loops and the collector loop, each run for a time budget; and
measurements made in another interpreter (a cold start, or torchrl's side)."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import gymnasium as gym
import numpy as np
import torch

from bench.workloads import cpu_seconds

# Checking the clock every step would itself cost a measurable share of a CartPole step.
CLOCK_EVERY = 128


@dataclass(frozen=True)
class Rate:
    """Frames over seconds, with a word on how it was obtained (and what a probe read at the
    end of the window, if one was given)."""

    frames_per_s: float
    how: str
    probed: dict = field(default_factory=dict)
    #: CPU seconds per 1,000 frames over the window: the measuring process, its threads and its
    #: child processes (workers, env processes) together; None when not measured.
    cpu_per_kframe: float | None = None
    #: The main process's own CPU (all its threads) per delivered batch, in milliseconds
    #: (collectors only).
    main_cpu_ms_per_batch: float | None = None


@dataclass(frozen=True)
class Duration:
    """Seconds something took (lower is better), with a word on how it was obtained."""

    seconds: float
    how: str


@dataclass(frozen=True)
class Window:
    """What one timed window measured: frames, wall seconds and CPU seconds (the process, its
    threads and its children: ``bench.workloads.cpu_seconds``)."""

    frames: int
    seconds: float
    cpu_s: float

    @property
    def frames_per_s(self) -> float:
        return self.frames / self.seconds

    @property
    def cpu_per_kframe(self) -> float:
        return self.cpu_s / self.frames * 1e3


def measure_for(step: Callable[[], int], seconds: float) -> Window:
    """Call ``step`` (which returns the frames it made) for ``seconds`` after a short warmup;
    the frames, wall and CPU seconds of the timed part."""
    warmup_end = time.perf_counter() + min(0.5, seconds / 10)
    while time.perf_counter() < warmup_end:
        step()
    frames = 0
    cpu = cpu_seconds()["total"]
    start = time.perf_counter()
    while True:
        for _ in range(CLOCK_EVERY):
            frames += step()
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return Window(frames, elapsed, cpu_seconds()["total"] - cpu)


def run_for(step: Callable[[], int], seconds: float) -> float:
    """Call ``step`` (which returns the frames it made) for ``seconds`` after a short warmup,
    and return frames per second."""
    return measure_for(step, seconds).frames_per_s


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
        window = measure_for(step_random if policy is None else step_policy, seconds)
    finally:
        for env in envs:
            env.close()
    what = "action_space.sample()" if policy is None else "the MLP on the stacked observations"
    return Rate(window.frames_per_s, f"bare loop over {num_envs} gymnasium env(s) with {what}",
                cpu_per_kframe=window.cpu_per_kframe)


def timed_loop(step_time: float, busy: bool, seconds: float) -> Rate:
    """A bare loop doing what ``BusyEnv`` / ``SleepEnv`` do per step: spin or sleep ``step_time``."""

    def step() -> int:
        if busy:
            deadline = time.perf_counter() + step_time
            while time.perf_counter() < deadline:
                pass
        else:
            time.sleep(step_time)
        return 1

    window = measure_for(step, seconds)
    return Rate(window.frames_per_s, f"bare loop that {'spins' if busy else 'sleeps'} step_time per step",
                cpu_per_kframe=window.cpu_per_kframe)


def _loop_child(loop: Callable[[float], Rate], seconds: float, conn) -> None:
    torch.set_num_threads(1)
    rate = loop(seconds)
    conn.send((rate.frames_per_s, rate.cpu_per_kframe))
    conn.close()


def at_once(loop: Callable[[float], Rate], processes: int, seconds: float) -> Rate:
    """``processes`` copies of a bare ``loop`` running at the same time, in forked processes:
    the most ``processes`` workers could get out of this machine now (on a machine that other
    jobs share, less than ``processes`` times one loop alone)."""
    import multiprocessing

    context = multiprocessing.get_context("fork")  # cheap: the loops need nothing re-imported
    pipes = [context.Pipe(duplex=False) for _ in range(processes)]
    children = [context.Process(target=_loop_child, args=(loop, seconds, send)) for _, send in pipes]
    for child in children:
        child.start()
    try:
        total = 0.0
        cpu_per_s = 0.0  # CPU seconds per wall second, all loops together
        for receive, send in pipes:
            send.close()
            if not receive.poll(60 + 2 * seconds):
                raise RuntimeError(f"a bare loop process did not report within {60 + 2 * seconds:g} s")
            fps, cpu_per_kframe = receive.recv()
            total += fps
            cpu_per_s = None if cpu_per_kframe is None or cpu_per_s is None else cpu_per_s + fps * cpu_per_kframe / 1e3
            receive.close()
    finally:
        for child in children:
            child.join(5)
            if child.is_alive():
                child.kill()
                child.join()
    return Rate(total, f"{processes} bare loops at once",
                cpu_per_kframe=None if cpu_per_s is None else cpu_per_s / total * 1e3)


def collector_rate(make_collector: Callable[[], object], seconds: float, warmup: float = 0.0,
                   probe: Callable[[object, object, dict | None], dict] | None = None) -> Rate:
    """Iterate an endless collector for ``seconds`` after one warmup batch (and more warmup
    batches until ``warmup`` seconds have passed); frames per second. ``probe(last_batch,
    collector, stats)``, if given, runs at the end of the window, before the collector shuts
    down (``stats``: the collector's ``stats()`` when the clock started, if it has them), and its
    dict is kept in ``Rate.probed`` (e.g. the main process's memory then)."""
    collector = make_collector()
    try:
        batches = iter(collector)
        warmup_end = time.perf_counter() + warmup
        next(batches)  # warmup: first reset, buffer allocation, first policy call
        while time.perf_counter() < warmup_end:
            next(batches)
        stats = collector.stats() if probe is not None and hasattr(collector, "stats") else None
        frames = batches_seen = 0
        cpu = cpu_seconds()["total"]
        main_cpu = time.process_time()
        start = time.perf_counter()
        while True:
            batch = next(batches)
            frames += batch.numel()
            batches_seen += 1
            elapsed = time.perf_counter() - start
            if elapsed >= seconds:
                main_cpu = time.process_time() - main_cpu
                cpu = cpu_seconds()["total"] - cpu
                probed = probe(batch, collector, stats) if probe is not None else {}
                return Rate(frames / elapsed, f"{type(collector).__name__}", probed, cpu_per_kframe=cpu / frames * 1e3,
                            main_cpu_ms_per_batch=main_cpu / batches_seen * 1e3)
    finally:
        collector.shutdown()


def run_json(argv: list[str], timeout: float, cwd: str | None = None, env: dict[str, str] | None = None,
             label: str | None = None) -> dict:
    """Run ``argv`` (another interpreter, in ``cwd``, with the environment ``env``: this one's
    when None) and return the JSON object on the last line of its stdout; a failure raises
    ``RuntimeError`` naming ``label`` (default: the command) with the end of its stderr."""
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"{label or argv[1]} did not finish within {timeout:g} s") from None
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        tail = "\n".join(done.stderr.strip().splitlines()[-15:])
        raise RuntimeError(f"{label or ' '.join(argv[1:3])} exited with code {done.returncode}:\n{tail}")
    return json.loads(lines[-1])


_SPIN = """
import time
end = time.perf_counter() + {seconds}
cpu = time.process_time()
while time.perf_counter() < end:
    pass
print((time.process_time() - cpu) / {seconds})
"""


def cpu_share(processes: int, seconds: float = 0.5) -> list[float]:
    """How much of a core each of ``processes`` processes spinning together gets, now (1.0 on
    an idle machine with that many cores; less while other jobs share it)."""
    import sys

    argv = [sys.executable, "-S", "-c", _SPIN.format(seconds=seconds)]
    spinners = [subprocess.Popen(argv, stdout=subprocess.PIPE, text=True) for _ in range(processes)]
    return [float(p.communicate(timeout=30 + seconds)[0]) for p in spinners]
