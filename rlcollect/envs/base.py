"""The environment protocol and the base class of rlcollect's native environments.

A native environment works on *rows*: ``n = prod(batch_size)`` independent copies (``n = 1``
for an unbatched env).  The collector's hot loop talks to it through the **array interface**,
the contract between the envs and the rollout (rlcollect/rollout.py), which writes into
preallocated numpy buffers so that no TensorDict is built per step:

- ``obs_layout`` (``{key: ArraySpec}``), ``action_layout``, ``batch_size``, ``num_rows``,
  ``has_truncated``: what one row holds;
- ``new_obs_buffers()``: ``{key: array of (num_rows, *spec.shape)}``, one per observation;
- ``reset_rows(rows, obs_out)``: reset ``rows`` (None: all), write their first observations;
- ``step_rows(action, obs_out, reward, terminated, truncated)``: step every row with
  ``action`` (``(num_rows, *action_layout.shape)``) and write the outcome (a row that ends is
  reset by the rollout with ``reset_rows``);
- ``sample_actions(out)``: one uniformly random action per row into ``out``;
- ``arm_checks()``: check what the next step and reset return against the layout
  (``check_output``), then trust them again.

``SerialEnv``, ``VectorEnv``, ``GymEnv``, ``EnvPoolEnv``, the torchrl adapter and central
inference's ``SplitEnvs`` implement it; ``EnvGroup`` is what "several envs as one" share.
The torchrl-style TensorDict interface (``reset``, ``step``, ``rand_action``, ...) is built on
top of it for users and for compatibility; foreign envs that only have the TensorDict interface
are adapted the other way round by :mod:`rlcollect.envs.adapter`.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:  # tensordict is imported only where a TensorDict is built (workers stay light)
    from tensordict import TensorDict

NestedKey = str | tuple[str, ...]

DONE_KEYS = ("done", "terminated", "truncated")


@dataclass(frozen=True)
class ArraySpec:
    """Shape and dtype of one field of one env row (the batch dims are not included)."""

    shape: tuple[int, ...]
    dtype: np.dtype

    def empty(self, rows: int) -> np.ndarray:
        return np.zeros((rows, *self.shape), dtype=self.dtype)


class RandomActionBlocks:
    """Uniformly random actions drawn ``block`` steps at a time: one numpy call per block
    instead of one per step (a numpy generator call costs several microseconds, as much as
    the rest of a step of a cheap env).

    ``draw(rng, steps)`` returns ``steps`` steps of actions, shape ``(steps, rows, *action)``.
    The generator's state together with the unused rest of the current block is the sampler's
    whole state, so that a saved state continues the same sequence.
    """

    def __init__(self, draw: Callable[[np.random.Generator, int], np.ndarray], seed: int | None = None,
                 block: int = 256):
        self._draw = draw
        self._size = block
        self.seed(seed)

    def seed(self, seed: int | None) -> None:
        self.rng = np.random.default_rng(seed)
        self._block, self._pos = self._draw(self.rng, 0), 0

    def sample(self, out: np.ndarray) -> None:
        """Write the next step's actions into ``out``."""
        if self._pos >= len(self._block):
            self._block, self._pos = self._draw(self.rng, self._size), 0
        out[...] = self._block[self._pos]
        self._pos += 1

    def state_dict(self) -> dict[str, Any]:
        return {"rng": self.rng.bit_generator.state, "random_block": self._block[self._pos :].copy()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict()``; a state without ``"random_block"`` (saved before actions
        were drawn in blocks) continues from the generator state alone."""
        self.rng.bit_generator.state = state["rng"]
        block = state.get("random_block")
        self._block, self._pos = (self._draw(self.rng, 0) if block is None else np.asarray(block)), 0


_ACCEPTED_KINDS = {"f": "biuf", "i": "biu", "u": "biu", "b": "biu"}


def check_output(env: Any, what: str, key: NestedKey, value: Any, spec: ArraySpec) -> None:
    """Raise ``ValueError`` unless ``value`` (one env row's ``what`` ``key``) has ``spec``'s shape
    and a dtype that converts to ``spec.dtype`` without loss of meaning (a scalar is not
    broadcast into every feature, ``None`` is not NaN, complex is not cast to real).

    The envs call this on the first step and reset of each batch only (see
    ``EnvBase.arm_checks``): checking every step would cost a large share of a cheap env's step.
    """
    if isinstance(value, torch.Tensor):
        shape, dtype = tuple(value.shape), numpy_dtype(value.dtype)
    else:
        array = np.asarray(value) if value is not None else None
        shape, dtype = (None, None) if array is None else (array.shape, array.dtype)
    ok = (dtype is not None and shape == spec.shape
          and dtype.kind in _ACCEPTED_KINDS.get(spec.dtype.kind, spec.dtype.kind))
    if not ok:
        got = "None" if dtype is None else f"shape {shape} and dtype {dtype}"
        raise ValueError(
            f"{env!r} returned a malformed {what} {key!r}: got {got}, expected shape {spec.shape} and dtype "
            f"{spec.dtype} (per env row); fix the env or wrap it so that it returns that"
        )


#: Where a ``GymEnv`` / ``VectorEnv`` state keeps the pickles of its gymnasium envs.
PICKLED_ENVS = "envs"


def without_env_pickles(state: Any) -> tuple[Any, int]:
    """``state`` (a collector's state: nested dicts and lists) without the pickled envs of any
    ``GymEnv`` / ``VectorEnv`` state in it, and how many such entries it held. What crosses the
    network is kept to plain data: unpickling runs code.

    Example:
        >>> without_env_pickles({"env": {"envs": [b"\\x80..."], "pending_seeds": [None]}, "frames": 3})
        ({'env': {'pending_seeds': [None]}, 'frames': 3}, 1)
    """
    if isinstance(state, dict):
        out, found = {}, 0
        for key, value in state.items():
            if key == PICKLED_ENVS and isinstance(value, list) and any(isinstance(b, bytes) for b in value):
                found += 1
                continue
            out[key], n = without_env_pickles(value)
            found += n
        return out, found
    if isinstance(state, list):
        parts = [without_env_pickles(v) for v in state]
        return [p for p, _ in parts], sum(n for _, n in parts)
    return state, 0


#: What stands for pickled envs kept where they were saved (``EnvPickleStash``): their digest.
KEPT_ENVS = "envs_kept"


class EnvPickleStash:
    """Pickled env state kept in the process that saved it (a distributed node), so that only a
    digest crosses the network: ``keep(state)`` swaps each ``"envs"`` list of pickles for its
    sha256 digest (the last ``size`` are kept), ``restore(state)`` swaps a digest back; a digest
    this process does not hold (a relaunched node, another run) is dropped, and those envs keep
    their own state.

    Example:
        >>> stash = EnvPickleStash()
        >>> sent = stash.keep({"env": {"envs": [b"pickle"], "rng": 1}})
        >>> sent["env"]["envs_kept"][:8], stash.restore(sent)
        ('47bf3e15', {'env': {'rng': 1, 'envs': [b'pickle']}})
    """

    def __init__(self, size: int = 4):
        self.size = size
        self.kept: dict[str, list] = {}

    def keep(self, state: Any) -> Any:
        if isinstance(state, dict):
            out = {}
            for key, value in state.items():
                if key == PICKLED_ENVS and isinstance(value, list) and all(isinstance(b, bytes) for b in value):
                    digest = hashlib.sha256(b"".join(hashlib.sha256(b).digest() for b in value)).hexdigest()
                    self.kept.pop(digest, None)
                    self.kept[digest] = value
                    while len(self.kept) > self.size:
                        del self.kept[next(iter(self.kept))]
                    out[KEPT_ENVS] = digest
                else:
                    out[key] = self.keep(value)
            return out
        return [self.keep(v) for v in state] if isinstance(state, list) else state

    def restore(self, state: Any) -> Any:
        if isinstance(state, dict):
            out = {k: self.restore(v) for k, v in state.items() if k != KEPT_ENVS}
            digest = state.get(KEPT_ENVS)
            if isinstance(digest, str) and digest in self.kept:
                out[PICKLED_ENVS] = self.kept[digest]
            return out
        return [self.restore(v) for v in state] if isinstance(state, list) else state


def torch_dtype(dtype: np.dtype) -> torch.dtype:
    """The torch dtype of a numpy dtype (``np.bool_`` -> ``torch.bool`` and so on)."""
    return torch.from_numpy(np.zeros((), dtype=dtype)).dtype


def numpy_dtype(dtype: torch.dtype) -> np.dtype:
    return torch.zeros((), dtype=dtype).numpy().dtype


class EnvBase:
    """Base class of rlcollect's environments.

    Subclasses set ``batch_size``, ``obs_layout`` (``{key: ArraySpec}``), ``action_layout``
    (an ``ArraySpec``) and ``has_truncated``, and implement ``reset_rows``, ``step_rows``,
    ``sample_actions`` and ``_seed``.  Everything else (the TensorDict interface) comes from
    here.

    Example:
        >>> from rlcollect import CountingEnv
        >>> env = CountingEnv(max_steps=3)
        >>> td = env.reset()
        >>> td = env.step(env.rand_action(td))
        >>> td["next", "observation"].tolist()
        [1.0]
    """

    batch_size: torch.Size = torch.Size([])
    device = torch.device("cpu")
    obs_layout: dict[NestedKey, ArraySpec]
    action_layout: ArraySpec
    has_truncated: bool = True
    action_key: NestedKey = "action"

    # Check the outputs of the next step / reset against the layout (then trust them): the
    # first ones after construction, and the first of each batch (the rollout re-arms them).
    _check_step: bool = True
    _check_reset: bool = True

    # -- array interface (the collector's hot path) ----------------------------------------
    @property
    def num_rows(self) -> int:
        return math.prod(self.batch_size)

    def arm_checks(self) -> None:
        """Have the next step and reset check what the env returns (``check_output``)."""
        self._check_step = self._check_reset = True

    def reset_rows(self, rows: np.ndarray | None, obs_out: dict[NestedKey, np.ndarray]) -> None:
        """Reset ``rows`` (all when None) and write their first observation into ``obs_out``."""
        raise NotImplementedError

    def step_rows(
        self,
        action: np.ndarray,
        obs_out: dict[NestedKey, np.ndarray],
        reward: np.ndarray,
        terminated: np.ndarray,
        truncated: np.ndarray,
    ) -> None:
        """Step every row with ``action`` and write the outcome into the given buffers."""
        raise NotImplementedError

    def sample_actions(self, out: np.ndarray) -> None:
        """Write one uniformly random action per row into ``out``."""
        raise NotImplementedError

    def _seed(self, seed: int) -> None:
        raise NotImplementedError

    # -- torchrl-style interface --------------------------------------------------------------
    def set_seed(self, seed: int, static_seed: bool = False) -> int:
        """Seed every row (``seed``, ``seed + 1``, ...) and return the next unused seed."""
        self._seed(int(seed))
        return int(seed) if static_seed else int(seed) + self.num_rows

    def new_obs_buffers(self) -> dict[NestedKey, np.ndarray]:
        return {k: spec.empty(self.num_rows) for k, spec in self.obs_layout.items()}

    def _to_td(self, arrays: dict[NestedKey, np.ndarray]) -> TensorDict:
        from tensordict import TensorDict

        td = TensorDict({}, batch_size=self.batch_size)
        for key, arr in arrays.items():
            td.set(key, torch.from_numpy(arr.copy()).reshape((*self.batch_size, *arr.shape[1:])))
        return td

    def _rows_of(self, td: TensorDict | None, key: NestedKey, spec: ArraySpec) -> np.ndarray:
        value = td.get(key)
        return np.ascontiguousarray(value.detach().cpu().numpy().reshape(self.num_rows, *spec.shape))

    def reset(self, td: TensorDict | None = None) -> TensorDict:
        """Reset all rows, or those flagged by a boolean ``"_reset"`` entry of ``td``."""
        rows = None
        if td is not None and "_reset" in td.keys():
            mask = td.get("_reset").reshape(self.num_rows, -1).any(-1).cpu().numpy()
            rows = np.flatnonzero(mask)
        obs = getattr(self, "_td_obs", None)
        if obs is None or rows is None:
            obs = self.new_obs_buffers()
        self.reset_rows(rows, obs)
        self._td_obs = obs
        out = self._to_td(obs)
        for key in DONE_KEYS:
            out.set(key, torch.zeros(*self.batch_size, 1, dtype=torch.bool))
        return out

    def rand_action(self, td: TensorDict | None = None) -> TensorDict:
        """Write a random ``"action"`` into ``td`` (a new TensorDict when None) and return it."""
        if td is None:
            from tensordict import TensorDict

            td = TensorDict({}, batch_size=self.batch_size)
        action = self.action_layout.empty(self.num_rows)
        self.sample_actions(action)
        td.set(self.action_key, torch.from_numpy(action).reshape((*self.batch_size, *self.action_layout.shape)))
        return td

    def step(self, td: TensorDict) -> TensorDict:
        """Step with ``td["action"]``; the outcome goes under ``td["next"]``. No reset happens."""
        action = self._rows_of(td, self.action_key, self.action_layout).astype(self.action_layout.dtype, copy=False)
        obs = self.new_obs_buffers()
        n = self.num_rows
        reward = np.zeros(n, np.float32)
        terminated = np.zeros(n, np.bool_)
        truncated = np.zeros(n, np.bool_)
        self.step_rows(action, obs, reward, terminated, truncated)
        # A later partial reset starts from these buffers: the rows it does not reset must
        # report their current observation, not the one from the previous reset.
        self._td_obs = obs
        nxt = self._to_td(obs)
        shape = (*self.batch_size, 1)
        nxt.set("reward", torch.from_numpy(reward).reshape(shape))
        nxt.set("terminated", torch.from_numpy(terminated).reshape(shape))
        nxt.set("truncated", torch.from_numpy(truncated).reshape(shape))
        nxt.set("done", torch.from_numpy(terminated | truncated).reshape(shape))
        td.set("next", nxt)
        return td

    def step_and_maybe_reset(self, td: TensorDict) -> tuple[TensorDict, TensorDict]:
        """Step, then reset the rows that ended; returns ``(td, root of the next step)``."""
        td = self.step(td)
        nxt = td.get("next")
        done = nxt.get("done")
        root = nxt.exclude("reward").clone()
        if done.any():
            from tensordict import TensorDict

            reset = self.reset(TensorDict({"_reset": done}, batch_size=self.batch_size))
            mask = done.reshape(*self.batch_size) if self.batch_size else done.reshape(())
            for key in reset.keys(include_nested=True, leaves_only=True):
                root.get(key)[mask] = reset.get(key)[mask]
        return td, root

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state:
            raise ValueError(f"{type(self).__name__} has no state to load, got keys {sorted(state)}")

    def close(self) -> None:
        """Release the env's resources. Idempotent."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(batch_size={list(self.batch_size)})"


class EnvGroup(EnvBase):
    """Several envs as one (``SerialEnv``'s envs, central inference's ``SplitEnvs``): seeding,
    state and closing go to each member in turn. A subclass sets ``members`` and the layout.

    Example:
        >>> from rlcollect import CountingEnv, SerialEnv
        >>> group = SerialEnv(2, CountingEnv)
        >>> group.set_seed(3), len(group.state_dict()["envs"])
        (5, 2)
        >>> group.close()
    """

    members: list[EnvBase] = []
    #: The key of the members' states in ``state_dict()``.
    state_key = "envs"

    def arm_checks(self) -> None:
        for member in self.members:
            member.arm_checks()

    def set_seed(self, seed: int, static_seed: bool = False) -> int:
        for member in self.members:
            seed = member.set_seed(seed, static_seed=static_seed)
        return seed

    def state_dict(self) -> dict:
        return {self.state_key: [member.state_dict() for member in self.members]}

    def load_state_dict(self, state: dict) -> None:
        if len(state.get(self.state_key, ())) != len(self.members):
            raise ValueError(f"{type(self).__name__}.load_state_dict: expected {len(self.members)} env states")
        for member, sub in zip(self.members, state[self.state_key]):
            member.load_state_dict(sub)

    def close(self) -> None:
        for member in self.members:
            member.close()
