"""What the sync and async multi-process collectors share: argument validation, per-worker
specs, the worker pool, shared batch slots, weight sync, seeding, state and statistics."""

from __future__ import annotations

import contextlib
import importlib
import logging
import math
import os
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import cloudpickle
import torch
from tensordict import TensorDict

from rlcollect.collector import Collector, frames_written
from rlcollect import torchrl_args
from rlcollect.base import CollectorBase
from rlcollect.torchrl_args import version_tracker
from rlcollect.config import CollectorConfig, kwargs_arg, optional_positive_int, positive_int, total_frames_arg
from rlcollect.data import deliver
from rlcollect.errors import WorkerError
from rlcollect.multiprocess import protocol as P
from rlcollect.freerun import BackgroundLoop
from rlcollect.multiprocess.freerun import FreeRunningWorkers
from rlcollect.multiprocess.weight_sync import WorkerWeights
from rlcollect.multiprocess import start
from rlcollect.multiprocess.pool import DEFAULT_START_TIMEOUT_S, WorkerPool
from rlcollect.multiprocess.restart import RestartPolicy, WorkerRestarts
from rlcollect.multiprocess.shm import allocate_slot, check_free_space, slot_buffer, slot_bytes
from rlcollect.multiprocess.stats import WorkerStats
from rlcollect.policy import as_exploration_type, has_weights, load_weights
from rlcollect.weights.models import delegate_to_updater, make_weight_updater, update_targets
from rlcollect.weights.schemes import validate_schemes

logger = logging.getLogger("rlcollect")

START_METHODS = start.START_METHODS
PER_WORKER_ARGS = ("device", "storing_device", "env_device", "policy_device")
#: Options forwarded unchanged to each worker's inner collector.
INNER_OPTIONS = (
    "max_frames_per_traj", "reset_at_each_iter", "exploration_type", "set_truncated", "trust_policy",
    "compile_policy", "cudagraph_policy", "no_cuda_sync", "track_policy_version",
)


def _per_worker(name: str, value: Any, n: int) -> list:
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ValueError(f"{name} is a per-worker list of length {len(value)}, but there are {n} workers")
        return list(value)
    return [value] * n


#: The collector classes ``collector_class`` may name by string. The multi-process ones are this
#: module's subclasses: named by path and imported when first named, so that this module does
#: not import the modules built on it.
_NAMED = {
    "single": ("rlcollect.collector", "Collector"),
    "sync": ("rlcollect.multiprocess.sync", "MultiSyncCollector"),
    "async": ("rlcollect.multiprocess.asynchronous", "MultiAsyncCollector"),
}


def resolve_collector_class(value: Any) -> type:
    """``collector_class``: a collector class (``Collector``, a multi-process collector, or a
    subclass), or one of ``"single"``, ``"sync"``, ``"async"``.

    Example:
        >>> resolve_collector_class("sync").__name__
        'MultiSyncCollector'
    """
    if isinstance(value, str):
        if value not in _NAMED:
            raise ValueError(f"collector_class must be a collector class or one of {sorted(_NAMED)}, got {value!r}")
        module, name = _NAMED[value]
        return getattr(importlib.import_module(module), name)
    if isinstance(value, type) and issubclass(value, (Collector, MultiCollectorBase)):
        return value
    raise ValueError(
        f"collector_class must be Collector, MultiSyncCollector, MultiAsyncCollector (or a subclass), "
        f"or one of {sorted(_NAMED)}; got {value!r}"
    )


def _pickled(name: str, value: Any, hint: str) -> None:
    try:
        cloudpickle.dumps(value)
    except Exception as err:
        raise TypeError(f"{name} cannot be pickled for the worker processes ({err}); {hint}") from err


