"""Argument validation, done once in the main process, with errors that name the argument,
the value received and what is accepted: the checks every collector family shares (both
wings use them), ``bound_arguments`` (a constructor's call as the keyword arguments of its
config: each argument is listed once, in the signature) and ``CollectorConfig``, the
single-process collector's validated options.

Example:
    >>> def make(frames_per_batch, total_frames=-1, **extra):
    ...     return bound_arguments(make, locals())
    >>> make(10, sync=True)
    {'frames_per_batch': 10, 'total_frames': -1, 'extra': {'sync': True}}
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import math
from collections.abc import Callable
from typing import Any

import torch
from rlcollect.base import CollectorBase
from rlcollect.policy import as_exploration_type
from rlcollect.trajectories import check_traj_args
from rlcollect.policy_transforms import check_flag
from rlcollect.torchrl_args import (check_face, check_hook, check_interruptor, check_recv_schemes,
                                    check_reset_when_done, check_trust_policy, endless_total_frames, random_frames,
                                    traj_limit, use_buffers, version_tracker)
from rlcollect.weights.schemes import validate_schemes

#: The collector classes ``collector_class`` may name by string, imported when first named (so
#: that nothing here imports the collector modules, which import this one).
NAMED_COLLECTORS = {
    "single": ("rlcollect.collector", "SingleCollector"),
    "sync": ("rlcollect.multiprocess.collector", "MultiSyncCollector"),
    "async": ("rlcollect.multiprocess.collector", "MultiAsyncCollector"),
}


#: ``check_finite``: no check, the first step of each batch, every step.
FINITE_CHECKS = (None, "first", "every")


def bound_arguments(function: Callable, values: dict[str, Any]) -> dict[str, Any]:
    """The call's arguments, ``{name: value}`` for every parameter of ``function`` (``self``
    left out; ``**kwargs`` as the dict of that name), read from ``values``: the ``locals()``
    its body takes first thing.  What a constructor hands its config, each argument once."""
    return {name: values[name] for name in inspect.signature(function).parameters if name != "self"}


def flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}")
    return value


def seconds(name: str, value: Any, accepted: str = "a positive number of seconds", finite: bool = False) -> float:
    """A positive number of seconds (``finite``: and not infinite)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or \
            (finite and not math.isfinite(value)):
        raise ValueError(f"{name} must be {accepted}, got {value!r}")
    return float(value)


def resolve_collector_class(value: Any) -> type:
    """``collector_class``: a collector class (``Collector``, a multi-process collector, or a
    subclass), one of ``"single"``, ``"sync"``, ``"async"``, or None (torchrl's default: ``Collector``).

    Example:
        >>> resolve_collector_class("sync").__name__
        'MultiSyncCollector'
    """
    if value is None:  # torchrl's default
        value = "single"
    if isinstance(value, str):
        if value not in NAMED_COLLECTORS:
            raise ValueError(f"collector_class must be a collector class or one of {sorted(NAMED_COLLECTORS)}, "
                             f"got {value!r}")
        module, name = NAMED_COLLECTORS[value]
        return getattr(importlib.import_module(module), name)
    # A collector that can fill a worker's batch slot (rlcollect/source.py): Collector, the
    # multi-process ones and their subclasses (not DistributedCollector).
    if isinstance(value, type) and issubclass(value, CollectorBase) and callable(getattr(value, "collect_into", None)):
        return value
    raise ValueError(
        f"collector_class must be Collector, MultiSyncCollector, MultiAsyncCollector (or a subclass), "
        f"or one of {sorted(NAMED_COLLECTORS)}; got {value!r}"
    )


def positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def optional_positive_int(name: str, value: Any) -> int | None:
    return None if value is None else positive_int(name, value)


def non_negative_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    return value


def total_frames_arg(value: Any) -> int:
    """A positive int, or -1 for torchrl's endless values (None, any negative int)."""
    return endless_total_frames(value)


