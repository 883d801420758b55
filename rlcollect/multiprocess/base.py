"""What the sync and async multi-process collectors share: the worker pool and their shared
batch slots, seeding, state, shutdown, and the public calls that their collaborators (config.py,
weight_sync.py, restart.py, freerun.py, stats.py) do the work of."""

from __future__ import annotations

import contextlib
import logging
import os
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import cloudpickle
import torch
from tensordict import TensorDict

from rlcollect.collector import Collector, frames_written
from rlcollect import torchrl_args
from rlcollect.base import CollectorBase, FromConfig
from rlcollect.config import bound_arguments
from rlcollect.data import slot_buffer
from rlcollect.multiprocess import config as mpconfig
from rlcollect.multiprocess import protocol as P
from rlcollect.freerun import BackgroundLoop
from rlcollect.inference.central import CentralInference
from rlcollect.multiprocess.freerun import FreeRunningWorkers
from rlcollect.multiprocess.weight_sync import WorkerWeights
from rlcollect.multiprocess import start
from rlcollect.multiprocess.pool import DEFAULT_START_TIMEOUT_S, WorkerPool
from rlcollect.multiprocess.restart import RestartPolicy, WorkerRestarts
from rlcollect.multiprocess.shm import allocate_slot, check_free_space, slot_bytes
from rlcollect.multiprocess.stats import WorkerStats
from rlcollect.policy import has_weights, load_weights
from rlcollect.weights.models import make_weight_updater

logger = logging.getLogger("rlcollect")

START_METHODS = start.START_METHODS
#: (distributed/config.py imports it from here.)


