"""Deterministic envs for tests and benchmarks: ``CountingEnv``, ``BusyEnv``, ``SleepEnv``, ``FaultyEnv``."""

from __future__ import annotations

import ctypes
import os
import signal
import time
from collections.abc import Sequence

import numpy as np
import torch

from rlcollect._context import current_worker_index
from rlcollect.envs.base import ArraySpec, EnvBase, RandomActionBlocks


def _as_batch_size(batch_size: int | Sequence[int] | torch.Size | None) -> torch.Size:
    if batch_size is None:
        return torch.Size([])
    if isinstance(batch_size, int):
        return torch.Size([batch_size])
    return torch.Size(batch_size)


class CountingEnv(EnvBase):
    """Observation = steps since the last reset; ends (terminated) after ``max_steps`` steps.

    Each row counts on its own; the observation is float32 with shape ``(obs_dim,)`` (every
    entry holds the count), the action is a ``Discrete(num_actions)`` int64 index that does
    not change the dynamics, and the reward is ``1.0`` per step.  With ``max_steps=None`` the
    env never ends.

    Args:
        max_steps: the episode length: the step that brings a row's count to ``max_steps`` is
            terminated (``None``: never). At least 1. Default 5.
        batch_size: the env's batch dims: ``None`` or ``[]`` for one env, an int ``n`` or a
            sequence (``[n]``, ``[a, b]``) for ``prod(batch_size)`` independent rows.
        obs_dim: the observation's length (every entry holds the count). Default 1.
        num_actions: the size of the ``Discrete`` action space (actions are ignored). Default 2.

    Example:
        >>> env = CountingEnv(max_steps=2, batch_size=[3])
        >>> env.reset()["observation"][:, 0].tolist()
        [0.0, 0.0, 0.0]
    """

    def __init__(
        self,
        max_steps: int | None = 5,
        batch_size: int | Sequence[int] | None = None,
        obs_dim: int = 1,
        num_actions: int = 2,
    ):
        if max_steps is not None and max_steps < 1:
            raise ValueError(f"CountingEnv: max_steps must be None or >= 1, got {max_steps!r}")
        self.max_steps = max_steps
        self.batch_size = _as_batch_size(batch_size)
        self.num_actions = num_actions
        self.obs_layout = {"observation": ArraySpec((obs_dim,), np.dtype(np.float32))}
        self.action_layout = ArraySpec((), np.dtype(np.int64))
        # Row i's count is total_steps - _reset_at[i]: one numpy call per step updates them all.
        self._reset_at = np.zeros(self.num_rows, np.int64)
        self._reset_column = self._reset_at[:, None]
        self._random = RandomActionBlocks(self._draw, seed=0)
        self.total_steps = 0

    def reset_rows(self, rows, obs_out) -> None:
        if rows is None:
            self._reset_at[:] = self.total_steps
            obs_out["observation"][:] = 0
        else:
            self._reset_at[rows] = self.total_steps
            obs_out["observation"][rows] = 0

    def _advance(self, obs_out, reward, terminated, truncated) -> None:
        # The benchmarks measure the collector's own per-step cost with these envs, so every
        # numpy call here counts: fill() is several times cheaper than a slice assignment.
        self.total_steps += 1
        np.subtract(self.total_steps, self._reset_column, out=obs_out["observation"], casting="unsafe")
        reward.fill(1.0)
        truncated.fill(False)
        if self.max_steps is None:
            terminated.fill(False)
        else:  # count >= max_steps
            np.less_equal(self._reset_at, self.total_steps - self.max_steps, out=terminated)

    def step_rows(self, action, obs_out, reward, terminated, truncated) -> None:
        self._advance(obs_out, reward, terminated, truncated)

    def sample_actions(self, out) -> None:
        self._random.sample(out)

    def _draw(self, rng: np.random.Generator, steps: int) -> np.ndarray:
        return rng.integers(0, self.num_actions, size=(steps, self.num_rows))

    def _seed(self, seed: int) -> None:
        self._random.seed(seed)

    def state_dict(self) -> dict:
        """The counts, the step total and the random-action sampler's state (its generator and
        the unused rest of its current block)."""
        return {"count": self.total_steps - self._reset_at, "total_steps": self.total_steps,
                **self._random.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        missing = {"count", "rng", "total_steps"} - set(state)
        if missing:
            raise KeyError(f"{type(self).__name__}.load_state_dict: missing keys {sorted(missing)}")
        self._random.load_state_dict(state)
        self.total_steps = state["total_steps"]
        self._reset_at[:] = self.total_steps - np.asarray(state["count"])


class BusyEnv(CountingEnv):
    """Burns ``step_time`` seconds of CPU per step (per row): a compute-bound simulator.

    Otherwise a ``CountingEnv`` (observation = steps since the reset, reward 1.0).

    Args:
        step_time: seconds of busy loop per step and per row (a batch of ``n`` rows spins
            ``n * step_time``). Default 1 ms.
        batch_size: the env's batch dims: ``None`` or ``[]`` for one env, an int ``n`` or a
            sequence (``[n]``, ``[a, b]``) for ``prod(batch_size)`` independent rows.
        obs_dim: the observation's length. Default 4.
        max_steps: the episode length (``None``: episodes never end). Default ``None``.

    Example:
        >>> env = BusyEnv(step_time=1e-4)
        >>> env.step(env.rand_action(env.reset()))["next", "reward"].item()
        1.0
    """

    def __init__(self, step_time: float = 1e-3, batch_size: int | Sequence[int] | None = None, obs_dim: int = 4,
                 max_steps: int | None = None):
        super().__init__(max_steps=max_steps, batch_size=batch_size, obs_dim=obs_dim)
        self.step_time = float(step_time)

    def step_rows(self, action, obs_out, reward, terminated, truncated) -> None:
        deadline = time.perf_counter() + self.step_time * self.num_rows
        while time.perf_counter() < deadline:
            pass
        self._advance(obs_out, reward, terminated, truncated)


class SleepEnv(CountingEnv):
    """Sleeps ``step_time`` seconds per step: a simulator waiting on I/O or another process.

    Otherwise a ``CountingEnv`` (observation = steps since the reset, reward 1.0).

    Args:
        step_time: seconds of ``time.sleep`` per step, whatever the number of rows (the OS
            may sleep a little longer: about 1.08 ms for 1 ms on Linux). Default 1 ms.
        batch_size: the env's batch dims: ``None`` or ``[]`` for one env, an int ``n`` or a
            sequence (``[n]``, ``[a, b]``) for ``prod(batch_size)`` independent rows.
        obs_dim: the observation's length. Default 4.
        max_steps: the episode length (``None``: episodes never end). Default ``None``.

    Example:
        >>> env = SleepEnv(step_time=1e-3)
        >>> env.step(env.rand_action(env.reset()))["next", "done"].item()
        False
    """

    def __init__(self, step_time: float = 1e-3, batch_size: int | Sequence[int] | None = None, obs_dim: int = 4,
                 max_steps: int | None = None):
        super().__init__(max_steps=max_steps, batch_size=batch_size, obs_dim=obs_dim)
        self.step_time = float(step_time)

    def step_rows(self, action, obs_out, reward, terminated, truncated) -> None:
        time.sleep(self.step_time)
        self._advance(obs_out, reward, terminated, truncated)


FAULTS = ("raise", "hang", "exit", "kill", "segfault")


class InjectedFault(RuntimeError):
    """The exception ``FaultyEnv(fault="raise")`` raises."""


class FaultyEnv(CountingEnv):
    """A ``CountingEnv`` that fails on purpose, for fault-injection tests.

    Args:
        fault: ``"raise"`` (``InjectedFault``), ``"hang"`` (sleeps forever), ``"exit"``
            (``os._exit(exit_code)``), ``"kill"`` (SIGKILL of its own process) or
            ``"segfault"`` (reads address 0 through ctypes).
        at_step: the fault fires on this step call (1-based, counted over the env's life), or
            on each of several (a sequence); None with ``trigger_file`` only.
        where: ``"step"`` or ``"reset"`` (then ``at_step`` counts reset calls).
        worker_ids: fire only in these collector workers (None: everywhere).
        times: fire at most this many times in total, counted in ``counter_file`` so that
            the count survives a restarted worker (None: every time).
        counter_file: path of the shared fire counter (required with ``times``).
        start_delay: seconds to sleep in the constructor (a slow start).
        trigger_file: a path checked before every step: when a file appears there holding
            ``"<fault> <worker index>"``, the matching worker claims it (removes it) and fails
            that way. Lets a driver inject faults at chosen moments (``bench/soak.py``).
        exit_code: the process's exit status with ``fault="exit"``. Default 3.
        max_steps: the episode length of the underlying ``CountingEnv`` (``None``: never ends).
        batch_size: the env's batch dims: ``None`` or ``[]`` for one env, an int ``n`` or a
            sequence (``[n]``, ``[a, b]``) for ``prod(batch_size)`` independent rows.

    Example:
        >>> env = FaultyEnv(fault="raise", at_step=2)
        >>> td = env.step(env.rand_action(env.reset()))
        >>> env.step(env.rand_action(td))
        Traceback (most recent call last):
        ...
        rlcollect.envs.testing.InjectedFault: FaultyEnv: injected fault at step 2 (worker None)
    """

    def __init__(
        self,
        fault: str = "raise",
        at_step: int | Sequence[int] | None = 1,
        *,
        where: str = "step",
        worker_ids: Sequence[int] | None = None,
        times: int | None = None,
        counter_file: str | None = None,
        start_delay: float = 0.0,
        exit_code: int = 3,
        max_steps: int | None = None,
        batch_size: int | Sequence[int] | None = None,
        trigger_file: str | None = None,
    ):
        if fault not in FAULTS:
            raise ValueError(f"FaultyEnv: fault must be one of {FAULTS}, got {fault!r}")
        steps = [] if at_step is None else [at_step] if isinstance(at_step, int) and not isinstance(at_step, bool) \
            else list(at_step) if isinstance(at_step, (list, tuple, set, range)) else [at_step]
        if not all(isinstance(k, int) and not isinstance(k, bool) and k >= 1 for k in steps) or \
                (not steps and trigger_file is None):
            # at_step=0 would never fire and a fault-injection test would pass vacuously.
            raise ValueError(
                f"FaultyEnv: at_step must be an int >= 1 (1-based call count) or a sequence of them "
                f"(None only with trigger_file), got {at_step!r}"
            )
        if where not in ("step", "reset"):
            raise ValueError(f"FaultyEnv: where must be 'step' or 'reset', got {where!r}")
        if times is not None and counter_file is None:
            raise ValueError("FaultyEnv: times needs counter_file (the count must survive restarts)")
        super().__init__(max_steps=max_steps, batch_size=batch_size)
        if start_delay:
            time.sleep(start_delay)
        self.fault, self.at_step, self.where = fault, at_step, where
        self._steps = set(steps)
        self.trigger_file = trigger_file
        self.worker_ids = None if worker_ids is None else set(worker_ids)
        self.times, self.counter_file, self.exit_code = times, counter_file, exit_code
        self.worker_index = current_worker_index()
        self._calls = {"step": 0, "reset": 0}

    def _armed(self) -> bool:
        if self.worker_ids is not None and self.worker_index not in self.worker_ids:
            return False
        if self.times is None:
            return True
        fired = os.path.getsize(self.counter_file) if os.path.exists(self.counter_file) else 0
        if fired >= self.times:
            return False
        with open(self.counter_file, "ab") as f:
            f.write(b"x")
        return True

    def _triggered(self) -> str | None:
        """The fault named in ``trigger_file`` if it targets this worker (claimed atomically)."""
        if self.trigger_file is None or not os.path.exists(self.trigger_file):
            return None
        claimed = f"{self.trigger_file}.{os.getpid()}"
        try:
            with open(self.trigger_file) as f:
                fault, worker = f.read().split()
            if int(worker) != self.worker_index or fault not in FAULTS:
                return None
            os.rename(self.trigger_file, claimed)
        except (OSError, ValueError):
            return None  # claimed by someone else, or half-written: check again next step
        os.remove(claimed)
        return fault

    def _maybe_fail(self, where: str) -> None:
        self._calls[where] += 1
        fault = self._triggered() if where == "step" else None
        if fault is None:
            if where != self.where or self._calls[where] not in self._steps or not self._armed():
                return
            fault = self.fault
        self._fire(fault, where)

    def _fire(self, fault: str, where: str) -> None:
        if fault == "raise":
            raise InjectedFault(
                f"FaultyEnv: injected fault at {where} {self._calls[where]} (worker {self.worker_index})"
            )
        if fault == "hang":
            while True:
                time.sleep(3600)
        if fault == "exit":
            os._exit(self.exit_code)
        if fault == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if fault == "segfault":
            ctypes.string_at(0)

    def reset_rows(self, rows, obs_out) -> None:
        self._maybe_fail("reset")
        super().reset_rows(rows, obs_out)

    def step_rows(self, action, obs_out, reward, terminated, truncated) -> None:
        self._maybe_fail("step")
        self._advance(obs_out, reward, terminated, truncated)
