"""Central against worker inference (``inference="central"`` / ``"worker"``): Pong with a
Nature-CNN and CartPole with a 2x256 MLP, ``WORKERS`` workers x ``ENVS_PER_WORKER`` envs, in
the same run.

Every row runs in a fresh interpreter (``python -m bench.central KEY SECONDS``, one JSON line
out)::

    python -m bench.central "workload=Pong collector=sync inference=central" 10

The rows of one workload and collector:

- ``ideal``: ``WORKERS`` processes at once, each stepping ``ENVS_PER_WORKER`` envs in a bare
  loop with the policy on their batch (what worker inference does, with no collector);
- ``ideal-central``: the bare pattern of central inference, with no collector: ``WORKERS``
  processes step their envs and write the observations into shared memory, the main process
  waits for all of them, runs one forward over every row and writes the actions back (one byte
  on a pipe each way); the most central inference could do on this machine;
- ``worker``: the collector with the policy in each worker (``GymEnv(make_env,
  num_envs=ENVS_PER_WORKER)``);
- ``central``: the same envs per worker (``env_splits=2`` of ``ENVS_PER_WORKER / 2``, stepped
  alternately) and the policy in the main process, one forward for every ready split;
- ``central-1``: central with ``env_splits=1`` (no double buffering: a worker waits for its
  actions);
- ``torchrl`` (with ``--torchrl-python``): torchrl's ``AsyncBatchedCollector``, its own inference
  server, on ``WORKERS * ENVS_PER_WORKER`` envs (``GymWrapper`` of the same env) in ``WORKERS``
  env processes of ``ENVS_PER_WORKER`` envs each, the same policy as a ``TensorDictModule``.

Each reports steps/s (an env step of one env), the main process's memory, and for central
inference the forwards per second and the mean rows (env steps) per forward over the window.
Policies run with one torch thread per process (the main process's too, as the suite's).
"""

from __future__ import annotations

import functools
import importlib.util
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from bench.measure import at_once, measure_for
from bench.workloads import WORKLOADS, cpu_seconds, rss

ROOT = Path(__file__).resolve().parent.parent  # where "python -m bench.central" runs
WORKERS = 2
ENVS_PER_WORKER = 8
STEPS_PER_BATCH = 16  # T of each worker's share of a batch
WARMUP_S = 1.0
ROWS = ("ideal", "ideal-central", "worker", "central", "central-1")
#: Measured in torchrl's venv, when the suite is given one.
TORCHRL_ROWS = ("torchrl",)
COLLECTORS = ("sync", "async")


def cartpole() -> object:
    import gymnasium as gym

    return gym.make("CartPole-v1")


