"""``VectorEnv``: a gymnasium ``VectorEnv`` (``make_vec``, ``SyncVectorEnv``, ``AsyncVectorEnv``,
third-party subclasses such as ale-py's ``AtariVectorEnv`` or EnvPool) as an rlcollect env.

The collector's batch semantics are: the outcome of step ``t`` is under ``"next"`` (the true
final observation when the episode ended there), and the next row starts from the reset
observation. Gymnasium's three autoreset modes are mapped onto that:

* ``NEXT_STEP`` (gymnasium's default): ``step`` returns the final observation of the sub-envs
  that ended, which is what ``"next"`` needs; those sub-envs are then reset at once with
  ``reset(options={"reset_mask": ...})``, which also cancels the vector env's pending
  autoreset, so the extra "reset step" NEXT_STEP would otherwise spend (reward 0, action
  ignored) never happens and never reaches a batch.
* ``SAME_STEP``: ``step`` returns the reset observation and ``info["final_obs"]`` the final
  one; the final observation goes under ``"next"`` and the reset one into the next row.
* ``DISABLED``: the ended sub-envs are reset with ``reset(options={"reset_mask": ...})``.

Rows the collector itself ends (``max_frames_per_traj``, ``set_truncated``) are reset the same
way, in every mode.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import gymnasium as gym
import numpy as np
import torch
from gymnasium.vector import AutoresetMode

from rlcollect.envs.base import EnvBase, NestedKey, RandomActionBlocks
from rlcollect.envs.gym import _leaf_spec, _obs_writer, _observation_layout, draw_actions, envs_state, load_envs_state



def _space_paths(space: gym.Space, path: tuple = ()) -> list[tuple]:
    """The index path of every leaf of a (Dict/Tuple) space, in the order of its layout."""
    if isinstance(space, gym.spaces.Dict):
        return [p for name, sub in space.spaces.items() for p in _space_paths(sub, (*path, name))]
    if isinstance(space, gym.spaces.Tuple):
        return [p for i, sub in enumerate(space.spaces) for p in _space_paths(sub, (*path, i))]
    return [path]


def autoreset_mode_of(env: Any) -> AutoresetMode:
    """The autoreset mode a vector env declares (``metadata["autoreset_mode"]`` or an
    ``autoreset_mode`` attribute); ``NEXT_STEP``, gymnasium's default, when it declares none."""
    mode = (getattr(env, "metadata", None) or {}).get("autoreset_mode", getattr(env, "autoreset_mode", None))
    if mode is None:
        return AutoresetMode.NEXT_STEP
    try:
        return AutoresetMode(mode)
    except ValueError:
        raise ValueError(
            f"VectorEnv: unknown autoreset mode {mode!r} of {type(env).__name__}; accepted: "
            f"{[m.value for m in AutoresetMode]}"
        ) from None


