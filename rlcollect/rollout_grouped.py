"""The loop of grouped envs (``envs/grouped.py``: multi-agent, nested and multi-key envs).

torchrl's collectors step such an env with ``step_and_maybe_reset`` on one TensorDict, the
*carrier*: the policy writes its outputs into it, the env writes ``"next"`` and returns the root
of the next step, resetting only the rows, groups or agents whose ``_reset`` entries it raised.
This loop does the same, so a batch holds what torchrl's does, key for key, and copies each
step's leaves into the preallocated batch (``(n, T, *feature)``, as ``rollout.py``'s). It is
not the single-agent hot loop: per step it costs a TensorDict step and one copy per leaf.

A trajectory ends for a whole env row when any ``done`` entry of the row is set (any group,
any agent), as torchrl's trajectory ids count it (``envs/grouped.py``'s ``end_of_trajectory``).
"""

from __future__ import annotations

import contextlib
from time import perf_counter
from typing import Any

import numpy as np
import torch

from rlcollect.data import MASK, POLICY_VERSION, TRAJ_IDS, BatchBuffer, BatchLayout
from rlcollect.envs.base import ArraySpec, NestedKey, numpy_dtype
from rlcollect.envs.grouped import GroupedEnv, assign, end_of_trajectory, logical, resolve, walk


def _parts(key: NestedKey) -> tuple[str, ...]:
    return (key,) if isinstance(key, str) else tuple(key)


def _torchrl_calls_it(module: Any, fields: dict) -> bool:
    """Whether torchrl's collector calls ``module`` once when it is built, drawing from torch's
    random stream (to learn its outputs): always, unless the policy has a full ``spec`` that
    declares every out_key and a key the env's own entries lack."""
    spec = getattr(module, "spec", None)
    if spec is None or not hasattr(spec, "keys") or any(v is None for v in spec.values(True, True)):
        return True
    spec_keys = set(spec.keys(True, True))
    declared = spec_keys if any(k not in fields for k in spec_keys) else set()
    return any(k not in declared for k in getattr(module, "out_keys", ()))