def device_arg(name: str, value: Any) -> torch.device | None:
    if value is None:
        return None
    try:
        device = torch.device(value)
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"{name} must be a torch device or a device string like 'cpu' or 'cuda:0', "
                         f"got {value!r}") from err
    # Here, at the call, rather than torch's bare "Torch not compiled with CUDA enabled" from a
    # worker (where the policy is moved). is_available() does not initialise CUDA (forking stays
    # safe). env_device and storing_device have checks of their own (the env's, the sync join's).
    if device.type == "cuda" and name == "policy_device" and not torch.cuda.is_available():
        raise ValueError(f"{name}={value!r}, but this torch ({torch.__version__}) sees no CUDA device "
                         "(torch.cuda.is_available() is False): pass 'cpu', or run where a GPU and a CUDA build "
                         "of torch are")
    return device


def callable_or_none(name: str, value: Any) -> Callable | None:
    if value is not None and not callable(value):
        raise TypeError(f"{name} must be callable or None, got {type(value).__name__}")
    return value


def kwargs_arg(name: str, value: Any) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise TypeError(f"{name} must be a dict (or None), got {type(value).__name__}")
    return dict(value)


def compile_arg(name: str, value: Any) -> bool | dict | None:
    if value is None or isinstance(value, (bool, dict)):
        return value
    raise TypeError(f"{name} must be a bool or a dict of keyword arguments, got {type(value).__name__}")


def per_member(name: str, value: Any, n: int, member: str = "worker") -> list:
    """One value per worker (or node): ``value`` itself if it is a list or tuple of ``n``
    values, else ``n`` times ``value``.

    Example:
        >>> per_member("device", ["cpu", "cpu"], 2), per_member("device", None, 3)
        (['cpu', 'cpu'], [None, None, None])
        >>> per_member("device", ["cpu"], 2, "node")
        Traceback (most recent call last):
        ...
        ValueError: device is a per-node list of length 1, but there are 2 nodes
    """
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ValueError(f"{name} is a per-{member} list of length {len(value)}, but there are {n} {member}s")
        return list(value)
    return [value] * n


def check_policy_sources(policy: Any, has_factory: bool, schemes: dict,
                         scheme: str = "SharedMemWeightSyncScheme") -> None:
    """``policy`` and ``policy_factory`` together need a ``"policy"`` weight-sync scheme: the
    factory builds the acting policy, ``policy`` is then only the source of its weights
    (``scheme``: the scheme class the message suggests)."""
    if has_factory and policy is not None and "policy" not in schemes:
        raise ValueError(
            "policy and policy_factory were both given but weight_sync_schemes has no 'policy' scheme: pass "
            f"weight_sync_schemes={{'policy': {scheme}()}} (policy is then only the source of "
            "weights), or give just one of policy / policy_factory"
        )


def check_weight_updater(weight_updater: Any, weight_sync_schemes: Any) -> None:
    if weight_updater is not None and weight_sync_schemes is not None:
        raise ValueError("give weight_sync_schemes or weight_updater, not both (as in torchrl)")


def check_replay_buffer(replay_buffer: Any) -> None:
    if replay_buffer is not None and not callable(getattr(replay_buffer, "extend", None)):
        raise TypeError(f"replay_buffer must have an extend() method, got {type(replay_buffer).__name__}")


