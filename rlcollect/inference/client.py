"""The env worker's side of central inference: a runner that asks the main process.

A worker's collector is built with a :class:`RemotePolicy` instead of a policy. Its rollout
calls the policy through a :class:`RemoteRunner` (one per split of the worker's envs), which has
the call signature of every runner (rlcollect/policy.py): observations in, the policy's
outputs out. Before the shared block exists the first call sends the observations pickled
(the rollout's dry run that learns what the policy writes); from then on each call copies the
observations into the runner's rows of the block, sends one byte and waits for one byte back.

Example (the main process's loop is played by hand here):
    >>> import multiprocessing, pickle, threading, torch
    >>> here, there = multiprocessing.Pipe()
    >>> runner = RemoteRunner(there, torch.Size([2]))
    >>> def answer():
    ...     message = here.recv_bytes()
    ...     obs = pickle.loads(message[1:])["inputs"]["observation"]
    ...     here.send_bytes(pickle.dumps(("ok", {"action": (obs[:, 0] > 0).astype("int64")})))
    >>> threading.Thread(target=answer).start()
    >>> runner({"observation": torch.tensor([[1.0], [-1.0]])})["action"].tolist()
    [1, 0]
"""

from __future__ import annotations

import os
import pickle
from typing import Any

import numpy as np
import torch

from rlcollect.envs.base import ArraySpec, NestedKey
from rlcollect.errors import InferenceUnavailable, unpack_exception
from rlcollect.inference.block import ACTIONS, DISCOVER, REQUEST, SlotSpec, block_views

_GONE = ("the main process's inference loop is gone (the collector is shutting down, or its policy raised: the "
         "collector raises that error)")


def yield_on_wake() -> bool:
    """Make this process (and the threads it starts from now on) ``SCHED_BATCH``: when the
    inference loop wakes it with its actions, it does not preempt the loop, which goes on to
    wake the other workers first. Without it, on a machine with few cores, the first worker
    woken takes the loop's core and the next one waits (~1 ms per forward measured on 2 vCPUs).
    Returns whether the policy was set (Linux only; any user may lower its own priority).

    Example (in a child process: the policy stays with the process that sets it):
        >>> import multiprocessing
        >>> child = multiprocessing.get_context("fork").Process(target=yield_on_wake)
        >>> child.start(); child.join(); child.exitcode
        0
    """
    if not hasattr(os, "SCHED_BATCH"):
        return False
    try:
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
    except OSError:
        return False
    return True


class RemoteRunner:
    """Runs the policy in the main process for one split of a worker's envs (``batch_size``
    rows), through pipe ``conn``; ``version`` is the policy version of the last answer."""

    is_random = False
    module = None
    reports_version = True  # the rollout records each step's version (the main process's may move)
    remote = True  # a grouped env's rollout sends it every leaf of the step (rollout_grouped.py)
    #: a grouped env's sub-TensorDict batch dims, ``[(key, dims)]`` (its rollout sets them before
    #: the dry run); None for an env stepped through the array interface
    group_dims: list | None = None
    #: its lazily stacked groups, ``[(key parts, agents, stack dim past the rows)]`` (agents of
    #: different shapes, whose entries arrive agent by agent: ``TensorDictRunner.lazy``)
    lazy: list | None = None

    def __init__(self, conn: Any, batch_size: torch.Size):
        self.conn = conn
        self.batch_size = torch.Size(batch_size)
        self.rows = int(np.prod(self.batch_size, dtype=np.int64))
        self.out_keys: list[NestedKey] = []
        self.out_spec: dict[NestedKey, ArraySpec] = {}
        self.version = 0
        self._ins: list[tuple[NestedKey, torch.Tensor]] | None = None
        self._outs: dict[NestedKey, torch.Tensor] = {}
        self._versions: np.ndarray | None = None
        self._slot = 0

    def spec(self, inputs: dict[NestedKey, ArraySpec], env_keys: list[NestedKey]) -> SlotSpec:
        return SlotSpec(self.rows, dict(inputs), dict(self.out_spec), list(env_keys))

    def attach(self, flat: torch.Tensor, spec: SlotSpec, total_rows: int, slot: int, offset: int,
               versions: torch.Tensor) -> None:
        """Use rows ``offset:offset + rows`` of the block ``flat`` (slot ``slot``) from now on."""
        ins, outs = block_views(flat, spec, total_rows)
        rows = slice(offset, offset + self.rows)
        self._ins = [(k, v[rows]) for k, v in ins.items()]
        shape = tuple(self.batch_size)
        self._outs = {k: v[rows].reshape(shape + tuple(v.shape[1:])) for k, v in outs.items()}
        self._versions = versions.numpy()
        self._slot = slot

    def __call__(self, obs: dict[NestedKey, torch.Tensor]) -> dict[NestedKey, torch.Tensor]:
        if self._ins is None:
            return self._discover(obs)
        for key, rows in self._ins:
            rows.copy_(obs[key].reshape(rows.shape))
        try:
            self.conn.send_bytes(REQUEST)
            reply = self.conn.recv_bytes()
        except (EOFError, OSError) as err:
            raise InferenceUnavailable(_GONE) from err
        if reply != ACTIONS:
            raise InferenceUnavailable(_GONE)
        self.version = int(self._versions[self._slot])
        return self._outs

    def _discover(self, obs: dict[NestedKey, torch.Tensor]) -> dict[NestedKey, torch.Tensor]:
        """The dry run: the observations go pickled, the outputs come back pickled."""
        inputs = {k: v.detach().cpu().numpy().reshape(self.rows, *v.shape[len(self.batch_size):])
                  for k, v in obs.items()}
        try:
            self.conn.send_bytes(DISCOVER + pickle.dumps({"inputs": inputs, "groups": self.group_dims,
                                                           "lazy": self.lazy}))
            kind, value = pickle.loads(self.conn.recv_bytes())
        except (EOFError, OSError) as err:
            raise InferenceUnavailable(_GONE) from err
        if kind != "ok":
            raise unpack_exception(value, "the policy's first call (central inference, in the main process)")
        shape = tuple(self.batch_size)
        out = {k: torch.from_numpy(v).reshape(shape + v.shape[1:]) for k, v in value.items()}
        self.out_keys = list(out)
        self.out_spec = {k: ArraySpec(tuple(v.shape[1:]), v.dtype) for k, v in value.items()}
        return out


