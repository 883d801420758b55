"""torchrl's argument values and the methods torchrl's collectors have, shared by every
rlcollect collector.

torchrl spells "no limit" several ways (``total_frames=None`` or any negative number,
``max_frames_per_traj=-1``/``None``/``0``, ``init_random_frames=-1``/``None``); the helpers here
map each to rlcollect's one spelling, and reject everything else with a message naming the
argument. ``RL_WARNINGS=0`` (torchrl's environment variable) silences the warnings collectors
give about batch arithmetic, as it does in torchrl.

Example:
    >>> from rlcollect.torchrl_args import endless_total_frames, traj_limit
    >>> endless_total_frames(None), endless_total_frames(-5), endless_total_frames(100)
    (-1, -1, 100)
    >>> traj_limit(-1), traj_limit(0), traj_limit(None), traj_limit(20)
    (None, None, None, 20)
"""

from __future__ import annotations

import os
import sys
import warnings
from typing import Any

import torch


_FALSE = {"0", "false", "f", "no", "n", "off"}


def rl_warnings() -> bool:
    """False when the environment variable ``RL_WARNINGS`` says no (``0``/``False``/``no``/``off``)."""
    return os.environ.get("RL_WARNINGS", "1").strip().lower() not in _FALSE


def warn(message: str, stacklevel: int = 2) -> None:
    """``warnings.warn`` unless ``RL_WARNINGS`` is off."""
    if rl_warnings():
        warnings.warn(message + " (set RL_WARNINGS=0 to silence this message)", stacklevel=stacklevel + 1)


def warn_overshoot(total_frames: int, frames_per_batch: int, stacklevel: int = 2) -> None:
    """Warn when ``total_frames`` is not a multiple of ``frames_per_batch`` (the last batch
    overshoots)."""
    if total_frames > 0 and total_frames % frames_per_batch:
        warn(f"total_frames={total_frames} is less than frames_per_batch={frames_per_batch}: the only batch has "
             f"{frames_per_batch} frames" if total_frames < frames_per_batch else
             f"total_frames={total_frames} is not a multiple of frames_per_batch={frames_per_batch}: the last "
             "batch overshoots to a whole batch", stacklevel=stacklevel + 1)


