"""``CollectorBase``: what every public collector shares, written once: torchrl's face.

Iteration up to ``total_frames``, ``len()``, the context manager, the "shut down already"
check, the error guard of control calls, delivery of a finished batch, the policy version
(which moves a torchrl ``PolicyVersion`` given as ``track_policy_version`` along with it) and
torchrl's public methods with their argument checks: ``shutdown``, ``set_seed``,
``load_state_dict``, ``update_policy_weights_`` (with the hand-off to a ``weight_updater``),
``frames_per_batch_worker``, ``next()``, ``increment_version()``, ``get_policy_version()``.

A subclass provides only what differs: ``_collect_next()`` (the next batch and where it is
delivered: this base delivers it), ``total_frames``, ``_frames``,
``_closed``, ``_batch_frames()`` (the frames of one yielded batch, for ``len()``),
``_release(timeout)`` (shut down), ``_seed``, ``_load``, ``_push_weights``, ``_members`` and
``_member_frames`` (its workers or nodes); everything else (workers, weights, free running,
statistics) is composed from collaborators in its own module.

Example:
    >>> import torch
    >>> from types import SimpleNamespace
    >>> from tensordict import TensorDict
    >>> class Counter(CollectorBase):
    ...     total_frames, _frames, _closed = 6, 0, False
    ...     config = SimpleNamespace(split_trajs=False, postproc=None)  # (delivery's options)
    ...     def _collect_next(self):
    ...         self._frames += 2
    ...         return TensorDict({"frames": torch.tensor(self._frames)}, []), {}
    ...     def _batch_frames(self):
    ...         return 2
    ...     def _release(self, timeout):
    ...         self._closed = True
    >>> with Counter() as c:
    ...     len(c), [batch["frames"].item() for batch in c]
    (3, [2, 4, 6])
    >>> c.increment_version(); c.get_policy_version()
    1
"""

from __future__ import annotations

import contextlib
import logging
import math
import operator
from collections.abc import Iterator
from typing import Any

from rlcollect.data import deliver
from rlcollect.errors import WorkerError
from rlcollect.trajectories import new_assembler
from rlcollect.torchrl_args import (TorchRLAttribute, check_close_env, check_hook, check_timeout, per_worker_stats,
                                    register_with_torchrl, tracks_versions, trimmed)
from rlcollect.weights.models import update_targets

logger = logging.getLogger("rlcollect")


