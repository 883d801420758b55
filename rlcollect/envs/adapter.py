"""Adapting foreign envs (torchrl-style TensorDict envs, gymnasium envs, ids) to ``EnvBase``."""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from rlcollect.envs.base import DONE_KEYS, ArraySpec, EnvBase, check_output, numpy_dtype

if TYPE_CHECKING:
    from collections.abc import Callable

    from tensordict import TensorDict

_NOT_OBS = {*DONE_KEYS, "reward", "action"}
_ONE_FLOAT = ArraySpec((1,), np.dtype(np.float32))
_ONE_FLAG = ArraySpec((1,), np.dtype(np.bool_))
#: The adapter's own entry in ``state_dict()``: the env's last root tensordict (StepCounter's
#: ``step_count``, RewardSum's ``episode_reward``, primers' entries: what the next step reads).
ROOT_KEY = "_rlcollect_root"


def exposes_state(env: Any) -> bool:
    """Whether ``env.state_dict()`` holds the env's whole state: the innermost env (through
    torchrl's ``base_env``) defines its own ``state_dict``, not only ``nn.Module``'s or a torchrl
    class's (those hold parameters and buffers, e.g. ObservationNorm's loc/scale, but not the
    simulator)."""
    inner = env
    for _ in range(32):
        nxt = getattr(inner, "base_env", None)
        if nxt is None or nxt is inner:
            break
        inner = nxt
    owner = next((c for c in type(inner).__mro__ if "state_dict" in c.__dict__), None)
    if owner is None or owner is torch.nn.Module:
        return False
    return not (getattr(owner, "__module__", "") or "").startswith("torchrl.")


def _leaf_key_ok(key) -> bool:
    parts = (key,) if isinstance(key, str) else key
    return (not any(p.startswith("_") for p in parts)
            and parts[0] not in _NOT_OBS and parts[0] not in ("next", "collector"))