class RemotePolicy:
    """What a worker's collector gets as its policy with central inference: one pipe per split
    of its envs (``conns``). It builds its own env and rollout (the collector asks
    ``make_env`` and ``make_rollout``, rlcollect/rollout.py): ``len(conns)`` envs, a rollout
    for each (split.py), each with a ``RemoteRunner``."""

    def __init__(self, conns: list[Any]):
        self.conns = list(conns)
        self.runners: list[RemoteRunner] = []
        self.inputs: list[dict[NestedKey, ArraySpec]] = []
        self.env_keys: list[NestedKey] = []
        self.rollout: Any = None

    def make_env(self, make_one: Any) -> Any:
        """One env per split (``make_one()`` builds one), as one env (``SplitEnvs``)."""
        from rlcollect.inference.split import SplitEnvs

        parts = [make_one()]
        if self.splits == 1:
            return parts[0]
        try:
            parts += [make_one() for _ in range(self.splits - 1)]
        except BaseException:
            for part in parts:
                part.close()
            raise
        return SplitEnvs(parts)

    def make_rollout(self, env: Any, time: int, traj_id_start: int, options: dict) -> Any:
        """A rollout per split of ``env``, each asking the main process for its actions."""
        from rlcollect.inference.split import remote_rollout

        self.rollout = remote_rollout(self, env, time, traj_id_start, options)
        return self.rollout

    @property
    def splits(self) -> int:
        return len(self.conns)

    def runner(self, split: int, batch_size: torch.Size) -> RemoteRunner:
        runner = RemoteRunner(self.conns[split], batch_size)
        self.runners.append(runner)
        return runner

    def describe(self, rollout: Any) -> None:
        """Learn each split's inputs from its rollout (after the rollout's dry run)."""
        parts = getattr(rollout, "parts", [rollout])
        self.inputs = [part.policy_inputs() for part in parts]
        self.env_keys = list(parts[0].env.obs_layout)

    def specs(self) -> list[SlotSpec]:
        """Each split's slot, reported by the worker once its rollouts know their inputs."""
        if not self.inputs:
            self.describe(self.rollout)
        return [r.spec(inputs, self.env_keys) for r, inputs in zip(self.runners, self.inputs)]

    def attach(self, flat: torch.Tensor, spec: SlotSpec, total_rows: int, slots: list[tuple[int, int]],
               versions: torch.Tensor) -> None:
        """Use the block: split ``h`` gets slot ``slots[h] = (slot index, first row)``."""
        for runner, (slot, offset) in zip(self.runners, slots):
            runner.attach(flat, spec, total_rows, slot, offset, versions)

    def close(self) -> None:
        for conn in self.conns:
            conn.close()
