"""Batches of whole trajectories (torchrl 0.14's ``trajs_per_batch``): the trajectory assembler.

A collector given ``trajs_per_batch`` still collects ``frames_per_batch`` frames at a time; each
of those batches goes through a ``TrajectoryAssembler``, which files its steps by
``("collector", "traj_ids")`` and keeps each trajectory until its last step (``("next",
"done")``) has come, so a trajectory spanning several batches (or several env rows' worth of
frames) comes out whole. Finished trajectories leave in the order they finished:

- yielded ``trajs_per_batch`` at a time, ``traj_format="padded"`` (torchrl's default): a
  ``(trajs_per_batch, longest)`` batch zero-padded along time with a ``("collector", "mask")``
  marking the real steps; ``"cat"``: concatenated along time, ``[sum of lengths]``, no padding;
- or, with a ``replay_buffer``, written to it flat (each trajectory's steps in order, ``extend``
  of ``trajs_per_write`` trajectories at a time; None: all that finished), and the iteration
  yields ``None`` once per collected batch.

Steps of trajectories still running when the collection ends (``total_frames``) are dropped, as
are those a reset interrupts (``reset()``, ``reset_at_each_iter=True``).

Example:
    >>> import torch
    >>> from tensordict import TensorDict
    >>> def frames(ids, done):
    ...     n = len(ids)
    ...     return TensorDict({"obs": torch.arange(n).float(),
    ...                        "collector": {"traj_ids": torch.tensor(ids)},
    ...                        "next": {"done": torch.tensor(done).unsqueeze(-1)}}, [n])
    >>> a = TrajectoryAssembler(2, "padded")
    >>> a.feed(frames([0, 0, 1], [False, True, False]))  # trajectory 0 ends; 1 goes on
    []
    >>> [batch] = a.feed(frames([1, 2], [True, True]))
    >>> batch.shape, batch["collector", "mask"].tolist()
    (torch.Size([2, 2]), [[True, True], [True, True]])
"""

from __future__ import annotations

from typing import Any

import torch
from tensordict import TensorDict, pad

#: ``traj_format``: how the trajectories of one yielded batch are laid out.
TRAJ_FORMATS = ("padded", "cat")
TRAJ_IDS = ("collector", "traj_ids")
MASK = ("collector", "mask")
END_KEYS = ("done", "terminated", "truncated")


