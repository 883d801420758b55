"""The hot loop: step an env with a policy and fill a preallocated batch in place.

Everything per step is numpy indexing into buffers allocated once; torch is only touched to
call the policy (through tensors that share memory with those buffers).  No TensorDict is
built per step.

Small fields are staged: each step writes into *time-major* staging arrays ``(T, n, *feature)``,
one per batch field, owned by the rollout: the env writes its outcome straight into them (step
``t``'s slice is a contiguous ``(n, *feature)`` array), and the batch, stored ``(n, T, *feature)``,
is written from them with one copy per field once the batch is done. Every numpy call costs
0.5-1 µs (several times that right after a sleeping env wakes up), a large share of a cheap env's
step, so the loop makes as few as it can: the observations live in one ``(T + 1, n, *feature)``
array whose slice ``t + 1`` is both step ``t``'s next observation and step ``t + 1``'s
observation (the final observations of rows that ended are kept aside before their reset
overwrites them), and the trajectory ids, the policy version and the done flags are written once
per batch. The price is a second, private copy of those fields.

Large observations (at least :data:`DIRECT_ROW_BYTES` per env row: pixels) are not staged, so
the rollout holds no second copy of them: the env writes step ``t``'s next observation straight
into the batch's ``("next", key)[:, t]`` (a strided ``(n, *feature)`` view: each row is
contiguous, rows are ``T`` frames apart), which is copied into ``key[:, t + 1]`` before the rows
that ended are reset there, so ``("next", key)`` keeps the true final observation. The
observation after the batch's last step goes to a carry array of one ``(n, *feature)`` frame.
Per frame that is the env's write and one copy (the staged path makes two copies after it).

What a policy writes under ``"next"`` (a recurrent module's ``("next", "recurrent_state_h")``)
is *carried*, as torchrl's collectors do: it becomes the root input of the next step, row by
row, and rows that start an episode get the env's reset value instead (zeros for a key the env
does not know). Carried keys live in the observation staging beside the env's own, so the carry
costs one copy per carried key per step, and nothing for policies that write nothing there.
"""

from __future__ import annotations

from time import perf_counter
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from rlcollect._context import current_worker_index
from rlcollect.data import MASK, POLICY_VERSION, TRAJ_IDS, BatchBuffer, BatchLayout
from rlcollect.envs.base import DONE_KEYS, ArraySpec, EnvBase, NestedKey, numpy_dtype

_BOOL = np.dtype(np.bool_)
#: Observations with at least this many bytes per env row are written straight into the batch
#: instead of being staged (a strided write per step costs nothing next to copying a frame).
DIRECT_ROW_BYTES = 4096


def _next(key: NestedKey) -> tuple[str, ...]:
    return ("next", key) if isinstance(key, str) else ("next", *key)


class _ObsBuffers:
    """One set of observation buffers, as numpy rows and as policy-ready torch views."""

    def __init__(self, env: EnvBase):
        self.arrays = env.new_obs_buffers()
        shape = tuple(env.batch_size)
        self.tensors = {k: torch.from_numpy(a).reshape(*shape, *a.shape[1:]) for k, a in self.arrays.items()}


