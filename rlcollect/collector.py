"""``SingleCollector``: steps one env (batched or not) with a policy in this process and yields
batches of experience.  The public ``Collector`` (rlcollect/backends.py) is this class with
torchrl's front door (``backend=``, ``num_collectors=``, ...) added; the multi-process workers
and the distributed nodes run this class (or a subclass) by default."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time
import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from rlcollect._context import worker_index
from rlcollect.config import CollectorConfig, bound_arguments
from rlcollect.collector_doc import COLLECTOR_DOC
from rlcollect.collector_state import check_state, load_all_or_nothing
from rlcollect.data import TRAJ_ID_BLOCK, BatchBuffer, fresh_batch, with_mask
from rlcollect.envs.adapter import TensorDictEnvAdapter, make_env
from rlcollect.freerun import BackgroundLoop
from rlcollect.metrics import BatchClock, StepTimes, batch_meta, policy_lag, stats_keys, worker_keys
from rlcollect.profiling import RolloutProfiler
from rlcollect.policy_transforms import PolicyTransforms
from rlcollect.policy import exploration_scope, has_weights, load_weights, make_runner
from rlcollect.rollout import build_env, make_rollout
from rlcollect.trajectories import new_assembler
from rlcollect import torchrl_args
from rlcollect.base import CollectorBase, FromConfig
from rlcollect.weights.local import LocalWeights, acting_policy, place_env
from rlcollect.weights.models import make_weight_updater

if TYPE_CHECKING:
    from rlcollect.typing import DeviceLike, EnvSource, ExplorationLike, PolicyLike, ReplayBufferLike
    from tensordict import TensorDict

logger = logging.getLogger("rlcollect")


class SingleCollector(CollectorBase):
    __doc__ = COLLECTOR_DOC

    init_random_frames = FromConfig()  # torchrl's attribute (its Trainer reads it)

    def __init__(
        self,
        create_env_fn: EnvSource,
        policy: PolicyLike = None,
        *,
        policy_factory: Callable[[], Any] | None = None,
        frames_per_batch: int,
        total_frames: int = -1,
        device: DeviceLike = None, storing_device: DeviceLike = None,
        env_device: DeviceLike = None, policy_device: DeviceLike = None,
        create_env_kwargs: dict | None = None,
        max_frames_per_traj: int | None = None,
        init_random_frames: int | None = None,
        reset_at_each_iter: bool = False,
        postproc: Callable | None = None,
        split_trajs: bool = False,
        exploration_type: ExplorationLike = "random",
        set_truncated: bool = False,
        use_buffers: bool = True,
        return_same_td: bool = False,
        replay_buffer: ReplayBufferLike | None = None,
        extend_buffer: bool = True,
        trust_policy: bool | None = None,
        compile_policy: bool | dict | None = None, cudagraph_policy: bool | dict | None = None,
        no_cuda_sync: bool = False,
        weight_sync_schemes: dict | None = None,
        track_policy_version: bool = False,
        worker_idx: int | None = None,
        traj_id_start: int | None = None,
        reset_when_done: bool = True,
        weight_updater: Any = None,
        pre_collect_hook: Callable[[], Any] | None = None,
        post_collect_hook: Callable[[Any], Any] | None = None,
        weight_recv_schemes: None = None,
        track_traj_ids: bool = True, compact_obs: bool = False,
        check_finite: str | None = None,
        trajs_per_batch: int | None = None, trajs_per_write: int | None = None, traj_format: str | None = None,
        interruptor: Any = None,
        auto_register_policy_transforms: bool | None = None,
    ):
        self._closed = True  # until construction succeeds, shutdown has nothing to do
        self.config = cfg = CollectorConfig(**bound_arguments(SingleCollector.__init__, locals()))
        self._version_tracker = cfg.version_tracker
        self._schemes = cfg.schemes
        self.replay_buffer = replay_buffer
        torchrl_args.warn_overshoot(cfg.total_frames, cfg.frames_per_batch, stacklevel=3)

        self.policy, self._weight_source = acting_policy(policy, policy_factory, cfg.policy_device_or_default)
        transforms = PolicyTransforms.needed_by(self.policy, cfg.auto_register_policy_transforms)
        prepare = None if transforms is None else transforms.apply
        with worker_index(worker_idx):
            # (a policy that builds its own rollout may build the env in parts: rollout.build_env)
            self.env = build_env(policy, lambda: make_env(create_env_fn, cfg.create_env_kwargs, prepare))
        try:
            place_env(self.env, cfg.env_device)
            self._setup(traj_id_start)
            self._weights = LocalWeights(self._runner.module, self.policy, self._weight_source, self._schemes,
                                         weakref.ref(self))
            self._weights.check_models()
            self.weight_updater = make_weight_updater(weight_updater, self)
        except BaseException:
            self.env.close()
            raise
        self._closed = False

    def _setup(self, traj_id_start: int | None) -> None:
        cfg, env = self.config, self.env
        if cfg.set_truncated and not env.has_truncated:
            raise RuntimeError(
                f"set_truncated=True needs an env with a 'truncated' entry; {type(env).__name__} has none"
            )
        rows = env.num_rows
        self.frames_per_batch = cfg.frames_per_batch
        self.total_frames = cfg.total_frames
        if traj_id_start is None:
            traj_id_start = (cfg.worker_idx or 0) * TRAJ_ID_BLOCK
        options = dict(max_frames_per_traj=cfg.max_frames_per_traj, set_truncated=cfg.set_truncated,
                       track_version=cfg.track_policy_version, check_finite=cfg.check_finite)
        time_steps = math.ceil(cfg.frames_per_batch / rows)
        device = cfg.policy_device_or_default
        self._rollout = make_rollout(
            self.policy, env,
            lambda: make_runner(self.policy, list(env.obs_layout), env.batch_size, device, cfg.compile_policy,
                                cfg.cudagraph_policy, cfg.trust_policy),
            time_steps, traj_id_start, options)
        self._runner = self._rollout.runner
        if cfg.frames_per_batch % rows:
            torchrl_args.warn(
                f"frames_per_batch={cfg.frames_per_batch} is not a multiple of the env's {rows} rows: "
                f"each batch holds {rows * self._rollout.time} frames",
                stacklevel=3,
            )
        with exploration_scope(cfg.exploration_type):
            self.layout = self._rollout.discover_layout()
        if cfg.interruptor is not None:  # the steps an interrupted batch did not reach are masked
            self.layout = with_mask(self.layout)
        self._buffer: BatchBuffer | None = None  # the in-place batch, allocated on first use
        # torchrl's: the frames of one batch, frames_per_batch rounded up to whole env rows
        self.requested_frames_per_batch = self.layout.frames
        self._frames = 0
        self._iter = 0
        self._version = 0
        self._torch_rng: torch.Tensor | None = None
        self._iterator: Iterator | None = None
        self._profiler = RolloutProfiler()
        self._started_at: float | None = None
        self._first_batch: tuple[int, float] | None = None
        self._last_batch_s = 0.0
        self._loop: BackgroundLoop | None = None
        self._step_times = StepTimes()
        self._last_collected = (0, 0, 0.0)  # (valid frames, min and mean policy version) of the last batch
        self._lag = (0.0, 0)
        self._wait = BatchClock()  # stays at zero: this process steps the env itself

    # -- iteration (rlcollect/base.py) ---------------------------------------------------------
    def _check_iterable(self) -> None:
        if self._loop is not None:
            raise RuntimeError("this collector is running free (start()); it cannot be iterated until async_shutdown()")

    def _batch_frames(self) -> int:
        # A batch holds layout.frames (frames_per_batch rounded up to whole env rows): count
        # the batches iteration actually yields.
        return self.layout.frames

    def _name_when_closed(self) -> str:
        return "collector"

    @property
    def frames(self) -> int:
        """Frames collected so far."""
        return self._frames

    def _member_frames(self, index: int) -> int:
        return self.layout.frames  # (a single collector is its own only worker)

    @contextlib.contextmanager
    def _rng_scope(self) -> Iterator[None]:
        """After ``set_seed``, rollouts draw torch randomness from the collector's own stream."""
        if self._torch_rng is None or self._loop is not None:
            # Running free, the rollout shares the process with the trainer: swapping the global
            # torch RNG state from a background thread would disturb it.
            yield
            return
        outer = torch.get_rng_state()
        torch.set_rng_state(self._torch_rng)
        try:
            yield
        finally:
            self._torch_rng = torch.get_rng_state()
            torch.set_rng_state(outer)

    def _random_now(self) -> bool:
        return torchrl_args.frames_written(self.replay_buffer, self._frames) < self.config.init_random_frames

    def _collect_next(self) -> tuple[TensorDict, dict]:
        cfg = self.config
        if self._started_at is None:
            self._started_at = time.perf_counter()
        start = time.perf_counter()
        # The user gets fresh memory unless return_same_td (or a replay buffer, which copies what
        # it keeps): the batch is then filled in a new buffer, not filled in place and cloned.
        in_place = cfg.use_buffers and (cfg.return_same_td or self.replay_buffer is not None)
        if in_place and self._buffer is None:
            self._buffer = BatchBuffer(self.layout)
        buf = self._buffer if in_place else fresh_batch(self.layout)
        stop = None if cfg.interruptor is None else torchrl_args.InterruptorFlag(cfg.interruptor)
        self.collect_into(buf, random=self._random_now(), stop=stop)
        self._lag = policy_lag(self._version, [self._batch_meta(timing=False)])
        batch = buf.td
        self._last_batch_s = time.perf_counter() - start
        if self._first_batch is None:  # stats()["fps_steady"] counts from here
            self._first_batch = (self._frames, time.perf_counter() - self._started_at)
        return batch, {"storing_device": cfg.storing_device_or_default}

    def collect_into(self, buf: BatchBuffer, random: bool = False, stop: Any = None) -> int:
        """Fill ``buf`` (a ``BatchBuffer`` of ``layout``) with the next batch, in place; returns
        the valid frames written. ``random``: act randomly; ``stop``: a one-element array that,
        once set non-zero, ends the batch after the current step. This is what a worker process
        or a distributed node calls to write straight into shared memory (rlcollect/source.py).

        Example:
            >>> from rlcollect import Collector
            >>> from rlcollect.data import BatchBuffer
            >>> c = Collector("CartPole-v1", frames_per_batch=10)
            >>> c.collect_into(BatchBuffer(c.layout))
            10
            >>> c.shutdown()
        """
        self._check_open()
        cfg = self.config
        if cfg.reset_at_each_iter:
            self._rollout.needs_reset = True
        with self._profiler.scope(self._iter), self._rng_scope(), exploration_scope(cfg.exploration_type), \
                torch.no_grad():
            steps = self._rollout.fill(buf, random=random, version=self._version, stop=stop)
        self._step_times.add(self._rollout.step_seconds[:steps])
        frames = steps * self.layout.rows
        if self._runner.reports_version and not random:
            self._version = self._rollout.last_version  # the policy acts elsewhere: its version moves there
        self._last_collected = (frames, *self._rollout.version_range)
        self._frames += frames
        self._iter += 1
        return frames

    # -- profiling ---------------------------------------------------------------------------
    def enable_profile(self, path: str | os.PathLike = "rlcollect_trace.json", *, rollouts=(0,),
                       **profiler_kwargs) -> None:
        """Record a torch.profiler trace of the chosen rollouts (batch indices counted from the
        next one) and write it as a Chrome trace to ``path`` (``path`` gets ``.N`` appended
        before the extension when several rollouts are profiled). torchrl 0.14's arguments
        (``save_path``, ``num_rollouts``, ``warmup_rollouts``, ``activities``, ...) are taken too.

        Example:
            >>> from rlcollect import Collector
            >>> c = Collector("CartPole-v1", frames_per_batch=50, total_frames=50)
            >>> c.enable_profile("/tmp/trace.json")
            >>> _ = list(c); c.shutdown()
        """
        path, rollouts, profiler_kwargs, _ = torchrl_args.profile_args(path, rollouts, profiler_kwargs)
        self._profiler.enable(path, rollouts, profiler_kwargs, next_index=self._iter)

    # -- control -----------------------------------------------------------------------------
    def _seed(self, seed: int, static_seed: bool) -> int:
        # The env is reset on the next batch so that the seed takes effect from there.
        with self._quiet():
            next_seed = self.env.set_seed(seed, static_seed=static_seed)
            self._torch_rng = torch.Generator().manual_seed(seed).get_state()
            self._rollout.needs_reset = True
        return next_seed

    def reset(self, index: Any = None, **kwargs: Any) -> None:
        """Reset every env; the next frames start new trajectories.

        ``index`` (torchrl's: which rows of a batched env to reset) may be None or select every
        row (a full mask, a slice, all indices); resetting some rows only is refused, since
        rlcollect's envs reset as a whole (rows that end reset themselves at once).

        Example:
            >>> from rlcollect import Collector
            >>> c = Collector("CartPole-v1", frames_per_batch=10)
            >>> c.reset()
        """
        self._check_open()
        if kwargs:
            raise TypeError(f"Collector.reset got unexpected arguments {sorted(kwargs)} (it takes index=None)")
        if index is not None and not torchrl_args.selects_all(index, self.env.num_rows):
            raise ValueError(
                f"Collector.reset(index={index!r}): resetting only some rows of a batched env is not supported "
                f"(its {self.env.num_rows} rows reset as a whole; a row that ends resets itself); call reset() "
                "to reset every row"
            )
        with self._quiet():
            self._rollout.needs_reset = True
        self._forget_trajectories()

    @contextlib.contextmanager
    def _quiet(self) -> Iterator[None]:
        """Control calls made while running free wait for the batch in progress (and surface
        an error the background loop hit)."""
        if self._loop is None:
            yield
        else:
            with self._loop.pause():
                yield

    def _release(self, timeout: float) -> None:
        """Stop running free (if started) and close the env."""
        if self._closed:
            return
        # The background loop stops first (it finishes the batch in progress): closed before
        # it, the loop's next step would fail on "has been shut down" and stop() re-raise that.
        loop, self._loop = getattr(self, "_loop", None), None
        try:
            if loop is not None:
                loop.stop(timeout)
        finally:
            self._closed = True
            self.env.close()

    # -- free-running ------------------------------------------------------------------------
    def start(self) -> None:
        """Collect continuously into the replay buffer from a background thread; returns at once.

        Example:
            >>> from rlcollect import Collector, ReplayBuffer
            >>> rb = ReplayBuffer(1000)
            >>> c = Collector("CartPole-v1", frames_per_batch=100, replay_buffer=rb)
            >>> c.start()
            >>> with c.pause():
            ...     written = rb.write_count
            >>> c.async_shutdown(); rb.close()
        """
        self._check_startable(self.replay_buffer, running=self._loop is not None)
        # (trajs_per_batch: whole trajectories go to the buffer, as when iterating)
        assembler = self._assembler = new_assembler(self.config, self.replay_buffer)
        step = self._next_batch if assembler is None else (lambda: assembler.feed(self._next_batch()))
        self._loop = BackgroundLoop(step, name="rlcollect-collector")
        self._loop.start()

    @contextlib.contextmanager
    def pause(self) -> Iterator[None]:
        """Within the block no frame is written (the batch in progress is finished first)."""
        self._check_open()
        if self._loop is None:
            raise RuntimeError("pause() needs a collector running free: call start() first")
        with self._loop.pause():
            yield

    def async_shutdown(self, timeout: float | None = None) -> None:
        """Stop running free, then shut down. Re-raises an error the background loop hit."""
        self.shutdown(timeout)

    def __del__(self) -> None:
        # A collector left open until the interpreter exits may be finalized after the module
        # globals are gone (contextlib among them): only builtins here, and nothing printed.
        try:
            self.shutdown()
        except Exception:
            pass

    def _torchrl_env(self) -> Any:
        """The torchrl env given (``create_env_fn``), whose transform torchrl's ``Evaluator``
        dumps after each evaluation (``_dump_env_transform``); None for any other env."""
        env = self.env
        return env.env if isinstance(env, TensorDictEnvAdapter) else None

    # -- weights (rlcollect/weights/local.py) ------------------------------------------------
    def _push_weights(self, models: dict[str, Any], worker_ids: Any) -> None:
        """Load ``models``' weights into the acting modules, then bump the policy version."""
        loads = self._weights.plan(models, worker_ids)
        if not loads:
            return
        with self._quiet():  # never between two steps of a running batch
            self._weights.load(loads)
            self._version += 1

    def get_model(self, model_id: str) -> Any:
        """The model ``model_id`` names: ``"policy"`` is the acting policy, anything else an
        attribute path from this collector (``"policy.module[0]"``, ``"env.some_module"``).

        Example:
            >>> import torch
            >>> from rlcollect import Collector, CountingEnv
            >>> class Policy(torch.nn.Module):
            ...     def __init__(self):
            ...         super().__init__()
            ...         self.head = torch.nn.Linear(1, 1)
            ...     def forward(self, observation):
            ...         return (self.head(observation)[..., 0] > 0).long()
            >>> c = Collector(CountingEnv(), Policy(), frames_per_batch=4)
            >>> type(c.get_model("policy.head")).__name__
            'Linear'
        """
        return self._weights.get_model(model_id)

    def get_cached_weights(self, model_id: str) -> Any:
        """Cached shared-memory weights of ``model_id``: None here (a single-process collector
        acts with the module itself; torchrl returns None too when it caches nothing)."""
        return None

    @property
    def weight_spec(self) -> dict | None:
        """Names, shapes and dtypes of the acting policy's parameters and buffers (None: none)."""
        return self._weights.spec

    def weights_module(self, model_id: str = "policy") -> torch.nn.Module | None:
        """The module that acts for ``model_id`` (``"policy"``: the acting policy; else an
        attribute path from this collector, which must have parameters or buffers)."""
        return self._weights.module(model_id)

    def set_weights(self, state: Any, version: int, model_id: str = "policy") -> None:
        """Load ``state`` (None: the module was written in place) into ``weights_module(model_id)``
        and act with version ``version`` from the next batch (a worker's or node's call: the
        version is its owner's number, not a bump).

        Example:
            >>> import torch
            >>> from rlcollect import Collector, CountingEnv
            >>> class Policy(torch.nn.Module):
            ...     def __init__(self):
            ...         super().__init__()
            ...         self.w = torch.nn.Parameter(torch.zeros(1))
            ...     def forward(self, observation):
            ...         return (observation[..., 0] * self.w[0] > 0).long()
            >>> c = Collector(CountingEnv(), Policy(), frames_per_batch=10)
            >>> c.set_weights({"w": torch.ones(1)}, version=7)
            >>> c.policy_version, c.weights_module().w.item()
            (7, 1.0)
        """
        self._check_open()
        module = self.weights_module(model_id)
        with self._quiet():
            if state is not None:
                load_weights(module, state)
            self._version = version

    # -- state -------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue the same stream: counters, the env's state, the
        rollout carry (current observations, trajectory ids), weights, version and RNG.

        Example:
            >>> from rlcollect import Collector
            >>> c = Collector("CartPole-v1", frames_per_batch=10)
            >>> sorted(c.state_dict())[:3]
            ['env', 'frames', 'iter']
        """
        module = self._runner.module
        return {
            "frames": self._frames,
            "iter": self._iter,
            "rollout": self._rollout.state_dict(),
            "env": self.env.state_dict(),
            "policy": module.state_dict() if has_weights(module) else None,
            "policy_version": self._version,
            "torch_rng": None if self._torch_rng is None else self._torch_rng.clone(),
        }

    def _load(self, state: dict[str, Any]) -> None:
        # Everything that can fail is checked before anything is changed.
        frames, iters, version, torch_rng = check_state(state, self._rollout.check_state_dict)
        load_all_or_nothing(self._runner.module, self.env, state["policy"], state["env"])
        self._rollout.load_state_dict(state["rollout"])
        self._frames, self._iter, self._version = frames, iters, version
        self._torch_rng = None if torch_rng is None else torch_rng.clone()
        self._iterator = None

    # -- observability -----------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """A JSON-serialisable summary: frames, rates, policy version and lag, env-step latency
        (docs/observability.md defines every key; the multi-process and distributed collectors
        have the same ones).

        Example:
            >>> from rlcollect import Collector
            >>> c = Collector("CartPole-v1", frames_per_batch=10, total_frames=10)
            >>> _ = list(c)
            >>> s = c.stats()
            >>> s["frames"], s["policy_lag_max"], s["workers"][0]["env_step_mean_s"] > 0
            (10, 0, True)
            >>> c.shutdown()
        """
        elapsed = 0.0 if self._started_at is None else time.perf_counter() - self._started_at
        recent = self.layout.frames / self._last_batch_s if self._last_batch_s else 0.0
        worker = worker_keys(self.config.worker_idx or 0, frames=self._frames, alive=not self._closed, restarts=0,
                             version=self._version, step=self._step_times.summary())
        return self._torchrl_stats(stats_keys(
            frames=self._frames, batches=self._iter, elapsed=elapsed, recent_fps=recent, version=self._version,
            workers=[worker], restarts=0, dropped_frames=0, lag=self._lag, wait=self._wait,
            replay_buffer_write_count=getattr(self.replay_buffer, "write_count", None), first_batch=self._first_batch))

    def batch_info(self) -> dict:
        """The last batch filled, for the collector this one fills batches for (a worker's or
        a node's): its frames, their policy versions and the env-step latency
        (``rlcollect.metrics.batch_meta``)."""
        return self._batch_meta()

    def getattr_env(self, name: str) -> Any:
        """An attribute of the env."""
        return getattr(self.env, name)

    def getattr_policy(self, name: str) -> Any:
        """An attribute of the policy."""
        return getattr(self.policy, name)

    def _batch_meta(self, timing: bool = True) -> dict:
        frames, version_min, version_mean = self._last_collected
        return batch_meta(frames, version_min, version_mean, self._step_times.summary() if timing else (None, None))

    def __repr__(self) -> str:
        return (f"Collector(env={self.env!r}, frames_per_batch={self.frames_per_batch}, "
                f"total_frames={self.total_frames}, frames={self._frames})")