class Mlp256(torch.nn.Module):
    """CartPole's policy here: 2 hidden layers of 256 (ReLU), argmax over 2 logits."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                                       torch.nn.ReLU(), torch.nn.Linear(256, 2))

    def forward(self, observation: torch.Tensor) -> torch.Tensor:
        return self.net(observation).argmax(-1)


@dataclass(frozen=True)
class Case:
    name: str
    make_env: object
    make_policy: object
    modules: tuple[str, ...] = ()
    frames_per_step: int = 1


CASES = {
    "Pong": Case("Pong", WORKLOADS["Pong"].make_env, WORKLOADS["Pong"].make_policy, ("ale_py",), 4),
    "CartPole": Case("CartPole", cartpole, Mlp256),
}


def key(workload: str, collector: str, row: str) -> str:
    return f"workload={workload} collector={collector} inference={row}"


def _bare_loop(case: Case, seconds: float):
    """One process stepping ``ENVS_PER_WORKER`` envs with the policy on their batch."""
    from bench.measure import Rate

    torch.set_num_threads(1)
    envs = [case.make_env() for _ in range(ENVS_PER_WORKER)]
    obs = np.stack([env.reset(seed=i)[0] for i, env in enumerate(envs)])
    policy = case.make_policy()

    def step() -> int:
        nonlocal obs
        with torch.no_grad():
            actions = policy(torch.from_numpy(obs)).numpy()
        out = []
        for env, action in zip(envs, actions):
            o, _, term, trunc, _ = env.step(int(action))
            out.append(env.reset()[0] if term or trunc else o)
        obs = np.stack(out)
        return len(envs)

    window = measure_for(step, seconds)
    return Rate(window.frames_per_s, f"{ENVS_PER_WORKER} envs + the policy, one process",
                cpu_per_kframe=window.cpu_per_kframe)


def _bare_central_worker(case: Case, index: int, conn, obs_shm, act_shm) -> None:
    import gymnasium as gym  # noqa: F401  (the env factories import what they need)

    from rlcollect.inference.client import yield_on_wake

    yield_on_wake()  # as the collector's env workers do
    torch.set_num_threads(1)
    envs = [case.make_env() for _ in range(ENVS_PER_WORKER)]
    first = envs[0].reset(seed=0)[0]
    rows = slice(index * ENVS_PER_WORKER, (index + 1) * ENVS_PER_WORKER)
    obs = np.frombuffer(obs_shm, dtype=first.dtype).reshape(WORKERS * ENVS_PER_WORKER, *first.shape)[rows]
    act = np.frombuffer(act_shm, dtype=np.int64)[rows]
    for j, env in enumerate(envs):
        obs[j] = env.reset(seed=j)[0]
    while True:
        conn.send_bytes(b"r")
        if conn.recv_bytes() == b"q":
            return
        for j, env in enumerate(envs):
            o, _, term, trunc, _ = env.step(int(act[j]))
            obs[j] = env.reset()[0] if term or trunc else o


def _bare_central(case: Case, seconds: float) -> dict:
    """``WORKERS`` env processes and one forward for all of them in this process (see ``ROWS``)."""
    import multiprocessing

    torch.set_num_threads(1)
    probe = case.make_env().reset(seed=0)[0]
    rows = WORKERS * ENVS_PER_WORKER
    ctx = multiprocessing.get_context("fork")
    obs_shm = ctx.RawArray("B", rows * probe.nbytes)
    act_shm = ctx.RawArray("q", rows)
    obs = torch.from_numpy(np.frombuffer(obs_shm, dtype=probe.dtype).reshape(rows, *probe.shape))
    act = torch.from_numpy(np.frombuffer(act_shm, dtype=np.int64))
    pipes = [ctx.Pipe() for _ in range(WORKERS)]
    procs = [ctx.Process(target=_bare_central_worker, args=(case, i, there, obs_shm, act_shm))
             for i, (_, there) in enumerate(pipes)]
    for proc in procs:
        proc.start()
    policy, conns = case.make_policy(), [here for here, _ in pipes]
    try:
        steps, started = 0, None
        with torch.no_grad():
            while True:
                for conn in conns:
                    conn.recv_bytes()
                now = time.perf_counter()
                if started is None or now - started < WARMUP_S:
                    started = started or now
                    warm_end, steps, cpu = now, 0, cpu_seconds()["total"]
                elif now - warm_end >= seconds:
                    cpu = cpu_seconds()["total"] - cpu
                    break
                act.copy_(policy(obs))
                steps += rows
                for conn in conns:
                    conn.send_bytes(b"a")
        return {"steps_per_s": steps / (now - warm_end), "how": "bare central loop, one forward for every row",
                "cpu_per_kstep": cpu / steps * 1e3}
    finally:
        for conn in conns:
            conn.send_bytes(b"q")
        for proc in procs:
            proc.join(10)


def _warm(it) -> None:
    """Collect ``WARMUP_S`` of batches from ``it`` (at least one), untimed."""
    end = time.perf_counter() + WARMUP_S
    next(it)
    while time.perf_counter() < end:
        next(it)


def _timed(it, seconds: float) -> tuple[int, float, dict]:
    """The frames of the batches ``it`` yields in the next ``seconds``: ``(frames, elapsed, cpu)``,
    ``cpu`` holding the CPU seconds per 1,000 frames of this process and its children
    (``cpu_per_kstep``) and this process's own CPU per batch (``main_cpu_ms_per_batch``)."""
    got = batches = 0
    cpu, main_cpu, start = cpu_seconds()["total"], time.process_time(), time.perf_counter()
    while True:
        got += next(it).numel()
        batches += 1
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            main_cpu = time.process_time() - main_cpu
            return got, elapsed, {"cpu_per_kstep": (cpu_seconds()["total"] - cpu) / got * 1e3,
                                  "main_cpu_ms_per_batch": main_cpu / batches * 1e3}