class MultiCollectorBase(CollectorBase):
    """Shared machinery of ``MultiSyncCollector`` and ``MultiAsyncCollector``: the worker pool
    (pool.py), their shared batch slots (shm.py), and collaborators built once the workers have
    started: ``WorkerWeights`` (weight_sync.py), ``WorkerRestarts`` (restart.py),
    ``FreeRunningWorkers`` (freerun.py) and ``WorkerStats`` (stats.py)."""

    _sync: bool = True
    _slots_per_worker = 1
    _shutdown_on_error = True
    _loop: BackgroundLoop | None = None  # free running, when this process writes the buffer
    _free: FreeRunningWorkers | None = None  # free running, when the workers write it
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
        collector_class: Any = Collector,
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
        **inner_options: Any,
    ):
        args = bound_arguments(MultiCollectorBase.__init__, locals())
        self._pool = None
        self._central: CentralInference | None = None
        self._closed = True
        self.config = cfg = mpconfig.MultiConfig(sync=self._sync, owner=type(self).__name__, **args)
        n = self.num_workers = cfg.num_workers
        self._version_tracker = cfg.version_tracker
        self.requested_frames_per_batch = sum(cfg.worker_frames)
        self._schemes, self._workers_write, self._weight_source = cfg.schemes, cfg.workers_write, cfg.weight_source
        self._storing_devices = cfg.storing_devices
        self._storing_device = cfg.storing_devices[0]
        payloads = [cloudpickle.dumps(spec) for spec in cfg.specs]
        self._restart = RestartPolicy(cfg.on_worker_failure, cfg.max_worker_restarts, cfg.specs)
        # -- start ---------------------------------------------------------------------------------
        start.check_fork_is_safe(self.mp_start_method, [d for ds in cfg.devices.values() for d in ds], policy)
        start.check_not_bootstrapping()
        self._previous_threads = torch.get_num_threads()
        torch.set_num_threads(num_threads or max(1, (os.cpu_count() or 1) - n))
        self._frames = 0
        self._iter = 0
        self._version = 0
        self._stats = WorkerStats(n)
        self._iterator: Iterator | None = None
        context = start.get_context(self.mp_start_method)
        try:
            channels = guard = None
            if cfg.inference == "central":  # rlcollect/inference/: the policy acts here, for every worker
                options = cfg.inner_options
                self._central = CentralInference(
                    policy, splits=cfg.env_splits, device=cfg.central_device,
                    exploration_type=options.get("exploration_type", "random"), allocate=allocate_slot,
                    max_wait_us=cfg.max_wait_us,
                    compile_policy=options.get("compile_policy"), trust_policy=options.get("trust_policy"))
                channels, guard = self._central.channels(context), self._central.lock
            self._pool = WorkerPool(context, payloads, num_sub_threads, self.worker_timeout, self.start_timeout,
                                    channels=channels, start_guard=guard)
        except BaseException:
            torch.set_num_threads(self._previous_threads)  # no shutdown() will run to restore it
            if self._central is not None:
                self._central.close()
            raise
        self._finalizer = weakref.finalize(self, _shutdown, self._pool, self._previous_threads, self._central)
        self._closed = False
        try:
            self._attach()
            self._weights.check_models()
            self.weight_updater = make_weight_updater(weight_updater, self)
        except BaseException:
            self.shutdown()
            raise

    # -- set-up ------------------------------------------------------------------------------------
    def _attach(self) -> None:
        """Allocate every worker's shared batch slots and weight store and hand them over;
        build the collaborators that need the started workers."""
        pool = self._pool
        self.layouts = [h.info["layout"] for h in pool.handles]
        if self._central is not None:
            self._central.attach([h.info for h in pool.handles])
        self._allocate_slots()
        self._stops = [torch.zeros(1, dtype=torch.uint8).share_memory_() for _ in range(self.num_workers)]
        self._weights = WorkerWeights(pool, self._schemes, self.policy, self._weight_source, self.per_worker_weights,
                                      queued=not self._sync, models=weakref.ref(self))
        self._restarts = WorkerRestarts(self._restart, pool, self.layouts, self.collector_class is Collector,
                                        after=self._weights.resend,
                                        # (the inference side's own attribute: no reference back to this collector)
                                        give_up=None if self._central is None else lambda c=self._central: c.error)
        if self._workers_write:
            self._free = FreeRunningWorkers(pool, self._restarts, self._stats, self.init_random_frames)
        for i in range(self.num_workers):
            self._attach_worker(i)

    def _allocate_slots(self) -> None:
        """``self._slots[i]``: what worker ``i`` is handed (one flat slot per batch it may fill
        at once); ``self._buffers[i]``: their typed views in this process."""
        # Known only now (the workers report their layouts): check before allocating anything,
        # rather than fail half-way (or have a write hit SIGBUS) on a full /dev/shm.
        needed = sum(self._slots_per_worker * slot_bytes(layout) for layout in self.layouts)
        check_free_space(needed, f"the batch slots of {self.num_workers} workers ({self._slots_per_worker} each)")
        self._slots = [[allocate_slot(layout) for _ in range(self._slots_per_worker)] for layout in self.layouts]
        self._buffers = [[slot_buffer(flat, layout) for flat in slots]
                         for slots, layout in zip(self._slots, self.layouts)]

    def _attach_worker(self, index: int) -> None:
        inference = self._central.attachments[index] if self._central is not None else None
        self._pool.attach(index, self._slots[index], self._stops[index], self._weights.store_for(index), inference)

    def _inference_error(self) -> BaseException | None:
        """The error central inference's policy raised (a worker waiting for it failed because of it)."""
        return None if self._central is None else self._central.error

    # -- delivery -------------------------------------------------------------------------------
    def _deliver(self, batch: TensorDict, stacked_workers: bool = False,
                 worker: int | None = None) -> TensorDict | None:
        storing = self._storing_device if worker is None else self._storing_devices[worker]
        return super()._deliver(batch, storing_device=storing, stacked_workers=stacked_workers)

    def _running(self) -> bool:
        return self._loop is not None or (self._free is not None and self._free.running)

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

    def _next_batch(self) -> TensorDict | None:
        raise NotImplementedError

    def _fatal_error(self) -> BaseException | None:
        """The error central inference's policy raised in the main process: nothing can go on."""
        return self._inference_error()

    def _quiesce(self) -> None:
        """Wait for the replies workers still owe (async keeps the batches for delivery)."""

    def _broadcast(self, command: str, *args: Any, workers: list[int] | None = None) -> list:
        with self._control(), self._guard():
            self._quiesce()
            indices = range(self.num_workers) if workers is None else workers
            for i in indices:
                self._pool.send(i, command, *args)
            return [self._pool.receive(i) for i in indices]

    # -- control --------------------------------------------------------------------------------
    def _seed(self, seed: int, static_seed: bool) -> int:
        # Batches collected before the call and not yet delivered are discarded.
        with self._control(), self._guard():
            self._discard_in_flight()
            for i in range(self.num_workers):
                self._restart.seeds[i] = seed
                seed = self._pool.request(i, P.SEED, seed, static_seed)
        return seed

    def reset(self, reset_idx: Any = None) -> None:
        """Reset the envs of every worker (``reset_idx=None``) or of the workers whose entry of
        ``reset_idx`` (torchrl's: one bool per worker) is True; their next frames start new
        trajectories.  Batches collected before the call and not yet delivered are discarded.

        Example:
            >>> from rlcollect import MultiSyncCollector
            >>> c = MultiSyncCollector("CartPole-v1", num_workers=2, frames_per_batch=20)
            >>> c.reset(reset_idx=[True, False])
            >>> c.shutdown()
        """
        chosen = torchrl_args.chosen_workers(reset_idx, self.num_workers)
        with self._control(), self._guard():
            self._discard_in_flight()
            for i in chosen:
                self._pool.request(i, P.RESET)

    def _discard_in_flight(self) -> None:
        self._quiesce()

    def getattr_policy(self, name: str) -> Any:
        """An attribute of worker 0's policy (with ``inference="central"``: of the policy the
        main process runs, the one every worker's actions come from)."""
        if self._central is not None:
            return getattr(self._central.policy, name)
        return self._broadcast(P.GETATTR_POLICY, name, workers=[0])[0]

    def getattr_env(self, name: str) -> Any:
        """An attribute of worker 0's env."""
        return self._broadcast(P.GETATTR_ENV, name, workers=[0])[0]

    def getattr_rb(self, name: str) -> Any:
        """An attribute of the replay buffer."""
        if self.replay_buffer is None:
            raise RuntimeError("getattr_rb: this collector has no replay_buffer")
        return getattr(self.replay_buffer, name)

    def state_dict(self) -> dict[str, Any]:
        """``{"worker0": ..., ..., "frames", "iter", "traj_pool"}``."""
        states = self._broadcast(P.STATE_DICT)
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
            self._discard_in_flight()
            for i in range(self.num_workers):
                self._pool.request(i, P.LOAD_STATE_DICT, state[f"worker{i}"])
        self._frames = int(state["frames"])
        self._iter = int(state["iter"])
        self._version = int(state.get("policy_version", self._version))

    # -- weights (weight_sync.py) ------------------------------------------------------------
    def _push_weights(self, models: dict[str, Any], worker_ids: Any) -> None:
        if self._central is not None:
            self._update_central(models)
            return
        plan = self._weights.plan(models, worker_ids)
        if plan:
            self._push(plan, lambda: self._version + 1)

    @contextlib.contextmanager
    def updating_weights(self) -> Iterator[None]:
        """See ``CollectorBase.updating_weights``: with ``inference="central"`` the block holds the
        inference loop's lock (forwards wait for it) and the version moves at its end."""
        if self._central is None:
            yield
            self.update_policy_weights_()
            return
        self._check_open()
        with self._central.lock:
            yield
            self._version += 1
            self._central.server.version = self._version
        self._stats.note_pushed(range(self.num_workers), self._version)

    def increment_version(self) -> None:
        """Bump the policy version without new weights (with ``inference="central"``, the
        version the next forward tags its frames with)."""
        if self._central is None:
            super().increment_version()
            return
        with self._central.lock:
            self._version += 1
            self._central.server.version = self._version

    def _update_central(self, models: dict[str, Any]) -> None:
        """Central inference: the weights are loaded into the acting policy (a no-op when it is
        the trainer's own, updated in place), the version moves, the next forward uses both."""
        unknown = sorted(set(models) - {"policy"})
        if unknown:
            raise ValueError(f"model_id {unknown[0]!r}: with inference='central' only 'policy' is updated (the "
                             "workers hold no model)")
        with self._guard():
            self._check_free()
        self._version += 1
        self._central.update(models["policy"], self._version)
        self._stats.note_pushed(range(self.num_workers), self._version)

    def _push(self, plan: list[tuple[str, dict[int, Any]]], version: Callable[[], int]) -> None:
        """Send ``plan``'s weights with the version ``version()`` returns (asked once a worker
        that failed while running free has been dealt with)."""
        with self._guard():
            self._check_free()
        self._version = version()
        for mid, targets in plan:
            with (contextlib.nullcontext() if self._weights.shared(mid) else self._control()), self._guard():
                self._weights.push(mid, targets, self._version)
            self._stats.note_pushed(targets, self._version)

    def get_model(self, model_id: str) -> Any:
        """The main process's model ``model_id``: ``"policy"`` is the ``policy`` given (the source
        of weights), any other an attribute path from this collector (``"policy.module[0]"``);
        models that exist only inside the workers (``"env.x"``) raise ``UnknownModelError``.

        Example (``policy`` a module with a ``head`` sub-module)::

            collector = MultiSyncCollector(make_env, policy, num_workers=2, frames_per_batch=100,
                                           weight_sync_schemes={"policy.head": "process"})
            collector.get_model("policy.head") is policy.head   # True
            collector.update_policy_weights_(model_id="policy.head")  # policy.head's weights, to every worker
        """
        return self._weights.get_model(model_id)

    def get_cached_weights(self, model_id: str) -> Any:
        """The shared-memory weights the workers copy from (``{name: tensor}``, worker 0's with
        ``per_worker_weights=True``) for ``"policy"`` with the shared scheme; None otherwise
        (as torchrl: nothing cached)."""
        return self._weights.cached(model_id)

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
        return self._central.weight_spec if self._central is not None else self._weights.spec

    def weights_module(self, model_id: str = "policy") -> Any:
        """The main process's ``policy`` (the source of the workers' weights); only ``"policy"``."""
        if model_id != "policy":
            raise ValueError(f"model_id {model_id!r}: a nested multi-process collector updates only 'policy'")
        return self._central.policy if self._central is not None else self.policy

    def set_weights(self, state: Any, version: int, model_id: str = "policy") -> None:
        """Have every worker act with ``state`` (None: ``policy``'s weights, as they are now)
        from its next batch on, with ``policy_version`` set to ``version`` (the number of the
        worker or node that runs this collector, not a bump)."""
        self._check_open()
        module = self.weights_module(model_id)
        if self._central is not None:
            self._central.set_weights(state, version)
            self._version = version
            return
        if state is not None and has_weights(module):
            load_weights(module, state)  # the main copy stays the one the workers act with
        plan = self._weights.plan({"policy": state}, None)
        if plan:
            self._push(plan, lambda: version)

    def batch_info(self) -> dict:
        """The last batch filled for an outer collector (see ``WorkerStats.batch_info``)."""
        return self._stats.batch_info()

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
        with self._guard():
            self._discard_in_flight()
            if self._free is not None:
                self._free.start()
            else:
                self._loop = BackgroundLoop(self._next_batch, name="rlcollect-multi-collector")
                self._loop.start()

    @contextlib.contextmanager
    def pause(self) -> Iterator[None]:
        """Within the block nothing is written to the buffer (batches in progress finish first)."""
        self._check_open()
        if self._loop is not None:
            with self._loop.pause():
                yield
            return
        if not self._running():
            raise RuntimeError("pause() needs a collector running free: call start() first")
        with self._guard():
            self._frames += self._free.stop()
        try:
            yield
        finally:
            if not self._closed:
                with self._guard():
                    self._free.start()

    def _check_free(self) -> None:
        """Surface a worker that failed while running free (restarting it when allowed)."""
        if self._free is not None:
            self._frames += self._free.check()

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
        (``timeout=None``: 10 s, as ``shutdown``)."""
        timeout = 10.0 if timeout is None else timeout
        try:
            if not self._closed:
                if self._loop is not None:
                    loop, self._loop = self._loop, None
                    loop.stop(timeout)
                elif self._running():
                    with self._guard():
                        self._frames += self._free.stop()
        finally:
            self.shutdown(timeout)

    def _random_now(self) -> bool:
        return frames_written(self.replay_buffer, self._frames) < self.init_random_frames

    # -- statistics (stats.py) --------------------------------------------------------------------
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
        out = self._stats.summary(frames=self._frames, batches=self._iter, version=self._version, alive=alive,
                                  restarts=self._restart.counts, replay_buffer=self.replay_buffer)
        if self._central is not None:
            out["inference"] = self._central.stats()
        return out

    # -- observability ------------------------------------------------------------------------------
    def enable_profile(self, path: str = "rlcollect_trace.json", *, rollouts=(0,), workers=(0,),
                       **profiler_kwargs) -> None:
        """Record torch.profiler traces of the chosen rollouts inside the chosen workers; worker
        ``i`` writes ``<path stem>.worker<i><ext>`` (see ``Collector.enable_profile``)."""
        root, ext = os.path.splitext(os.fspath(path))
        for i in workers:
            self._broadcast(P.ENABLE_PROFILE, f"{root}.worker{i}{ext or '.json'}", tuple(rollouts), profiler_kwargs,
                            workers=[i])

    # -- shutdown -------------------------------------------------------------------------------------
    def _release(self, timeout: float) -> None:
        """Stop every worker (close -> terminate -> kill within ``timeout``), free shared
        memory, restore the main process's torch threads."""
        self._shutdown(timeout)

    def _shutdown(self, timeout: float) -> None:
        if self._closed and self._pool is None:
            return
        self._closed = True
        if self._free is not None:
            self._free.running = False
        loop, self._loop = self._loop, None
        loop_error = None
        if loop is not None:
            try:
                loop.stop(timeout)
            except Exception as err:  # noqa: BLE001  (raised once everything is shut down)
                loop_error = err
        for stop in getattr(self, "_stops", []):
            stop[0] = 1
        pool, self._pool = self._pool, None
        central, self._central = self._central, None
        if pool is not None:
            self._finalizer.detach()
            _shutdown(pool, self._previous_threads, central, timeout)
        self._slots = self._buffers = None
        # The collaborators hold the pool (its handles hold what they were attached with) and
        # the weight stores: shared tensors, each holding a file descriptor until it is freed.
        self._weights = self._restarts = self._free = None
        self._stops = []  # shared tensors: each holds a file descriptor until it is freed
        # An iterator that ended with an exception would answer StopIteration from now on; a
        # fresh one says that the collector is shut down.
        self._iterator = None
        if loop_error is not None:
            raise loop_error


def _shutdown(pool: WorkerPool, threads: int, central: CentralInference | None = None, timeout: float = 10.0) -> None:
    if central is not None:  # first: a worker waiting for its actions gets an error at once, and exits
        central.close()
    pool.shutdown(timeout)
    torch.set_num_threads(threads)

