"""``EnvPoolEnv``: an EnvPool pool (``envpool.make_gymnasium``) as an rlcollect env.

EnvPool (>= 1.0) pools are gymnasium ``VectorEnv`` s with NEXT_STEP autoreset: after a
sub-env ends, its next ``step`` ignores the action and returns the reset observation with
reward 0. ``EnvPoolEnv`` resets the ended sub-envs at once with ``reset(env_id=rows)``, which
cancels that pending autoreset, so that no such fake transition reaches a batch (see
:mod:`rlcollect.envs.vector`). EnvPool fixes its seeds when the pool is created (sub-env
``i`` gets ``seed + i``; ``reset(seed=...)`` is ignored), so ``set_seed`` builds the pool again
with the new seed.

Only the synchronous mode fits the collector (every row steps at every step, rows are fixed
sub-envs): EnvPool's asynchronous mode (``batch_size < num_envs``, ``send``/``recv``) hands back
a different subset of sub-envs at each ``recv`` and is refused.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from rlcollect.envs.base import NestedKey
from rlcollect.envs.vector import VectorEnv


def _import_envpool():
    try:
        import envpool
    except ImportError as err:  # pragma: no cover - depends on the extra
        raise ImportError("EnvPoolEnv needs envpool: pip install 'rlcollect[envpool]'") from err
    return envpool


def is_envpool(env: Any) -> bool:
    """Whether ``env`` is an EnvPool pool (without importing envpool)."""
    return any(cls.__module__.startswith("envpool") for cls in type(env).__mro__)


class EnvPoolEnv(VectorEnv):
    """An EnvPool pool of ``num_envs`` sub-envs, stepped synchronously, batch size ``[num_envs]``.

    Args:
        task: an EnvPool task id (``"Pong-v5"``, ``"HalfCheetah-v5"``, ``"CartPole-v1"``, see
            ``envpool.list_all_envs()``), or a pool built with ``envpool.make_gymnasium``
            (then ``set_seed`` cannot rebuild it and raises).
        num_envs: the number of sub-envs (with a task id).
        **make_kwargs: passed to ``envpool.make_gymnasium`` (``seed``, ``num_threads``,
            ``episodic_life``, ``reward_clip``, ``img_height``, ...); ``batch_size``, if given,
            must equal ``num_envs`` (the asynchronous mode does not fit the collector).

    Example (needs ``pip install 'rlcollect[envpool]'``)::

        env = EnvPoolEnv("Pong-v5", num_envs=8, seed=0)
        collector = Collector(env, policy=None, frames_per_batch=8 * 128)
    """

    def __init__(self, task: str | Any, num_envs: int | None = None, **make_kwargs: Any):
        if isinstance(task, str):
            if not isinstance(num_envs, int) or isinstance(num_envs, bool) or num_envs < 1:
                raise ValueError(f"EnvPoolEnv: num_envs must be a positive int, got {num_envs!r}")
            batch = make_kwargs.get("batch_size", num_envs)
            if batch != num_envs:
                raise ValueError(
                    f"EnvPoolEnv: batch_size must equal num_envs ({num_envs}), got {batch!r}: EnvPool's asynchronous "
                    "mode returns a different subset of sub-envs at each recv(), which the collector's fixed rows "
                    "cannot hold; use more workers (MultiAsyncCollector) for asynchrony instead"
                )
            make_kwargs.pop("batch_size", None)
            self.task_id = task
            self._make_kwargs = {"num_envs": num_envs, **make_kwargs}
            env = _import_envpool().make_gymnasium(task, **self._make_kwargs)
        else:
            if num_envs is not None or make_kwargs:
                raise ValueError("EnvPoolEnv: num_envs and make kwargs only apply to a task id; got a pool instance")
            if not is_envpool(task):
                raise TypeError(f"EnvPoolEnv: task must be an EnvPool task id or pool, got {type(task).__name__}")
            config = getattr(task, "config", {})
            if config.get("batch_size", config.get("num_envs")) != config.get("num_envs"):
                raise ValueError(
                    f"EnvPoolEnv: the pool's batch_size ({config.get('batch_size')}) must equal its num_envs "
                    f"({config.get('num_envs')}): the asynchronous mode does not fit the collector"
                )
            self.task_id = None
            self._make_kwargs = None
            env = task
        self.env = env
        self._setup(env)

    def _take_seeds(self, rows: np.ndarray | None) -> None:
        return None  # EnvPool's seeds are fixed when the pool is built (see _seed)

    def _partial_reset(self, rows: np.ndarray, obs_out: dict[NestedKey, np.ndarray]) -> None:
        obs, info = self.env.reset(env_id=rows.astype(np.int32))
        self._write(obs, obs_out, rows, info)

    def _seed(self, seed: int) -> None:
        if self._make_kwargs is None:
            raise ValueError(
                "EnvPoolEnv.set_seed: EnvPool fixes its seeds when a pool is built and this EnvPoolEnv was given a "
                "built pool; build it from a task id (EnvPoolEnv('Pong-v5', num_envs=8)) or pass seed= to envpool"
            )
        self.env.close()
        self._make_kwargs["seed"] = int(seed)
        self.env = _import_envpool().make_gymnasium(self.task_id, **self._make_kwargs)
        self._random.seed(seed)

    def __repr__(self) -> str:
        return f"EnvPoolEnv({self.task_id!r}, batch_size={list(self.batch_size)})"