def _torchrl_env(case: Case):
    from torchrl.envs import GymWrapper

    return GymWrapper(case.make_env(), categorical_action_encoding=True)


def _torchrl(case: Case, seconds: float) -> dict:
    """torchrl's ``AsyncBatchedCollector`` on the same envs and policy (in torchrl's venv)."""
    from tensordict.nn import TensorDictModule
    from torchrl.collectors import AsyncBatchedCollector

    torch.set_num_threads(1)
    policy = TensorDictModule(case.make_policy(), in_keys=["observation"], out_keys=["action"])
    envs = [functools.partial(_torchrl_env, case)] * (WORKERS * ENVS_PER_WORKER)
    c = AsyncBatchedCollector(envs, policy=policy, frames_per_batch=ENVS_PER_WORKER * STEPS_PER_BATCH * WORKERS,
                              total_frames=-1, env_backend="multiprocessing", envs_per_worker=ENVS_PER_WORKER)
    try:
        it = iter(c)
        _warm(it)
        got, elapsed, cpu = _timed(it, seconds)
        return {"steps_per_s": got / elapsed, "how": "torchrl AsyncBatchedCollector", "rss_mb": rss()["VmRSS"] / 2**20,
                **cpu}
    finally:
        c.shutdown()


def measure(text: str, seconds: float) -> dict:
    words = dict(word.split("=", 1) for word in text.split())
    case, collector, row = CASES[words["workload"]], words["collector"], words["inference"]
    missing = [m for m in case.modules if importlib.util.find_spec(m) is None]
    if missing:
        return {"skip": f"{', '.join(missing)} not installed"}
    if row == "ideal":
        rate = at_once(functools.partial(_bare_loop, case), WORKERS, seconds)
        return {"steps_per_s": rate.frames_per_s, "how": rate.how, "cpu_per_kstep": rate.cpu_per_kframe}
    if row == "ideal-central":
        return _bare_central(case, seconds)
    if row == "torchrl":
        return _torchrl(case, seconds)
    from rlcollect import GymEnv, MultiAsyncCollector, MultiSyncCollector

    torch.set_num_threads(1)
    cls = MultiSyncCollector if collector == "sync" else MultiAsyncCollector
    central = row.startswith("central")
    splits = int(words.get("splits", 1 if row == "central-1" else 2))
    envs = ENVS_PER_WORKER // splits if central else ENVS_PER_WORKER
    frames = ENVS_PER_WORKER * STEPS_PER_BATCH * (WORKERS if collector == "sync" else 1)
    options = {"inference": "central", "env_splits": splits} if central else {}
    if "wait" in words:
        options["max_wait_us"] = float(words["wait"])
    c = cls(functools.partial(GymEnv, case.make_env, num_envs=envs), case.make_policy(), num_workers=WORKERS,
            frames_per_batch=frames, total_frames=-1, num_threads=int(words.get("threads", 1)), **options)
    try:
        it = iter(c)
        _warm(it)
        before = c.stats().get("inference", {})
        got, elapsed, cpu = _timed(it, seconds)
        after = c.stats().get("inference", {})
        out = {"steps_per_s": got / elapsed, "how": f"{row} inference, {cls.__name__}",
               "rss_mb": rss()["VmRSS"] / 2**20, **cpu}
        if central:
            calls = after["forward_calls"] - before["forward_calls"]
            rows = after["forward_rows"] - before["forward_rows"]
            out["forward_calls_per_s"] = calls / elapsed
            out["mean_batch_rows"] = rows / calls if calls else 0.0
        return out
    finally:
        c.shutdown()