def _int(name: str, value: Any, accepted: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be {accepted}; got {value!r}")
    return value


def endless_total_frames(value: Any) -> int:
    """``total_frames``: a positive int, or ``None`` / any negative int for an endless collector
    (returned as -1). 0 is refused: it would collect nothing."""
    if value is None:
        return -1
    value = _int("total_frames", value, "a positive int, or None / a negative int (-1) for an endless collector")
    if value == 0:
        raise ValueError("total_frames must be a positive int, or None / a negative int (-1) for an endless "
                         "collector; got 0 (which would collect nothing)")
    return -1 if value < 0 else value


def traj_limit(value: Any) -> int | None:
    """``max_frames_per_traj``: a positive int, or ``None`` / ``-1`` / ``0`` for no limit (None)."""
    if value is None:
        return None
    value = _int("max_frames_per_traj", value, "a positive int, or None / -1 / 0 for no limit")
    if value in (0, -1):
        return None
    if value < 0:
        raise ValueError(f"max_frames_per_traj must be a positive int, or None / -1 / 0 for no limit; got {value!r}")
    return value


def random_frames(value: Any) -> int:
    """``init_random_frames``: an int >= 0, or ``None`` / ``-1`` for none (0)."""
    if value is None:
        return 0
    value = _int("init_random_frames", value, "an int >= 0, or None / -1 for no random frames")
    if value == -1:
        return 0
    if value < 0:
        raise ValueError(f"init_random_frames must be an int >= 0, or None / -1 for no random frames; got {value!r}")
    return value


def frames_written(replay_buffer: Any, collected: int) -> int:
    """Frames judged by ``init_random_frames``: the buffer's ``write_count`` when it has one."""
    count = getattr(replay_buffer, "write_count", None) if replay_buffer is not None else None
    return collected if not isinstance(count, int) else count


def version_tracker(value: Any) -> tuple[bool, Any]:
    """``track_policy_version``: a bool, or a torchrl ``PolicyVersion``-like object (anything with
    ``increment_version()``). Returns (track, the object or None)."""
    if isinstance(value, bool):
        return value, None
    if callable(getattr(value, "increment_version", None)):
        return True, value
    raise TypeError("track_policy_version must be a bool or a torchrl PolicyVersion (an object with "
                    f"increment_version()), got {type(value).__name__}")


def check_close_env(close_env: Any, owner: str) -> None:
    if close_env is not True:
        raise ValueError(
            f"{owner}.shutdown(close_env={close_env!r}): a collector owns its envs and always closes them when it "
            "shuts down (torchrl's multi-process collectors refuse close_env=False too); to keep using an env, "
            "keep collecting, or build a new env after shutdown"
        )


def check_hook(name: str, value: Any) -> Any:
    """``pre_collect_hook`` / ``post_collect_hook``: a callable or None."""
    if value is not None and not callable(value):
        raise TypeError(f"{name} must be a callable or None, got {type(value).__name__}")
    return value


def check_recv_schemes(value: Any) -> None:
    """``weight_recv_schemes``: torchrl's schemes for a collector that receives weights from a
    parent collector; only its default ``None`` is accepted."""
    if value is not None:
        raise ValueError(f"weight_recv_schemes={value!r} is not supported: an rlcollect collector receives weights "
                         "only from its owner (update_policy_weights_, weight_sync_schemes); pass None (torchrl's "
                         "default)")


def use_buffers(value: Any) -> bool:
    """``use_buffers``: a bool, or torchrl's ``None`` (decide for me: True)."""
    if value is None:
        return True
    if not isinstance(value, bool):
        raise TypeError(f"use_buffers must be True, False or None, got {value!r}")
    return value


def check_face(track_traj_ids: Any, compact_obs: Any, split_trajs: bool) -> None:
    """``track_traj_ids`` and ``compact_obs`` (bools; splitting needs the trajectory ids)."""
    for name, value in (("track_traj_ids", track_traj_ids), ("compact_obs", compact_obs)):
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be True or False, got {value!r}")
    if split_trajs and not track_traj_ids:
        raise ValueError("split_trajs=True needs the trajectory ids: track_traj_ids must be True")


#: The ``("next", ...)`` entries ``compact_obs`` keeps (they are not the next step's root).
_NOT_OBSERVATIONS = ("reward", "done", "terminated", "truncated")


def trimmed(batch: Any, track_traj_ids: bool, compact_obs: bool) -> Any:
    """The batch as torchrl 0.14 gives it with ``track_traj_ids=False`` (no
    ``("collector", "traj_ids")``) and ``compact_obs=True`` (no ``("next", key)`` copy of a root
    entry, but the reward and done flags)."""
    drop = [] if track_traj_ids else [("collector", "traj_ids")]
    if compact_obs and "next" in batch.keys():
        root = set(batch.exclude("next").keys(True, True))
        drop += [("next", *((k,) if isinstance(k, str) else k)) for k in batch["next"].keys(True, True)
                 if k not in _NOT_OBSERVATIONS and k in root]
    return batch.exclude(*drop) if drop else batch


def profile_args(path: Any, rollouts: Any, kwargs: dict, workers: Any = (0,)) -> tuple[Any, tuple, dict, Any]:
    """``enable_profile``'s arguments as ``(path, rollouts, torch.profiler.profile kwargs,
    workers)``, torchrl 0.14's among them mapped: ``save_path`` (its ``{worker_idx}`` is
    dropped: each worker writes its own file), ``num_rollouts`` / ``warmup_rollouts`` (the
    rollouts ``warmup .. num - 1``), ``activities`` as ``"cpu"`` / ``"cuda"``, ``workers``.
    Anything ``torch.profiler.profile`` does not take is a ``TypeError`` here, at the call.

    Example:
        >>> path, rollouts, kw, workers = profile_args("t.json", (0,), {"num_rollouts": 3, "warmup_rollouts": 1,
        ...                                                            "save_path": "p_{worker_idx}.json"})
        >>> path, rollouts, kw, workers
        ('p_.json', (1, 2), {}, (0,))
    """
    import inspect

    kwargs = dict(kwargs)
    workers = kwargs.pop("workers", workers)
    workers = (0,) if workers is None else tuple(workers)
    save_path = kwargs.pop("save_path", None)
    if save_path is not None:
        path = str(save_path).replace("{worker_idx}", "")
    if "num_rollouts" in kwargs or "warmup_rollouts" in kwargs:
        total, warmup = kwargs.pop("num_rollouts", 3), kwargs.pop("warmup_rollouts", 1)
        rollouts = tuple(range(warmup, total))
        if not rollouts:
            raise ValueError(f"enable_profile: num_rollouts={total} leaves no rollout after warmup_rollouts={warmup}")
    if kwargs.get("on_trace_ready") is not None:
        raise ValueError("enable_profile(on_trace_ready=...) is not supported: the trace is written as a Chrome "
                         "trace to save_path (path)")
    kwargs.pop("on_trace_ready", None)
    if kwargs.get("activities") is not None:
        names = {"cpu": torch.profiler.ProfilerActivity.CPU, "cuda": torch.profiler.ProfilerActivity.CUDA}
        kwargs["activities"] = [names.get(a, a) if isinstance(a, str) else a for a in kwargs["activities"]]
    accepted = set(inspect.signature(torch.profiler.profile.__init__).parameters) - {"self"}
    unknown = sorted(set(kwargs) - accepted)
    if unknown:
        raise TypeError(f"enable_profile got unexpected arguments {unknown}: accepted are path, rollouts, workers, "
                        "torchrl's save_path/num_rollouts/warmup_rollouts/activities, and torch.profiler.profile's "
                        f"{sorted(accepted)}")
    return path, tuple(rollouts), kwargs, workers


def register_with_torchrl(base: type) -> None:
    """Make ``base`` (rlcollect's ``CollectorBase``) a virtual subclass of torchrl's
    ``torchrl.collectors.BaseCollector``, when torchrl's collectors are imported already: this
    never imports torchrl. Called when rlcollect.base is imported and when a collector is
    built (so ``isinstance(c, BaseCollector)`` holds whichever was imported first)."""
    torchrl_base = getattr(sys.modules.get("torchrl.collectors"), "BaseCollector", None)
    if torchrl_base is not None and callable(getattr(torchrl_base, "register", None)) \
            and not issubclass(base, torchrl_base):
        torchrl_base.register(base)


def check_interruptor(value: Any) -> Any:
    """``interruptor``: None, or torchrl's ``_Interruptor`` (anything with ``collection_stopped()``)."""
    if value is not None and not callable(getattr(value, "collection_stopped", None)):
        raise TypeError("interruptor must be None or an object with collection_stopped() (torchrl's "
                        f"collectors' _Interruptor), got {type(value).__name__}")
    return value


def check_init_fn(value: Any) -> Any:
    """``init_fn``: None, or a callable run with no argument in each worker process."""
    if value is not None and not callable(value):
        raise TypeError(f"init_fn must be a callable taking no argument, or None, got {type(value).__name__}")
    return value


class InterruptorFlag:
    """The ``stop`` flag a rollout reads before each step, from torchrl's ``interruptor``: as
    torchrl's collector reads it after each step, the first step of a batch always runs (a
    stopped interruptor gives one-step batches, never empty ones). One per batch."""

    __slots__ = ("stopped", "first")

    def __init__(self, interruptor: Any) -> None:
        self.stopped = interruptor.collection_stopped
        self.first = True

    def __getitem__(self, index: int) -> bool:
        if self.first:
            self.first = False
            return False
        return bool(self.stopped())


def check_reset_when_done(value: Any) -> None:
    """``reset_when_done``: True is what rlcollect always does; False is refused."""
    if value is True:
        return
    raise ValueError(
        f"reset_when_done={value!r} is not supported: rlcollect resets an env in the very step it ends "
        "(same-step autoreset, the ending step's observation is kept under 'next'), so every batch row is a "
        "valid transition; torchrl's reset_when_done=False leaves ended envs for you to reset. To start "
        "every batch fresh use reset_at_each_iter=True; to reset by hand use collector.reset()"
    )


def optional_flag(name: str, value: Any) -> bool | None:
    """torchrl's three-way flags (``trust_policy``, ``auto_register_policy_transforms``): None
    (torchrl's default), True or False."""
    if value is None or isinstance(value, bool):
        return value
    raise TypeError(f"{name} must be None, True or False, got {value!r}")


def check_trust_policy(value: Any) -> bool | None:
    return optional_flag("trust_policy", value)


def check_local_init_rb(value: Any) -> bool | None:
    """``local_init_rb``: accepted; the buffer's storage is always set up in the main process."""
    if value is None or isinstance(value, bool):
        return value
    raise TypeError(f"local_init_rb must be None, True or False, got {value!r}")


def check_timeout(timeout: Any, default: float) -> float:
    """``shutdown(timeout=None)`` means the collector's default."""
    if timeout is None:
        return default
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout < 0:
        raise ValueError(f"shutdown timeout must be None or a number of seconds >= 0, got {timeout!r}")
    return float(timeout)


def selects_all(index: Any, rows: int) -> bool:
    """Whether torchrl's ``reset(index=...)`` names every row of the env."""
    if isinstance(index, slice):
        return len(range(*index.indices(rows))) == rows
    flat = torch.as_tensor(index).reshape(-1)
    if flat.dtype == torch.bool:
        return flat.numel() == rows and bool(flat.all())
    return set(flat.tolist()) >= set(range(rows)) if rows > 1 else flat.numel() >= 1


def chosen_workers(reset_idx: Any, n: int) -> list[int]:
    """torchrl's ``reset(reset_idx=...)``: None is every worker, else one bool per worker."""
    if reset_idx is None:
        return list(range(n))
    flags = reset_idx.reshape(-1).tolist() if isinstance(reset_idx, torch.Tensor) else list(reset_idx)
    if len(flags) != n or not all(isinstance(f, bool) for f in flags):
        raise ValueError(f"reset_idx must be None or {n} bools (one per worker), got {reset_idx!r}")
    return [i for i, f in enumerate(flags) if f]


def random_batches(init_random_frames: int, worker_frames: list[int]) -> int:
    """How many random batches torchrl's MultiAsyncCollector asks for: every worker's first
    (when ``init_random_frames`` > 0), then one per delivered batch while the frames delivered
    are fewer than ``init_random_frames`` (deliveries counted in turn over the workers).

    Example:
        >>> random_batches(200, [200, 200]), random_batches(0, [10, 10]), random_batches(50, [10, 10])
        (2, 0, 6)
    """
    if init_random_frames <= 0:
        return 0
    count, delivered, n = len(worker_frames), 0, len(worker_frames)
    while True:
        delivered += worker_frames[(count - n) % n]
        if delivered >= init_random_frames:
            return count
        count += 1


class TorchRLAttribute:
    """One of torchrl's public collector attributes, read from the collector's ``config`` with
    torchrl's value: ``worker_idx``, ``trajs_per_write`` (the arguments, None when a collector
    has none), ``traj_format`` (None given reads ``"padded"``, as torchrl resolves it),
    ``trajs_per_batch`` (None on a multi-process collector given a replay buffer: torchrl hands
    the count to its workers then).

    Example:
        >>> class C:
        ...     class config:
        ...         traj_format = None
        ...     traj_format = TorchRLAttribute("traj_format")
        >>> C().traj_format
        'padded'
    """

    def __init__(self, name: str):
        self.name = name

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            return self
        value = getattr(obj.config, self.name, None)
        if self.name == "traj_format":
            return value or "padded"
        if self.name == "trajs_per_batch" and hasattr(obj.config, "worker_frames"):  # (multiprocess's MultiConfig)
            return None if getattr(obj, "replay_buffer", None) is not None else value
        return value


def _num_workers(collector: Any) -> int:
    """torchrl's name for the number of nodes."""
    return collector.config.num_nodes


def _policy_factory(collector: Any) -> list:
    """torchrl's: one policy factory (or None) per node."""
    return list(collector.config.factories)


def _tcp_port(collector: Any) -> str | None:
    """torchrl's: the port of rank 0's store as a string (torchrl keeps the one it was given or
    ``$TCP_PORT``/10003); here the one given or, once started, the free one picked."""
    port = getattr(collector, "master_port", None) or collector.config.tcp_port
    return None if port is None else str(port)


#: torchrl's ``DistributedCollector``'s public attributes, as torchrl's sets them from the same
#: arguments, read from our collector's ``config`` (``collector_class`` resolved to a class, as
#: torchrl resolves ``"single"``/``"sync"``/``"async"``); set on ``DistributedCollector``.
DISTRIBUTED_ATTRIBUTES: dict[str, Any] = {
    **{name: TorchRLAttribute(name) for name in (
        "collector_class", "collector_kwargs", "num_workers_per_collector", "launcher", "backend", "slurm_kwargs",
        "update_after_each_batch", "max_weight_update_interval", "update_interval", "split_trajs", "postproc")},
    "num_workers": property(_num_workers), "policy_factory": property(_policy_factory),
    "tcp_port": property(_tcp_port),
}


def tracks_versions(config: Any) -> bool:
    """Whether a collector's config tracks policy versions (a multi-process collector forwards
    ``track_policy_version`` to its workers' collectors)."""
    return bool(getattr(config, "track_policy_version", None)
                or getattr(config, "inner_options", {}).get("track_policy_version"))


def per_worker_stats(stats: dict, sizes: list[int], tracked: bool, both: bool = False) -> dict:
    """torchrl's ``stats(workers="per_worker")`` view of our ``stats`` (whose ``"workers"`` is a
    list of per-worker dicts; ``sizes``: each worker's frames per batch): ``"workers"`` a count,
    ``"workers_alive"``, and ``"worker_<i>/frames"``, ``"worker_<i>/batches"`` (its whole
    batches of frames), ``"worker_<i>/requested_frames_per_batch"``, ``"worker_<i>/policy_version"``
    when ``tracked``. ``both``: ``stats`` (ours) with those per-worker keys added.

    Example:
        >>> per_worker_stats({"workers": [{"frames": 20, "policy_version": 0}], "workers_alive": 1}, [10], False)
        {'workers': 1, 'workers_alive': 1, 'worker_0/frames': 20, 'worker_0/batches': 2, \
'worker_0/requested_frames_per_batch': 10}
    """
    keys: dict[str, Any] = {}
    for i, (worker, size) in enumerate(zip(stats.get("workers", []), sizes)):
        keys[f"worker_{i}/frames"] = int(worker["frames"])
        keys[f"worker_{i}/batches"] = int(worker["frames"]) // size if size else 0
        keys[f"worker_{i}/requested_frames_per_batch"] = size
        if tracked:
            keys[f"worker_{i}/policy_version"] = int(worker["policy_version"])
    if both:
        return {**stats, **keys}
    return {"workers": len(stats.get("workers", [])), "workers_alive": stats["workers_alive"], **keys}
