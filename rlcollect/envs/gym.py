"""``GymEnv``: gymnasium environments, one or several copies stepped in-process."""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import Any

import cloudpickle
import gymnasium as gym
import numpy as np
import torch

from rlcollect.envs.base import ArraySpec, EnvBase, NestedKey, RandomActionBlocks, check_output
from rlcollect.envs.gym_ids import make
from rlcollect.envs.gym_state import load_plain_state, plain_state


def _box_dtype(dtype: np.dtype) -> np.dtype:
    # float64 observations are stored as float32: that is what networks consume.
    return np.dtype(np.float32) if np.dtype(dtype) == np.float64 else np.dtype(dtype)


def _observation_layout(space: gym.Space, prefix: tuple[str, ...] = ()) -> dict[NestedKey, ArraySpec]:
    """Map an observation space to ``{key: ArraySpec}``; Dict/Tuple spaces become nested keys."""
    if isinstance(space, gym.spaces.Dict):
        layout: dict[NestedKey, ArraySpec] = {}
        for name, sub in space.spaces.items():
            layout.update(_observation_layout(sub, (*prefix, str(name))))
        return layout
    if isinstance(space, gym.spaces.Tuple):
        layout = {}
        base = prefix or ("observation",)
        for i, sub in enumerate(space.spaces):
            layout.update(_observation_layout(sub, (*base, str(i))))
        return layout
    key: NestedKey = prefix if len(prefix) > 1 else (prefix[0] if prefix else "observation")
    return {key: _leaf_spec(space, "observation space")}


def _leaf_spec(space: gym.Space, what: str) -> ArraySpec:
    if isinstance(space, gym.spaces.Box):
        return ArraySpec(tuple(space.shape), _box_dtype(space.dtype))
    if isinstance(space, gym.spaces.Discrete):
        return ArraySpec((), np.dtype(np.int64))
    if isinstance(space, gym.spaces.MultiDiscrete):
        return ArraySpec(tuple(space.shape), np.dtype(np.int64))
    if isinstance(space, gym.spaces.MultiBinary):
        return ArraySpec(tuple(space.shape), np.dtype(np.int8))
    raise TypeError(
        f"GymEnv: unsupported {what} {space!r}; accepted: Box, Discrete, MultiDiscrete, "
        "MultiBinary, and Dict/Tuple of those (observations only)"
    )


def _obs_writer(space: gym.Space, layout: dict[NestedKey, ArraySpec]) -> Callable:
    """A function ``write(obs, row, out)`` storing one gym observation into row ``row``."""
    if len(layout) == 1 and not isinstance(space, (gym.spaces.Dict, gym.spaces.Tuple)):
        (key,) = layout

        def write_single(obs: Any, row: int, out: dict) -> None:
            out[key][row] = obs

        return write_single

    paths: list[tuple[NestedKey, tuple]] = []

    def collect(sp: gym.Space, path: tuple) -> None:
        if isinstance(sp, gym.spaces.Dict):
            for name, sub in sp.spaces.items():
                collect(sub, (*path, name))
        elif isinstance(sp, gym.spaces.Tuple):
            for i, sub in enumerate(sp.spaces):
                collect(sub, (*path, i))
        else:
            paths.append(path)

    collect(space, ())
    keys = list(layout)
    routes = list(zip(keys, paths))

    def write_nested(obs: Any, row: int, out: dict) -> None:
        for key, path in routes:
            value = obs
            for part in path:
                value = value[part]
            out[key][row] = value

    return write_nested


def _obs_leaves(space: gym.Space, layout: dict[NestedKey, ArraySpec]) -> Callable:
    """A function ``leaves(obs)`` listing ``(key, value)`` of one gym observation, in layout order
    (a Dict or Tuple observation that lacks an entry gives ``None`` for it)."""
    if not isinstance(space, (gym.spaces.Dict, gym.spaces.Tuple)):
        (key,) = layout
        return lambda obs: [(key, obs)]
    paths: list[tuple] = []

    def collect(sp: gym.Space, path: tuple) -> None:
        if isinstance(sp, gym.spaces.Dict):
            for name, sub in sp.spaces.items():
                collect(sub, (*path, name))
        elif isinstance(sp, gym.spaces.Tuple):
            for i, sub in enumerate(sp.spaces):
                collect(sub, (*path, i))
        else:
            paths.append(path)

    collect(space, ())

    def leaves(obs: Any) -> list:
        out = []
        for key, path in zip(layout, paths):
            value = obs
            for part in path:
                try:
                    value = value[part]
                except (KeyError, IndexError, TypeError):
                    value = None
                    break
            out.append((key, value))
        return out

    return leaves