# -- the suite's side (bench/suite.py runs every row in a fresh interpreter) ----------------------
@dataclass
class CentralResult:
    workload: str
    collector: str
    rows: dict[str, dict] = field(default_factory=dict)

    def ratio(self, row: str) -> float | None:
        ideal, mine = self.rows.get("ideal", {}), self.rows.get(row, {})
        if "steps_per_s" not in ideal or "steps_per_s" not in mine:
            return None
        return mine["steps_per_s"] / ideal["steps_per_s"]

    def table(self) -> str:
        case = CASES[self.workload]
        lines = [f"{self.workload} ({'Nature-CNN' if self.workload == 'Pong' else 'MLP 2x256'}), {WORKERS} workers x "
                 f"{ENVS_PER_WORKER} envs, Multi{self.collector.capitalize()}Collector: central vs worker inference",
                 "| row | steps/s | frames/s | of ideal | vs worker | overhead us/step | forwards/s | rows/forward "
                 "| main RSS MB | CPU s/1k frames | main CPU ms/batch |", "|---" * 11 + "|"]
        worker = self.rows.get("worker", {}).get("steps_per_s")
        ideal = self.rows.get("ideal", {}).get("steps_per_s")
        for row in ROWS + TORCHRL_ROWS:
            if row in TORCHRL_ROWS and row not in self.rows:
                continue
            r = self.rows.get(row, {})
            if "skip" in r or "steps_per_s" not in r:
                lines.append(f"| {row} | {r.get('skip', 'failed')} | | | | | | | | | |")
                continue
            sps = r["steps_per_s"]
            over = (1e6 / sps - 1e6 / ideal) if ideal and row != "ideal" else None
            cells = [row, f"{sps:,.0f}", f"{sps * case.frames_per_step:,.0f}",
                     f"{sps / ideal:.2f}" if ideal else "", f"{sps / worker:.2f}" if worker and row != "worker" else "",
                     f"{over:.1f}" if over is not None else "",
                     f"{r['forward_calls_per_s']:,.0f}" if "forward_calls_per_s" in r else "",
                     f"{r['mean_batch_rows']:.1f}" if "mean_batch_rows" in r else "",
                     f"{r['rss_mb']:.0f}" if "rss_mb" in r else "",
                     f"{r['cpu_per_kstep'] / case.frames_per_step:.3f}" if r.get("cpu_per_kstep") is not None else "",
                     f"{r['main_cpu_ms_per_batch']:.3f}" if "main_cpu_ms_per_batch" in r else ""]
            lines.append("| " + " | ".join(cells) + " |")
        return "\n".join(lines)

    def as_dict(self) -> dict:
        return {"config": f"central {self.workload} {self.collector}", "rows": self.rows}


@dataclass(frozen=True)
class CentralConfig:
    """One workload and collector: its rows measured in alternating rounds, best of each."""

    workload: str
    collector: str
    budget: float = 2.0

    torchrl = None  # (no torchrl side: its inference server is not what this compares)

    @property
    def name(self) -> str:
        # (not "Pong": --only Pong selects the real-workload tables of bench/real.py)
        what = "Nature-CNN on Atari frames" if self.workload == "Pong" else "MLP 2x256 on CartPole"
        return f"central inference: {what}, Multi{self.collector.capitalize()}"

    def run(self, seconds: float, rounds: int, log, torchrl_python: str | None = None) -> CentralResult:
        from bench.measure import run_json

        result = CentralResult(self.workload, self.collector)
        per_round = seconds * self.budget / rounds
        for i in range(rounds):
            # torchrl has no sync counterpart of AsyncBatchedCollector: measured beside MultiAsync
            for row in ROWS + (TORCHRL_ROWS if torchrl_python and self.collector == "async" else ()):
                log(f"{self.name}: {row}, round {i + 1}/{rounds}")
                python = torchrl_python if row in TORCHRL_ROWS else sys.executable
                try:
                    out = run_json([python, "-m", "bench.central", key(self.workload, self.collector, row),
                                    f"{per_round:g}"], timeout=300 + per_round, cwd=str(ROOT))
                except RuntimeError as err:
                    log(f"{self.name}: {row} failed: {err}")
                    continue
                best = result.rows.get(row)
                if best is None or out.get("steps_per_s", 0) > best.get("steps_per_s", 0):
                    result.rows[row] = out
        return result


def central_configs() -> list[CentralConfig]:
    return [CentralConfig(w, c) for w in CASES for c in COLLECTORS]


if __name__ == "__main__":
    print(json.dumps(measure(sys.argv[1], float(sys.argv[2]))))
