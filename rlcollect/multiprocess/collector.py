"""``MultiSyncCollector`` and ``MultiAsyncCollector``: thin faces that wire the parts of the
multi-process wing in one place (``_build``), each part handed its dependencies and calling
none of the others but through them: ``WorkerPool`` (pool.py: processes, pipes, liveness), the
slots (slots.py: written by the workers, lent to the user), the gather (gather.py: sync or
async), where the policy acts (acting.py: in the workers, or central), ``WorkerRestarts``
(recovery.py), free running (freerun.py) and ``MemberStats`` (rlcollect/members.py: counters, statistics);
``Members`` (rlcollect/members.py) holds the pool, the gather, the restarts and the statistics,
and runs the gather under recovery (the face's ``_collect_next`` is its ``next_batch``);
the workers are started and stopped by lifecycle.py (start method, torch threads, acting, pool).
Options are read from ``self.config`` (config.py); torchrl's face (``shutdown``, ``set_seed``,
``update_policy_weights_``, ...) is ``CollectorBase``'s (rlcollect/base.py).
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from tensordict import TensorDict

from rlcollect import torchrl_args
from rlcollect.base import CollectorBase, FromConfig
from rlcollect.collector import SingleCollector
from rlcollect.config import bound_arguments
from rlcollect.data import BatchLayout
from rlcollect.members import Members, MemberStats
from rlcollect.multiprocess import config as mpconfig
from rlcollect.multiprocess import protocol as P
from rlcollect.multiprocess.freerun import free_running
from rlcollect.multiprocess.gather import SyncGather
from rlcollect.multiprocess.gather_async import AsyncGather
from rlcollect.multiprocess.lifecycle import start_workers, stop_workers
from rlcollect.multiprocess.pool import DEFAULT_START_TIMEOUT_S, Attach, WorkerPool
from rlcollect.multiprocess.recovery import RestartPolicy, WorkerRestarts
from rlcollect.multiprocess.schedule import schedule_for
from rlcollect.weights.models import make_weight_updater


class MultiCollectorBase(CollectorBase):
    """What ``MultiSyncCollector`` and ``MultiAsyncCollector`` are: one face, wired in
    ``_build``; the two differ only in the gather they are built with."""

    _sync = True
    _shutdown_on_error = True
    _pool: WorkerPool | None = None
    _acting: Any = None
    _gather: Any = None
    _free: Any = None
    _member_control: Members | None = None
    _stats: MemberStats | None = None
    _stops: list = []
    # torchrl's public attributes: the validated arguments, read from the config
    frames_per_batch = FromConfig()
    total_frames = FromConfig()
    policy = FromConfig()
    replay_buffer = FromConfig()
    init_random_frames = FromConfig()
    mp_start_method = FromConfig()
    worker_timeout = FromConfig()
    start_timeout = FromConfig()
    preemptive_threshold = FromConfig()
    cat_results = FromConfig()
    collector_class = FromConfig()
    update_at_each_batch = FromConfig()
    per_worker_weights = FromConfig()
    postproc = FromConfig()
    split_trajs = FromConfig()

    def __init__(
        self,
        create_env_fn: Any,
        policy: Any = None,
        *,
        num_workers: int | None = None,
        policy_factory: Callable | list | None = None,
        frames_per_batch: int | list[int],
        total_frames: int = -1,
        device: Any = None,
        storing_device: Any = None,
        env_device: Any = None,
        policy_device: Any = None,
        create_env_kwargs: dict | list | None = None,
        collector_class: Any = SingleCollector,
        preemptive_threshold: float | None = None,
        cat_results: str | int | None = None,
        update_at_each_batch: bool = False,
        num_threads: int | None = None,
        num_sub_threads: int = 1,
        mp_start_method: str | None = None,
        worker_timeout: float | None = None,
        start_timeout: float = DEFAULT_START_TIMEOUT_S,
        on_worker_failure: str = "raise",
        max_worker_restarts: int = 3,
        init_random_frames: int | None = None,
        postproc: Callable | None = None,
        split_trajs: bool = False,
        return_same_td: bool = False,
        replay_buffer: Any = None,
        extend_buffer: bool = True,
        use_buffers: bool = True,
        weight_sync_schemes: dict | None = None,
        per_worker_weights: bool = False,
        weight_updater: Any = None,
        collector_kwargs: dict | None = None,
        worker_idx: int | None = None,
        reset_when_done: bool = True,
        local_init_rb: bool | None = None,
        inference: str = "worker",
        env_splits: int | None = None,
        max_wait_us: float = 0.0,
        pre_collect_hook: Callable | None = None,
        post_collect_hook: Callable | None = None,
        max_policy_lag: int | None = None,
        lag_policy: str = "drop",
        record: Any = None,
        replay: Any = None,
        **inner_options: Any,
    ):
        args = bound_arguments(MultiCollectorBase.__init__, locals())
        self._versions = threading.RLock()  # the version moves under it (see _Gather's hold)
        self._closed = True
        self.config = cfg = mpconfig.MultiConfig(sync=self._sync, owner=type(self).__name__, **args)
        n = self.num_workers = cfg.num_workers
        self._version_tracker = cfg.version_tracker
        self.requested_frames_per_batch = cfg.requested_frames_per_batch  # torchrl's
        self._restart = RestartPolicy(cfg.on_worker_failure, cfg.max_worker_restarts, cfg.specs)
        self._stats = MemberStats(n)
        self._version = 0
        self._iterator: Iterator | None = None
        self._pool, self._acting, self._previous_threads = start_workers(cfg, policy, num_threads)
        self._finalizer = weakref.finalize(self, stop_workers, self._pool, self._previous_threads, self._acting)
        self._closed = False
        try:
            self._build()
            self._acting.check_models()
            self.weight_updater = make_weight_updater(weight_updater, self)
        except BaseException:
            self.shutdown()
            raise

    def _build(self) -> None:
        """Wire the parts that need the started workers (their reported layouts)."""
        cfg, pool, acting = self.config, self._pool, self._acting
        self.layouts = [h.info["layout"] for h in pool.handles]
        acting.start(pool, weakref.ref(self))
        gather_class = SyncGather if self._sync else AsyncGather
        slots = gather_class.make_slots(cfg, self.layouts)
        self._stops = stops = [P.control_block() for _ in range(self.num_workers)]
        restarts = WorkerRestarts(self._restart, pool, self.layouts, issubclass(cfg.collector_class, SingleCollector),
                                  after=acting.resend, give_up=lambda a=acting: a.fatal_error)
        attach = Attach(pool, slots, stops, acting)
        for i in range(self.num_workers):
            attach(i)
        slots.settle()
        extra = {} if self._sync else {"schedule": schedule_for(cfg)}
        me = weakref.ref(self)  # (no reference cycle through the gather)
        self._gather = gather_class(cfg, pool, slots, attach, self._stats, stops,
                                    trainer_version=lambda: me()._version, hold=self._versions, **extra)
        self._free = free_running(cfg, pool, self._stats, stops)
        # Through a proxy: no reference cycle through the parts.
        members = self._member_control = Members(
            pool, self._gather, restarts, self._stats,
            update=functools.partial(type(self)._update_each_batch, weakref.proxy(self)), free=self._free)
        self._collect_next = members.next_batch  # (no _guard: iteration shuts down on any error)

    # -- the policy version: it moves under _versions, which the gather holds from the check of a
    # batch's lag (max_policy_lag) until the batch is delivered ---------------------------------
    def _set_version(self, value: int) -> None:
        with self._versions:
            CollectorBase._version.fset(self, value)
            if self._stats is not None:  # (what Members hands the gather: a batch's lag is behind it)
                self._stats.note_version(value)

    _version = property(CollectorBase._version.fget, _set_version)

    # -- the counters, owned by the statistics (the gather reports each batch) ---------------------
    _frames = property(lambda self: self._stats.frames)
    _iter = property(lambda self: self._stats.batches)

    # -- iteration (``_collect_next`` is ``Members.next_batch``, bound in ``_build``) ----------------
    def _next_batch_guarded(self) -> TensorDict | None:  # (free running: a failure shuts down)
        with self._guard():
            return self._next_batch()

    def _update_each_batch(self, index: int | None) -> int:
        """``update_at_each_batch`` (the gather calls it only then): before a sync batch (``index``
        None), or after an async batch of worker ``index`` (to it alone, unless one shared store
        serves all)."""
        if self.config.weight_source is not None:
            # with lag_policy="wait" every worker starts its next batch with the new weights
            if index is None or self._acting.shared_weights or self._gather.waiting:
                self.update_policy_weights_()
            else:
                self.update_policy_weights_(worker_ids=[index])
        return self._version

    def _running(self) -> bool:
        return self._free is not None and self._free.running

    def _check_iterable(self) -> None:
        if self._running():
            raise RuntimeError("this collector is running free (start()); it cannot be iterated until async_shutdown()")

    def _batch_frames(self) -> int:
        if not isinstance(self.frames_per_batch, int):
            raise TypeError("an async collector with one frames_per_batch per worker has no len(): how many "
                            "batches reach total_frames depends on which workers deliver them")
        return self.frames_per_batch

    def _members(self) -> int:
        return self.num_workers

    def _member_frames(self, index: int) -> int:
        return self.config.worker_frames[index]

    def _fatal_error(self) -> BaseException | None:
        return None if self._acting is None else self._acting.fatal_error

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

    @property
    def slots(self) -> Any:
        """The shared-memory batch slots (slots.py: ``StackedSlots`` or ``WorkerSlots``), for
        inspection: what the workers write into and the batches you get are views of."""
        return self._gather.slots

    # -- control: Members (rlcollect/members.py), over the pool contract both wings share ----------------
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

    # -- weights (acting.py) ------------------------------------------------------------------------
    def _push_weights(self, models: dict[str, Any], worker_ids: Any) -> None:
        plan = self._acting.plan(models, worker_ids)
        if plan:
            self._push(plan, lambda: self._version + 1)

    def _push(self, plan: list[tuple[str, dict[int, Any]]], version: Callable[[], int]) -> None:
        """Send ``plan``'s weights with the version ``version()`` returns (asked once a worker
        that failed while running free has been dealt with)."""
        with self._guard():
            self._check_free()
        self._version = version()
        for mid, targets in plan:
            with (contextlib.nullcontext() if self._acting.shared(mid) else self._control()), self._guard():
                self._member_control.push(functools.partial(self._acting.push, mid), targets, self._version)

    @contextlib.contextmanager
    def updating_weights(self) -> Iterator[None]:
        """See ``CollectorBase.updating_weights``: with ``inference="central"`` the block holds the
        inference loop's lock (forwards wait for it) and the version moves at its end."""
        self._check_open()
        with self._acting.updating(self.update_policy_weights_, self._bump_version):
            yield

    def _bump_version(self) -> int:
        self._version += 1
        self._stats.note_pushed(range(self.num_workers), self._version)
        return self._version

    def increment_version(self) -> None:
        """Bump the policy version without new weights (with ``inference="central"``, the
        version the next forward tags its frames with)."""
        acting = self._acting
        if acting is None:  # shut down: only the number moves
            super().increment_version()
            return
        with acting.lock:
            self._version += 1
            acting.set_version(self._version)

    def get_model(self, model_id: str) -> Any:
        """The main process's model ``model_id``: ``"policy"`` is the ``policy`` given (the source
        of weights), any other an attribute path from this collector (``"policy.module[0]"``);
        models that exist only inside the workers (``"env.x"``) raise ``UnknownModelError``.

        With ``weight_sync_schemes={"policy.head": "process"}``, ``get_model("policy.head")`` is
        ``policy.head`` and ``update_policy_weights_(model_id="policy.head")`` sends its weights.
        """
        return self._acting.get_model(model_id)

    def get_cached_weights(self, model_id: str) -> Any:
        """The shared-memory weights the workers copy from (``{name: tensor}``, worker 0's with
        ``per_worker_weights=True``) for ``"policy"`` with the shared scheme; None otherwise
        (as torchrl: nothing cached)."""
        return self._acting.cached(model_id)

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

    # -- driven by an outer worker or node (rlcollect/source.py) ------------------------------------
    @property
    def weight_spec(self) -> dict | None:
        """Names, shapes and dtypes of the workers' policy parameters and buffers (None: none)."""
        return self._acting.weight_spec

    def weights_module(self, model_id: str = "policy") -> Any:
        """The main process's ``policy`` (the source of the workers' weights); only ``"policy"``."""
        if model_id != "policy":
            raise ValueError(f"model_id {model_id!r}: a nested multi-process collector updates only 'policy'")
        return self._acting.module()

    def set_weights(self, state: Any, version: int, model_id: str = "policy") -> None:
        """Have every worker act with ``state`` (None: ``policy``'s weights, as they are now)
        from its next batch on, with ``policy_version`` set to ``version`` (the number of the
        worker or node that runs this collector, not a bump)."""
        self._check_open()
        self.weights_module(model_id)
        adopted = self._acting.set_weights(state, version, self._push)
        if adopted is not None:
            self._version = adopted

    def batch_info(self) -> dict:
        """The last batch filled for an outer collector (see ``MemberStats.batch_info``)."""
        return self._stats.batch_info()

    @property
    def layout(self) -> BatchLayout:
        """The layout of one delivered batch, for an outer collector's slot (sync: only with
        ``cat_results="stack"``; async: every worker's batches must have the same shape)."""
        return self._gather.layout()

    def collect_into(self, buf: Any, random: bool = False, stop: Any = None) -> int:
        """Collect one batch straight into ``buf`` (the outer worker's shared slot); ``stop`` is
        not watched (each inner worker has its own)."""
        with self._guard():
            return self._member_control.run(self._gather.collect_into, buf, random, self._version)

    # -- free running (freerun.py) ------------------------------------------------------------------
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
        self._check_open()
        if self.replay_buffer is None:
            raise RuntimeError("start() needs a replay_buffer: batches collected while running free go there")
        if self._running():
            raise RuntimeError("start() was already called; use pause() to stop writing for a while")
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

    # -- statistics (MemberStats, rlcollect/members.py) ---------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """JSON-serialisable statistics: frames, rates, per-worker frames, liveness, restarts,
        versions and env-step latency, the last batch's policy lag, time blocked waiting for the
        workers (docs/observability.md defines every key).

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
        return self._torchrl_stats(out)

    # -- observability ------------------------------------------------------------------------------
    def enable_profile(self, path: str = "rlcollect_trace.json", *, rollouts=(0,), workers=(0,),
                       **profiler_kwargs) -> None:
        """Record torch.profiler traces of the chosen rollouts inside the chosen workers (torchrl's
        arguments too); worker ``i`` writes ``<path stem>.worker<i><ext>`` (``Collector.enable_profile``)."""
        path, rollouts, profiler_kwargs, workers = torchrl_args.profile_args(path, rollouts, profiler_kwargs, workers)
        root, ext = os.path.splitext(os.fspath(path))
        for i in workers:
            self._broadcast(P.ENABLE_PROFILE, f"{root}.worker{i}{ext or '.json'}", tuple(rollouts), profiler_kwargs,
                            worker=i)

    # -- shutdown -------------------------------------------------------------------------------------
    def _release(self, timeout: float) -> None:
        """Stop every worker (close -> terminate -> kill within ``timeout``), free shared
        memory, restore the main process's torch threads."""
        if self._closed and self._pool is None:
            return
        self._closed = True
        free_error = self._free.close(timeout) if self._free is not None else None
        for stop in self._stops:
            stop[0] = 1
        pool, self._pool = self._pool, None
        acting, self._acting = self._acting, None
        if pool is not None:
            self._finalizer.detach()
            stop_workers(pool, self._previous_threads, acting, timeout)
        if self._gather is not None:
            self._gather.close()
        # The parts hold the pool (its handles hold what they were attached with), the slots
        # and the weight stores: shared tensors, each holding a file descriptor until it is freed.
        self._gather = self._free = self._member_control = None
        self.__dict__.pop("_collect_next", None)  # (Members.next_batch, bound in _build)
        self._stops = []
        # An iterator that ended with an exception would answer StopIteration from now on; a
        # fresh one says that the collector is shut down.
        self._iterator = None
        if free_error is not None:
            raise free_error


class MultiSyncCollector(MultiCollectorBase):
    __doc__ = mpconfig.SYNC_DOC

    _sync = True


class MultiAsyncCollector(MultiCollectorBase):
    __doc__ = mpconfig.ASYNC_DOC

    _sync = False