def _shared_buffer(replay_buffer: Any) -> bool:
    """Whether the workers can write into ``replay_buffer`` themselves (an rlcollect
    ``ReplayBuffer``); any other object with ``extend()`` is written by the main process."""
    from rlcollect.buffers.replay import ReplayBuffer

    return isinstance(replay_buffer, ReplayBuffer)


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
        **inner_options: Any,
    ):
        self._pool = None
        self._closed = True
        unknown = set(inner_options) - set(INNER_OPTIONS)
        if unknown:
            raise TypeError(f"{type(self).__name__} got unexpected arguments {sorted(unknown)}")
        torchrl_args.check_reset_when_done(reset_when_done)
        self.local_init_rb = torchrl_args.check_local_init_rb(local_init_rb)
        if not isinstance(use_buffers, bool):
            raise TypeError(f"use_buffers must be a bool, got {use_buffers!r}")
        # Batches always cross from the workers through shared-memory slots; use_buffers=False
        # (torchrl: no preallocated buffers) is honoured where it is observable: every batch
        # delivered is freshly allocated memory, never a view that the next batch overwrites.
        self.use_buffers = use_buffers
        if "track_policy_version" in inner_options:  # a torchrl PolicyVersion stays here; workers get True
            inner_options["track_policy_version"], self._version_tracker = version_tracker(
                inner_options["track_policy_version"])
        if "exploration_type" in inner_options:  # travels as a plain string
            inner_options["exploration_type"] = as_exploration_type(inner_options["exploration_type"])
        # -- workers and per-worker lists -------------------------------------------------------
        if isinstance(create_env_fn, (list, tuple)):
            if not create_env_fn:
                raise ValueError("create_env_fn is an empty list; give one env factory per worker")
            if num_workers is not None and num_workers != len(create_env_fn):
                raise ValueError(
                    f"num_workers={num_workers} but create_env_fn lists {len(create_env_fn)} envs (one per worker)"
                )
            env_fns = list(create_env_fn)
        else:
            if num_workers is None:
                raise ValueError("num_workers is required when create_env_fn is not a list (one entry per worker)")
            env_fns = [create_env_fn] * positive_int("num_workers", num_workers)
        n = self.num_workers = len(env_fns)
        total_frames = total_frames_arg(total_frames)
        if isinstance(frames_per_batch, (list, tuple)):
            frames = [positive_int("frames_per_batch", f) for f in _per_worker("frames_per_batch", frames_per_batch, n)]
        else:
            positive_int("frames_per_batch", frames_per_batch)
            if self._sync:
                if frames_per_batch % n:
                    torchrl_args.warn(
                        f"frames_per_batch={frames_per_batch} is not divisible by num_workers={n}: each worker "
                        f"collects {math.ceil(frames_per_batch / n)} frames", stacklevel=3)
                frames = [math.ceil(frames_per_batch / n)] * n
            else:
                frames = [frames_per_batch] * n
        # async with one size per worker: a batch is one worker's, so frames_per_batch stays the list
        self.frames_per_batch = sum(frames) if self._sync else frames_per_batch
        self._worker_frames_per_batch = frames
        self.requested_frames_per_batch = sum(frames)
        self.total_frames = total_frames
        kwargs_list = _per_worker("create_env_kwargs", create_env_kwargs, n)
        factories = _per_worker("policy_factory", policy_factory, n)
        devices = {name: _per_worker(name, value, n) for name, value in
                   zip(PER_WORKER_ARGS, (device, storing_device, env_device, policy_device))}
        if total_frames > 0 and isinstance(self.frames_per_batch, int) and total_frames % self.frames_per_batch:
            torchrl_args.warn(f"total_frames={total_frames} is not a multiple of frames_per_batch="
                              f"{self.frames_per_batch}: the last batch overshoots", stacklevel=3)
        # -- options of this class ----------------------------------------------------------------
        if preemptive_threshold is not None:
            if not self._sync:
                raise ValueError("preemptive_threshold is only supported by MultiSyncCollector (got it for async)")
            if isinstance(preemptive_threshold, bool) or not isinstance(preemptive_threshold, (int, float)) \
                    or not 0.0 <= preemptive_threshold <= 1.0:
                raise ValueError(f"preemptive_threshold must be a number in [0, 1], got {preemptive_threshold!r}")
        self.preemptive_threshold = preemptive_threshold
        self.cat_results = self._check_cat_results(cat_results)
        self.mp_start_method = start.resolve_start_method(mp_start_method)
        RestartPolicy(on_worker_failure, max_worker_restarts, [])  # validates both arguments
        if worker_timeout is not None and (isinstance(worker_timeout, bool) or not isinstance(worker_timeout, (int, float))
                                           or worker_timeout <= 0):
            raise ValueError(f"worker_timeout must be a positive number of seconds or None, got {worker_timeout!r}")
        self.worker_timeout = None if worker_timeout is None else float(worker_timeout)
        if isinstance(start_timeout, bool) or not isinstance(start_timeout, (int, float)) \
                or not math.isfinite(start_timeout) or start_timeout <= 0:
            raise ValueError(f"start_timeout must be a positive, finite number of seconds (default "
                             f"{DEFAULT_START_TIMEOUT_S:g}), got {start_timeout!r}")
        self.start_timeout = float(start_timeout)
        optional_positive_int("num_threads", num_threads)
        positive_int("num_sub_threads", num_sub_threads)
        self.collector_class = resolve_collector_class(collector_class)
        collector_kwargs = dict(kwargs_arg("collector_kwargs", collector_kwargs))
        if self.collector_class is not Collector and "num_workers" not in collector_kwargs:
            raise ValueError(
                f"collector_class={self.collector_class.__name__} runs its own workers: give their number with "
                "collector_kwargs={'num_workers': K}"
            )
        self._schemes = validate_schemes(weight_sync_schemes)
        if weight_updater is not None and weight_sync_schemes is not None:
            raise ValueError("give weight_sync_schemes or weight_updater, not both (as in torchrl)")
        if any(f is not None for f in factories) and policy is not None and "policy" not in self._schemes:
            raise ValueError(
                "policy and policy_factory were both given but weight_sync_schemes has no 'policy' scheme: pass "
                "weight_sync_schemes={'policy': SharedMemWeightSyncScheme()} (policy is then only the source of "
                "weights), or give just one of policy / policy_factory"
            )
        if replay_buffer is not None and not callable(getattr(replay_buffer, "extend", None)):
            raise TypeError(f"replay_buffer must have an extend() method, got {type(replay_buffer).__name__}")
        self.replay_buffer, self.extend_buffer = replay_buffer, extend_buffer
        self._workers_write = _shared_buffer(replay_buffer)
        if self._workers_write:
            _pickled("postproc", postproc, "define it as a module-level function: the workers apply it before writing")
        self.postproc, self.split_trajs, self.return_same_td = postproc, split_trajs, return_same_td
        self.update_at_each_batch = bool(update_at_each_batch)
        self.per_worker_weights = bool(per_worker_weights)
        self.init_random_frames = torchrl_args.random_frames(init_random_frames)
        self.policy = policy
        self._weight_source = policy if has_weights(policy) else None
        self._storing_devices = [devices["storing_device"][i] or devices["device"][i] for i in range(n)]
        self._storing_device = self._storing_devices[0]
        if self._sync and len({None if d is None else str(d) for d in self._storing_devices}) > 1:
            raise ValueError(f"storing_device: MultiSyncCollector joins the workers' batches into one, so every worker "
                             f"must store on the same device; got {[str(d) for d in self._storing_devices]} (use "
                             "MultiAsyncCollector, which delivers each worker's batch on its own storing_device)")
        # -- per-worker specs, validated here before any process starts --------------------------
        specs = []
        for i in range(n):
            kwargs = {
                "policy_factory": factories[i],
                "frames_per_batch": frames[i],
                "create_env_kwargs": kwargs_list[i],
                "init_random_frames": None,
                "use_buffers": True,
                **{name: devices[name][i] for name in PER_WORKER_ARGS},
                **inner_options,
            }
            # Unique trajectory-id blocks also when this collector is itself nested in a worker.
            kwargs["worker_idx"] = i if worker_idx is None else worker_idx * n + i
            kwargs.update(collector_kwargs)
            if self.collector_class is Collector:
                CollectorConfig(**{k: v for k, v in kwargs.items() if k in CollectorConfig.__dataclass_fields__})
            if "policy" in self._schemes and factories[i] is not None and policy is not None:
                kwargs["weight_sync_schemes"] = {"policy": self._schemes["policy"]}
            sent_policy = None if factories[i] is not None else policy
            _pickled("create_env_fn", env_fns[i], "pass a module-level factory function (or a gymnasium id) instead "
                     "of an object that holds unpicklable state")
            _pickled("policy", sent_policy, "build it inside the workers with policy_factory=<a function>")
            specs.append({
                "collector_class": self.collector_class, "create_env_fn": env_fns[i], "policy": sent_policy,
                "kwargs": kwargs, "preemptive": preemptive_threshold is not None,
                "replay_buffer": replay_buffer.share() if self._workers_write else None,
                "write_options": {"postproc": postproc, "split_trajs": split_trajs, "extend_buffer": extend_buffer},
            })
        payloads = [cloudpickle.dumps(spec) for spec in specs]
        self._restart = RestartPolicy(on_worker_failure, max_worker_restarts, specs)
        self._in_updater = False
        self.weight_updater = None
        # -- start ---------------------------------------------------------------------------------
        start.check_fork_is_safe(self.mp_start_method, [d for ds in devices.values() for d in ds], policy)
        start.check_not_bootstrapping()
        self._previous_threads = torch.get_num_threads()
        torch.set_num_threads(num_threads or max(1, (os.cpu_count() or 1) - n))
        self._frames = 0
        self._iter = 0
        self._version = 0
        self._stats = WorkerStats(n)
        self._iterator: Iterator | None = None
        try:
            self._pool = WorkerPool(start.get_context(self.mp_start_method), payloads, num_sub_threads, self.worker_timeout,
                                    self.start_timeout)
        except BaseException:
            torch.set_num_threads(self._previous_threads)  # no shutdown() will run to restore it
            raise
        self._finalizer = weakref.finalize(self, _shutdown, self._pool, self._previous_threads)
        self._closed = False
        try:
            self._attach()
            self._weights.check_models()
            self.weight_updater = make_weight_updater(weight_updater, self)
        except BaseException:
            self.shutdown()
            raise

    # -- set-up ------------------------------------------------------------------------------------
    def _check_cat_results(self, value: Any) -> str | int:
        raise NotImplementedError

    def _attach(self) -> None:
        """Allocate every worker's shared batch slots and weight store and hand them over;
        build the collaborators that need the started workers."""
        pool = self._pool
        self.layouts = [h.info["layout"] for h in pool.handles]
        self._allocate_slots()
        self._stops = [torch.zeros(1, dtype=torch.uint8).share_memory_() for _ in range(self.num_workers)]
        self._weights = WorkerWeights(pool, self._schemes, self.policy, self._weight_source, self.per_worker_weights,
                                      queued=not self._sync, models=weakref.ref(self))
        self._restarts = WorkerRestarts(self._restart, pool, self.layouts, self.collector_class is Collector,
                                        after=self._weights.resend)
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
        self._buffers = [[slot_buffer(flat, layout) for flat in slots] for slots, layout in zip(self._slots, self.layouts)]

    def _attach_worker(self, index: int) -> None:
        self._pool.attach(index, self._slots[index], self._stops[index], self._weights.store_for(index))

    # -- delivery -------------------------------------------------------------------------------
    def _deliver(self, batch: TensorDict, stacked_workers: bool = False, worker: int | None = None) -> TensorDict | None:
        storing = self._storing_device if worker is None else self._storing_devices[worker]
        return deliver(batch, storing_device=storing, split_trajs=self.split_trajs,
                       postproc=self.postproc, replay_buffer=self.replay_buffer, extend_buffer=self.extend_buffer,
                       stacked_workers=stacked_workers)

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

    def frames_per_batch_worker(self, worker_idx: int | None = None) -> int:
        """Frames in each batch worker ``worker_idx`` collects (torchrl's; None: worker 0).

        Example:
            >>> from rlcollect import MultiAsyncCollector
            >>> c = MultiAsyncCollector(["CartPole-v1"] * 2, frames_per_batch=[10, 30], total_frames=80)
            >>> c.frames_per_batch_worker(1), c.requested_frames_per_batch
            (30, 40)
            >>> c.shutdown()
        """
        index = 0 if worker_idx is None else worker_idx
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < self.num_workers:
            raise ValueError(f"worker_idx must be None or an int in 0..{self.num_workers - 1}, got {worker_idx!r}")
        return self._worker_frames_per_batch[index]

    def _next_batch(self) -> TensorDict | None:
        raise NotImplementedError

    @contextlib.contextmanager
    def _guard(self) -> Iterator[None]:
        """A control call that fails because a worker died shuts the collector down."""
        self._check_open()
        try:
            yield
        except WorkerError:
            self.shutdown()
            raise

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
    def set_seed(self, seed: int, static_seed: bool = False) -> int:
        """Seed worker 0 with ``seed``, worker 1 with what that returned, and so on; returns the
        last seed.  Batches collected before the call and not yet delivered are discarded.

        Example:
            >>> from rlcollect import MultiSyncCollector
            >>> c = MultiSyncCollector("CartPole-v1", num_workers=2, frames_per_batch=20)
            >>> c.set_seed(0)
            2
            >>> c.shutdown()
        """
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"seed must be an int, got {seed!r}")
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
        """An attribute of worker 0's policy."""
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

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict()``; the workers continue their saved streams."""
        if not isinstance(state, dict):
            raise TypeError(f"load_state_dict expects the dict state_dict() returned, got {type(state).__name__}")
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
    def update_policy_weights_(self, policy_or_weights: Any = None, *, weights: Any = None, policy: Any = None,
                               worker_ids: Any = None, model_id: str | None = None,
                               weights_dict: dict | None = None) -> None:
        """Push new weights to the workers (all, or ``worker_ids``) with a new version.

        The weights (positionally, ``weights=`` or ``policy=``): None (the main ``policy``'s),
        an ``nn.Module``, a TensorDict of parameters, a state dict, or with
        ``per_worker_weights=True`` a dict ``{worker_index: weights}``. ``model_id`` names the
        model (default ``"policy"``; any other must be a key of ``weight_sync_schemes``, an
        attribute path in each worker's collector such as ``"policy.module[0]"``);
        ``weights_dict={model_id: weights}`` updates several models with one version. The
        workers take them between two batches; every frame records the version that acted in
        ``("collector", "policy_version")`` when ``track_policy_version=True``. With
        ``weight_updater`` the call goes to it instead (no ``model_id`` / ``weights_dict``).

        Example:
            >>> import torch
            >>> from rlcollect import MultiSyncCollector, CountingEnv
            >>> class Policy(torch.nn.Module):
            ...     def __init__(self):
            ...         super().__init__()
            ...         self.bias = torch.nn.Parameter(torch.zeros(1))
            ...     def forward(self, observation):
            ...         return (observation[..., 0] * 0 + self.bias[0]).long()
            >>> c = MultiSyncCollector(CountingEnv, Policy(), num_workers=2, frames_per_batch=8)
            >>> c.update_policy_weights_(weights={"bias": torch.ones(1)})
            >>> c.worker_policy_versions()
            [1, 1]
            >>> c.shutdown()
        """
        self._check_open()
        if delegate_to_updater(self, policy_or_weights, weights=weights, policy=policy, model_id=model_id,
                               weights_dict=weights_dict, worker_ids=worker_ids,
                               hint="; use weight_sync_schemes for several models"):
            return
        models = update_targets(policy_or_weights, weights=weights, policy=policy, model_id=model_id,
                                weights_dict=weights_dict)
        plan = self._weights.plan(models, worker_ids)
        if plan:
            self._push(plan, lambda: self._version + 1)

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
        return self._weights.spec

    def weights_module(self, model_id: str = "policy") -> Any:
        """The main process's ``policy`` (the source of the workers' weights); only ``"policy"``."""
        if model_id != "policy":
            raise ValueError(f"model_id {model_id!r}: a nested multi-process collector updates only 'policy'")
        return self.policy

    def set_weights(self, state: Any, version: int, model_id: str = "policy") -> None:
        """Have every worker act with ``state`` (None: ``policy``'s weights, as they are now)
        from its next batch on, with ``policy_version`` set to ``version`` (the number of the
        worker or node that runs this collector, not a bump)."""
        self._check_open()
        module = self.weights_module(model_id)
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
        return self._stats.summary(frames=self._frames, batches=self._iter, version=self._version, alive=alive,
                                   restarts=self._restart.counts, replay_buffer=self.replay_buffer)

    # -- observability ------------------------------------------------------------------------------
    def enable_profile(self, path: str = "rlcollect_trace.json", *, rollouts=(0,), workers=(0,), **profiler_kwargs) -> None:
        """Record torch.profiler traces of the chosen rollouts inside the chosen workers; worker
        ``i`` writes ``<path stem>.worker<i><ext>`` (see ``Collector.enable_profile``)."""
        root, ext = os.path.splitext(os.fspath(path))
        for i in workers:
            self._broadcast(P.ENABLE_PROFILE, f"{root}.worker{i}{ext or '.json'}", tuple(rollouts), profiler_kwargs,
                            workers=[i])

    # -- shutdown -------------------------------------------------------------------------------------
    def shutdown(self, timeout: float | None = None, close_env: bool = True, raise_on_error: bool = True) -> None:
        """Stop every worker (close -> terminate -> kill within ``timeout``, None: 10 s), free
        shared memory, restore the main process's torch threads. Idempotent.  torchrl's
        ``close_env`` must be True (workers own their envs); ``raise_on_error=False`` logs an
        error met while stopping instead of raising it.

        Example:
            >>> from rlcollect import MultiSyncCollector
            >>> c = MultiSyncCollector("CartPole-v1", num_workers=2, frames_per_batch=20)
            >>> c.shutdown(); c.shutdown()
        """
        torchrl_args.check_close_env(close_env, type(self).__name__)
        timeout = torchrl_args.check_timeout(timeout, 10.0)
        try:
            self._shutdown(timeout)
        except Exception:
            if raise_on_error:
                raise
            logger.exception("rlcollect: error while shutting down %s (raise_on_error=False)", type(self).__name__)

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
        if pool is not None:
            self._finalizer.detach()
            _shutdown(pool, self._previous_threads, timeout)
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


def _shutdown(pool: WorkerPool, threads: int, timeout: float = 10.0) -> None:
    pool.shutdown(timeout)
    torch.set_num_threads(threads)

