"""``WorkerControl``: a multi-process collector's control of its workers, the base of its face
(collector.py, which holds the signature, the wiring of the parts, the weights and nesting):

- the calls of torchrl's face that reach the workers (``set_seed``, ``reset``, ``state_dict`` /
  ``load_state_dict``, ``getattr_policy`` / ``getattr_env`` / ``getattr_rb``, ``enable_profile``,
  ``worker_pids``, ``worker_policy_versions``, ``stats``), each one call of the collector's
  ``Members`` (rlcollect/members.py: written once for both wings, over the pool contract) or of
  its statistics;
- free running (``start``, ``pause``, ``async_shutdown``: freerun.py's part), which pauses the
  workers around each of those calls (``_control``).

It reads the parts the face wires (``_member_control``, ``_free``, ``_stats``, ``_pool``,
``_acting``, ``_restart``) and declares them below; it wires nothing and holds no part of its own.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

from tensordict import TensorDict

from rlcollect import torchrl_args
from rlcollect.base import CollectorBase
from rlcollect.members import Members, MemberStats
from rlcollect.multiprocess import protocol as P
from rlcollect.multiprocess.pool import WorkerPool
from rlcollect.multiprocess.recovery import RestartPolicy


class WorkerControl(CollectorBase):
    """The workers of a multi-process collector under its user's control (the parts are wired
    by the face, ``MultiCollectorBase`` in collector.py)."""

    _pool: WorkerPool | None = None
    _acting: Any = None
    _gather: Any = None
    _free: Any = None
    _member_control: Members | None = None
    _stats: MemberStats | None = None
    _restart: RestartPolicy | None = None
    num_workers: int
    replay_buffer: Any  # (the face's: from its config)

    # -- control: Members (rlcollect/members.py), over the pool contract both wings share ------------
    def _seed(self, seed: int, static_seed: bool) -> int:
        # Batches collected before the call and not yet delivered are discarded.
        with self._control(), self._guard():
            return self._member_control.seed(seed, static_seed)

    def reset(self, reset_idx: Any = None) -> None:
        """Reset the envs of every worker (``reset_idx=None``) or of the workers whose entry of
        ``reset_idx`` (torchrl's: one bool per worker) is True; their next frames start new
        trajectories.  Batches collected before the call and not yet delivered are discarded.

        Args:
            reset_idx (list[bool] | None): which workers to reset (default None: all).

        Example:
            >>> from rlcollect import MultiSyncCollector
            >>> c = MultiSyncCollector("CartPole-v1", num_workers=2, frames_per_batch=20)
            >>> c.reset(reset_idx=[True, False])
            >>> c.shutdown()
        """
        chosen = torchrl_args.chosen_workers(reset_idx, self.num_workers)
        with self._control(), self._guard():
            self._forget_trajectories()
            self._member_control.reset(chosen)

    def _broadcast(self, command: str, *args: Any, worker: int = 0) -> Any:
        with self._control(), self._guard():
            return self._member_control.broadcast(command, *args, members=[worker])[0]

    def getattr_policy(self, name: str) -> Any:
        """An attribute of worker 0's policy (with ``inference="central"``: of the policy the
        main process runs, the one every worker's actions come from)."""
        local = None if self._acting is None else self._acting.local_policy
        if local is not None:
            return getattr(local, name)
        return self._broadcast(P.GETATTR_POLICY, name)

    def getattr_env(self, name: str) -> Any:
        """An attribute of worker 0's env."""
        return self._broadcast(P.GETATTR_ENV, name)

    def getattr_rb(self, name: str) -> Any:
        """An attribute of the replay buffer."""
        if self.replay_buffer is None:
            raise RuntimeError("getattr_rb: this collector has no replay_buffer")
        return getattr(self.replay_buffer, name)

    def state_dict(self) -> dict[str, Any]:
        """``{"worker0": ..., ..., "frames", "iter", "traj_pool", "policy_version"}``."""
        with self._control(), self._guard():
            states = list(self._member_control.states().values())
        out: dict[str, Any] = {f"worker{i}": s for i, s in enumerate(states)}
        out["frames"] = self._frames
        out["iter"] = self._iter
        out["traj_pool"] = [s.get("rollout", {}).get("next_traj_id") for s in states]
        out["policy_version"] = self._version
        return out

    def _load(self, state: dict[str, Any]) -> None:
        missing = [k for k in (*(f"worker{i}" for i in range(self.num_workers)), "frames", "iter") if k not in state]
        if missing:
            raise KeyError(f"{type(self).__name__}.load_state_dict: missing keys {missing}")
        with self._control(), self._guard():
            self._member_control.load({i: state[f"worker{i}"] for i in range(self.num_workers)},
                                      int(state["frames"]), int(state["iter"]))
        self._version = int(state.get("policy_version", self._version))

    def enable_profile(self, path: str = "rlcollect_trace.json", *, rollouts=(0,), workers=(0,),
                       **profiler_kwargs) -> None:
        """Record torch.profiler traces of the chosen rollouts inside the chosen workers (torchrl's
        arguments too); worker ``i`` writes ``<path stem>.worker<i><ext>`` (``Collector.enable_profile``)."""
        path, rollouts, profiler_kwargs, workers = torchrl_args.profile_args(path, rollouts, profiler_kwargs, workers)
        root, ext = os.path.splitext(os.fspath(path))
        for i in workers:
            self._broadcast(P.ENABLE_PROFILE, f"{root}.worker{i}{ext or '.json'}", tuple(rollouts), profiler_kwargs,
                            worker=i)


    # -- free running (freerun.py): control calls pause the workers around themselves ---------------

    def worker_pids(self) -> list[int]:
        """The process id of each worker, in worker order (a restarted worker's replacement
        from then on).

        Example:
            >>> from rlcollect import MultiSyncCollector
            >>> c = MultiSyncCollector("CartPole-v1", num_workers=2, frames_per_batch=20)
            >>> len(c.worker_pids())
            2
            >>> c.shutdown()
        """
        self._check_open()
        return self._pool.pids()

    def worker_policy_versions(self) -> list[int]:
        """The weights version each worker acts with (after its next batch starts).

        Example:
            >>> from rlcollect import MultiSyncCollector
            >>> c = MultiSyncCollector("CartPole-v1", num_workers=2, frames_per_batch=20)
            >>> c.worker_policy_versions()
            [0, 0]
            >>> c.shutdown()
        """
        return list(self._stats.worker_versions)

    def stats(self, workers: str = "aggregate") -> dict[str, Any]:
        """JSON-serialisable statistics: frames, rates, per-worker frames, liveness, restarts,
        versions and env-step latency, the last batch's policy lag, time blocked waiting for the
        workers (docs/observability.md defines every key). ``workers="per_worker"`` or
        ``"both"``: torchrl's per-worker keys (``base.CollectorBase._torchrl_stats``).

        Example:
            >>> from rlcollect import MultiSyncCollector
            >>> with MultiSyncCollector("CartPole-v1", num_workers=2, frames_per_batch=20, total_frames=20) as c:
            ...     _ = list(c)
            ...     s = c.stats()
            >>> s["frames"], s["policy_lag_mean"], [w["env_step_p95_s"] > 0 for w in s["workers"]]
            (20, 0.0, [True, True])
        """
        if self._running() and not self._closed:
            with self._guard():
                self._check_free()
        alive = self._pool.alive() if self._pool is not None and not self._closed else [False] * self.num_workers
        written = self._free.written() if self._running() and not self._closed else None  # live while free
        out = self._stats.summary(frames=self._frames, batches=self._iter, version=self._version, alive=alive,
                                  restarts=self._restart.counts, replay_buffer=self.replay_buffer, written=written)
        extra = None if self._acting is None else self._acting.stats()
        if extra is not None:
            out["inference"] = extra
        return self._torchrl_stats(out, workers)

    def _running(self) -> bool:
        return self._free is not None and self._free.running

    def _check_iterable(self) -> None:
        if self._running():
            raise RuntimeError("this collector is running free (start()); it cannot be iterated until async_shutdown()")

    def _next_batch_guarded(self) -> TensorDict | None:  # (free running: a failure shuts down)
        with self._guard():
            return self._next_batch()

    def start(self) -> None:
        """Collect continuously into the replay buffer; returns at once.

        Example:
            >>> from rlcollect import MultiAsyncCollector, ReplayBuffer
            >>> rb = ReplayBuffer(10_000)
            >>> c = MultiAsyncCollector("CartPole-v1", num_workers=2, frames_per_batch=200, replay_buffer=rb)
            >>> c.start()
            >>> with c.pause():
            ...     frozen = rb.write_count
            >>> c.async_shutdown(); rb.close()
        """
        self._check_startable(self.replay_buffer, running=self._running())
        if self.config.record is not None or self.config.replay is not None:
            raise RuntimeError("start() cannot record or replay a run: use iteration with record= / replay=")
        if self.config.trajs_per_batch is not None:
            raise RuntimeError("start() cannot assemble whole trajectories (trajs_per_batch) in the multi-process "
                               "collectors: iterate instead (a torchrl buffer gets whole trajectories), or use "
                               "Collector.start()")
        with self._guard():
            self._member_control.discard()
            self._free.start(self._next_batch_guarded)

    @contextlib.contextmanager
    def pause(self) -> Iterator[None]:
        """Within the block nothing is written to the buffer (batches in progress finish first)."""
        self._check_open()
        if not self._running():
            raise RuntimeError("pause() needs a collector running free: call start() first")
        with self._guard():
            self._member_control.count_free(self._free.suspend)
        try:
            yield
        finally:
            if not self._closed:
                with self._guard():
                    self._free.resume()

    def _check_free(self) -> None:
        """Surface a worker that failed while running free (restarting it when allowed)."""
        if self._free is not None:
            self._member_control.count_free(self._free.check)

    @contextlib.contextmanager
    def _control(self) -> Iterator[None]:
        """Control calls made while running free pause the workers around themselves."""
        if self._running():
            with self.pause():
                yield
        else:
            yield

    def async_shutdown(self, timeout: float | None = None) -> None:
        """Stop running free (writes stop after the batches in progress), then shut down
        (``timeout=None``: 10 s, as ``shutdown``).

        Args:
            timeout (float | None): seconds to wait for the batches in progress and the
                workers (default None: 10 s).
        """
        timeout = 10.0 if timeout is None else timeout
        try:
            if not self._closed and self._running():
                with self._guard():
                    self._member_control.count_free(self._free.stop, final=True)
        finally:
            self.shutdown(timeout)