def frame_traj_ids(start: np.ndarray, resets: list[tuple[int, np.ndarray]], steps: int, first_new: int) -> np.ndarray:
    """The trajectory id of every frame of a batch, time-major ``(steps, n)``.

    Row ``i`` starts with ``start[i]``; each ``(t, rows)`` of ``resets`` (in the order they
    happened) gives ``rows`` new ids from step ``t + 1`` on, handed out consecutively from
    ``first_new`` in that order, as ``Rollout._new_ids`` does.
    """
    n = len(start)
    # Label each frame with an index into [start ids, new ids]; labels only grow along time
    # within a row, so a running maximum carries each one forward to the next reset.
    labels = np.full((steps, n), -1, np.int64)
    labels[0] = np.arange(n)
    given = n
    for t, rows in resets:
        if t + 1 < steps:
            labels[t + 1, rows] = np.arange(given, given + len(rows))
        given += len(rows)
    np.maximum.accumulate(labels, axis=0, out=labels)
    table = np.concatenate([start, np.arange(first_new, first_new + given - n, dtype=np.int64)])
    return table[labels]


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
        check_finite: ``None`` (no check), ``"first"`` (the first step of each batch) or
            ``"every"`` (every step): a NaN or infinite reward or float observation raises
            ``ValueError`` naming the worker, the env row, the key and the step.
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
        check_finite: str | None = None,
    ):
        self.env = env
        self.check_finite = check_finite
        self.runner = runner
        self.time = time
        self.max_frames_per_traj = max_frames_per_traj
        self.set_truncated = set_truncated
        self.track_version = track_version
        self.rows = rows = env.num_rows
        # Staged keys: slice 0 holds the current observations between batches (the carry).
        # Direct keys (large ones) have only their carry here; their frames live in the batch.
        buffers = env.new_obs_buffers()
        self._direct = [k for k, a in buffers.items() if a[0].nbytes >= DIRECT_ROW_BYTES]
        self._obs = {k: np.zeros((time + 1, *a.shape), a.dtype) for k, a in buffers.items() if k not in self._direct}
        self._carry = {k: (np.zeros_like(a) if k in self._direct else self._obs[k][0]) for k, a in buffers.items()}
        # The policy reads buffers of its own, filled from the staging before each call, so that
        # its inputs stay the same tensors from step to step (a view of the staging would move).
        self._policy_in = _ObsBuffers(env)
        self.traj_ids = np.zeros(rows, np.int64)
        self.next_traj_id = traj_id_start
        self.step_count = np.zeros(rows, np.int64)
        self._ids_used = True
        self.needs_reset = True
        self._reward = np.zeros((time, rows), np.float32)
        self._terminated = np.zeros((time, rows), _BOOL)
        self._truncated = np.zeros((time, rows), _BOOL)
        self._step_counts = np.zeros((2, time, rows), np.int64) if max_frames_per_traj is not None else None
        self._random_actions = np.zeros((time, rows, *env.action_layout.shape), env.action_layout.dtype)
        self.step_seconds = [0.0] * time  # how long each env step of the last batch took (a list: cheaper to set)
        # A runner whose version may move from one call to the next (central inference, whose
        # weights are the trainer's) has each step's version recorded.
        self._versions = np.zeros(time, np.int64)
        self.version_range: tuple[int, float] = (0, 0.0)  # the last batch's frames' (min, mean) version
        self.last_version = 0  # the version of its last step
        self._obs_version = 0  # the version when the current observations came (torchrl's root "policy_version")
        self._outputs: dict[NestedKey, np.ndarray] = {}  # the policy's outputs, by key (on first use)
        self.layout: BatchLayout | None = None
        self._env_keys = list(buffers)  # the observation keys the env writes
        # The policy's ("next", key) outputs carried into the root key at the next step, as
        # (key, output key); keys the env does not write are the ones in ``_policy_only``.
        self._carried: list[tuple[NestedKey, NestedKey]] = []
        self._policy_only: list[NestedKey] = []

    # -- carry -------------------------------------------------------------------------------
    def _new_ids(self, rows: np.ndarray | None) -> None:
        count = self.rows if rows is None else len(rows)
        ids = np.arange(self.next_traj_id, self.next_traj_id + count, dtype=np.int64)
        self.next_traj_id += count
        if rows is None:
            self.traj_ids[:] = ids
        else:
            self.traj_ids[rows] = ids

    def _env_view(self, arrays: dict[NestedKey, np.ndarray]) -> dict[NestedKey, np.ndarray]:
        return arrays if not self._policy_only else {k: arrays[k] for k in self._env_keys}

    def reset_all(self) -> None:
        """Reset every row; the next frames start new trajectories."""
        self.env.reset_rows(None, self._env_view(self._carry))
        for key in self._policy_only:
            self._carry[key][...] = 0
        if self._ids_used:
            self._new_ids(None)
            self._ids_used = False
        self.step_count[:] = 0
        self.needs_reset = False

    def current_observation(self) -> dict[NestedKey, torch.Tensor]:
        if self.needs_reset:
            self.reset_all()
        for key, array in self._carry.items():
            self._policy_in.arrays[key][...] = array
        return self._policy_in.tensors

    def policy_inputs(self) -> dict[NestedKey, ArraySpec]:
        """What the policy is called with, per env row: the env's observations and the carried keys."""
        return {k: ArraySpec(tuple(a.shape[1:]), a.dtype) for k, a in self._policy_in.arrays.items()}

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
            # (drawing nothing from torch's global random stream: building a collector leaves it
            # as torchrl's does, so a seeded run samples the same actions)
            with torch.no_grad(), torch.random.fork_rng(devices=[]):
                out = self.runner(obs)
            nb = len(env.batch_size)
            for key, value in out.items():
                fields[key] = ArraySpec(tuple(value.shape[nb:]), numpy_dtype(value.dtype))
            self._check_action(fields["action"])
            self._add_carry(out, fields)
        for key in DONE_KEYS:
            fields[key] = ArraySpec((1,), _BOOL)
        for key, spec in env.obs_layout.items():
            fields[_next(key)] = spec
        for key in self._policy_only:
            fields[_next(key)] = fields[key]
        fields[("next", "reward")] = ArraySpec((1,), np.dtype(np.float32))
        for key in DONE_KEYS:
            fields[("next", key)] = ArraySpec((1,), _BOOL)
        if self.max_frames_per_traj is not None:
            fields["step_count"] = ArraySpec((1,), np.dtype(np.int64))
            fields[("next", "step_count")] = ArraySpec((1,), np.dtype(np.int64))
        fields[TRAJ_IDS] = ArraySpec((), np.dtype(np.int64))
        if self.track_version:  # ours, and torchrl 0.14's (its PolicyVersion transform's root and "next" entries)
            for key in (POLICY_VERSION, "policy_version", ("next", "policy_version")):
                fields[key] = ArraySpec((), np.dtype(np.int64))
        fields.update(extra or {})
        self.layout = BatchLayout(fields, env.batch_size, self.time)
        return self.layout

    def _add_carry(self, out: dict[NestedKey, torch.Tensor], fields: dict[NestedKey, ArraySpec]) -> None:
        """Make every ``("next", key)`` the policy wrote the root ``key`` of the next step."""
        for out_key in list(out):
            if isinstance(out_key, str) or out_key[0] != "next" or len(out_key) < 2:
                continue
            key: NestedKey = out_key[1] if len(out_key) == 2 else tuple(out_key[1:])
            if key in DONE_KEYS or key == "reward":
                raise TypeError(f"the policy wrote {out_key!r}: the env's outcome keys under 'next' are the env's")
            spec = fields[out_key]
            env_spec = self.env.obs_layout.get(key)
            if env_spec is not None and env_spec != spec:
                raise TypeError(
                    f"the policy writes {out_key!r} with shape {spec.shape} and dtype {spec.dtype} per env row, "
                    f"but the env's {key!r} has shape {env_spec.shape} and dtype {env_spec.dtype}; "
                    "they must match for the value to be carried into the next step"
                )
            if key in self._direct:  # a carried key is overwritten after the env's step: stage it
                self._direct.remove(key)
                self._obs[key] = np.zeros((self.time + 1, self.rows, *spec.shape), spec.dtype)
                self._obs[key][0] = self._carry[key]
                self._carry[key] = self._obs[key][0]
            if env_spec is None:
                if key in fields and fields[key] != spec:
                    raise TypeError(f"the policy writes both {key!r} and {out_key!r} with different shapes or dtypes")
                self._policy_only.append(key)
                self._obs[key] = np.zeros((self.time + 1, self.rows, *spec.shape), spec.dtype)
                self._carry[key] = self._obs[key][0]
                array = self._policy_in.arrays[key] = np.zeros((self.rows, *spec.shape), spec.dtype)
                self._policy_in.tensors[key] = torch.from_numpy(array).reshape(*self.env.batch_size, *spec.shape)
                fields[key] = spec
            del fields[out_key]  # the observation staging holds it from here on
            self._carried.append((key, out_key))

    def _check_action(self, got: ArraySpec) -> None:
        want = self.env.action_layout
        if got.shape != want.shape:
            if want.shape == () and len(got.shape) == 1:
                hint = ("the env takes an action index: turn logits or a one-hot vector into the index "
                        "(argmax or sampling), or, for a gymnasium id, make the env with "
                        "GymEnv(..., categorical_action_encoding=False) to take one-hot actions")
            elif len(want.shape) == 1 and got.shape == ():
                hint = (f"the env takes one-hot actions of {want.shape[0]} entries: one-hot encode the index "
                        f"(torch.nn.functional.one_hot(index, {want.shape[0]})), or, for a gymnasium id, make the env "
                        "with GymEnv(..., categorical_action_encoding=True) to take indices")
            else:
                hint = "make the policy's action match the env's action space"
            raise TypeError(
                f"the policy's 'action' has shape {got.shape} per env row but the env expects {want.shape} "
                f"(dtype {want.dtype}); {hint}"
            )
        if np.issubdtype(want.dtype, np.integer) and not (
            np.issubdtype(got.dtype, np.integer) or got.dtype == _BOOL
        ):
            raise TypeError(f"the policy's 'action' is {got.dtype} but the env expects integer actions ({want.dtype})")

    # -- the loop ----------------------------------------------------------------------------
    def _output(self, key: NestedKey, like: np.ndarray) -> np.ndarray:
        """The staging array of the policy output ``key`` (shaped after the batch field ``like``)."""
        array = self._outputs.get(key)
        if array is None or array.dtype != like.dtype or array.shape[2:] != like.shape[2:]:
            array = self._outputs[key] = np.zeros((self.time, self.rows, *like.shape[2:]), like.dtype)
        return array

    def fill(self, buf: BatchBuffer, *, random: bool = False, version: int = 0, stop: np.ndarray | None = None) -> int:
        """Collect ``time`` steps into ``buf`` (in place) and return how many were filled.

        ``stop`` (preemption): a shared flag checked before each step; once it is set the
        remaining steps are marked invalid (traj id -1, ``("collector", "mask")`` False).
        """
        self.env.arm_checks()
        if self.needs_reset:
            self.reset_all()
            self._obs_version = version
        env, runner, n_time = self.env, self.runner, self.time
        random = random or runner.is_random
        versioned = not random and runner.reports_version
        versions = self._versions
        obs_items = list(self._obs.items())
        policy_in, policy_tensors = self._policy_in.arrays, self._policy_in.tensors
        carried_out = {out_key for _, out_key in self._carried}
        if random:
            outputs, actions = [], self._random_actions
        else:
            outputs = [(key, self._output(key, buf.arrays[key])) for key in runner.out_keys if key not in carried_out]
            actions = self._output("action", buf.arrays["action"])
        # (staging of the carried root key, the policy's output key); without a policy, a key
        # only the policy writes keeps its value (the env keeps its own).
        carried = [(self._obs[key], out_key) for key, out_key in self._carried]
        kept = [self._obs[key] for key in self._policy_only] if random else []
        env_keys, policy_only = self._env_keys, self._policy_only
        action_dtype = env.action_layout.dtype
        step_rows, sample, reset_rows = env.step_rows, env.sample_actions, env.reset_rows
        reward, terminated, truncated = self._reward, self._terminated, self._truncated
        step_count, max_steps, counts = self.step_count, self.max_frames_per_traj, self._step_counts
        last = n_time - 1 if self.set_truncated else -1
        step_seconds, clock = self.step_seconds, perf_counter
        finite_check = self.check_finite
        go_on = bytes(self.rows)  # a flag array's tobytes() when no row is set: 10x cheaper than any()
        start_ids, first_new = self.traj_ids.copy(), self.next_traj_id
        resets: list[tuple[int, np.ndarray, dict]] = []  # (step, rows that ended, their final observations)
        self._ids_used = True
        # Direct keys: the batch's (n, T, ...) observation and next observation, and the carry.
        direct = [(key, buf.arrays[key], buf.arrays[_next(key)], self._carry[key]) for key in self._direct]
        for _, obs_b, _, carry in direct:
            obs_b[:, 0] = carry
        obs_keys = [key for key, _ in obs_items] + [key for key, *_ in direct]
        # Step t's slices of the staging arrays, handed out by iteration (cheaper than indexing);
        # for a direct key, the batch's ("next", key)[:, t], then where step t + 1's observation goes.
        lanes = zip(actions, reward, terminated, truncated, *(array[1:] for _, array in obs_items),
                    *(next_b.swapaxes(0, 1) for _, _, next_b, _ in direct),
                    *((*obs_b.swapaxes(0, 1)[1:], carry) for _, obs_b, _, carry in direct))
        n_obs = len(obs_keys)
        t = 0
        try:
            for action, rew, term, trunc, *next_obs in lanes:
                if stop is not None and stop[0]:
                    break
                # 1. act
                if random:
                    sample(action)
                else:
                    for key, array in obs_items:
                        policy_in[key][...] = array[t]
                    for key, obs_b, _, _ in direct:
                        policy_in[key][...] = obs_b[:, t]
                    out = runner(policy_tensors)
                    if versioned:
                        versions[t] = runner.version
                    for key, array in outputs:
                        array[t] = out[key].detach().cpu().numpy().reshape(array.shape[1:])
                    if action.dtype != action_dtype:
                        action = action.astype(action_dtype)
                # 2. step: the outcome lands in the staging arrays at t (observations at t + 1)
                # and, for direct keys, in the batch's ("next", key)[:, t]
                nxt = dict(zip(obs_keys, next_obs))
                began = clock()
                try:
                    step_rows(action, nxt if not policy_only else {k: nxt[k] for k in env_keys}, rew, term, trunc)
                except ValueError as err:
                    raise self._malformed(err, t) from err
                step_seconds[t] = clock() - began
                if finite_check and (t == 0 or finite_check == "every"):
                    self._check_finite(t, rew, nxt)
                if direct:
                    now = next_obs[n_obs:]  # where step t + 1's observation of each direct key goes
                    for i, value in enumerate(now):
                        np.copyto(value, next_obs[len(obs_items) + i])
                if carried and not random:
                    for array, out_key in carried:
                        array[t + 1] = out[out_key].detach().cpu().numpy().reshape(array.shape[1:])
                for array in kept:
                    array[t + 1] = array[t]
                if max_steps is not None:
                    counts[0, t] = step_count
                    step_count += 1
                    counts[1, t] = step_count
                    trunc |= step_count >= max_steps
                if t == last:
                    trunc.fill(True)
                t += 1
                # 3. rows that ended are reset: their next observation becomes the reset one
                if term.tobytes() != go_on or trunc.tobytes() != go_on:
                    rows = np.flatnonzero(term | trunc)
                    if direct:  # their final observations stay in ("next", key): reset the copy
                        staged = {key: nxt[key] for key, _ in obs_items}
                        resets.append((t - 1, rows, {key: array[rows] for key, array in staged.items()}))
                        nxt = {**staged, **{key: now[i] for i, (key, *_) in enumerate(direct)}}
                    else:
                        resets.append((t - 1, rows, {key: array[rows] for key, array in nxt.items()}))
                    if policy_only:
                        reset_rows(rows, {k: nxt[k] for k in env_keys})
                        for key in policy_only:
                            nxt[key][rows] = 0
                    else:
                        reset_rows(rows, nxt)
                    step_count[rows] = 0
                    self._new_ids(rows)
            if versioned:
                self.version_range = (int(versions[:t].min()), float(versions[:t].mean())) if t else (version, version)
                self.last_version = int(versions[t - 1]) if t else version
            else:
                self.version_range, self.last_version = (version, float(version)), version
            self._write(buf, t, outputs if not random else None, resets, start_ids, first_new,
                        versions[:t] if versioned else version)
        finally:
            if t:  # the observations at t are the current ones (also after an error)
                for _, array in obs_items:
                    array[0] = array[t]
                if t < n_time:  # (after the last step the carry got them already)
                    for _, obs_b, _, carry in direct:
                        carry[...] = obs_b[:, t]
        return t

    def _malformed(self, error: ValueError, t: int) -> ValueError:
        """A clearer error for numpy's "could not broadcast" (an env whose observation changed
        shape after the first step of the batch, which is checked): which env, which step, and
        the shapes each env row must have. Any other ``ValueError`` is returned as it is."""
        text = str(error)
        if "broadcast" not in text and "reshape" not in text:
            return error
        expected = {key: spec.shape for key, spec in self.env.obs_layout.items()}
        return ValueError(f"{_where()}{self.env!r} returned an observation of the wrong shape at step {t} of the "
                          f"batch ({text}); expected per env row: {expected}")

    def _check_finite(self, t: int, reward: np.ndarray, obs: dict[NestedKey, np.ndarray]) -> None:
        """Raise ``ValueError`` if step ``t``'s reward or a float observation holds a NaN or an
        infinity (``check_finite``)."""
        for key, array in (("reward", reward), *obs.items()):
            if array.dtype.kind != "f" or np.isfinite(array).all():
                continue
            per_row = np.isfinite(array.reshape(len(array), -1)).all(axis=1)
            row = int(np.flatnonzero(~per_row)[0])
            value = array[row]
            raise ValueError(
                f"{_where()}{self.env!r} row {row} returned a non-finite {key!r} at step {t} of the batch "
                f"({value if value.size <= 8 else 'of shape ' + str(value.shape)}; check_finite="
                f"{self.check_finite!r}): fix the env, or clip or mask the value in a wrapper")

    def _write(self, buf: BatchBuffer, steps: int, outputs: list | None, resets: list, start_ids: np.ndarray,
               first_new: int, version: int | np.ndarray) -> None:
        """Write the first ``steps`` steps of the staging arrays into ``buf`` (``(n, T, ...)``),
        and mark the rest invalid. ``outputs`` is None for a random batch; ``version``: the
        batch's policy version, or each step's."""
        arrays = buf.arrays
        n_time = self.time
        if steps:
            span = slice(0, steps)
            for key, array in self._obs.items():
                np.copyto(arrays[key][:, span], array[:steps].swapaxes(0, 1))
                np.copyto(arrays[_next(key)][:, span], array[1 : steps + 1].swapaxes(0, 1))
            for t, rows, finals in resets:
                for key, value in finals.items():
                    arrays[_next(key)][rows, t] = value
            if outputs is None:
                np.copyto(arrays["action"][:, span], self._random_actions[:steps].swapaxes(0, 1), casting="unsafe")
                if not self.runner.is_random:  # a random batch of a real policy: its other outputs are zero
                    for key in self.runner.out_keys:
                        if key != "action" and key in arrays:
                            arrays[key][:, span] = 0
            else:
                for key, array in outputs:
                    np.copyto(arrays[key][:, span], array[:steps].swapaxes(0, 1))
            for key, array in (("reward", self._reward), ("terminated", self._terminated),
                               ("truncated", self._truncated)):
                np.copyto(arrays[("next", key)][:, span, 0], array[:steps].T)
            done = arrays[("next", "done")][:, span, 0]
            np.logical_or(self._terminated[:steps].T, self._truncated[:steps].T, out=done)
            for key in DONE_KEYS:  # every frame's root state is one that goes on (ended rows were reset)
                arrays[key][:, span] = False
            if self._step_counts is not None:
                np.copyto(arrays["step_count"][:, span, 0], self._step_counts[0, :steps].T)
                np.copyto(arrays[("next", "step_count")][:, span, 0], self._step_counts[1, :steps].T)
            ids = frame_traj_ids(start_ids, [(t, rows) for t, rows, _ in resets], steps, first_new)
            np.copyto(arrays[TRAJ_IDS][:, span], ids.T)
            if POLICY_VERSION in arrays:
                arrays[POLICY_VERSION][:, span] = version
                arrays[("next", "policy_version")][:, span] = version
                # torchrl's root entry: the version when the step's observation came (the step before's)
                acted = np.broadcast_to(np.asarray(version, np.int64), (steps,))
                arrays["policy_version"][:, 0] = self._obs_version
                arrays["policy_version"][:, 1:steps] = acted[:-1]
                self._obs_version = int(acted[-1])
        mask = arrays.get(MASK)
        if mask is not None:
            mask[:, :steps] = True
            mask[:, steps:] = False
        if steps < n_time:
            arrays[TRAJ_IDS][:, steps:] = -1

    # -- state -------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {
            "obs": {k: v.copy() for k, v in self._carry.items()},
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
        if set(state["obs"]) != set(self._carry):
            raise ValueError(f"rollout state has observation keys {sorted(map(str, state['obs']))}, "
                             f"this env has {sorted(map(str, self._carry))}")
        for key, value in state["obs"].items():
            if np.shape(value) != self._carry[key].shape:
                raise ValueError(f"rollout state: observation {key!r} has shape {np.shape(value)}, "
                                 f"expected {self._carry[key].shape}")
        if np.shape(state["traj_ids"]) != self.traj_ids.shape:
            raise ValueError(f"rollout state: traj_ids has shape {np.shape(state['traj_ids'])}, "
                             f"expected {self.traj_ids.shape}")
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
            self._carry[key][...] = value
        self.traj_ids[:] = state["traj_ids"]
        self.next_traj_id = int(state["next_traj_id"])
        self.step_count[:] = state["step_count"]
        self.needs_reset = bool(state["needs_reset"])
        self._ids_used = bool(state["ids_used"])