class TensorDictEnvAdapter(EnvBase):
    """Gives a torchrl-style env (``reset``/``step``/``rand_action`` on TensorDicts) the array
    interface the collector's hot loop uses.  Only duck typing: torchrl is never imported.

    The observation keys are the leaves of the first ``reset()`` output other than the done
    family, ``"reward"``, ``"action"`` and private ``_`` keys.

    Example:
        >>> from rlcollect.envs.adapter import TensorDictEnvAdapter
        >>> from rlcollect import CountingEnv
        >>> TensorDictEnvAdapter(CountingEnv()).obs_layout["observation"].shape
        (1,)
    """

    def __init__(self, env: Any):
        for attr in ("reset", "step", "batch_size"):
            if not hasattr(env, attr):
                raise TypeError(f"env {type(env).__name__} lacks {attr!r}: not a TensorDict env")
        self.env = env
        self.batch_size = torch.Size(env.batch_size)
        self.device = torch.device(getattr(env, "device", None) or "cpu")
        root = env.reset()
        self._root = root
        # This reset is the env's first: the first reset of all rows takes its observation
        # instead of resetting again, so the env is reset once at construction, as torchrl's
        # collectors reset it (an env seeded before the collector is built gives the same
        # episodes). Stepping, seeding or loading a state spends it.
        self._probe_unused = True
        nb = len(self.batch_size)
        self.obs_layout = {
            k: ArraySpec(tuple(v.shape[nb:]), numpy_dtype(v.dtype))
            for k, v in root.items(include_nested=True, leaves_only=True)
            if _leaf_key_ok(k)
        }
        if not self.obs_layout:
            raise TypeError(f"env {type(env).__name__}: reset() returned no observation keys ({list(root.keys())})")
        with torch.random.fork_rng(devices=[]):  # (the probe draws nothing from torch's global stream)
            action = self._rand_action_tensor()
        self.action_layout = ArraySpec(tuple(action.shape[nb:]), numpy_dtype(action.dtype))
        self.has_truncated = "truncated" in root.keys()
        self._warned_state = False

    def _rand_action_tensor(self) -> torch.Tensor:
        if hasattr(self.env, "rand_action"):
            return self.env.rand_action(self._root.clone()).get("action")
        spec = getattr(self.env, "action_spec", None)
        if spec is None:
            raise TypeError(f"env {type(self.env).__name__} has neither rand_action nor action_spec")
        return spec.rand()

    def _check_td(self, td: TensorDict, what: str, keys) -> None:
        """Check the entries ``keys`` of ``td`` against the layout (see ``check_output``)."""
        nb = self.batch_size
        for key, spec in keys:
            value = td.get(key, None)
            if (isinstance(value, torch.Tensor) and value.shape == nb and spec.shape == (1,)
                    and key not in self.obs_layout):
                spec = ArraySpec((), spec.dtype)  # a reward or flag without its trailing 1 (read as such)
            if isinstance(value, torch.Tensor) and tuple(value.shape[: len(nb)]) == tuple(nb):
                value = value[(0,) * len(nb)] if nb else value  # one row's entry
            elif isinstance(value, torch.Tensor):
                spec = ArraySpec((*nb, *spec.shape), spec.dtype)  # report the whole entry
            check_output(self, what, key, value, spec)

    def _read_rows(self, td: TensorDict, rows, obs_out) -> None:
        n = self.num_rows
        for key, out in obs_out.items():
            value = _array(td.get(key)).reshape(n, *out.shape[1:])
            if rows is None:
                out[:] = value
            else:
                out[rows] = value[rows]

    def reset_rows(self, rows, obs_out) -> None:
        if rows is None or not self.batch_size:
            td = self._root if self._probe_unused else self.env.reset()
            self._probe_unused = False
            if self._check_reset:
                self._check_td(td, "reset() observation", self.obs_layout.items())
                self._check_reset = False
            self._read_rows(td, None, obs_out)
            self._root = td
            return
        self._probe_unused = False
        mask = np.zeros(self.num_rows, np.bool_)
        mask[rows] = True
        request = self._root.clone()
        request.set("_reset", torch.from_numpy(mask).reshape(*self.batch_size, 1).to(self.device))
        td = self.env.reset(request)
        if self._check_reset:
            self._check_td(td, "reset() observation", self.obs_layout.items())
            self._check_reset = False
        self._read_rows(td, rows, obs_out)
        reset = torch.from_numpy(mask).reshape(self.batch_size)
        for key in self.obs_layout:
            # A new tensor, not an in-place write: the root's entries may be the step's own
            # tensors (they are not copied after each step), which the env may still hold.
            value = self._root.get(key).clone()
            value[reset] = td.get(key)[reset]
            self._root.set(key, value)

    def step_rows(self, action, obs_out, reward, terminated, truncated) -> None:
        self._probe_unused = False
        td = self._root
        batched = torch.from_numpy(action).reshape((*self.batch_size, *self.action_layout.shape))
        td.set("action", batched if self.device.type == "cpu" else batched.to(self.device))
        td = self.env.step(td)
        nxt = td.get("next")
        if self._check_step:
            self._check_td(nxt, "step() observation", self.obs_layout.items())
            self._check_td(nxt, "step() entry", [("reward", _ONE_FLOAT), ("done", _ONE_FLAG)] + [
                (k, _ONE_FLAG) for k in ("terminated", "truncated") if k in nxt.keys()])
            self._check_step = False
        self._read_rows(nxt, None, obs_out)
        n = self.num_rows
        reward[:] = _array(nxt.get("reward")).reshape(n)
        done = _array(nxt.get("done")).reshape(n)
        term = nxt.get("terminated", None)
        terminated[:] = done if term is None else _array(term).reshape(n)
        trunc = nxt.get("truncated", None)
        truncated[:] = False if trunc is None else _array(trunc).reshape(n)
        # The next root shares the step's tensors (torchrl's step_mdp does the same): they were
        # copied into the batch above, and a partial reset replaces entries (reset_rows).
        self._root = nxt.exclude("reward", *DONE_KEYS)

    def sample_actions(self, out) -> None:
        out[:] = self._rand_action_tensor().detach().cpu().numpy().reshape(out.shape)

    def _seed(self, seed: int) -> None:
        self._probe_unused = False
        self.env.set_seed(seed)

    def set_seed(self, seed: int, static_seed: bool = False) -> int:
        self._probe_unused = False
        return self.env.set_seed(seed, static_seed=static_seed)

    def state_dict(self) -> dict:
        """The env's ``state_dict()`` (for a torchrl env: its transforms' parameters and buffers)
        plus its last root tensordict under ``ROOT_KEY``.  An env whose state_dict does not hold
        the simulator's state warns once: after a load, episodes in progress continue from the
        env's own current internal state."""
        fn = getattr(self.env, "state_dict", None)
        # Cloned: an nn.Module's state_dict aliases its live buffers, which later steps change.
        out = {k: _snapshot(v) for k, v in fn().items()} if fn is not None else {}
        if not self._warned_state and not exposes_state(self.env):
            self._warned_state = True
            held = sorted(map(str, out)) or "nothing"
            warnings.warn(
                f"rlcollect: env {type(self.env).__name__} does not expose its simulator's state (its state_dict "
                f"holds {held}): state_dict() keeps the transforms' state, the last root tensordict (StepCounter's "
                "step_count, RewardSum's episode_reward, primers) and the collector's carry, but load_state_dict() "
                "cannot restore the simulator, so episodes in progress continue from the env's current internal "
                "state; call collector.reset() after loading to start clean episodes",
                stacklevel=3,
            )
        out[ROOT_KEY] = self._root.clone()
        return out

    def load_state_dict(self, state: dict) -> None:
        state = dict(state)
        root = state.pop(ROOT_KEY, None)
        if root is not None and (not hasattr(root, "batch_size") or tuple(root.batch_size) != tuple(self.batch_size)):
            raise ValueError(f"env state: {ROOT_KEY} must be a TensorDict with batch size {list(self.batch_size)}, "
                             f"got {root!r}")
        self._probe_unused = False
        fn = getattr(self.env, "load_state_dict", None)
        if fn is not None:
            fn(state)
        elif state:
            raise ValueError(f"env {type(self.env).__name__} has no load_state_dict")
        if root is not None:
            self._root = root.clone()

    def __repr__(self) -> str:
        return f"{type(self.env).__name__}(batch_size={list(self.batch_size)})"

    def move_to(self, device: torch.device) -> None:
        """Move the wrapped env (and the observations it carries) to ``device`` (``env_device``)."""
        inner = self.env
        if torch.device(getattr(inner, "device", None) or "cpu") != device:
            self.env = inner.to(device) or inner
            self._root = self._root.to(device)
        self.device = device

    def close(self) -> None:
        close = getattr(self.env, "close", None)
        if close is not None:
            close()


