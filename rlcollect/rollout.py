"""The hot loop: step an env with a policy and fill a preallocated batch in place.

Everything per step is numpy indexing into buffers allocated once; torch is only touched to
call the policy (through tensors that share memory with those buffers).  No TensorDict is
built per step.
"""

from __future__ import annotations

import numpy as np
import torch

from rlcollect.data import MASK, POLICY_VERSION, TRAJ_IDS, BatchBuffer, BatchLayout
from rlcollect.envs.base import DONE_KEYS, ArraySpec, EnvBase, NestedKey, numpy_dtype

_BOOL = np.dtype(np.bool_)


def _next(key: NestedKey) -> tuple[str, ...]:
    return ("next", key) if isinstance(key, str) else ("next", *key)


class _ObsBuffers:
    """One set of observation buffers, as numpy rows and as policy-ready torch views."""

    def __init__(self, env: EnvBase):
        self.arrays = env._new_obs_buffers()
        shape = tuple(env.batch_size)
        self.tensors = {k: torch.from_numpy(a).reshape(*shape, *a.shape[1:]) for k, a in self.arrays.items()}


class Rollout:
    """Owns the carry between batches (current observations, trajectory ids, step counts) and
    fills :class:`BatchBuffer` s.

    Args:
        env: the env (array interface).
        runner: the policy runner (``rlcollect.policy``).
        time: time steps per batch.
        max_frames_per_traj: truncate trajectories at this many steps (adds ``"step_count"``).
        set_truncated: mark the last step of each batch truncated and reset every row.
        track_version: write ``("collector", "policy_version")``.
        traj_id_start: the first trajectory id this rollout hands out.
    """

    def __init__(
        self,
        env: EnvBase,
        runner,
        time: int,
        *,
        max_frames_per_traj: int | None = None,
        set_truncated: bool = False,
        track_version: bool = False,
        traj_id_start: int = 0,
    ):
        self.env = env
        self.runner = runner
        self.time = time
        self.max_frames_per_traj = max_frames_per_traj
        self.set_truncated = set_truncated
        self.track_version = track_version
        self.rows = env.num_rows
        self._cur = _ObsBuffers(env)
        self._nxt = _ObsBuffers(env)
        self.traj_ids = np.zeros(self.rows, np.int64)
        self.next_traj_id = traj_id_start
        self.step_count = np.zeros(self.rows, np.int64)
        self._ids_used = True
        self.needs_reset = True
        self._reward = np.zeros(self.rows, np.float32)
        self._terminated = np.zeros(self.rows, _BOOL)
        self._truncated = np.zeros(self.rows, _BOOL)
        self._done = np.zeros(self.rows, _BOOL)
        self._random_action = env.action_layout.empty(self.rows)
        self.layout: BatchLayout | None = None

    # -- carry -------------------------------------------------------------------------------
    def _new_ids(self, rows: np.ndarray | None) -> None:
        count = self.rows if rows is None else len(rows)
        ids = np.arange(self.next_traj_id, self.next_traj_id + count, dtype=np.int64)
        self.next_traj_id += count
        if rows is None:
            self.traj_ids[:] = ids
        else:
            self.traj_ids[rows] = ids

    def reset_all(self) -> None:
        """Reset every row; the next frames start new trajectories."""
        self.env._reset_rows(None, self._cur.arrays)
        if self._ids_used:
            self._new_ids(None)
            self._ids_used = False
        self.step_count[:] = 0
        self.needs_reset = False

    def current_observation(self) -> dict[NestedKey, torch.Tensor]:
        if self.needs_reset:
            self.reset_all()
        return self._cur.tensors

    # -- layout ------------------------------------------------------------------------------
    def discover_layout(self, extra: dict[NestedKey, ArraySpec] | None = None) -> BatchLayout:
        """Dry-run the policy once on the current observation to learn what it writes, and
        build the batch layout from that and the env's layout."""
        env = self.env
        fields: dict[NestedKey, ArraySpec] = dict(env.obs_layout)
        obs = self.current_observation()
        if self.runner.is_random:
            fields["action"] = env.action_layout
        else:
            with torch.no_grad():
                out = self.runner(obs)
            nb = len(env.batch_size)
            for key, value in out.items():
                fields[key] = ArraySpec(tuple(value.shape[nb:]), numpy_dtype(value.dtype))
            self._check_action(fields["action"])
        for key in DONE_KEYS:
            fields[key] = ArraySpec((1,), _BOOL)
        for key, spec in env.obs_layout.items():
            fields[_next(key)] = spec
        fields[("next", "reward")] = ArraySpec((1,), np.dtype(np.float32))
        for key in DONE_KEYS:
            fields[("next", key)] = ArraySpec((1,), _BOOL)
        if self.max_frames_per_traj is not None:
            fields["step_count"] = ArraySpec((1,), np.dtype(np.int64))
            fields[("next", "step_count")] = ArraySpec((1,), np.dtype(np.int64))
        fields[TRAJ_IDS] = ArraySpec((), np.dtype(np.int64))
        if self.track_version:
            fields[POLICY_VERSION] = ArraySpec((), np.dtype(np.int64))
        fields.update(extra or {})
        self.layout = BatchLayout(fields, env.batch_size, self.time)
        return self.layout

    def _check_action(self, got: ArraySpec) -> None:
        want = self.env.action_layout
        if got.shape != want.shape:
            raise TypeError(
                f"the policy's 'action' has shape {got.shape} per env row but the env expects {want.shape} "
                f"(dtype {want.dtype}); e.g. turn logits into an index with argmax or sampling"
            )
        if np.issubdtype(want.dtype, np.integer) and not (
            np.issubdtype(got.dtype, np.integer) or got.dtype == _BOOL
        ):
            raise TypeError(f"the policy's 'action' is {got.dtype} but the env expects integer actions ({want.dtype})")

    # -- the loop ----------------------------------------------------------------------------
    def fill(self, buf: BatchBuffer, *, random: bool = False, version: int = 0, stop: np.ndarray | None = None) -> int:
        """Collect ``time`` steps into ``buf`` (in place) and return how many were filled.

        ``stop`` (preemption): a shared flag checked before each step; once it is set the
        remaining steps are marked invalid (traj id -1, ``("collector", "mask")`` False).
        """
        if self.needs_reset:
            self.reset_all()
        env, runner, arrays = self.env, self.runner, buf.arrays
        rows, n_time = self.rows, self.time
        obs_keys = list(env.obs_layout)
        obs_pairs = [(arrays[k], k) for k in obs_keys]
        next_obs_pairs = [(arrays[_next(k)], k) for k in obs_keys]
        random = random or runner.is_random
        out_arrays = [] if random else [(arrays[k], k) for k in runner.out_keys]
        action_arr = arrays["action"]
        action_dtype = env.action_layout.dtype
        action_shape = (rows, *env.action_layout.shape)
        ids_arr = arrays[TRAJ_IDS]
        version_arr = arrays.get(POLICY_VERSION)
        step_arr = arrays.get("step_count")
        next_step_arr = arrays.get(("next", "step_count"))
        reward_arr = arrays[("next", "reward")]
        term_arr, trunc_arr, done_arr = (arrays[("next", k)] for k in ("terminated", "truncated", "done"))
        reward, terminated, truncated, done = self._reward, self._terminated, self._truncated, self._done
        step_count, max_steps = self.step_count, self.max_frames_per_traj
        random_action = self._random_action
        if random and not runner.is_random:
            for array, _ in out_arrays:
                array.fill(0)
        self._ids_used = True
        filled = n_time
        for t in range(n_time):
            if stop is not None and stop[0]:
                filled = t
                break
            cur, nxt = self._cur, self._nxt
            # 1. act
            if random:
                env._sample_actions(random_action)
                action = random_action
                action_arr[:, t] = action
            else:
                out = runner(cur.tensors)
                for array, key in out_arrays:
                    array[:, t] = out[key].detach().cpu().numpy().reshape(array.shape[0], *array.shape[2:])
                action = action_arr[:, t]
                if action.dtype != action_dtype:
                    action = action.astype(action_dtype)
                action = action.reshape(action_shape)
            # 2. record the state the action was taken in
            for array, key in obs_pairs:
                array[:, t] = cur.arrays[key]
            ids_arr[:, t] = self.traj_ids
            if version_arr is not None:
                version_arr[:, t] = version
            # 3. step
            env._step_rows(action, nxt.arrays, reward, terminated, truncated)
            if max_steps is not None:
                step_arr[:, t, 0] = step_count
                step_count += 1
                next_step_arr[:, t, 0] = step_count
                truncated |= step_count >= max_steps
            if self.set_truncated and t == n_time - 1:
                truncated[:] = True
            np.logical_or(terminated, truncated, out=done)
            for array, key in next_obs_pairs:
                array[:, t] = nxt.arrays[key]
            reward_arr[:, t, 0] = reward
            term_arr[:, t, 0] = terminated
            trunc_arr[:, t, 0] = truncated
            done_arr[:, t, 0] = done
            # 4. carry over: the next observation becomes current; ended rows are reset
            self._cur, self._nxt = nxt, cur
            if done.any():
                ended = np.flatnonzero(done)
                env._reset_rows(ended, nxt.arrays)
                step_count[ended] = 0
                self._new_ids(ended)
        mask = arrays.get(MASK)
        if mask is not None:
            mask[:, :filled] = True
            mask[:, filled:] = False
        if filled < n_time:
            ids_arr[:, filled:] = -1
        return filled

    # -- state -------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {
            "obs": {k: v.copy() for k, v in self._cur.arrays.items()},
            "traj_ids": self.traj_ids.copy(),
            "next_traj_id": self.next_traj_id,
            "step_count": self.step_count.copy(),
            "needs_reset": self.needs_reset,
            "ids_used": self._ids_used,
        }

    def check_state_dict(self, state: dict) -> None:
        missing = {"obs", "traj_ids", "next_traj_id", "step_count", "needs_reset", "ids_used"} - set(state)
        if missing:
            raise KeyError(f"rollout state is missing {sorted(missing)}")
        if set(state["obs"]) != set(self._cur.arrays):
            raise ValueError(f"rollout state has observation keys {sorted(map(str, state['obs']))}, "
                             f"this env has {sorted(map(str, self._cur.arrays))}")
        for key, value in state["obs"].items():
            if np.shape(value) != self._cur.arrays[key].shape:
                raise ValueError(f"rollout state: observation {key!r} has shape {np.shape(value)}, "
                                 f"expected {self._cur.arrays[key].shape}")
        if np.shape(state["traj_ids"]) != self.traj_ids.shape:
            raise ValueError(f"rollout state: traj_ids has shape {np.shape(state['traj_ids'])}, expected {self.traj_ids.shape}")
        if np.shape(state["step_count"]) != self.step_count.shape:
            raise ValueError(
                f"rollout state: step_count has shape {np.shape(state['step_count'])}, expected {self.step_count.shape}"
            )
        try:
            int(state["next_traj_id"])
        except (TypeError, ValueError) as err:
            raise ValueError(f"rollout state: next_traj_id must be an int, got {state['next_traj_id']!r}") from err

    def load_state_dict(self, state: dict) -> None:
        self.check_state_dict(state)
        for key, value in state["obs"].items():
            self._cur.arrays[key][:] = value
        self.traj_ids[:] = state["traj_ids"]
        self.next_traj_id = int(state["next_traj_id"])
        self.step_count[:] = state["step_count"]
        self.needs_reset = bool(state["needs_reset"])
        self._ids_used = bool(state["ids_used"])
