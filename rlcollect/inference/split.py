"""A worker's envs in splits, stepped alternately, with central inference.

With ``env_splits=k`` a worker builds its env ``k`` times. Each split has its own rollout and
runner and is stepped by its own thread: while one split waits for its actions from the main
process (its thread blocked on its pipe, the GIL released), the other steps its envs, so the
worker's CPU and the inference loop work at the same time (Sample Factory's double-buffered
sampling). To the collector the splits are one env (:class:`SplitEnvs`, their rows side by
side) and one rollout (:class:`SplitRollout`, filling their row ranges of one batch).

Example:
    >>> from rlcollect import CountingEnv
    >>> env = SplitEnvs([CountingEnv(), CountingEnv()])
    >>> env.batch_size, env.num_rows
    (torch.Size([2]), 2)
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import torch

from rlcollect.data import TRAJ_ID_BLOCK, BatchBuffer, BatchLayout
from rlcollect.envs.base import EnvBase, EnvGroup
from rlcollect.rollout import Rollout


def joined_batch_size(part: torch.Size, splits: int) -> torch.Size:
    """The batch size of ``splits`` envs of batch size ``part`` side by side (along dim 0)."""
    if len(part) == 0:
        return torch.Size([splits])
    return torch.Size([splits * part[0], *part[1:]])


class SplitEnvs(EnvGroup):
    """Envs of one layout as one env, their rows side by side; stepped through their own
    rollouts (``SplitRollout``), so this one has no step of its own. Other attributes are
    read from the first env."""

    state_key = "parts"

    def __init__(self, parts: list[EnvBase]):
        first = parts[0]
        for part in parts[1:]:
            if (part.batch_size, part.obs_layout, part.action_layout) != (first.batch_size, first.obs_layout,
                                                                         first.action_layout):
                raise ValueError("env_splits: the env factory built envs of different batch sizes or layouts")
        self.parts = self.members = parts
        self.batch_size = joined_batch_size(first.batch_size, len(parts))
        self.obs_layout = first.obs_layout
        self.action_layout = first.action_layout
        self.has_truncated = first.has_truncated

    def __getattr__(self, name: str) -> Any:
        if name in ("parts", "members"):  # (not set yet: construction failed)
            raise AttributeError(name)
        return getattr(self.parts[0], name)

    def __repr__(self) -> str:
        return f"SplitEnvs({self.parts!r})"


class _SharedStop:
    """One ``stop`` flag seen by several splits so that they all stop after the same number of
    steps: the first split to see it set fixes that number at the furthest step any split has
    begun, and each split goes on until it has made that many (at most one step more).

    Each split reads ``view(i)[0]`` once before each of its steps (what ``Rollout.fill`` does)."""

    def __init__(self, flag: Any, splits: int):
        self.flag = flag
        self.begun = [0] * splits
        self.stop_at: int | None = None
        self.lock = threading.Lock()

    def view(self, split: int) -> _StopView:
        return _StopView(self, split)

    def check(self, split: int) -> bool:
        with self.lock:
            step = self.begun[split]
            if self.stop_at is None and self.flag[0]:
                self.stop_at = max(self.begun)
            if self.stop_at is not None and step >= self.stop_at:
                return True
            self.begun[split] = step + 1
            return False


class _StopView:
    def __init__(self, shared: _SharedStop, split: int):
        self.shared, self.split = shared, split

    def __getitem__(self, index: int) -> bool:
        return self.shared.check(self.split)


class SplitRollout:
    """The rollouts of a worker's splits, as one: ``fill`` has each fill its rows of the batch,
    split 0 in the calling thread and the others each in a thread of its own."""

    def __init__(self, rollouts: list[Rollout], batch_size: torch.Size):
        self.parts = rollouts
        self.batch_size = batch_size
        self.time = rollouts[0].time
        self.runner = rollouts[0].runner
        self.layout: BatchLayout | None = None
        self.version_range: tuple[int, float] = (0, 0.0)
        self.last_version = 0

    @property
    def needs_reset(self) -> bool:
        return any(part.needs_reset for part in self.parts)

    @needs_reset.setter
    def needs_reset(self, value: bool) -> None:
        for part in self.parts:
            part.needs_reset = value

    @property
    def step_seconds(self) -> list[float]:
        """Each step's env time, summed over the splits (a step of the worker's envs)."""
        return [sum(values) for values in zip(*(part.step_seconds for part in self.parts))]

    def discover_layout(self) -> BatchLayout:
        layouts = [part.discover_layout() for part in self.parts]
        first = layouts[0]
        if any(layout.fields != first.fields for layout in layouts[1:]):
            raise ValueError("env_splits: the policy writes different keys for different splits of the envs")
        self.layout = BatchLayout(first.fields, self.batch_size, self.time, first.groups, first.lazy)
        return self.layout

    def _views(self, buf: BatchBuffer) -> list[BatchBuffer]:
        rows = self.parts[0].layout.rows
        out = []
        for i, part in enumerate(self.parts):
            span = slice(i * rows, (i + 1) * rows)
            out.append(BatchBuffer(part.layout, tensors={k: t[span] for k, t in buf.tensors.items()}))
        return out

    def fill(self, buf: BatchBuffer, *, random: bool = False, version: int = 0, stop: Any = None) -> int:
        """Fill every split's rows of ``buf``; returns the steps filled (the same for all)."""
        views = self._views(buf)
        shared = None if stop is None else _SharedStop(stop, len(self.parts))
        steps: list[int | None] = [None] * len(self.parts)
        errors: list[BaseException | None] = [None] * len(self.parts)

        def run(i: int) -> None:
            try:
                steps[i] = self.parts[i].fill(views[i], random=random, version=version,
                                              stop=None if shared is None else shared.view(i))
            except BaseException as err:  # noqa: BLE001  (re-raised in the calling thread)
                errors[i] = err

        threads = [threading.Thread(target=run, args=(i,), name=f"rlcollect-split-{i}", daemon=True)
                   for i in range(1, len(self.parts))]
        for thread in threads:
            thread.start()
        run(0)
        for thread in threads:
            thread.join()
        for err in errors:
            if err is not None:
                raise err
        ranges = [part.version_range for part in self.parts]
        self.version_range = (min(r[0] for r in ranges), float(np.mean([r[1] for r in ranges])))
        self.last_version = max(part.last_version for part in self.parts)
        return min(steps)

    def state_dict(self) -> dict:
        return {"parts": [part.state_dict() for part in self.parts]}

    def check_state_dict(self, state: dict) -> None:
        if not isinstance(state, dict) or len(state.get("parts", ())) != len(self.parts):
            raise ValueError(f"rollout state: expected the states of {len(self.parts)} env splits")
        for part, sub in zip(self.parts, state["parts"]):
            part.check_state_dict(sub)

    def load_state_dict(self, state: dict) -> None:
        self.check_state_dict(state)
        for part, sub in zip(self.parts, state["parts"]):
            part.load_state_dict(sub)


def remote_rollout(policy: Any, env: EnvBase, time: int, traj_id_start: int, options: dict) -> Rollout | SplitRollout:
    """The rollout of a worker's collector whose policy is a ``RemotePolicy`` (client.py):
    one per split of ``env`` (a ``SplitEnvs`` when there are several), each with its runner;
    split ``i`` hands out trajectory ids from its own share of the worker's id block."""
    cls = Rollout
    if getattr(env, "grouped", False):  # action, reward or done under groups: envs/grouped.py
        from rlcollect.rollout_grouped import GroupedRollout as cls  # noqa: N813
    if policy.splits == 1:
        return cls(env, policy.runner(0, env.batch_size), time, traj_id_start=traj_id_start, **options)
    share = TRAJ_ID_BLOCK // policy.splits
    parts = [cls(part, policy.runner(i, part.batch_size), time, traj_id_start=traj_id_start + i * share,
                     **options) for i, part in enumerate(env.parts)]
    return SplitRollout(parts, env.batch_size)