def _array(value: torch.Tensor) -> np.ndarray:
    """``value`` as a numpy array: a CPU tensor that needs no grad as is (no detach, no move)."""
    if value.device.type == "cpu" and not value.requires_grad:
        return value.numpy()
    return value.detach().cpu().numpy()


def _snapshot(value: Any) -> Any:
    if isinstance(value, torch.Tensor) or hasattr(value, "to_module"):  # a tensor or a TensorDict
        return value.detach().clone() if isinstance(value, torch.Tensor) else value.clone()
    if isinstance(value, dict):
        return {k: _snapshot(v) for k, v in value.items()}
    return value


def as_env(env: Any) -> EnvBase:
    """Turn what a user gave into an ``EnvBase``: ours as is, gymnasium envs and ids through
    ``GymEnv``, TensorDict envs through ``TensorDictEnvAdapter``, or ``GroupedEnv`` for those whose
    action, reward or done entries lie under groups (multi-agent, nested, multi-key envs), a
    PettingZoo ``ParallelEnv`` through ``PettingZooEnv`` (an ``AECEnv`` through
    ``PettingZooAECEnv``) and then ``GroupedEnv``."""
    import gymnasium as gym

    from rlcollect.envs.gym import GymEnv

    if isinstance(env, EnvBase):
        return env
    if isinstance(env, str):
        return GymEnv(env)
    if isinstance(env, gym.vector.VectorEnv):  # before gym.Env: an EnvPool pool is both
        from rlcollect.envs.envpool import EnvPoolEnv, is_envpool
        from rlcollect.envs.vector import VectorEnv

        return EnvPoolEnv(env) if is_envpool(env) else VectorEnv(env)  # EnvPoolEnv can reseed its pool
    if isinstance(env, gym.Env):
        return GymEnv(env)
    from rlcollect.envs.grouped import GroupedEnv, is_grouped
    from rlcollect.envs.pettingzoo import PettingZooAECEnv, PettingZooEnv, is_aec_env, is_parallel_env

    if is_parallel_env(env):
        env = PettingZooEnv(env)
    elif is_aec_env(env):
        env = PettingZooAECEnv(env)
    return GroupedEnv(env) if is_grouped(env) else TensorDictEnvAdapter(env)


def make_env(create_env_fn: Any, kwargs: dict | None = None, prepare: Callable[[Any], Any] | None = None) -> EnvBase:
    """Build the env a collector was given: an instance, a gymnasium id or a factory.
    ``prepare``: called with the env made (before it is adapted), returns the env to use."""
    kwargs = kwargs or {}
    if isinstance(create_env_fn, str) and prepare is None:
        from rlcollect.envs.gym import GymEnv

        return GymEnv(create_env_fn, **kwargs)
    env = raw_env(create_env_fn, kwargs)
    return as_env(env if prepare is None else prepare(env))


def raw_env(create_env_fn: Any, kwargs: dict) -> Any:
    """What ``create_env_fn`` stands for, not adapted: the instance, or what the factory (or
    gymnasium, for an id) makes."""
    if isinstance(create_env_fn, str):
        import gymnasium as gym

        return gym.make(create_env_fn, **kwargs)
    # An env class (``CountingEnv``) has a ``step`` attribute too, but it is a factory.
    is_instance = not isinstance(create_env_fn, type) and (
        isinstance(create_env_fn, EnvBase) or hasattr(create_env_fn, "step") or _is_gym(create_env_fn)
    )
    if is_instance:
        if kwargs:
            raise ValueError("create_env_kwargs cannot be used with an env instance; pass a factory instead")
        return create_env_fn
    if callable(create_env_fn):
        return create_env_fn(**kwargs)
    raise TypeError(
        "create_env_fn must be an env, a gymnasium id or a callable returning an env, "
        f"got {type(create_env_fn).__name__}"
    )


def _is_gym(obj: Any) -> bool:
    import gymnasium as gym

    return isinstance(obj, gym.Env)