@dataclasses.dataclass
class CollectorConfig:
    """Every option of a single-process ``Collector`` (its arguments of the same names),
    validated; ``schemes`` (the validated ``weight_sync_schemes``) and ``version_tracker`` (a
    torchrl ``PolicyVersion`` given as ``track_policy_version``, or None) follow from them."""

    frames_per_batch: int
    create_env_fn: Any = dataclasses.field(default=None, repr=False, compare=False)
    policy: Any = dataclasses.field(default=None, repr=False, compare=False)
    policy_factory: Callable[[], Any] | None = dataclasses.field(default=None, repr=False, compare=False)
    total_frames: int = -1
    device: torch.device | None = None
    storing_device: torch.device | None = None
    env_device: torch.device | None = None
    policy_device: torch.device | None = None
    create_env_kwargs: dict = dataclasses.field(default_factory=dict)
    max_frames_per_traj: int | None = None
    init_random_frames: int = 0
    reset_at_each_iter: bool = False
    postproc: Callable | None = None
    split_trajs: bool = False
    exploration_type: str = "random"  # a tensordict InteractionType value; see policy.as_exploration_type
    set_truncated: bool = False
    use_buffers: bool = True
    return_same_td: bool = False
    extend_buffer: bool = True
    trust_policy: bool | None = None
    compile_policy: bool | dict | None = None
    cudagraph_policy: bool | dict | None = None
    no_cuda_sync: bool = False
    track_policy_version: bool = False
    worker_idx: int | None = None
    replay_buffer: Any = dataclasses.field(default=None, repr=False, compare=False)
    weight_sync_schemes: dict | None = None
    weight_updater: Any = dataclasses.field(default=None, repr=False, compare=False)
    traj_id_start: int | None = None
    reset_when_done: bool = True
    weight_recv_schemes: None = None
    track_traj_ids: bool = True
    compact_obs: bool = False
    pre_collect_hook: Callable[[], Any] | None = dataclasses.field(default=None, repr=False, compare=False)
    post_collect_hook: Callable[[Any], Any] | None = dataclasses.field(default=None, repr=False, compare=False)
    check_finite: str | None = None
    trajs_per_batch: int | None = None
    trajs_per_write: int | None = None
    traj_format: str | None = None
    interruptor: Any = dataclasses.field(default=None, repr=False, compare=False)
    auto_register_policy_transforms: bool | None = None

    def __post_init__(self) -> None:
        check_reset_when_done(self.reset_when_done)
        check_interruptor(self.interruptor)
        check_flag(self.auto_register_policy_transforms)
        check_hook("pre_collect_hook", self.pre_collect_hook)
        check_hook("post_collect_hook", self.post_collect_hook)
        check_recv_schemes(self.weight_recv_schemes)
        self.use_buffers = use_buffers(self.use_buffers)
        check_face(self.track_traj_ids, self.compact_obs, self.split_trajs)
        check_traj_args(self.trajs_per_batch, self.trajs_per_write, self.traj_format, self.split_trajs)
        self.track_policy_version, self.version_tracker = version_tracker(self.track_policy_version)
        positive_int("frames_per_batch", self.frames_per_batch)
        self.total_frames = total_frames_arg(self.total_frames)
        for name in ("device", "storing_device", "env_device", "policy_device"):
            setattr(self, name, device_arg(name, getattr(self, name)))
        self.create_env_kwargs = kwargs_arg("create_env_kwargs", self.create_env_kwargs)
        self.max_frames_per_traj = traj_limit(self.max_frames_per_traj)
        self.init_random_frames = random_frames(self.init_random_frames)
        callable_or_none("postproc", self.postproc)
        self.exploration_type = as_exploration_type(self.exploration_type)
        self.trust_policy = check_trust_policy(self.trust_policy)
        self.compile_policy = compile_arg("compile_policy", self.compile_policy)
        self.cudagraph_policy = compile_arg("cudagraph_policy", self.cudagraph_policy)
        if self.worker_idx is not None:
            non_negative_int("worker_idx", self.worker_idx)
        for name in ("reset_at_each_iter", "split_trajs", "set_truncated", "return_same_td",
                     "extend_buffer", "no_cuda_sync", "track_policy_version"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        self.schemes = validate_schemes(self.weight_sync_schemes)
        check_weight_updater(self.weight_updater, self.weight_sync_schemes)
        if self.policy_factory is not None and not callable(self.policy_factory):
            raise TypeError("policy_factory must be a callable returning the policy, got "
                            f"{type(self.policy_factory).__name__}")
        check_policy_sources(self.policy, self.policy_factory is not None, self.schemes)
        check_replay_buffer(self.replay_buffer)
        if self.check_finite not in FINITE_CHECKS:
            raise ValueError(f"check_finite must be one of {FINITE_CHECKS}, got {self.check_finite!r}")

    @property
    def policy_device_or_default(self) -> torch.device | None:
        return self.policy_device or self.device

    @property
    def storing_device_or_default(self) -> torch.device | None:
        return self.storing_device or self.device