_REWARD = ArraySpec((), np.dtype(np.float32))
_FLAG = ArraySpec((), np.dtype(np.bool_))


# torchrl GymEnv keyword arguments that have no meaning here, and what to do instead.
_TORCHRL_ONLY = {
    "device": "GymEnv steps on the CPU; give the collector policy_device / storing_device instead",
    "batch_size": "use num_envs=K for K copies (batch size [K])",
    "num_workers": "use a MultiSyncCollector / MultiAsyncCollector for parallel workers",
    "allow_done_after_reset": "an env that is done right after reset is an error here",
    "convert_actions_to_numpy": "actions always reach gymnasium as numpy values (Discrete as Python ints)",
    "missing_obs_value": "every observation must be present (a missing one is an error)",
    "native_autoreset": "GymEnv resets each copy the moment it ends",
}


class GymEnv(EnvBase):
    """A gymnasium environment (or ``num_envs`` copies of it, stepped in-process).

    Args:
        env: a gymnasium id such as ``"CartPole-v1"``, a ``gymnasium.Env`` instance, or a
            zero-argument callable returning one (torchrl's ``env_name=`` is accepted too).
        num_envs: ``None`` for an unbatched env (batch size ``[]``); ``K`` for ``K`` copies
            with batch size ``[K]``.  Each copy is reset the moment it ends (the collector
            stores the true final observation under ``"next"`` and the reset observation in
            the next row).
        categorical_action_encoding: for ``Discrete`` action spaces, ``True`` (the default
            here) takes an int64 index, ``False`` an int64 one-hot vector of ``n`` entries
            (torchrl's default).
        frame_skip: repeat each action this many steps (summing the rewards; stops early
            when the episode ends), as torchrl's ``frame_skip``.
        from_pixels: observe the rendered frame as ``"pixels"`` (uint8 ``(H, W, 3)``); an id
            is made with ``render_mode="rgb_array"``, an instance must have that render mode.
        pixels_only: with ``from_pixels``, drop the state observation (``True``, torchrl's
            default for ``GymEnv``) or keep it as ``"observation"`` (``False``).
        **make_kwargs: passed to ``gymnasium.make`` when ``env`` is an id (or to the callable).

    torchrl's ``device``, ``batch_size``, ``num_workers``, ``allow_done_after_reset``,
    ``convert_actions_to_numpy``, ``missing_obs_value`` and ``native_autoreset`` are refused
    with a message saying what to use instead. Box observations are stored as float32 when the
    space says float64.

    Example:
        >>> env = GymEnv("CartPole-v1", num_envs=4)
        >>> env.batch_size
        torch.Size([4])
        >>> env.reset()["observation"].shape
        torch.Size([4, 4])
        >>> GymEnv("CartPole-v1", categorical_action_encoding=False).rand_action()["action"].shape
        torch.Size([2])
    """

    def __init__(
        self,
        env: str | gym.Env | Callable[[], gym.Env] | None = None,
        num_envs: int | None = None,
        *,
        categorical_action_encoding: bool = True,
        frame_skip: int | None = None,
        from_pixels: bool = False,
        pixels_only: bool = True,
        **make_kwargs: Any,
    ):
        if env is None:
            env = make_kwargs.pop("env_name", None)
            if env is None:
                raise TypeError("GymEnv: env must be given (a gymnasium id, a gymnasium.Env or a callable), got None")
        if "device" in make_kwargs and torch.device(make_kwargs["device"]).type == "cpu":
            del make_kwargs["device"]  # what GymEnv does anyway
        refused = sorted(set(make_kwargs) & set(_TORCHRL_ONLY))
        if refused:
            raise ValueError("GymEnv: " + "; ".join(f"{k!r} is not supported: {_TORCHRL_ONLY[k]}" for k in refused))
        if num_envs is not None and (not isinstance(num_envs, int) or isinstance(num_envs, bool) or num_envs < 1):
            raise ValueError(f"GymEnv: num_envs must be None or a positive int, got {num_envs!r}")
        if not isinstance(categorical_action_encoding, bool):
            raise ValueError(
                f"GymEnv: categorical_action_encoding must be True or False, got {categorical_action_encoding!r}")
        if frame_skip is not None and (
                not isinstance(frame_skip, int) or isinstance(frame_skip, bool) or frame_skip < 1):
            raise ValueError(f"GymEnv: frame_skip must be None or a positive int, got {frame_skip!r}")
        if not isinstance(from_pixels, bool) or not isinstance(pixels_only, bool):
            raise ValueError(f"GymEnv: from_pixels and pixels_only must be bools, got {from_pixels!r}, {pixels_only!r}")
        copies = 1 if num_envs is None else num_envs
        if isinstance(env, str):
            if from_pixels:
                make_kwargs.setdefault("render_mode", "rgb_array")
            self._envs = [make(env, **make_kwargs) for _ in range(copies)]
            self.env_id = env
        elif isinstance(env, gym.Env):
            if copies > 1:
                raise ValueError(
                    "GymEnv: num_envs > 1 needs an env id or a callable to build each copy; "
                    "got a single gymnasium.Env instance"
                )
            if make_kwargs:
                raise ValueError(f"GymEnv: make kwargs {sorted(make_kwargs)} only apply to an env id")
            self._envs = [env]
            self.env_id = getattr(env.spec, "id", None)
        elif callable(env):
            self._envs = [env(**make_kwargs) for _ in range(copies)]
            if not all(isinstance(e, gym.Env) for e in self._envs):
                raise TypeError(f"GymEnv: the callable must return a gymnasium.Env, got {type(self._envs[0]).__name__}")
            self.env_id = getattr(self._envs[0].spec, "id", None)
        else:
            raise TypeError(
                f"GymEnv: env must be a gymnasium id, a gymnasium.Env or a callable, got {type(env).__name__}")
        if from_pixels:
            self._envs = [self._pixel_env(e, pixels_only) for e in self._envs]
        self.frame_skip = frame_skip or 1
        self.batch_size = torch.Size([] if num_envs is None else [num_envs])
        first = self._envs[0]
        self.observation_space = first.observation_space
        self.action_space = first.action_space
        # a pixels-only env observes the frame alone: its key is "pixels", as in torchrl
        prefix = ("pixels",) if from_pixels and pixels_only else ()
        self.obs_layout = _observation_layout(self.observation_space, prefix)
        self._one_hot = not categorical_action_encoding and isinstance(self.action_space, gym.spaces.Discrete)
        if self._one_hot:
            self.action_layout = ArraySpec((int(self.action_space.n),), np.dtype(np.int64))
        else:
            self.action_layout = _leaf_spec(self.action_space, "action space")
        self._write_obs = _obs_writer(self.observation_space, self.obs_layout)
        self._leaves = _obs_leaves(self.observation_space, self.obs_layout)
        self._scalar_actions = isinstance(self.action_space, gym.spaces.Discrete)
        self._random = RandomActionBlocks(self._draw)
        self._pending_seeds: list[int | None] = [None] * copies
        self._closed = False

    def _pixel_env(self, env: gym.Env, pixels_only: bool) -> gym.Env:
        if getattr(env, "render_mode", None) != "rgb_array":
            raise ValueError(
                f"GymEnv: from_pixels=True needs an env with render_mode='rgb_array', got "
                f"{getattr(env, 'render_mode', None)!r} (give an id, or make the env with render_mode='rgb_array')"
            )
        return gym.wrappers.AddRenderObservation(env, render_only=pixels_only, render_key="pixels",
                                                 obs_key="observation")

    def _actions(self, action: np.ndarray):
        """What gymnasium gets: Python ints for discrete actions (its contains() checks them
        much faster), the index of a one-hot action."""
        if self._one_hot:
            return action.argmax(-1).tolist()
        return action.tolist() if self._scalar_actions else action

    # -- array interface ----------------------------------------------------------------
    def reset_rows(self, rows: np.ndarray | None, obs_out: dict[NestedKey, np.ndarray]) -> None:
        indices = range(len(self._envs)) if rows is None else rows
        for i in indices:
            seed = self._pending_seeds[i]
            self._pending_seeds[i] = None
            obs, _ = self._envs[i].reset(seed=seed)
            if self._check_reset:
                self._check_obs(obs, "reset() observation")
            try:
                self._write_obs(obs, i, obs_out)
            except (ValueError, TypeError):  # checked on the first reset of a batch only
                self._check_obs(obs, f"reset() observation (env {i})")
                raise
        self._check_reset = False

    def _check_obs(self, obs: Any, what: str) -> None:
        layout = self.obs_layout
        for key, value in self._leaves(obs):
            check_output(self, what, key, value, layout[key])

    def step_rows(self, action, obs_out, reward, terminated, truncated) -> None:
        if self._check_step:
            self._step_rows_checked(action, obs_out, reward, terminated, truncated)
            return
        if self.frame_skip > 1:
            self._step_rows_skipping(action, obs_out, reward, terminated, truncated)
            return
        write = self._write_obs
        actions = self._actions(action)
        for i, env in enumerate(self._envs):
            obs, r, term, trunc, _ = env.step(actions[i])
            try:
                write(obs, i, obs_out)
            except (ValueError, TypeError):  # checked on the first step of a batch only: say what is wrong
                self._check_obs(obs, f"step() observation (env {i})")
                raise
            reward[i] = r
            terminated[i] = term
            truncated[i] = trunc

    def _step_rows_checked(self, action, obs_out, reward, terminated, truncated) -> None:
        """``step_rows`` checking everything each copy returns against the layout."""
        actions = self._actions(action)
        for i, env in enumerate(self._envs):
            obs, r, term, trunc = self._step_one(env, actions[i], check=True)
            self._write_obs(obs, i, obs_out)
            reward[i] = r
            terminated[i] = term
            truncated[i] = trunc
        self._check_step = False

    def _step_rows_skipping(self, action, obs_out, reward, terminated, truncated) -> None:
        actions = self._actions(action)
        for i, env in enumerate(self._envs):
            obs, r, term, trunc = self._step_one(env, actions[i], check=False)
            try:
                self._write_obs(obs, i, obs_out)
            except (ValueError, TypeError):
                self._check_obs(obs, f"step() observation (env {i})")
                raise
            reward[i] = r
            terminated[i] = term
            truncated[i] = trunc

    def _step_one(self, env: gym.Env, action: Any, check: bool) -> tuple:
        """One step of one copy, ``frame_skip`` times the action (rewards summed, stopping
        when the episode ends)."""
        total = 0.0
        for _ in range(self.frame_skip):
            result = env.step(action)
            if check:
                if not isinstance(result, tuple) or len(result) != 5:
                    raise ValueError(f"{self!r}: step() must return (obs, reward, terminated, truncated, info), "
                                     f"got {type(result).__name__} {result!r:.100}")
                self._check_obs(result[0], "step() observation")
                check_output(self, "step() reward", "reward", result[1], _REWARD)
                check_output(self, "step() flag", "terminated", result[2], _FLAG)
                check_output(self, "step() flag", "truncated", result[3], _FLAG)
            obs, r, term, trunc, _ = result
            total += r
            if term or trunc:
                break
        return obs, (total if self.frame_skip > 1 else r), term, trunc

    def sample_actions(self, out: np.ndarray) -> None:
        self._random.sample(out)

    def _draw(self, rng: np.random.Generator, steps: int) -> np.ndarray:
        space = self.action_space
        if self._one_hot:
            size = (steps, len(self._envs), *space.shape)
            index = rng.integers(int(space.start), int(space.start + space.n), size=size) - int(space.start)
            return np.eye(int(space.n), dtype=np.int64)[index]
        return draw_actions(space, len(self._envs), rng, steps)

    def _seed(self, seed: int) -> None:
        self._pending_seeds = [seed + i for i in range(len(self._envs))]
        self._random.seed(seed)
        for i, env in enumerate(self._envs):
            env.action_space.seed(seed + i)

    # -- state ----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The gymnasium envs' state and the action sampler's RNG state.

        Under ``"envs"``, one entry per copy: where every env allows it, each env's state as plain
        data (a dict per env: the class and plain attributes of each layer of its wrapper chain,
        see ``rlcollect.envs.gym_state``), which a checkpoint or a ``DistributedCollector`` node's
        state carries without unpickling anything; otherwise (an attribute of any layer of any copy
        that is not plain data) pickled copies of the envs (bytes), as before."""
        return {
            "envs": envs_state(self._envs),
            "pending_seeds": list(self._pending_seeds),
            **self._random.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict()``.  Plain env states (dicts) are set onto this env's gymnasium
        envs, which must have the same wrapper chain (else ``ValueError`` naming the layer); pickled
        ones (bytes) replace them, and unpickling runs code: **only load pickled states you trust**
        (your own checkpoints). A state without ``"envs"`` (pickles never cross the network)
        restores the random actions and pending seeds and leaves the envs as they are."""
        missing = {"rng", "pending_seeds"} - set(state)
        if missing:
            raise KeyError(f"GymEnv.load_state_dict: missing keys {sorted(missing)}")
        if "envs" in state:  # (left out of a state that crossed the network: the envs stay as they are)
            if len(state["envs"]) != len(self._envs):
                raise ValueError(
                    f"GymEnv.load_state_dict: state has {len(state['envs'])} envs, this env has {len(self._envs)}")
            self._envs = load_envs_state(self._envs, state["envs"], "GymEnv.load_state_dict")
        self._random.load_state_dict(state)
        self._pending_seeds = list(state["pending_seeds"])

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            for env in self._envs:
                env.close()

    def __repr__(self) -> str:
        name = self.env_id if self.env_id is not None else type(self._envs[0].unwrapped).__name__
        return f"GymEnv({name!r}, batch_size={list(self.batch_size)})"