def check_traj_args(trajs_per_batch: Any, trajs_per_write: Any, traj_format: Any, split_trajs: bool) -> str:
    """Check ``trajs_per_batch``, ``trajs_per_write`` and ``traj_format`` (with the
    ``split_trajs`` they exclude) and return the layout in use (``traj_format``, None being
    ``"padded"``, torchrl 0.14's)."""
    for name, value in (("trajs_per_batch", trajs_per_batch), ("trajs_per_write", trajs_per_write)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{name} must be None or a positive int, got {value!r}")
    if traj_format is not None and traj_format not in TRAJ_FORMATS:
        raise ValueError(f"traj_format must be None, 'padded' or 'cat', got {traj_format!r}")
    if trajs_per_batch is None:
        for name, value in (("traj_format", traj_format), ("trajs_per_write", trajs_per_write)):
            if value is not None:
                raise ValueError(f"{name}={value!r} needs trajs_per_batch (batches of whole trajectories)")
    elif split_trajs:
        raise ValueError("split_trajs=True cannot be combined with trajs_per_batch: trajs_per_batch already yields "
                         "whole trajectories, one per row (traj_format='padded')")
    return traj_format or "padded"


def _ends(chunk: TensorDict) -> bool:
    """Whether ``chunk``'s last step ends its trajectory (done, terminated or truncated)."""
    for key in END_KEYS:
        flag = chunk.get(("next", key), None)
        if flag is not None and bool(flag[-1].any()):
            return True
    return False


class TrajectoryAssembler:
    """Files the steps of fixed-frame batches by trajectory and hands out whole trajectories
    (see the module docstring).

    Args:
        trajs_per_batch (int): trajectories per yielded batch.
        traj_format (str): ``"padded"`` or ``"cat"``.
        replay_buffer: where finished trajectories are written instead (None: yielded).
        trajs_per_write (int | None): with ``replay_buffer``, trajectories per ``extend``
            (None: every one that finished, in one call).
        reset_each_batch (bool): the envs are reset before each batch (``reset_at_each_iter``):
            trajectories still running at the end of a batch are dropped.
    """

    def __init__(self, trajs_per_batch: int, traj_format: str, replay_buffer: Any = None,
                 trajs_per_write: int | None = None, reset_each_batch: bool = False):
        self.trajs_per_batch, self.traj_format = trajs_per_batch, traj_format
        self.reset_each_batch = reset_each_batch
        self.replay_buffer, self.trajs_per_write = replay_buffer, trajs_per_write
        self.running: dict[int, list[TensorDict]] = {}  # trajectory id -> its steps so far, in chunks
        self.finished: list[TensorDict] = []  # whole trajectories, in the order they finished

    def feed(self, batch: TensorDict) -> list[Any]:
        """File ``batch``'s steps; return what to yield now: whole-trajectory batches, or, with
        a replay buffer, ``[None]`` once the finished trajectories are written."""
        flat = batch.reshape(-1)
        ids = flat.get(TRAJ_IDS, None)
        if ids is None:
            raise KeyError("trajs_per_batch needs ('collector', 'traj_ids') in every batch (track_traj_ids=True, "
                           "and a postproc that keeps it)")
        ids = ids.reshape(-1)
        order = torch.argsort(ids, stable=True)  # each trajectory's steps together, in time order
        flat, ids = flat[order], ids[order]
        unique, counts = torch.unique_consecutive(ids, return_counts=True)
        start = 0
        for traj, count in zip(unique.tolist(), counts.tolist()):
            chunk, start = flat[start:start + count], start + count
            self.running.setdefault(traj, []).append(chunk)
            if _ends(chunk):
                chunks = self.running.pop(traj)
                self.finished.append(torch.cat(chunks, 0) if len(chunks) > 1 else chunks[0])
        if self.reset_each_batch:
            self.running.clear()
        if self.replay_buffer is not None:
            self._write()
            return [None]
        out = []
        while len(self.finished) >= self.trajs_per_batch:
            taken, self.finished = self.finished[:self.trajs_per_batch], self.finished[self.trajs_per_batch:]
            out.append(self._emit(taken))
        return out

    def drop_running(self) -> None:
        """Forget the trajectories not finished yet (the envs were reset)."""
        self.running.clear()

    def clear(self) -> None:
        """Forget everything held: running and finished trajectories."""
        self.running.clear()
        self.finished.clear()

    def _write(self) -> None:
        step = self.trajs_per_write or max(1, len(self.finished))
        while self.finished:
            taken, self.finished = self.finished[:step], self.finished[step:]
            self.replay_buffer.extend(torch.cat(taken, 0) if len(taken) > 1 else taken[0])

    def _emit(self, trajs: list[TensorDict]) -> TensorDict:
        if self.traj_format == "cat":
            return torch.cat(trajs, 0) if len(trajs) > 1 else trajs[0]
        longest = max(t.shape[0] for t in trajs)
        rows = []
        for traj in trajs:
            traj = traj.copy()
            traj.set(MASK, torch.ones(traj.shape[0], dtype=torch.bool, device=traj.device))
            rows.append(pad(traj, [0, longest - traj.shape[0]]) if traj.shape[0] < longest else traj)
        return torch.stack(rows, 0)


def new_assembler(config: Any, replay_buffer: Any) -> TrajectoryAssembler | None:
    """The assembler a collector with ``config`` uses for one iteration (None: no
    ``trajs_per_batch``, fixed-frame batches)."""
    trajs_per_batch = getattr(config, "trajs_per_batch", None)
    if trajs_per_batch is None:
        return None
    resets = getattr(config, "reset_at_each_iter", None)
    if resets is None:  # a multi-process collector's workers get it
        resets = getattr(config, "inner_options", {}).get("reset_at_each_iter", False)
    return TrajectoryAssembler(trajs_per_batch, config.traj_format or "padded", replay_buffer,
                               config.trajs_per_write, bool(resets))