class VectorEnv(EnvBase):
    """A gymnasium vector env (``num_envs`` sub-envs) as an rlcollect env with batch size
    ``[num_envs]``, in any of gymnasium's autoreset modes.

    Args:
        env: a ``gymnasium.vector.VectorEnv`` (``gymnasium.make_vec(...)``, ``SyncVectorEnv``,
            ``AsyncVectorEnv``, ale-py's ``AtariVectorEnv``, ...; for an EnvPool pool use
            ``EnvPoolEnv``, which can reseed it, as collectors do), a gymnasium
            id (built with ``gymnasium.make_vec(env, num_envs, **make_kwargs)``), or a callable
            returning a vector env (called with ``**make_kwargs``).
        num_envs: the number of sub-envs, only with an id (default 1).
        **make_kwargs: passed to ``gymnasium.make_vec`` (an id) or to the callable.

    A collector given a vector env, or a factory returning one, wraps it in ``VectorEnv``
    itself. Partial resets use ``reset(options={"reset_mask": mask})`` (gymnasium >= 1.1,
    ale-py >= 0.11, EnvPool); a vector env without it works only in ``SAME_STEP`` mode and
    without ``max_frames_per_traj``. ``set_seed(s)`` seeds sub-env ``i`` with ``s + i`` at its
    next reset, and the random actions, which are the same as ``GymEnv``'s for the same seed.
    Box observations are stored as float32 when the space says float64.

    Example:
        >>> import gymnasium
        >>> env = VectorEnv(gymnasium.make_vec("CartPole-v1", num_envs=3))
        >>> env.batch_size, env.autoreset_mode.name
        (torch.Size([3]), 'NEXT_STEP')
        >>> env.reset()["observation"].shape
        torch.Size([3, 4])
        >>> env.close()
    """

    #: What a pool with its own seeding and partial resets (``EnvPoolEnv``) overrides.
    _HOOKS = ("_partial_reset", "_seed", "_take_seeds")

    def __init__(self, env: str | gym.vector.VectorEnv | Callable[..., gym.vector.VectorEnv],
                 num_envs: int | None = None, **make_kwargs: Any):
        name = type(self).__name__
        if num_envs is not None and not isinstance(env, str):
            raise ValueError(f"{name}: num_envs only applies to a gymnasium id; got a {type(env).__name__}")
        if isinstance(env, str):
            if num_envs is not None and (not isinstance(num_envs, int) or isinstance(num_envs, bool) or num_envs < 1):
                raise ValueError(f"{name}: num_envs must be a positive int, got {num_envs!r}")
            env = gym.make_vec(env, num_envs=num_envs or 1, **make_kwargs)
        elif isinstance(env, gym.vector.VectorEnv):
            if make_kwargs:
                raise ValueError(f"{name}: make kwargs {sorted(make_kwargs)} only apply to an id or a callable")
        elif callable(env):
            env = env(**make_kwargs)
            if not isinstance(env, gym.vector.VectorEnv):
                raise TypeError(
                    f"{name}: the callable must return a gymnasium.vector.VectorEnv, got {type(env).__name__}")
        else:
            raise TypeError(
                f"{name}: env must be a gymnasium.vector.VectorEnv, a gymnasium id or a callable returning a "
                f"VectorEnv, got {type(env).__name__}"
            )
        self.env = env
        self._setup(env)

    def _setup(self, env: gym.vector.VectorEnv) -> None:
        n = int(env.num_envs)
        batch = getattr(env, "batch_size", n)
        if isinstance(batch, int) and not isinstance(batch, bool) and batch != n:
            raise ValueError(
                f"{type(self).__name__}: {type(env).__name__} has batch_size {batch} != num_envs {n}: an asynchronous "
                "vector env hands back a different subset of sub-envs at each step, which the collector's fixed "
                "rows cannot hold; build it with batch_size equal to num_envs"
            )
        self.batch_size = torch.Size([n])
        self.autoreset_mode = autoreset_mode_of(env)
        self.single_observation_space = env.single_observation_space
        self.single_action_space = env.single_action_space
        self.obs_layout = _observation_layout(self.single_observation_space)
        self.action_layout = _leaf_spec(self.single_action_space, "action space")
        self._routes = list(zip(self.obs_layout, _space_paths(self.single_observation_space)))
        self._write_one = _obs_writer(self.single_observation_space, self.obs_layout)
        self._arange = np.arange(n)
        self._random = RandomActionBlocks(lambda rng, steps: draw_actions(self.single_action_space, n, rng, steps))
        self._pending_seeds: list[int | None] = [None] * n
        # SAME_STEP: the reset observations of the rows that ended at the last step, until the
        # collector asks for them (rows -> their reset observation).
        self._stashed: dict[NestedKey, np.ndarray] | None = None
        self._stashed_rows = np.zeros(n, np.bool_)
        self._ale = type(env).__module__.startswith("ale_py")
        self._closed = False

    # -- writing observations ----------------------------------------------------------------
    def _leaf(self, obs: Any, path: tuple) -> np.ndarray:
        for part in path:
            obs = obs[part]
        return obs

    def _write(self, obs: Any, out: dict[NestedKey, np.ndarray], rows: np.ndarray | None, info: Any) -> None:
        """Write a batched observation into ``out``: all rows (``rows`` None) or ``rows``.

        A partial reset may answer with all ``num_envs`` rows (gymnasium) or only the reset
        ones (EnvPool, in the order of ``info["env_id"]`` when it gives one)."""
        env_ids = info.get("env_id") if isinstance(info, dict) else None
        for key, path in self._routes:
            value = np.asarray(self._leaf(obs, path))
            if rows is None:
                if env_ids is not None and len(env_ids) == len(value) and not np.array_equal(env_ids, self._arange):
                    out[key][np.asarray(env_ids)] = value
                else:
                    out[key][...] = value
            elif len(value) == self.num_rows:
                out[key][rows] = value[rows]
            elif len(value) == len(rows):
                out[key][np.asarray(env_ids) if env_ids is not None else rows] = value
            else:
                raise RuntimeError(
                    f"{type(self).__name__}: a partial reset of {len(rows)} of {self.num_rows} sub-envs returned "
                    f"{len(value)} observations"
                )

    # -- array interface -----------------------------------------------------------------------
    def _take_seeds(self, rows: np.ndarray | None) -> list[int | None] | None:
        indices = self._arange if rows is None else rows
        seeds = [self._pending_seeds[i] for i in indices]
        for i in indices:
            self._pending_seeds[i] = None
        return None if all(s is None for s in seeds) else seeds

    def _seed_argument(self, rows: np.ndarray, seeds: list[int | None] | None) -> Any:
        """``reset``'s ``seed`` for resetting ``rows`` with ``seeds``: gymnasium takes a list of
        ``num_envs`` entries (None: no seed), ale-py an array of one per reset row (-1: none)."""
        if seeds is None:
            return None
        if self._ale:
            return np.array([-1 if s is None else s for s in seeds], np.int64)
        full: list[int | None] = [None] * self.num_rows
        for i, s in zip(rows, seeds):
            full[i] = s
        return full

    def reset_rows(self, rows: np.ndarray | None, obs_out: dict[NestedKey, np.ndarray]) -> None:
        if rows is None:
            seeds = self._take_seeds(None)
            obs, info = self.env.reset(seed=self._seed_argument(self._arange, seeds))
            self._write(obs, obs_out, None, info)
            self._stashed, self._stashed_rows[:] = None, False
            return
        rows = np.asarray(rows, dtype=np.int64)
        if not len(rows):
            return
        if self._stashed is not None:
            # SAME_STEP: the env reset these rows already; hand out the observations it gave.
            have = self._stashed_rows[rows]
            done_rows = rows[have]
            for key, array in self._stashed.items():
                obs_out[key][done_rows] = array[done_rows]
            self._stashed_rows[done_rows] = False
            if not self._stashed_rows.any():
                self._stashed = None
            rows = rows[~have]
            if not len(rows):
                return
        self._partial_reset(rows, obs_out)

    def _partial_reset(self, rows: np.ndarray, obs_out: dict[NestedKey, np.ndarray]) -> None:
        """Reset ``rows`` only (this also cancels a pending NEXT_STEP autoreset of them)."""
        mask = np.zeros(self.num_rows, np.bool_)
        mask[rows] = True
        seeds = self._take_seeds(rows)
        try:
            obs, info = self.env.reset(seed=self._seed_argument(rows, seeds), options={"reset_mask": mask})
        except (TypeError, ValueError, KeyError, NotImplementedError) as err:
            raise RuntimeError(
                f"{type(self).__name__}: {type(self.env).__name__}.reset(options={{'reset_mask': ...}}) failed "
                f"({type(err).__name__}: {err}); a partial reset is needed in {self.autoreset_mode.name} mode "
                "and whenever the collector ends a trajectory itself (max_frames_per_traj); use a vector env "
                "that supports reset_mask (gymnasium >= 1.1) or SAME_STEP mode"
            ) from err
        self._write(obs, obs_out, rows, info)

    def step_rows(self, action, obs_out, reward, terminated, truncated) -> None:
        obs, r, term, trunc, info = self.env.step(action)
        env_ids = info.get("env_id") if isinstance(info, dict) else None
        if env_ids is not None and len(env_ids) == self.num_rows and not np.array_equal(env_ids, self._arange):
            order = np.argsort(env_ids)  # sub-envs answered out of order (an async pool)
            r, term, trunc = np.asarray(r)[order], np.asarray(term)[order], np.asarray(trunc)[order]
        self._write(obs, obs_out, None, info)
        reward[:] = r
        terminated[:] = term
        truncated[:] = trunc
        if self.autoreset_mode is AutoresetMode.SAME_STEP:
            self._same_step(obs_out, terminated | truncated, info)

    def _same_step(self, obs_out: dict[NestedKey, np.ndarray], ended: np.ndarray, info: dict) -> None:
        """SAME_STEP: keep the reset observations of the rows that ended, and put their final
        observations (``info["final_obs"]``) where the collector reads ``"next"``."""
        self._stashed, self._stashed_rows[:] = None, False
        if not ended.any():
            return
        rows = np.flatnonzero(ended)
        self._stashed = {key: array.copy() for key, array in obs_out.items()}
        self._stashed_rows[rows] = True
        final = info.get("final_obs") if isinstance(info, dict) else None
        if final is None:
            raise RuntimeError(
                f"{type(self).__name__}: {type(self.env).__name__} is in SAME_STEP mode but its step() info has no "
                "'final_obs' for the sub-envs that ended"
            )
        for i in rows:
            self._write_one(final[i], i, obs_out)

    def sample_actions(self, out: np.ndarray) -> None:
        self._random.sample(out)

    def _seed(self, seed: int) -> None:
        self._pending_seeds = [seed + i for i in range(self.num_rows)]
        self._random.seed(seed)
        self.env.action_space.seed(seed)

    # -- state ---------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The random-action stream and, for a ``SyncVectorEnv``, the state of its sub-envs: plain
        data where every sub-env allows it, else pickled copies (as ``GymEnv.state_dict``). Other
        vector envs (``AsyncVectorEnv``'s sub-envs live in other processes,
        EnvPool's and ale-py's in C++) cannot be saved: this raises ``TypeError``."""
        if not isinstance(self.env, gym.vector.SyncVectorEnv):
            raise TypeError(
                f"{type(self).__name__}.state_dict: the state of a {type(self.env).__name__} cannot be saved "
                "(only a SyncVectorEnv's sub-envs can be pickled)"
            )
        return {
            "envs": envs_state(self.env.envs),
            "pending_seeds": list(self._pending_seeds),
            **self._random.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not isinstance(self.env, gym.vector.SyncVectorEnv):
            raise TypeError(f"{type(self).__name__}.load_state_dict: a {type(self.env).__name__} cannot be restored")
        missing = {"rng", "pending_seeds"} - set(state)
        if missing:
            raise KeyError(f"{type(self).__name__}.load_state_dict: missing keys {sorted(missing)}")
        if "envs" in state:  # (left out of a state that crossed the network: the envs stay as they are)
            if len(state["envs"]) != self.num_rows:
                raise ValueError(
                    f"{type(self).__name__}.load_state_dict: state has {len(state['envs'])} envs, "
                    f"this env has {self.num_rows}"
                )
            self.env.envs = load_envs_state(self.env.envs, state["envs"], f"{type(self).__name__}.load_state_dict")
        self._random.load_state_dict(state)
        self._pending_seeds = list(state["pending_seeds"])

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.env.close()

    def __repr__(self) -> str:
        mode = getattr(self, "autoreset_mode", None)
        inner = type(getattr(self, "env", None)).__name__
        return (f"{type(self).__name__}({inner}, batch_size={list(self.batch_size)}, "
                f"autoreset_mode={getattr(mode, 'name', None)})")