def envs_state(envs: list[gym.Env]) -> list:
    """The state of ``envs`` (a GymEnv's copies, a SyncVectorEnv's sub-envs): plain data (a dict
    per env) where every env allows it, else a pickle (bytes) of each."""
    plain = [plain_state(e) for e in envs]
    return plain if all(p is not None for p in plain) else [cloudpickle.dumps(e) for e in envs]


def load_envs_state(envs: list[gym.Env], states: Any, where: str) -> list[gym.Env]:
    """``envs`` restored from ``envs_state``'s ``states``: a plain state is set onto the env in
    place (each is checked before any is set), a pickle replaces it (its env is closed)."""
    plain = [s for s in states if isinstance(s, dict)]
    if plain and len(plain) != len(states):
        raise ValueError(f"{where}: 'envs' mixes plain env states and pickles")
    if plain:
        for env, s in zip(envs, plain):
            load_plain_state(env, s, where, apply=False)
        for env, s in zip(envs, plain):
            load_plain_state(env, s, where)
        return list(envs)
    restored = [pickle.loads(blob) for blob in states]
    for env in envs:
        env.close()
    return restored


def draw_actions(space: gym.Space, rows: int, rng: np.random.Generator, steps: int) -> np.ndarray:
    """``steps`` steps of uniformly random actions of ``rows`` copies of ``space``: the draws of
    ``GymEnv`` and ``VectorEnv``, so that equal seeds give equal random actions."""
    size = (steps, rows, *space.shape)
    if isinstance(space, gym.spaces.Discrete):
        return rng.integers(int(space.start), int(space.start + space.n), size=size)
    if isinstance(space, gym.spaces.MultiDiscrete):
        return rng.integers(space.start, space.start + space.nvec, size=size)
    if isinstance(space, gym.spaces.MultiBinary):
        return rng.integers(0, 2, size=size)
    if np.issubdtype(space.dtype, np.integer):
        return rng.integers(space.low, space.high.astype(np.int64) + 1, size=size)
    low, high = space.low, space.high
    bounded = np.isfinite(low) & np.isfinite(high)
    sample = rng.normal(size=size)
    uniform = rng.uniform(np.where(bounded, low, 0.0), np.where(bounded, high, 1.0), size=size)
    return np.clip(np.where(bounded, uniform, sample), low, high)
