"""The real workloads of the suite (Pong pixels, HalfCheetah states): their envs, the names of
their policies (``bench/policies.py``), and how a process's memory is read. Imported by
rlcollect's side (``bench/real.py``) and by torchrl's (``bench/torchrl_side.py``), so it imports
neither rlcollect nor torchrl, nor torch: env worker processes (gymnasium's, SB3's) unpickle
its env factories without importing torch (ale-py or mujoco are imported when an env is built).

Example:
    >>> from bench.workloads import WORKLOADS
    >>> sorted(WORKLOADS)
    ['HalfCheetah', 'Pong']
    >>> WORKLOADS["Pong"].frames_per_step
    4
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass

import gymnasium as gym
import numpy as np


# -- envs (module level, so that "spawn" workers and pickled factories find them) ----------------
def make_pong() -> gym.Env:
    """``ALE/Pong-v5`` with ``frameskip=1`` and sticky actions off, then gymnasium's
    ``AtariPreprocessing`` (frameskip 4, 84x84 grey, up to 30 no-ops at reset) and
    ``FrameStackObservation(4)``: observations are ``(4, 84, 84)`` uint8."""
    import ale_py

    gym.register_envs(ale_py)
    env = gym.make("ALE/Pong-v5", frameskip=1, repeat_action_probability=0.0)
    env = gym.wrappers.AtariPreprocessing(env, frame_skip=4, screen_size=84, grayscale_obs=True, noop_max=30)
    return gym.wrappers.FrameStackObservation(env, 4)


def make_halfcheetah() -> gym.Env:
    """``HalfCheetah-v5`` (17 float64 observations, 6 actions in [-1, 1], 1000 steps an episode)."""
    return gym.make("HalfCheetah-v5")


@dataclass(frozen=True)
class Workload:
    """One real workload: ``make_env`` builds one env; ``policy`` names the function of
    ``bench/policies.py`` that builds the non-random policy (``policy_name`` in tables, and
    ``policy_key`` in torchrl keys); ``frames_per_step`` converts steps to frames (Atari: the
    emulator frames of a frameskip-4 step); ``envpool_id`` / ``envpool_kwargs`` build the same
    work with EnvPool; ``steps_per_worker_batch`` is each env's share of a batch (T);
    ``modules``: what must be installed to build the env."""

    name: str
    title: str
    make_env: object
    policy: str
    policy_name: str
    policy_key: str
    frames_per_step: int
    envpool_id: str
    envpool_kwargs: dict
    steps_per_worker_batch: int
    modules: tuple[str, ...]

    def make_policy(self):
        """The workload's policy module, built under a fixed seed."""
        from bench import policies

        return getattr(policies, self.policy)()


WORKLOADS = {
    "Pong": Workload(
        "Pong", "ALE/Pong-v5 + AtariPreprocessing + FrameStack(4)", make_pong,
        "nature_cnn", "Nature-CNN", "nature-cnn", 4,
        # EnvPool's defaults are the same preprocessing: frameskip 4, 84x84 grey, 4 stacked, 30 no-ops,
        # no sticky actions; episodic_life and reward_clip are off by default as in gymnasium.
        # FIRE at reset is EnvPool's own addition: off, as in gymnasium.
        "Pong-v5", {"use_fire_reset": False}, 32, ("ale_py",),
    ),
    "HalfCheetah": Workload(
        "HalfCheetah", "HalfCheetah-v5", make_halfcheetah,
        "cheetah_mlp", "MLP 2x64", "tanh-mlp", 1, "HalfCheetah-v5", {},
        128,
        ("mujoco",),
    ),
}


def available(workload: Workload) -> str | None:
    """None if this interpreter can build ``workload``'s env, else why not (a missing module)."""
    import importlib.util

    for module in workload.modules:
        if importlib.util.find_spec(module) is None:
            return f"{module} is not installed"
    return None


def sample_actions(space: gym.Space, rng: np.random.Generator, n: int) -> np.ndarray:
    """``n`` uniform random actions of a Discrete or bounded Box space, in one call."""
    if isinstance(space, gym.spaces.Discrete):
        return rng.integers(int(space.start), int(space.start + space.n), size=n)
    return rng.uniform(space.low, space.high, size=(n, *space.shape)).astype(space.dtype)


# -- memory of a process ------------------------------------------------------------------------
_KB = re.compile(r"^(\w+):\s+(\d+) kB", re.MULTILINE)


def rss(pid: int | None = None) -> dict[str, int]:
    """Resident memory of a process in bytes, from ``/proc/PID/status``: ``VmRSS`` (all),
    ``RssAnon`` (private), ``RssFile``, ``RssShmem`` (shared memory pages it touched) and
    ``VmHWM`` (the peak)."""
    with open(f"/proc/{pid or os.getpid()}/status") as f:
        found = dict(_KB.findall(f.read()))
    return {k: int(found[k]) * 1024 for k in ("VmRSS", "RssAnon", "RssFile", "RssShmem", "VmHWM") if k in found}


def shm_bytes(pid: int | None = None) -> int:
    """Bytes of ``/dev/shm`` files a process maps (each file once, at its largest mapping):
    torch's shared tensors and multiprocessing's shared arrays live there, unlinked but mapped."""
    sizes: dict[str, int] = {}
    with open(f"/proc/{pid or os.getpid()}/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            if len(parts) < 6 or not parts[5].startswith("/dev/shm/"):
                continue
            start, end = (int(x, 16) for x in parts[0].split("-"))
            path = parts[5].strip()
            sizes[path] = max(sizes.get(path, 0), end - start)
    return sum(sizes.values())


def nbytes(value) -> int:
    """Bytes of the tensors (or numpy arrays) in ``value``: a tensor, an array, a mapping or a
    sequence of them (a TensorDict is read through its ``values(include_nested=True,
    leaves_only=True)``)."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, np.ndarray):
        return value.nbytes
    if hasattr(value, "values") and hasattr(value, "batch_size"):  # a TensorDict
        return sum(nbytes(v) for v in value.values(include_nested=True, leaves_only=True))
    if isinstance(value, dict):
        return sum(nbytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(nbytes(v) for v in value)
    return 0


# -- CPU time of a process and its children --------------------------------------------------------
_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _stat(pid: int) -> tuple[int, float] | None:
    """(parent pid, user + system CPU seconds) of ``pid`` from ``/proc/PID/stat``; None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    # The command name (field 2) may hold spaces: the fields that follow start after its ")".
    fields = text[text.rindex(")") + 2:].split()
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / _TICKS


def cpu_seconds(pid: int | None = None) -> dict[str, float]:
    """CPU seconds (user + system, all threads) spent so far by a process (``main``) and by it
    with its live descendants and the children it has reaped (``total``): worker processes,
    gymnasium's or SB3's env processes, EnvPool's threads (threads count in ``main``).

    A window's CPU is the difference of two readings; a child that exits inside the window
    without being reaped is not counted (read after the workers are joined, or while they run)."""
    import resource

    root = pid or os.getpid()
    stats = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            found = _stat(int(entry))
            if found is not None:
                stats[int(entry)] = found
    children: dict[int, list[int]] = {}
    for child, (parent, _) in stats.items():
        children.setdefault(parent, []).append(child)
    main = stats.get(root, (0, 0.0))[1]
    total, todo = 0.0, [root]
    while todo:
        current = todo.pop()
        total += stats.get(current, (0, 0.0))[1]
        todo.extend(children.get(current, ()))
    if pid is None:
        reaped = resource.getrusage(resource.RUSAGE_CHILDREN)
        total += reaped.ru_utime + reaped.ru_stime
    return {"main": main, "total": total}
