"""``SerialEnv``: several unbatched envs stepped one after the other in one process."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from rlcollect.envs.adapter import as_env
from rlcollect.envs.base import EnvGroup


class SerialEnv(EnvGroup):
    """Batch ``num_envs`` unbatched envs built by ``create_env_fn`` (batch size ``[num_envs]``).

    Works with any env of the interface: rlcollect's own, gymnasium envs, or torchrl-style
    TensorDict envs.  Each env is seeded ``seed + i``.

    Args:
        num_envs: how many envs to build and step one after the other (a positive int).
        create_env_fn: a callable taking no argument and returning one unbatched env (an env
            class, a function, a ``functools.partial``); called ``num_envs`` times, here.

    Example:
        >>> from rlcollect import CountingEnv, SerialEnv
        >>> env = SerialEnv(3, lambda: CountingEnv(max_steps=4))
        >>> env.reset()["observation"].shape
        torch.Size([3, 1])
    """

    def __init__(self, num_envs: int, create_env_fn: Callable[[], Any]):
        if not isinstance(num_envs, int) or isinstance(num_envs, bool) or num_envs < 1:
            raise ValueError(f"SerialEnv: num_envs must be a positive int, got {num_envs!r}")
        if not callable(create_env_fn):
            raise TypeError(f"SerialEnv: create_env_fn must be callable, got {type(create_env_fn).__name__}")
        self.envs = self.members = [as_env(create_env_fn()) for _ in range(num_envs)]
        first = self.envs[0]
        if first.batch_size:
            raise ValueError(f"SerialEnv: the sub-envs must be unbatched, got batch size {list(first.batch_size)}")
        self.batch_size = torch.Size([num_envs])
        self.obs_layout = first.obs_layout
        self.action_layout = first.action_layout
        self.has_truncated = first.has_truncated

    @staticmethod
    def _row(buffers: dict, i: int) -> dict:
        return {k: v[i : i + 1] for k, v in buffers.items()}

    def reset_rows(self, rows, obs_out) -> None:
        for i in range(len(self.envs)) if rows is None else rows:
            self.envs[i].reset_rows(None, self._row(obs_out, i))

    def step_rows(self, action, obs_out, reward, terminated, truncated) -> None:
        for i, env in enumerate(self.envs):
            env.step_rows(
                action[i : i + 1], self._row(obs_out, i), reward[i : i + 1], terminated[i : i + 1], truncated[i : i + 1]
            )

    def sample_actions(self, out: np.ndarray) -> None:
        for i, env in enumerate(self.envs):
            env.sample_actions(out[i : i + 1])