def build_env(policy: Any, make_one: Callable[[], EnvBase]) -> EnvBase:
    """The env a collector steps: ``make_one()``, or, for a policy that builds its own rollout
    (``policy.make_rollout``), what that policy makes of ``make_one`` (``policy.make_env``:
    central inference builds one env per split of a worker's envs)."""
    own = getattr(policy, "make_env", None)
    return make_one() if own is None else own(make_one)


def _where() -> str:
    index = current_worker_index()
    return "" if index is None else f"worker {index}: "


def make_rollout(policy: Any, env: EnvBase, runner: Callable[[], Any], time: int, traj_id_start: int,
                 options: dict) -> Any:
    """The rollout of ``env``: ``policy.make_rollout(env, time, traj_id_start, options)`` for a
    policy that builds its own (central inference's ``RemotePolicy``), else a ``Rollout`` with
    the runner ``runner()`` builds."""
    own = getattr(policy, "make_rollout", None)
    if own is not None:
        return own(env, time, traj_id_start, options)
    if getattr(env, "grouped", False):  # action, reward or done under groups: envs/grouped.py
        from rlcollect.rollout_grouped import GroupedRollout

        return GroupedRollout(env, runner(), time, traj_id_start=traj_id_start, **options)
    return Rollout(env, runner(), time, traj_id_start=traj_id_start, **options)