class CollectorBase:
    """The one base class of rlcollect's public collectors (see the module docstring)."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        register_with_torchrl(CollectorBase)  # (torchrl may have been imported since rlcollect was)
        return super().__new__(cls)

    _version_tracker: Any = None
    _iterator: Iterator | None = None
    _assembler: Any = None  # the TrajectoryAssembler of the iteration in progress (trajs_per_batch)
    #: Whether an exception raised while iterating shuts the collector down (its workers).
    _shutdown_on_error = False
    #: torchrl's legacy weight updater (``weight_updater=``), or None.
    weight_updater: Any = None
    #: Where batches go instead of being yielded (``replay_buffer=``), or None.
    replay_buffer: Any = None
    #: Ends the error of ``update_policy_weights_(model_id=...)`` with a ``weight_updater``.
    _updater_hint = "; use weight_sync_schemes for several models"
    #: What ``frames_per_batch_worker``'s error calls a member ("worker", "node").
    _member_name = "worker"
    _in_updater = False
    #: The private methods a collector may override (besides those that raise
    #: NotImplementedError here): hooks with a default (tests/test_architecture.py).
    _HOOKS = ("_check_iterable", "_name_when_closed", "_members", "_fatal_error", "_frame_target", "_shut_down_after",
              "_torchrl_env")

    # -- iteration -------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Any]:
        self._check_open()
        self._check_iterable()
        assembler = self._assembler = new_assembler(getattr(self, "config", None), self.replay_buffer)
        target = self._frame_target()
        try:
            while target < 0 or self._frames < target:
                self._check_open()  # (shut down between two batches: say so)
                hook = self.pre_collect_hook
                if hook is not None:
                    hook()
                if assembler is None:
                    yield self._next_batch()
                    continue
                yield from assembler.feed(self._next_batch())  # trajs_per_batch: whole trajectories
        except GeneratorExit:
            raise
        except BaseException as err:
            if self._shutdown_on_error:
                self._shut_down_after(err)
            raise

    def _frame_target(self) -> int:
        """The frame count this iteration stops at (negative: never): ``total_frames``."""
        return self.total_frames

    def _shut_down_after(self, err: BaseException) -> None:
        """Shut down because ``err`` ended the iteration (with ``_shutdown_on_error``)."""
        self.shutdown()

    def _next_batch(self) -> Any:
        """The next batch, collected (``_collect_next``) and delivered: the batch, or None when
        it went to the replay buffer."""
        batch, where = self._collect_next()
        after = where.pop("after", None)
        try:
            return None if batch is None else self._deliver(batch, **where)
        finally:
            if after is not None:
                after()

    def _collect_next(self) -> tuple[Any, dict]:
        """``(batch, where)``: the next batch (None when it was written into the replay buffer
        already) and the keyword arguments of its delivery (``_deliver``'s), with ``"after"``:
        a callable to run once it is delivered (or its delivery failed), if any."""
        raise NotImplementedError

    def _forget_trajectories(self) -> None:
        """The envs were reset: the trajectories being assembled (``trajs_per_batch``) are
        dropped, running and finished alike (torchrl's)."""
        if self._assembler is not None:
            self._assembler.clear()

    def iterator(self) -> Iterator[Any]:
        """``iter(collector)`` (torchrl's name)."""
        return iter(self)

    def __next__(self) -> Any:
        if self._iterator is None:
            self._iterator = iter(self)
        return next(self._iterator)

    def __len__(self) -> int:
        if self.total_frames < 0:
            raise TypeError("an endless collector (total_frames=-1) has no len()")
        return math.ceil(self.total_frames / self._batch_frames())

    def _check_iterable(self) -> None:
        """Raise when the collector cannot be iterated now (it is running free, say)."""

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"this {self._name_when_closed()} has been shut down")

    def _check_startable(self, replay_buffer: Any, running: bool) -> None:
        """What every ``start()`` checks first: the collector is open, has a replay buffer to
        write into, and is not running free already."""
        self._check_open()
        if replay_buffer is None:
            raise RuntimeError("start() needs a replay_buffer: the batches collected while running free go there")
        if running:
            raise RuntimeError("start() was already called; use pause() to stop writing for a while")

    def _name_when_closed(self) -> str:
        return type(self).__name__

    def __enter__(self):
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    # -- torchrl's methods ---------------------------------------------------------------------
    def shutdown(self, timeout: float | None = None, close_env: bool = True, raise_on_error: bool = True) -> None:
        """Stop everything this collector started (background loop, worker processes, nodes),
        close its envs and free its shared memory. Idempotent.

        Args:
            timeout (float | None): seconds to wait for what is stopping before it is
                terminated, then killed (default None: 10 s).
            close_env (bool): must be True (default): a collector owns its envs and always
                closes them (torchrl's argument; its multi-process collectors refuse False too).
            raise_on_error (bool): False logs an error met while stopping instead of raising
                it (default True).

        Example:
            >>> from rlcollect import Collector
            >>> c = Collector("CartPole-v1", frames_per_batch=10)
            >>> c.shutdown(); c.shutdown(timeout=1.0, raise_on_error=False)
        """
        check_close_env(close_env, type(self).__name__)
        timeout = check_timeout(timeout, 10.0)
        try:
            self._release(timeout)
        except Exception:
            if raise_on_error:
                raise
            logger.exception("rlcollect: error while shutting down %s (raise_on_error=False)", type(self).__name__)

    def _release(self, timeout: float) -> None:
        """Shut down (``shutdown`` has checked its arguments); idempotent."""
        raise NotImplementedError

    def set_seed(self, seed: int, static_seed: bool = False) -> int:
        """Seed the envs; returns the next seed. A single collector seeds its env (and its own
        torch random stream); a multi-process or distributed collector seeds worker (node) 0
        with ``seed``, worker 1 with what that returned, and so on, and returns the last seed
        (batches in flight are discarded). The envs are reset on the next batch.

        Args:
            seed (int): the first seed.
            static_seed (bool): torchrl's: give every env the same seed instead of
                consecutive ones (default False).

        Example:
            >>> from rlcollect import Collector
            >>> c = Collector("CartPole-v1", frames_per_batch=10)
            >>> c.set_seed(0)
            1
            >>> c.shutdown()
        """
        self._check_open()
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"seed must be an int, got {seed!r}")
        return self._seed(seed, static_seed)

    def _seed(self, seed: int, static_seed: bool) -> int:
        raise NotImplementedError

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a ``state_dict()``: the collector (each of its workers or nodes) continues the
        saved stream. A malformed state raises (KeyError/ValueError/TypeError).

        Args:
            state (dict): what ``state_dict()`` returned.

        Example:
            >>> from rlcollect import Collector
            >>> c = Collector("CartPole-v1", frames_per_batch=10)
            >>> c.load_state_dict(c.state_dict()); c.shutdown()
        """
        self._check_open()
        if not isinstance(state, dict):
            raise TypeError(f"load_state_dict expects the dict state_dict() returned, got {type(state).__name__}")
        self._load(state)

    def _load(self, state: dict[str, Any]) -> None:
        raise NotImplementedError

    def update_policy_weights_(self, policy_or_weights: Any = None, *, weights: Any = None, policy: Any = None,
                               worker_ids: Any = None, model_id: str | None = None,
                               weights_dict: dict | None = None) -> None:
        """Act with new weights from the next batch on, with a new policy version.

        A single collector loads them into its acting policy; a multi-process collector
        pushes them to its workers (shared memory or pipes, see ``weight_sync_schemes``), or,
        with ``inference="central"``, loads them into the policy the main process runs; a
        distributed collector sends them to its nodes. With ``weight_updater`` the call goes
        to it instead (torchrl's legacy path; no ``model_id`` / ``weights_dict``); the updater
        may call this method back, which then takes the built-in path.

        Args:
            policy_or_weights: the weights: None (the main ``policy``'s as they are now), an
                ``nn.Module``, a TensorDict of parameters, a state dict, or ``{worker_index:
                weights}`` (per-worker weights).
            weights: the same, by keyword (torchrl's).
            policy: the same, by keyword (torchrl's).
            worker_ids (int | list[int] | None): only these workers (nodes) (default: all).
            model_id (str | None): the model to update (default ``"policy"``; any other must be
                a key of ``weight_sync_schemes``, an attribute path such as
                ``"policy.module[0]"``).
            weights_dict (dict | None): ``{model_id: weights}``: several models, one version.

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
            >>> c.update_policy_weights_(weights={"w": torch.ones(1)})
            >>> c.policy_version
            1
            >>> c.shutdown()
        """
        self._check_open()
        if self.weight_updater is not None and not self._in_updater:
            if model_id is not None or weights_dict is not None:
                raise ValueError("model_id / weights_dict are not supported with weight_updater (as in torchrl)"
                                 f"{self._updater_hint}")
            target = update_targets(policy_or_weights, weights=weights, policy=policy)["policy"]
            self._in_updater = True
            try:  # the updater may call update_policy_weights_ back: that is the built-in path
                self.weight_updater(policy_or_weights=target, worker_ids=worker_ids)
            finally:
                self._in_updater = False
            return
        models = update_targets(policy_or_weights, weights=weights, policy=policy, model_id=model_id,
                                weights_dict=weights_dict)
        self._push_weights(models, worker_ids)

    def receive_weights(self, policy_or_weights: Any = None, *, weights: Any = None, policy: Any = None) -> None:
        """torchrl 0.14's: with weights, act with them (``update_policy_weights_``, a new
        version); without, nothing to do: an rlcollect collector has no receiver schemes, its
        workers (nodes) take the weights it pushes.

        Args:
            policy_or_weights: the weights (as ``update_policy_weights_`` takes them) or None.
            weights: the same, by keyword.
            policy: the same, by keyword.

        Example:
            >>> from rlcollect import Collector
            >>> c = Collector("CartPole-v1", frames_per_batch=10)
            >>> c.receive_weights(); c.policy_version
            0
            >>> c.shutdown()
        """
        if policy_or_weights is None and weights is None and policy is None:
            self._check_open()
            return
        self.update_policy_weights_(policy_or_weights, weights=weights, policy=policy)

    def _torchrl_stats(self, stats: dict[str, Any], workers: str = "aggregate") -> dict[str, Any]:
        """``stats`` with torchrl 0.14's keys added after ours (``TORCHRL_STATS_KEYS``):
        ``total_frames`` (None for an endless collector, where torchrl leaves it out),
        ``completed``, ``requested_frames_per_batch``, ``workers_alive`` (``policy_version``
        is ours too). torchrl's ``"workers"`` (a count) is ours (a list of per-worker dicts):
        its count is ``len(stats["workers"])``.

        ``workers`` (the multi-process collectors' argument, torchrl's): ``"aggregate"`` (the
        above), ``"per_worker"`` (torchrl's view: ``"workers"`` a count, ``"workers_alive"``,
        and each worker's ``"worker_<i>/frames"``, ``"worker_<i>/batches"`` (its whole batches),
        ``"worker_<i>/requested_frames_per_batch"``, and ``"worker_<i>/policy_version"`` when
        versions are tracked) or ``"both"`` (the aggregate, ours, with the per-worker keys)."""
        if workers not in ("aggregate", "per_worker", "both"):
            raise ValueError(f"workers must be one of 'aggregate', 'per_worker' or 'both', got {workers!r}.")
        endless = self.total_frames < 0
        stats["total_frames"] = None if endless else self.total_frames
        stats["completed"] = not endless and self._frames >= self.total_frames
        stats["requested_frames_per_batch"] = getattr(self, "requested_frames_per_batch", None)
        stats["workers_alive"] = sum(bool(w.get("alive")) for w in stats.get("workers", []))
        if workers == "aggregate":
            return stats
        sizes = [self.frames_per_batch_worker(i) for i in range(len(stats.get("workers", [])))]
        return per_worker_stats(stats, sizes, tracks_versions(self.config), both=workers == "both")

    # -- torchrl's private face: called by torchrl's own code, so named as torchrl names it ----------
    def _dump_env_transform(self, step: int | None = None) -> None:
        """torchrl's ``BaseCollector._dump_env_transform``, which torchrl's ``Evaluator`` calls
        after each evaluation: ``dump(step=step)`` on the transform of the torchrl env this
        collector steps in this process (``_torchrl_env``), when that transform has a callable
        ``dump`` (a ``VideoRecorder``, or a ``Compose`` holding one); nothing otherwise. A
        multi-process or distributed collector steps no env in this process: nothing, as
        torchrl's multi-process collectors do here (torchrl's process-backed ``Evaluator``
        calls it in each worker through ``map_fn`` on its own ``MultiSyncCollector`` only)."""
        dump = getattr(getattr(self._torchrl_env(), "transform", None), "dump", None)
        if callable(dump):
            dump(step=step)

    def _torchrl_env(self) -> Any:
        """The torchrl (TensorDict) env this collector steps in this process, or None."""
        return None

    def _push_weights(self, models: dict[str, Any], worker_ids: Any) -> None:
        """Act with ``models`` (``{model_id: weights or None}``, checked) on ``worker_ids``."""
        raise NotImplementedError

    def frames_per_batch_worker(self, worker_idx: int | None = None) -> int:
        """Frames in each batch worker (node) ``worker_idx`` collects (torchrl's).

        Args:
            worker_idx (int | None): the worker's index (default None: worker 0; a single
                collector is its own only worker).

        Example:
            >>> from rlcollect import Collector
            >>> c = Collector("CartPole-v1", frames_per_batch=10)
            >>> c.frames_per_batch_worker(), c.frames_per_batch_worker(0)
            (10, 10)
            >>> c.shutdown()
        """
        n = self._members()
        index = 0 if worker_idx is None else worker_idx
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < n:
            raise ValueError(f"worker_idx must be None or an int in 0..{n - 1} ({type(self).__name__} has {n} "
                             f"{self._member_name}{'s' if n > 1 else ''}), got {worker_idx!r}")
        return self._member_frames(index)

    def _members(self) -> int:
        """How many workers (nodes) collect."""
        return 1

    def _member_frames(self, index: int) -> int:
        raise NotImplementedError

    # -- what control calls and batches pass through ----------------------------------------------
    @contextlib.contextmanager
    def _guard(self) -> Iterator[None]:
        """A control call that fails because a worker (node) died shuts the collector down, as
        does an error that nothing can go on after (``_fatal_error``)."""
        self._check_open()
        try:
            yield
        except WorkerError:
            self.shutdown()
            raise
        except Exception as err:
            if err is self._fatal_error():
                self.shutdown()
            raise

    def _fatal_error(self) -> BaseException | None:
        """An error after which nothing can go on (central inference's policy raised), or None."""
        return None

    def _deliver(self, batch: Any, storing_device: Any = None, stacked_workers: bool = False) -> Any:
        """A finished batch to the user (or the replay buffer): ``rlcollect.data.deliver`` with
        this collector's options."""
        cfg = self.config
        track_traj_ids, compact_obs = getattr(cfg, "track_traj_ids", True), getattr(cfg, "compact_obs", False)
        if compact_obs or not track_traj_ids:
            batch = trimmed(batch, track_traj_ids, compact_obs)
        # (with trajs_per_batch the assembler writes whole trajectories into the buffer instead)
        buffer = self.replay_buffer if getattr(cfg, "trajs_per_batch", None) is None else None
        return deliver(batch, storing_device=storing_device, split_trajs=cfg.split_trajs, postproc=cfg.postproc,
                       replay_buffer=buffer, extend_buffer=getattr(cfg, "extend_buffer", True),
                       stacked_workers=stacked_workers, post_hook=getattr(cfg, "post_collect_hook", None))

    # -- torchrl 0.14's collect hooks (kept in the config, where the constructor put them) -------
    @property
    def pre_collect_hook(self) -> Any:
        """Called with no argument before each batch is collected (torchrl 0.14's), or None.
        Setting it (to a callable or None) takes effect from the next batch.

        Example:
            >>> from rlcollect import Collector
            >>> c = Collector("CartPole-v1", frames_per_batch=10, total_frames=20)
            >>> calls = []
            >>> c.pre_collect_hook = lambda: calls.append("pre")
            >>> c.set_post_collect_hook(lambda batch: calls.append(batch.numel()))
            >>> for _ in c: pass
            >>> calls
            ['pre', 10, 'pre', 10]
            >>> c.shutdown()
        """
        return getattr(getattr(self, "config", None), "pre_collect_hook", None)

    @pre_collect_hook.setter
    def pre_collect_hook(self, hook: Any) -> None:
        self.config.pre_collect_hook = check_hook("pre_collect_hook", hook)

    @property
    def post_collect_hook(self) -> Any:
        """Called with each finished batch, after ``postproc`` and before it is yielded or
        written into the replay buffer (torchrl 0.14's; what it returns is ignored), or None."""
        return getattr(getattr(self, "config", None), "post_collect_hook", None)

    @post_collect_hook.setter
    def post_collect_hook(self, hook: Any) -> None:
        self.config.post_collect_hook = check_hook("post_collect_hook", hook)

    def set_post_collect_hook(self, hook: Any) -> None:
        """Set ``post_collect_hook`` (torchrl 0.14's method form).

        Args:
            hook (callable | None): called with each finished batch; None removes it.
        """
        self.post_collect_hook = hook

    def next(self) -> Any:
        """The next batch, or None once ``total_frames`` are collected (torchrl's ``next()``).

        Example:
            >>> from rlcollect import Collector
            >>> c = Collector("CartPole-v1", frames_per_batch=10, total_frames=10)
            >>> c.next().shape, c.next()
            (torch.Size([10]), None)
            >>> c.shutdown()
        """
        try:
            return self.__next__()
        except StopIteration:
            return None

    def increment_version(self) -> None:
        """Bump the policy version without sending weights (and a torchrl ``PolicyVersion``
        given as ``track_policy_version`` with it); weight updates bump it too.

        Example:
            >>> from rlcollect import Collector
            >>> c = Collector("CartPole-v1", frames_per_batch=10)
            >>> c.increment_version(); c.get_policy_version()
            1
            >>> c.shutdown()
        """
        self._version += 1

    @contextlib.contextmanager
    def updating_weights(self) -> Iterator[None]:
        """Change the trainer's policy in place inside the block (an optimizer step, say); at
        its end the collector takes the new weights with a new version, as
        ``update_policy_weights_()`` does. With ``inference="central"`` the main process's
        forward also waits for the block: no forward sees half a step, and every frame's
        version is exactly that of the weights that acted.

        Example:
            >>> import torch
            >>> from rlcollect import Collector, CountingEnv
            >>> class Policy(torch.nn.Module):
            ...     def __init__(self):
            ...         super().__init__()
            ...         self.w = torch.nn.Parameter(torch.zeros(1))
            ...     def forward(self, observation):
            ...         return (observation[..., 0] * self.w[0] > 0).long()
            >>> policy = Policy()
            >>> c = Collector(CountingEnv(), policy, frames_per_batch=4)
            >>> with c.updating_weights():
            ...     _ = policy.w.data.add_(1.0)
            >>> c.policy_version
            1
            >>> c.shutdown()
        """
        yield
        self.update_policy_weights_()

    _version_value = 0

    def _store_version(self, value: int) -> None:
        # Every bump (weight updates included) moves the user's torchrl PolicyVersion too.
        old = self._version_value
        self._version_value = value
        tracker = self._version_tracker
        if tracker is not None:
            for _ in range(max(0, value - old)):
                tracker.increment_version()

    #: The policy version acting now (read without a call into Python: it is read per batch).
    _version = property(operator.attrgetter("_version_value"), _store_version)

    # torchrl's public attributes, read from the config (torchrl_args.py's TorchRLAttribute)
    worker_idx = TorchRLAttribute("worker_idx")
    trajs_per_batch = TorchRLAttribute("trajs_per_batch")
    trajs_per_write = TorchRLAttribute("trajs_per_write")
    traj_format = TorchRLAttribute("traj_format")

    @property
    def policy_version(self) -> int:
        """The version of the weights acting now (0 until the first update)."""
        return self._version

    def get_policy_version(self) -> int:
        """``policy_version`` as a method (torchrl has both)."""
        return self.policy_version


class FromConfig:
    """A read-only attribute that is the collector's ``config`` field of the same name (a
    public torchrl attribute, read where it is kept rather than copied).

    Example:
        >>> class C:
        ...     class config:
        ...         frames_per_batch = 10
        ...     frames_per_batch = FromConfig()
        >>> C().frames_per_batch
        10
    """

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        return self if obj is None else getattr(obj.config, self.name)


register_with_torchrl(CollectorBase)
