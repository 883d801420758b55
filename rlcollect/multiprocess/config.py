"""The validated options of a multi-process collector, and the spec each worker is started
from.  Every argument is checked here, in the main process, before any process starts; each
error names the argument and what is accepted (the shared checks are in rlcollect/config.py).

Example:
    >>> cfg = MultiConfig(sync=True, create_env_fn="CartPole-v1", num_workers=2, frames_per_batch=20)
    >>> cfg.num_workers, cfg.worker_frames, cfg.frames_per_batch, cfg.cat_results
    (2, [10, 10], 20, 'stack')
    >>> MultiConfig(sync=False, create_env_fn="CartPole-v1", num_workers=2, frames_per_batch=20,
    ...             cat_results=0)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: cat_results must be None or 'stack' for MultiAsyncCollector (...), got 0
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import cloudpickle
import torch

from rlcollect import torchrl_args
from rlcollect.collector import SingleCollector
from rlcollect.trajectories import check_traj_args
from rlcollect.config import (CollectorConfig, check_policy_sources, check_replay_buffer, check_weight_updater,
                              device_arg, kwargs_arg, optional_positive_int, per_member, positive_int,
                              resolve_collector_class, seconds, total_frames_arg)
from rlcollect.multiprocess import start
from rlcollect.multiprocess.pool import DEFAULT_START_TIMEOUT_S
from rlcollect.multiprocess.recovery import RestartPolicy
from rlcollect.policy import as_exploration_type, has_weights
from rlcollect.policy_transforms import PolicyTransforms
from rlcollect.torchrl_args import version_tracker
from rlcollect.weights.schemes import validate_schemes

#: The ``Args:`` section of the multi-process collectors' docstrings (``MultiSyncCollector``,
#: ``MultiAsyncCollector``, ``MultiCollector``): one entry per parameter of their signature.
ARGS_DOC = """
    Args:
        create_env_fn (env | str | callable | list): what each worker builds its env from: an
            env instance (pickled to the workers), a gymnasium id, a callable returning an env,
            or a list with one of these per worker (``num_workers`` is then its length).
            Required. Must be picklable (a module-level function, ``functools.partial``).
        policy (nn.Module | TensorDictModule | callable | None): the policy; None (default)
            acts randomly. Sent to each worker, which acts with its own copy whose weights
            ``update_policy_weights_()`` keeps in sync from this one; with
            ``inference="central"`` it acts in this process for every worker.
        num_workers (int | None): the number of worker processes. Required unless
            ``create_env_fn`` is a list (default None).
        policy_factory (callable | list | None): builds the policy inside each worker (one per
            worker in a list) instead of sending ``policy``; with ``policy`` too, ``policy`` is
            only the source of weights and ``weight_sync_schemes`` must name ``"policy"``
            (default None).
        frames_per_batch (int | list[int]): frames per yielded batch. Sync: the total over the
            workers (each collects ``ceil(F / num_workers)``); async: each worker's batch. A
            list gives each worker its own count. Required.
        total_frames (int): stop after this many frames; -1 (default), None or any negative
            int: never.
        device (str | torch.device | list | None): the default for the three devices below,
            per worker in a list (default None: the CPU).
        storing_device (str | torch.device | list | None): where delivered batches are stored
            (default None: ``device``); sync collectors need one for all workers.
        env_device (str | torch.device | list | None): where each worker's env runs (default
            None: ``device``).
        policy_device (str | torch.device | list | None): where the policy runs (default
            None: ``device``); one device with ``inference="central"``.
        create_env_kwargs (dict | list | None): keyword arguments for ``create_env_fn`` (one
            dict per worker in a list; default None: none).
        collector_class (type | str): the collector each worker runs: ``Collector`` (default),
            ``MultiSyncCollector`` / ``MultiAsyncCollector`` (or ``"single"``, ``"sync"``,
            ``"async"``) to nest, with the inner ``num_workers`` in ``collector_kwargs``.
        preemptive_threshold (float | None): sync only: once this fraction (0..1) of the
            workers delivered, the others stop at their next step and their unfilled frames
            are masked or dropped (default None: wait for all).
        cat_results (str | int | None): how sync batches are joined: ``"stack"`` (default,
            also None) gives ``(N, *env_batch, T)``; an int dim concatenates along it (``0``:
            the first dim, ``-1``: time). Async accepts only None / ``"stack"``.
        update_at_each_batch (bool): push ``policy``'s weights before each batch (async: to
            the delivering worker) (default False).
        num_threads (int | None): torch threads of the main process (default None: cores
            minus workers, at least 1).
        num_sub_threads (int): torch threads of each worker (default 1).
        mp_start_method (str | None): ``"fork"``, ``"forkserver"`` or ``"spawn"``; None
            (default) picks ``"fork"`` where it is safe (no CUDA initialised, no other thread)
            and ``"forkserver"`` otherwise.
        worker_timeout (float | None): seconds a worker may take for one batch or reply
            before it counts as failed (default None: no limit).
        start_timeout (float): seconds a worker may take to start (default 120); a slower one
            raises ``WorkerError`` "during start-up".
        on_worker_failure (str): ``"raise"`` (default): a failed worker shuts the collector
            down and raises ``WorkerError`` with its index and traceback; ``"restart"``:
            replace it and collect its share again.
        max_worker_restarts (int): restarts allowed per worker with ``"restart"`` (default 3).
        init_random_frames (int | None): the batches started before this many frames were
            delivered (or written to ``replay_buffer``) act randomly (default None: 0).
        postproc (callable | None): applied to each batch before it is yielded or written
            (default None).
        split_trajs (bool): yield ``split_trajectories(batch)`` (default False).
        return_same_td (bool): torchrl's; accepted for parity (every delivered batch is its
            own memory, never overwritten by the next) (default False).
        replay_buffer (object | None): an object with ``extend()``: batches go there and
            iteration yields None; an ``rlcollect.ReplayBuffer`` is written by the workers
            themselves (default None).
        extend_buffer (bool): write batches to ``replay_buffer`` as a whole (default True).
        use_buffers (bool | None): torchrl's; every value accepted (None: True): batches
            always cross through shared-memory slots and every delivered batch is fresh memory (default True).
        weight_sync_schemes (dict | None): ``{model_id: scheme}``: how each model's weights
            reach the workers (``"shared"`` memory by default for ``"policy"``, ``"process"``
            pipes, ``"none"``) (default None).
        per_worker_weights (bool): one weight store per worker, so that
            ``update_policy_weights_({i: weights})`` may differ per worker (default False).
        weight_updater (object | callable | None): torchrl's legacy weight updater, called by
            ``update_policy_weights_`` instead of the built-in path (default None).
        collector_kwargs (dict | None): extra keyword arguments of each worker's collector
            (default None).
        worker_idx (int | None): this collector's index when it runs inside another
            collector's worker (its trajectory ids stay unique) (default None).
        reset_when_done (bool): torchrl's; must be True (default): an env is reset in the
            step it ends.
        local_init_rb (bool | None): torchrl's; accepted, without effect (a replay buffer's
            storage exists when it is created) (default None).
        inference (str): ``"worker"`` (default): each worker runs its own copy of the policy;
            ``"central"``: the workers only step envs and this process runs the policy for all
            of them, one batched forward per step (rlcollect's; torchrl has no such argument).
        env_splits (int | None): with ``inference="central"``, the groups each worker's envs
            are split into, stepped while the others wait for actions (default None: 2).
        max_wait_us (float): with ``inference="central"``, how long a forward waits for more
            workers once one is ready, in microseconds (default 0).
        pre_collect_hook (callable | None): torchrl 0.14's: called with no argument in this
            process before each batch is asked for (default None; settable as an attribute).
        post_collect_hook (callable | None): torchrl 0.14's: called in this process with each
            delivered batch after ``postproc``, before it is yielded or written into a replay
            buffer the main process writes (default None; the attribute and
            ``set_post_collect_hook`` set it later). torchrl calls both in each worker on its
            part instead.
        max_policy_lag (int | None): async only: no frame is delivered whose acting policy
            version is more than this many versions behind the collector's ``policy_version``
            at delivery (default None: no bound). ``lag_policy`` says what happens to such work.
        lag_policy (str): with ``max_policy_lag``: ``"drop"`` (default): stale batches are
            discarded and counted (``stats()["lag_dropped_frames"]``, per worker, and in the
            next batch's ``("collector", "lag_dropped_frames")``); ``"wait"``: at most
            ``max_policy_lag + 1`` batches are in flight, each started once the trainer's last
            update reached the workers, and delivered in the order they were started, so a
            trainer that updates at most once per batch never receives a stale one (any that
            still is, after more updates, is dropped and counted as with ``"drop"``); ``"tag"``:
            delivered anyway, tagged with their version (the behaviour without a bound).
        record (str | os.PathLike | None): async only: write the schedule of this run (which
            worker's batch was delivered or dropped when, the policy version each acted with,
            restarts, seeds) to this file, as JSON lines (default None: none).
        replay (str | os.PathLike | None): async only: make the run recorded in this file
            again: with the same envs, seeds and weight updates, the same batches in the same
            order, bit for bit, whatever the timing. Weights then travel through the workers'
            pipes (``weight_sync_schemes`` must be None or ``{"policy": "process"}``); not with
            ``inference="central"`` nor ``start()`` (default None: none).
        **inner_options: options passed unchanged to each worker's ``Collector``:
            ``max_frames_per_traj`` (truncate trajectories), ``reset_at_each_iter``,
            ``exploration_type`` (default ``"random"``), ``set_truncated``, ``trust_policy``,
            ``compile_policy``, ``cudagraph_policy``, ``no_cuda_sync``, ``track_policy_version``,
            ``check_finite`` (each as in ``Collector``); and torchrl 0.14's ``track_traj_ids`` (False drops
            ``("collector", "traj_ids")``), ``compact_obs`` (True drops the ``("next", ...)``
            copies of root entries), ``weight_recv_schemes`` (only None), applied in this
            process; ``trajs_per_batch``, ``trajs_per_write``, ``traj_format`` (batches of
            whole trajectories, assembled in this process from the workers' batches, as in
            ``Collector``; not with an rlcollect ``ReplayBuffer``, which the workers write);
            ``auto_register_policy_transforms`` (each worker appends the transforms the policy
            needs to its torchrl envs, as ``Collector``; not with ``inference="central"``);
            ``init_fn`` (torchrl 0.14's: a picklable callable run with no argument in each worker
            process, and in a worker started to replace one, before its env and policy are
            built; an exception in it is that worker's start-up failure). Any other name is a
            ``TypeError``.
"""

#: The docstrings of ``MultiSyncCollector`` and ``MultiAsyncCollector``.
SYNC_DOC = """Run a collector in each of ``num_workers`` processes and yield their batches together.

    Each batch holds exactly one contribution from every worker, collected with the same
    weights (an update made between batches is seen by every frame of the next batch).
    Workers write into shared memory allocated once; only short messages cross the pipes.
    When the workers' batches have the same layout, they write into one stacked shared slot
    and the batch you get is a view of it (two such slots take turns; a slot is reused only
    once you no longer hold its batch, else a reserve slot is used and the batch copied).

    With ``cat_results="stack"`` (default) a batch has shape ``(N, *env_batch, T)``; ``0``
    concatenates the workers' batches along the first dim, ``-1`` along time.
    ``preemptive_threshold=p``: once a fraction ``p`` of the workers delivered, the others stop
    at their next step; their unfilled frames are masked (``("collector", "mask")`` False,
    traj id -1) with "stack", or dropped with an int ``cat_results`` (counted in
    ``stats()["dropped_frames"]``).
""" + ARGS_DOC + """
    Example:
        >>> from rlcollect import MultiSyncCollector
        >>> with MultiSyncCollector("CartPole-v1", num_workers=2, frames_per_batch=200, total_frames=400) as c:
        ...     shapes = [batch.shape for batch in c]
        >>> shapes
        [torch.Size([2, 100]), torch.Size([2, 100])]
    """

ASYNC_DOC = """Run a collector in each of ``num_workers`` processes and yield each worker's batch as
    soon as it is ready.

    Each worker has three shared-memory slots: the batch you get is a view of the slot the
    worker wrote (nothing is copied), lent to you until you let go of it, while the worker fills
    the other two, so it never waits for the trainer. A worker's slot is never overwritten while
    you hold its batch: when you already hold one batch of that worker, the next one is copied
    out of its slot instead. Every yielded batch is one worker's ``frames_per_batch`` frames
    with ``("collector", "worker_id")``.
    ``set_seed``, ``reset`` and ``load_state_dict`` discard the batches in flight.
    ``max_policy_lag`` bounds how many versions behind the trainer a delivered batch may be;
    ``record=`` / ``replay=`` write a run's schedule and make the same run again.
""" + ARGS_DOC + """
    Example:
        >>> from rlcollect import MultiAsyncCollector
        >>> with MultiAsyncCollector("CartPole-v1", num_workers=2, frames_per_batch=100, total_frames=300) as c:
        ...     shapes = [batch.shape for batch in c]
        >>> shapes
        [torch.Size([100]), torch.Size([100]), torch.Size([100])]
    """

PER_WORKER_ARGS = ("device", "storing_device", "env_device", "policy_device")
#: ``inference``: each worker runs its own copy of the policy, or the main process runs it for all.
INFERENCE_MODES = ("worker", "central")
#: ``lag_policy``: what happens to work more than ``max_policy_lag`` versions behind.
LAG_POLICIES = ("drop", "wait", "tag")
#: Options forwarded unchanged to each worker's inner collector.
INNER_OPTIONS = (
    "max_frames_per_traj", "reset_at_each_iter", "exploration_type", "set_truncated", "trust_policy",
    "compile_policy", "cudagraph_policy", "no_cuda_sync", "track_policy_version", "check_finite",
    "auto_register_policy_transforms",
)
#: torchrl 0.14's options taken through ``**inner_options`` and held here: applied in the main
#: process, or (``init_fn``) sent to every worker.
FACE_OPTIONS = ("weight_recv_schemes", "track_traj_ids", "compact_obs", "trajs_per_batch", "trajs_per_write",
                "traj_format", "init_fn")
#: Where warnings point: the user's call (user -> collector __init__ -> MultiConfig __init__ ->
#: __post_init__ -> a check here).
_USER = 5


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


def _cat_results(value: Any, sync: bool) -> str | int:
    if not sync:
        if value is None or value == "stack":
            return "stack"
        raise ValueError(f"cat_results must be None or 'stack' for MultiAsyncCollector (it yields one worker's "
                         f"batch at a time), got {value!r}")
    if value is None:
        return "stack"
    if value == "stack" or (isinstance(value, int) and not isinstance(value, bool)):
        return value  # an int dim is checked against the workers' batch dims once they report them
    raise ValueError(f"cat_results must be 'stack' or an int dim of the workers' batches (0, -1, ...), got {value!r}")


@dataclasses.dataclass
class MultiConfig:
    """Every option of ``MultiSyncCollector`` (``sync=True``) or ``MultiAsyncCollector``,
    validated, and what follows from them: one entry per worker (``env_fns``,
    ``worker_frames``, ``storing_devices``) and the worker specs (``specs``)."""

    sync: bool
    create_env_fn: Any
    policy: Any = None
    num_workers: int | None = None
    policy_factory: Callable | list | None = None
    frames_per_batch: int | list[int] = 0
    total_frames: int = -1
    device: Any = None
    storing_device: Any = None
    env_device: Any = None
    policy_device: Any = None
    create_env_kwargs: dict | list | None = None
    collector_class: Any = SingleCollector
    preemptive_threshold: float | None = None
    cat_results: str | int | None = None
    update_at_each_batch: bool = False
    num_threads: int | None = None
    num_sub_threads: int = 1
    mp_start_method: str | None = None
    worker_timeout: float | None = None
    start_timeout: float = DEFAULT_START_TIMEOUT_S
    on_worker_failure: str = "raise"
    max_worker_restarts: int = 3
    init_random_frames: int | None = None
    postproc: Callable | None = None
    split_trajs: bool = False
    return_same_td: bool = False
    replay_buffer: Any = None
    extend_buffer: bool = True
    use_buffers: bool = True
    weight_sync_schemes: dict | None = None
    per_worker_weights: bool = False
    weight_updater: Any = None
    collector_kwargs: dict | None = None
    worker_idx: int | None = None
    reset_when_done: bool = True
    local_init_rb: bool | None = None
    inference: str = "worker"
    env_splits: int | None = None
    max_wait_us: float = 0.0
    pre_collect_hook: Callable | None = None
    post_collect_hook: Callable | None = None
    # torchrl 0.14's, given through **inner_options (FACE_OPTIONS); applied in this process
    weight_recv_schemes: None = None
    track_traj_ids: bool = True
    compact_obs: bool = False
    trajs_per_batch: int | None = None
    trajs_per_write: int | None = None
    traj_format: str | None = None
    init_fn: Callable[[], Any] | None = None
    max_policy_lag: int | None = None
    lag_policy: str = "drop"
    record: Any = None
    replay: Any = None
    inner_options: dict = dataclasses.field(default_factory=dict)
    owner: str = "MultiSyncCollector"  # the class name errors give

    def __post_init__(self) -> None:
        for name in FACE_OPTIONS:
            if name in self.inner_options:
                setattr(self, name, self.inner_options.pop(name))
        torchrl_args.check_init_fn(self.init_fn)
        torchrl_args.check_recv_schemes(self.weight_recv_schemes)
        torchrl_args.check_face(self.track_traj_ids, self.compact_obs, self.split_trajs)
        unknown = set(self.inner_options) - set(INNER_OPTIONS)
        if unknown:
            raise TypeError(f"{self.owner} got unexpected arguments {sorted(unknown)}")
        inner = self.inner_options = dict(self.inner_options)
        torchrl_args.check_reset_when_done(self.reset_when_done)
        torchrl_args.check_hook("pre_collect_hook", self.pre_collect_hook)
        torchrl_args.check_hook("post_collect_hook", self.post_collect_hook)
        self.local_init_rb = torchrl_args.check_local_init_rb(self.local_init_rb)
        self.use_buffers = torchrl_args.use_buffers(self.use_buffers)
        self.version_tracker = None
        if "track_policy_version" in inner:  # a torchrl PolicyVersion stays here; workers get True
            inner["track_policy_version"], self.version_tracker = version_tracker(inner["track_policy_version"])
        if "exploration_type" in inner:  # travels as a plain string
            inner["exploration_type"] = as_exploration_type(inner["exploration_type"])
        if "auto_register_policy_transforms" in inner:  # each worker adds them to its envs; checked here
            PolicyTransforms.needed_by(self.policy, inner["auto_register_policy_transforms"])
        self._workers()
        self._trajectories()
        self._schedule()
        self._options()
        self._inference()
        self._lag()
        self.specs = [self._spec(i) for i in range(self.num_workers)]

    def _workers(self) -> None:
        """The workers and the per-worker lists."""
        fns, num = self.create_env_fn, self.num_workers
        if isinstance(fns, Sequence) and not isinstance(fns, (str, bytes)):  # OmegaConf's ListConfig too
            if not fns:
                raise ValueError("create_env_fn is an empty list; give one env factory per worker")
            if num is not None and num != len(fns):
                raise ValueError(f"num_workers={num} but create_env_fn lists {len(fns)} envs (one per worker)")
            self.env_fns = list(fns)
        else:
            if num is None:
                raise ValueError("num_workers is required when create_env_fn is not a list (one entry per worker)")
            self.env_fns = [fns] * positive_int("num_workers", num)
        n = self.num_workers = len(self.env_fns)
        self.total_frames = total_frames_arg(self.total_frames)
        fpb = self.frames_per_batch
        if isinstance(fpb, (list, tuple)):
            frames = [positive_int("frames_per_batch", f) for f in per_member("frames_per_batch", fpb, n, "worker")]
        else:
            positive_int("frames_per_batch", fpb)
            if self.sync:
                if fpb % n:
                    torchrl_args.warn(f"frames_per_batch={fpb} is not divisible by num_workers={n}: each worker "
                                      f"collects {math.ceil(fpb / n)} frames", stacklevel=_USER)
                frames = [math.ceil(fpb / n)] * n
            else:
                frames = [fpb] * n
        # async with one size per worker: a batch is one worker's, so frames_per_batch stays the list
        self.frames_per_batch = sum(frames) if self.sync else fpb
        # torchrl's requested_frames_per_batch: a sync batch's frames, or what async was given
        # (an async batch is one worker's; a per-worker list counts all of them)
        self.requested_frames_per_batch = sum(fpb) if isinstance(fpb, (list, tuple)) else self.frames_per_batch
        self.worker_frames = frames
        self.env_kwargs = per_member("create_env_kwargs", self.create_env_kwargs, n, "worker")
        self.factories = per_member("policy_factory", self.policy_factory, n, "worker")
        self.devices = {name: per_member(name, getattr(self, name), n, "worker") for name in PER_WORKER_ARGS}
        for name, values in self.devices.items():  # a bad device fails here, not in a worker
            for value in values:
                device_arg(name, value)
        per_batch = self.frames_per_batch
        if self.total_frames > 0 and isinstance(per_batch, int) and self.total_frames % per_batch:
            # Named as the user wrote them: a sync batch of 1001 frames over 2 workers is 1002.
            given = f"frames_per_batch={fpb}" + (f" (a batch of {per_batch}: {n} workers x {frames[0]})"
                                                 if per_batch != fpb else "")
            if self.total_frames < per_batch:
                torchrl_args.warn(f"total_frames={self.total_frames} is less than {given}: the only batch has "
                                  f"{per_batch} frames", stacklevel=_USER)
            else:
                torchrl_args.warn(f"total_frames={self.total_frames} is not a multiple of {given}: the last batch "
                                  "overshoots to a whole batch", stacklevel=_USER)

    def _options(self) -> None:
        """The options of the collector itself."""
        p = self.preemptive_threshold
        if p is not None:
            if not self.sync:
                raise ValueError("preemptive_threshold is only supported by MultiSyncCollector (got it for async)")
            if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= p <= 1.0:
                raise ValueError(f"preemptive_threshold must be a number in [0, 1], got {p!r}")
        self.cat_results = _cat_results(self.cat_results, self.sync)
        self.mp_start_method = start.resolve_start_method(self.mp_start_method)
        RestartPolicy(self.on_worker_failure, self.max_worker_restarts, [])  # validates both arguments
        if self.worker_timeout is not None:
            self.worker_timeout = seconds("worker_timeout", self.worker_timeout,
                                          "a positive number of seconds or None", finite=True)
        self.start_timeout = seconds("start_timeout", self.start_timeout, "a positive, finite number of seconds "
                                     f"(default {DEFAULT_START_TIMEOUT_S:g})", finite=True)
        optional_positive_int("num_threads", self.num_threads)
        positive_int("num_sub_threads", self.num_sub_threads)
        self.collector_class = resolve_collector_class(self.collector_class)
        self.collector_kwargs = kwargs_arg("collector_kwargs", self.collector_kwargs)
        if self.collector_kwargs.get("postproc") is not None:  # workers fill slots: it would never run
            raise ValueError(f"collector_kwargs['postproc'] is not applied by {self.owner}'s workers (they fill "
                             "shared batch slots); pass postproc=f to the collector itself")
        if not issubclass(self.collector_class, SingleCollector) and "num_workers" not in self.collector_kwargs:
            raise ValueError(f"collector_class={self.collector_class.__name__} runs its own workers: give their number "
                             "with collector_kwargs={'num_workers': K}")
        self.schemes = validate_schemes(self.weight_sync_schemes)
        check_weight_updater(self.weight_updater, self.weight_sync_schemes)
        check_policy_sources(self.policy, any(f is not None for f in self.factories), self.schemes)
        check_replay_buffer(self.replay_buffer)
        self.workers_write = _shared_buffer(self.replay_buffer)
        if self.workers_write:
            _pickled("postproc", self.postproc, "define it as a module-level function: the workers apply it before "
                     "writing")
        self.update_at_each_batch = bool(self.update_at_each_batch)
        self.per_worker_weights = bool(self.per_worker_weights)
        self.init_random_frames = torchrl_args.random_frames(self.init_random_frames)
        self.weight_source = self.policy if has_weights(self.policy) else None
        self.storing_devices = [self.devices["storing_device"][i] or self.devices["device"][i]
                                for i in range(self.num_workers)]
        if self.sync and len({None if d is None else str(d) for d in self.storing_devices}) > 1:
            raise ValueError(f"storing_device: MultiSyncCollector joins the workers' batches into one, so every worker "
                             f"must store on the same device; got {[str(d) for d in self.storing_devices]} (use "
                             "MultiAsyncCollector, which delivers each worker's batch on its own storing_device)")

    def _schedule(self) -> None:
        """``record`` / ``replay``: async, in-worker inference; replaying, weights by pipe (each
        worker acts with the weights pushed before it was asked for a batch)."""
        given = {name: value for name, value in (("record", self.record), ("replay", self.replay))
                 if value is not None}
        if not given:
            return
        if len(given) > 1:
            raise ValueError("give record or replay, not both")
        (name, value), = given.items()
        if self.sync:
            raise ValueError(f"{name}: MultiSyncCollector runs are reproducible already (every batch waits for every "
                             "worker); record and replay are for MultiAsyncCollector")
        if self.inference == "central":
            raise ValueError(f"{name} cannot be used with inference='central': a batch's frames may be collected "
                             "with several versions there")
        if name == "replay":
            schemes = self.weight_sync_schemes
            if schemes is None:
                self.weight_sync_schemes = {"policy": "process"}
            elif schemes != {"policy": "process"}:
                raise ValueError(f"replay needs the weights to reach the workers by pipe, in order with the requests "
                                 f"for batches: weight_sync_schemes must be None or {{'policy': 'process'}}, got "
                                 f"{schemes!r}")

    def _lag(self) -> None:
        """``max_policy_lag`` and ``lag_policy``; ``lag_bound`` is the bound enforced (None:
        none, also with ``"tag"``)."""
        if self.lag_policy not in LAG_POLICIES:
            raise ValueError(f"lag_policy must be one of {LAG_POLICIES}, got {self.lag_policy!r}")
        k = self.max_policy_lag
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 0):
            raise ValueError(f"max_policy_lag must be None or an int >= 0 (versions), got {k!r}")
        self.lag_bound = None if k is None or self.lag_policy == "tag" else k
        if self.lag_bound is None:
            return
        if self.sync:
            raise ValueError(f"max_policy_lag={k}: MultiSyncCollector delivers every batch collected with the "
                             "trainer's current weights already; use it with MultiAsyncCollector")
        if self.workers_write:
            raise ValueError(f"max_policy_lag={k} with lag_policy={self.lag_policy!r}: the workers write this "
                             "rlcollect ReplayBuffer themselves, so no batch passes through this process to be "
                             "checked; use lag_policy='tag', or a replay buffer this process extends")

    def _trajectories(self) -> None:
        """``trajs_per_batch`` (assembled in this process from the workers' batches),
        ``trajs_per_write``, ``traj_format``."""
        check_traj_args(self.trajs_per_batch, self.trajs_per_write, self.traj_format, self.split_trajs)
        if self.trajs_per_batch is not None and _shared_buffer(self.replay_buffer):
            raise ValueError(f"{self.owner}: trajs_per_batch cannot be combined with an rlcollect ReplayBuffer, which "
                             "the workers write batches into themselves; pass a torchrl ReplayBuffer (written from "
                             "this process, whole trajectories), or no buffer and extend yours with the batches")

    def _inference(self) -> None:
        """``inference``, ``env_splits``, ``max_wait_us``, and what central inference rules out."""
        if self.inference not in INFERENCE_MODES:
            raise ValueError(f"inference must be one of {INFERENCE_MODES}, got {self.inference!r}")
        central = self.inference == "central"
        self.central_device = None
        if not central:
            if self.env_splits not in (None, 1):
                raise ValueError(f"env_splits={self.env_splits!r} needs inference='central' (a worker running its own "
                                 "policy steps its envs as one)")
            if self.max_wait_us:
                raise ValueError(f"max_wait_us={self.max_wait_us!r} needs inference='central'")
            self.env_splits = 1
            return
        self.env_splits = positive_int("env_splits", 2 if self.env_splits is None else self.env_splits)
        wait = self.max_wait_us
        if isinstance(wait, bool) or not isinstance(wait, (int, float)) or not math.isfinite(wait) or wait < 0:
            raise ValueError(f"max_wait_us must be a number of microseconds >= 0, got {wait!r}")
        self.max_wait_us = float(wait)
        refused = {
            "policy_factory": any(f is not None for f in self.factories),
            "weight_sync_schemes": bool(self.weight_sync_schemes),
            "weight_updater": self.weight_updater is not None,
            "per_worker_weights": self.per_worker_weights,
            "cudagraph_policy": bool(self.inner_options.get("cudagraph_policy")),
        }
        for name, given in refused.items():
            if given:
                raise ValueError(f"{name} cannot be used with inference='central': the main process's policy acts "
                                 "for every worker (its updates need no weight sync)")
        if self.inner_options.get("auto_register_policy_transforms"):
            raise ValueError("auto_register_policy_transforms=True cannot be used with inference='central': the "
                             "workers' envs never see the policy (it acts in this process); add the transforms to "
                             "the env in create_env_fn (torchrl.modules.utils.get_env_transforms_from_module(policy))")
        if self.policy is None:
            raise ValueError("inference='central' needs a policy: the main process runs it for every worker (for "
                             "random actions use inference='worker')")
        if not issubclass(self.collector_class, SingleCollector):
            raise ValueError("inference='central' needs collector_class=Collector in the workers (a nested "
                             "multi-process collector can run central inference itself)")
        chosen = [p if p is not None else d for p, d in zip(self.devices["policy_device"], self.devices["device"])]
        if len({None if d is None else str(d) for d in chosen}) > 1:
            raise ValueError(f"policy_device: with inference='central' one forward serves every worker, so there is "
                             f"one policy device; got {[str(d) for d in chosen]}")
        self.central_device = None if chosen[0] is None else torch.device(chosen[0])

    def _spec(self, i: int) -> dict:
        """Worker ``i``'s spec, every part checked (and picklable) before any process starts."""
        factory, n = self.factories[i], self.num_workers
        kwargs = {
            "policy_factory": factory,
            "frames_per_batch": self.worker_frames[i],
            "create_env_kwargs": self.env_kwargs[i],
            "init_random_frames": None,
            "use_buffers": True,
            **{name: self.devices[name][i] for name in PER_WORKER_ARGS},
            **self.inner_options,
        }
        # Unique trajectory-id blocks also when this collector is itself nested in a worker.
        kwargs["worker_idx"] = i if self.worker_idx is None else self.worker_idx * n + i
        kwargs.update(self.collector_kwargs)
        central = self.inference == "central"
        if central:  # the worker steps envs only: the policy's options are the main process's
            for name in ("policy_device", "compile_policy", "cudagraph_policy", "trust_policy"):
                kwargs.pop(name, None)
        if issubclass(self.collector_class, SingleCollector):
            CollectorConfig(**{k: v for k, v in kwargs.items() if k in CollectorConfig.__dataclass_fields__})
        if "policy" in self.schemes and factory is not None and self.policy is not None:
            kwargs["weight_sync_schemes"] = {"policy": self.schemes["policy"]}
        sent_policy = None if factory is not None or central else self.policy
        _pickled("create_env_fn", self.env_fns[i], "pass a module-level factory function (or a gymnasium id) instead "
                 "of an object that holds unpicklable state")
        _pickled("init_fn", self.init_fn, "pass a module-level function")
        _pickled("policy", sent_policy, "build it inside the workers with policy_factory=<a function>, or run it in "
                 "the main process with inference='central'")
        return {
            "collector_class": self.collector_class, "create_env_fn": self.env_fns[i], "policy": sent_policy,
            "kwargs": kwargs, "preemptive": self.preemptive_threshold is not None, "init_fn": self.init_fn,
            "replay_buffer": self.replay_buffer.share() if self.workers_write else None,
            "write_options": {"postproc": self.postproc, "split_trajs": self.split_trajs,
                              "extend_buffer": self.extend_buffer},
        }
