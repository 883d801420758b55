"""``MultiSyncCollector`` and ``MultiAsyncCollector``: thin faces that wire the parts of the
multi-process wing in one place (``_build``), each part handed its dependencies and calling
none of the others but through them: ``WorkerPool`` (pool.py: processes, pipes, liveness), the
slots (slots.py: written by the workers, lent to the user), the gather (gather.py: sync or
async), where the policy acts (acting.py: in the workers, or central), ``WorkerRestarts``
(recovery.py), free running (freerun.py) and ``MemberStats`` (rlcollect/members.py: counters, statistics);
``Members`` (rlcollect/members.py) holds the pool, the gather, the restarts and the statistics,
runs the gather under recovery (the face's ``_collect_next`` is its ``next_batch``) and controls
the workers; the workers are started and stopped by lifecycle.py (start method, torch threads,
acting, pool). The face keeps its signature, the wiring, the weights and version (acting.py) and
nesting; the calls that reach the workers and free running are its base's, ``WorkerControl``
(worker_control.py). Options are read from ``self.config`` (config.py); torchrl's face
(``shutdown``, ``set_seed``, ``update_policy_weights_``, ...) is ``CollectorBase``'s
(rlcollect/base.py).
"""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

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
from rlcollect.multiprocess.pool import DEFAULT_START_TIMEOUT_S, Attach
from rlcollect.multiprocess.recovery import RestartPolicy, WorkerRestarts
from rlcollect.multiprocess.schedule import schedule_for
from rlcollect.multiprocess.worker_control import WorkerControl
from rlcollect.weights.models import make_weight_updater


class MultiCollectorBase(WorkerControl):
    """What ``MultiSyncCollector`` and ``MultiAsyncCollector`` are: one face, wired in
    ``_build``; the two differ only in the gather they are built with. The calls that reach the
    workers and free running are ``WorkerControl``'s (worker_control.py)."""

    _sync = True
    _shutdown_on_error = True
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

    @property
    def slots(self) -> Any:
        """The shared-memory batch slots (slots.py: ``StackedSlots`` or ``WorkerSlots``), for
        inspection: what the workers write into and the batches you get are views of."""
        return self._gather.slots

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