class GroupedRollout:
    """Fills :class:`BatchBuffer` s from a :class:`GroupedEnv` (the arguments are
    ``rollout.Rollout``'s). ``set_truncated`` marks every truncated entry (and its ``done``) of
    the batch's last step and resets every row before the next batch, as ``Rollout`` does;
    ``check_finite`` checks every float leaf of ``"next"``.

    """

    def __init__(self, env: GroupedEnv, runner: Any, time: int, *, max_frames_per_traj: int | None = None,
                 set_truncated: bool = False, track_version: bool = False, traj_id_start: int = 0,
                 check_finite: str | None = None):
        if max_frames_per_traj:
            env.limit_steps(max_frames_per_traj)
        self.env, self.runner, self.time = env, runner, time
        self.set_truncated = set_truncated
        self.track_version = track_version
        self.check_finite = check_finite
        self.rows = env.num_rows
        self.traj_ids = torch.zeros(env.batch_size, dtype=torch.int64)
        self.next_traj_id = traj_id_start
        self._ids_used = True
        self.needs_reset = True
        self.step_seconds = [0.0] * time
        self._versions = np.zeros(time, np.int64)  # each step's policy version (central inference's)
        self.version_range: tuple[int, float] = (0, 0.0)
        self.last_version = 0
        self._obs_version = 0
        self._root = None
        self.layout: BatchLayout | None = None
        self._out_keys: list[NestedKey] = []
        self._in_keys: list[NestedKey] = []  # what a remote runner is sent (every leaf of the root)
        self._renamed: dict[NestedKey, NestedKey] = {}  # a plain module's "action" -> the env's action key
        self._truncated = [("next", *_parts(k)) for k in env.done_keys if _parts(k)[-1] == "truncated"]

    # -- carry -------------------------------------------------------------------------------
    def _new_ids(self, mask: torch.Tensor | None) -> None:
        count = self.rows if mask is None else int(mask.sum())
        ids = torch.arange(self.next_traj_id, self.next_traj_id + count, dtype=torch.int64)
        self.next_traj_id += count
        if mask is None:
            self.traj_ids = ids.reshape(self.env.batch_size)
        else:  # row-major order, as torchrl's masked_scatter hands them out
            self.traj_ids = self.traj_ids.masked_scatter(mask.cpu(), ids)

    def reset_all(self) -> None:
        """Reset every row; the next frames start new trajectories."""
        self._root = self.env.reset()
        if self._ids_used:
            self._new_ids(None)
            self._ids_used = False
        self.needs_reset = False

    def _act(self, carrier: Any, discover: bool = False) -> dict[NestedKey, torch.Tensor]:
        """Call the policy as torchrl's collectors do: a TensorDict policy on the whole root
        TensorDict; a plain module with its matched observations, its output being the env's
        one action. With central inference (a remote runner) the policy acts in the main
        process: it is sent every leaf of the root and the sub-TensorDicts' batch dims."""
        runner = self.runner
        if getattr(runner, "remote", False):
            return self._act_remote(carrier, discover)
        stack_dims = self.env.stack_dims
        if not hasattr(runner, "batch_size"):  # a plain module or callable (policy.py's ModuleRunner)
            out = runner({k: resolve(carrier, k, stack_dims) for k in self.env.obs_layout})
            if len(self.env.action_keys) != 1:
                raise TypeError(f"env {self.env!r} has the action keys {self.env.action_keys}: its policy must be a "
                                "TensorDictModule writing them (a plain module returns one 'action')")
            return {self.env.action_keys[0] if k == "action" else k: v for k, v in out.items()}
        policy_in = carrier if runner.device is None else carrier.to(runner.device)
        nb = len(self.env.batch_size)
        given = set(walk(carrier, nb)[0]) if discover else set()
        result = runner.fn(policy_in)
        result = policy_in if result is None else result
        if discover:  # (a lazy group's agents one by one: envs/grouped.py)
            self._out_keys = [k for k in walk(result, nb)[0]
                              if k not in given and not any(p.startswith("_") for p in _parts(k))]
        return {k: resolve(result, k, stack_dims) for k in self._out_keys}

    def _act_remote(self, carrier: Any, discover: bool) -> dict[NestedKey, torch.Tensor]:
        runner, env = self.runner, self.env
        if discover:
            # (a lazily stacked group's agents go one by one, ``(*key, "#i", ...)``: the shared block
            # holds one dense tensor per entry; the main process stacks them lazily again)
            leaves = walk(carrier, len(env.batch_size))[0] if env.lazy else carrier.keys(include_nested=True,
                                                                                          leaves_only=True)
            self._in_keys = [k for k in leaves if not any(p.startswith("_") for p in _parts(k))]
            runner.group_dims = sorted(env.group_dims.items(), key=lambda kv: len(_parts(kv[0])))
            runner.lazy = [(_parts(k), agents, stack) for k, (agents, stack) in env.lazy.items()] or None
        if env.lazy:
            out = runner({k: resolve(carrier, k, env.stack_dims) for k in self._in_keys})
        else:
            out = runner({k: carrier.get(k) for k in self._in_keys})
        if discover:
            # (a plain module in the main process returns one "action": the env's one action key)
            single = env.action_keys[0] if len(env.action_keys) == 1 else None
            self._renamed = {k: single if k == "action" and single is not None else k for k in out}
            self._out_keys = list(self._renamed.values())
        return {new: out[old] for old, new in self._renamed.items()}

    def policy_inputs(self) -> dict[NestedKey, ArraySpec]:
        """What a remote runner sends the policy, per env row: every leaf of the step's root."""
        nb, root, stack_dims = len(self.env.batch_size), self._root, self.env.stack_dims
        leaves = {k: resolve(root, k, stack_dims) for k in self._in_keys}
        return {k: ArraySpec(tuple(v.shape[nb:]), numpy_dtype(v.dtype)) for k, v in leaves.items()}

    # -- layout ------------------------------------------------------------------------------
    def discover_layout(self, extra: dict[NestedKey, ArraySpec] | None = None) -> BatchLayout:
        """The batch layout: every leaf of the env's ``fake_tensordict()``, the policy's outputs
        (a dry run on the first root, drawing nothing from torch's global random stream) and
        the collector's entries."""
        env = self.env
        fields = dict(env.fields)
        if self.needs_reset:  # (torchrl's collectors reset the env when they are built)
            self.reset_all()
        if self.runner.is_random:
            # torchrl's collector calls its RandomPolicy once when it is built: so do we, so that
            # a run seeded before the collector is built draws the same actions
            env.rand_action(self._root.clone())
        else:
            with torch.no_grad(), contextlib.ExitStack() as scope:
                if not _torchrl_calls_it(self.runner.module, fields):
                    scope.enter_context(torch.random.fork_rng(devices=[]))
                out = self._act(self._root.copy(), discover=True)
            nb = len(env.batch_size)
            for key, value in out.items():
                spec = ArraySpec(tuple(value.shape[nb:]), numpy_dtype(value.dtype))
                if key in fields and fields[key].shape != spec.shape:
                    raise TypeError(f"env {env!r}: the policy's {key!r} has shape {spec.shape} per env row, the env "
                                    f"expects {fields[key].shape}")
                fields.setdefault(key, spec)
            self._check_actions(list(out))
        fields[TRAJ_IDS] = ArraySpec((), np.dtype(np.int64))
        if self.track_version:
            for key in (POLICY_VERSION, "policy_version", ("next", "policy_version")):
                fields[key] = ArraySpec((), np.dtype(np.int64))
        fields.update(extra or {})
        groups = tuple(sorted(env.group_dims.items(), key=lambda kv: len(_parts(kv[0]))))
        lazy = tuple((_parts(key), agents, stack) for key, (agents, stack) in env.lazy.items())
        self.layout = BatchLayout(fields, env.batch_size, self.time, groups, lazy)
        return self.layout

    def _check_actions(self, written: list[NestedKey]) -> None:
        env = self.env
        actions = set(env.action_keys)
        names = {_parts(k)[-1] for k in actions}
        groups = {_parts(logical(k))[:-1] for k in env.fields}
        written = list(dict.fromkeys(logical(k) for k in written))  # (a lazy group's agents as one key)
        for key in written:
            parts = _parts(key)
            if key not in actions and parts[-1] in names and parts[:-1] not in groups:
                raise ValueError(
                    f"env {env!r} has no group {parts[:-1]!r}, but the policy wrote the action {key!r}; "
                    f"the env's action keys are {env.action_keys}")
        missing = [k for k in env.action_keys if k not in written]
        if missing:
            raise ValueError(f"env {env!r}: the policy did not write the action keys {missing} (it wrote {written}); "
                             f"the env's action keys are {env.action_keys}")

    # -- the loop ----------------------------------------------------------------------------
    def fill(self, buf: BatchBuffer, *, random: bool = False, version: int = 0, stop: np.ndarray | None = None) -> int:
        """Collect ``time`` steps into ``buf`` (in place) and return how many were filled."""
        if self.needs_reset:
            self.reset_all()
            self._obs_version = version
        env, runner = self.env, self.runner
        random = random or runner.is_random
        versioned = not random and getattr(runner, "reports_version", False)
        versions = self._versions
        nb, n = len(env.batch_size), self.rows
        tensors = buf.tensors
        keys = [k for k in self.layout.fields if k not in (TRAJ_IDS, MASK) and _parts(k)[0] != "collector"
                and k not in ("policy_version", ("next", "policy_version"))]
        # (what each step writes: the target, the key, whether it names an agent of a lazy group
        # (resolve() then; a plain key is one td.get, a third of resolve()'s cost), the env's shape)
        writes = [(tensors[k], k, logical(k) != k, (*env.batch_size, *tensors[k].shape[2:]), (n, *tensors[k].shape[2:]))
                  for k in keys]
        self._ids_used = True
        step_seconds, clock = self.step_seconds, perf_counter
        t = 0
        for t in range(self.time + 1):
            if t == self.time or (stop is not None and stop[0]):
                break
            carrier = self._root
            if random:
                env.rand_action(carrier)
            else:
                out = self._act(carrier)
                if versioned:
                    versions[t] = runner.version
                if out:
                    stack_dims = env.stack_dims
                    for key in self._out_keys:
                        assign(carrier, key, out[key], stack_dims)
            began = clock()
            td, root = env.step_and_maybe_reset(carrier)
            step_seconds[t] = clock() - began
            if self.check_finite and (t == 0 or self.check_finite == "every"):
                self._check_finite(td.get("next"), t)
            for target, key, agent, shape, rows in writes:
                value = resolve(td, key, env.stack_dims) if agent else td.get(key, None)
                if value is None or value.shape != shape:
                    self._refuse(value, target, key, t)
                target[:, t].copy_(value.reshape(rows))
            tensors[TRAJ_IDS][:, t] = self.traj_ids.reshape(n)
            ended = end_of_trajectory(td, env.done_fields, nb, env.stack_dims)
            self._root = root
            if ended.any():
                self._new_ids(ended)
        else:
            t = self.time
        self._finish(buf, t, version, versions[:t] if versioned and t else None)
        return t

    def _refuse(self, value: Any, target: torch.Tensor, key: NestedKey, t: int) -> None:
        got = "no entry" if value is None else f"shape {tuple(value.shape)}"
        raise ValueError(
            f"env {self.env!r} returned {got} for {key!r} at step {t} of the batch; the batch holds "
            f"{tuple(target.shape[2:])} per env row (what the env's specs / first step gave): an agent group "
            "whose shapes change mid-run cannot be collected, pad it to fixed shapes")

    def _check_finite(self, nxt: Any, t: int) -> None:
        for key, value in walk(nxt, len(self.env.batch_size))[0].items():
            if value.is_floating_point() and not bool(torch.isfinite(value).all()):
                raise ValueError(f"env {self.env!r} returned a non-finite {('next', *_parts(key))!r} at step {t} of "
                                 f"the batch (check_finite={self.check_finite!r})")

    def _finish(self, buf: BatchBuffer, steps: int, version: int, per_step: np.ndarray | None = None) -> None:
        """Mark truncations, write the policy versions (``version``, or ``per_step``'s with
        central inference), the mask, and the ids of the steps not collected."""
        tensors = buf.tensors
        if self.set_truncated and steps:
            for key in tensors:  # (a lazy group's agents each have theirs)
                flag = _parts(logical(key))
                if flag in self._truncated or (flag[-1] == "done" and (*flag[:-1], "truncated") in self._truncated):
                    tensors[key][:, steps - 1] = True
            self.needs_reset = True
        acted = torch.full((steps,), version, dtype=torch.int64) if per_step is None else torch.from_numpy(per_step)
        if POLICY_VERSION in tensors and steps:
            tensors[POLICY_VERSION][:, :steps] = acted
            tensors[("next", "policy_version")][:, :steps] = acted
            # torchrl's root entry: the version when the step's observation came (the step before's)
            tensors["policy_version"][:, 0] = self._obs_version
            tensors["policy_version"][:, 1:steps] = acted[:-1]
            self._obs_version = int(acted[-1])
        if per_step is None:
            self.version_range, self.last_version = (version, float(version)), version
        else:
            self.version_range, self.last_version = (int(acted.min()), float(acted.double().mean())), int(acted[-1])
        mask = tensors.get(MASK)
        if mask is not None:
            mask[:, :steps] = True
            mask[:, steps:] = False
        if steps < self.time:
            tensors[TRAJ_IDS][:, steps:] = -1

    # -- state -------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"root": None if self._root is None else self._root.clone(), "traj_ids": self.traj_ids.clone(),
                "next_traj_id": self.next_traj_id, "needs_reset": self.needs_reset, "ids_used": self._ids_used}

    def check_state_dict(self, state: dict) -> None:
        missing = {"root", "traj_ids", "next_traj_id", "needs_reset", "ids_used"} - set(state)
        if missing:
            raise KeyError(f"grouped rollout state is missing {sorted(missing)}")
        if tuple(state["traj_ids"].shape) != tuple(self.env.batch_size):
            raise ValueError(f"grouped rollout state: traj_ids has shape {tuple(state['traj_ids'].shape)}, "
                             f"expected {tuple(self.env.batch_size)}")

    def load_state_dict(self, state: dict) -> None:
        self.check_state_dict(state)
        self._root = None if state["root"] is None else state["root"].clone()
        self.traj_ids = state["traj_ids"].clone()
        self.next_traj_id = int(state["next_traj_id"])
        self.needs_reset = bool(state["needs_reset"]) or self._root is None
        self._ids_used = bool(state["ids_used"])

