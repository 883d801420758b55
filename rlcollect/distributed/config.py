"""``DistributedCollector``'s arguments, validated once on rank 0 before anything starts, and
the per-node specs (cloudpickled) that travel to the nodes.  Errors name the argument, the
value received and what is accepted."""

from __future__ import annotations

import copy
import ipaddress
import math
import os
from collections.abc import Callable
from typing import Any

import cloudpickle

from rlcollect.collector import Collector
from rlcollect.torchrl_args import random_frames
from rlcollect.config import CollectorConfig, kwargs_arg, optional_positive_int, positive_int, total_frames_arg
from rlcollect.data import TRAJ_ID_BLOCK
from rlcollect.distributed.auth import SECRET_ENV, SecretError, read_secret_file, secret_from_env
from rlcollect.distributed.launchers import LAUNCHERS, require_submitit
from rlcollect.distributed.transport import default_host_address, resolve
from rlcollect.multiprocess.base import resolve_collector_class
from rlcollect.policy import as_exploration_type, has_weights
from rlcollect.weights.schemes import DistributedWeightSyncScheme, NoWeightSyncScheme, validate_schemes

BACKENDS = ("gloo",)
PER_NODE_ARGS = ("device", "storing_device", "env_device", "policy_device")
#: Batches a node may have in flight: async nodes fill one buffer while rank 0 reads the other.
ASYNC_SLOTS = 2
NODE_FAILURE_POLICIES = ("raise", "continue", "restart")
#: The launchers that start the nodes themselves, and so can relaunch one.
RELAUNCHING_LAUNCHERS = ("mp", "submitit")


def _per_node(name: str, value: Any, n: int) -> list:
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ValueError(f"{name} is a per-node list of length {len(value)}, but there are {n} nodes")
        return list(value)
    return [value] * n


def _seconds(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
    return float(value)


def _master_addr(value: Any, launcher: str) -> str:
    if value is None:
        # Loopback for local nodes; the address other hosts see otherwise (docs/distributed.md,
        # "Launchers").
        return "127.0.0.1" if launcher == "mp" else default_host_address()
    if not isinstance(value, str) or not value:
        raise TypeError(f"master_addr must be a host name or address string, got {value!r}")
    if ipaddress.ip_address(resolve(value)).is_unspecified:
        raise ValueError(f"master_addr={value!r} is a wildcard: give the address of the interface the nodes "
                         "connect to (rank 0 listens on that interface only)")
    return value


class DistributedConfig:
    """Every option of a ``DistributedCollector``, validated, and the node specs."""

    def __init__(
        self,
        create_env_fn: Any,
        policy: Any,
        *,
        num_nodes: int | None,
        policy_factory: Callable | list | None,
        frames_per_batch: int,
        total_frames: int,
        devices: dict[str, Any],
        create_env_kwargs: dict | list | None,
        inner_options: dict[str, Any],
        init_random_frames: int | None,
        postproc: Callable | None,
        split_trajs: bool,
        collector_class: Any,
        collector_kwargs: dict | list | None,
        num_workers_per_collector: int,
        sync: bool,
        slurm_kwargs: dict | None,
        backend: str,
        update_after_each_batch: bool,
        max_weight_update_interval: int,
        update_interval: int | None,
        launcher: str,
        tcp_port: int | None,
        master_addr: str | None,
        timeout: float,
        heartbeat_timeout: float,
        weight_sync_schemes: dict | None,
        on_node_failure: str = "raise",
        max_node_restarts: int = 3,
        node_timeout: float | None = None,
        start_timeout: float = 120.0,
        rank0_timeout: float = 60.0,
        secret_file: Any = None,
    ):
        # -- nodes ----------------------------------------------------------------------------------
        if isinstance(create_env_fn, (list, tuple)):
            if not create_env_fn:
                raise ValueError("create_env_fn is an empty list; give one env factory per node")
            if num_nodes is not None and num_nodes != len(create_env_fn):
                raise ValueError(f"num_nodes={num_nodes} but create_env_fn lists {len(create_env_fn)} envs (one per node)")
            env_fns = list(create_env_fn)
        else:
            env_fns = [create_env_fn] * positive_int("num_nodes", 1 if num_nodes is None else num_nodes)
        n = self.num_nodes = len(env_fns)
        if not isinstance(sync, bool):
            raise TypeError(f"sync must be True or False, got {sync!r}")
        self.sync = sync
        self.slots = 1 if sync else ASYNC_SLOTS
        positive_int("frames_per_batch", frames_per_batch)
        self.total_frames = total_frames_arg(total_frames)
        if sync and frames_per_batch % n:
            raise RuntimeError(f"frames_per_batch={frames_per_batch} is not divisible by the {n} nodes: with sync=True "
                               "each node collects frames_per_batch / num_nodes frames")
        self.frames_per_batch = frames_per_batch
        self.node_frames = frames_per_batch // n if sync else frames_per_batch
        self.init_random_frames = random_frames(init_random_frames)
        if postproc is not None and not callable(postproc):
            raise TypeError(f"postproc must be callable or None, got {type(postproc).__name__}")
        self.postproc, self.split_trajs = postproc, bool(split_trajs)
        # -- transport and launcher -------------------------------------------------------------
        if backend not in BACKENDS:
            hint = " (nccl: batches travel over gloo; GPU nodes deliver on CPU)" if backend == "nccl" else ""
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}{hint}")
        if launcher not in LAUNCHERS:
            raise ValueError(f"launcher must be one of {LAUNCHERS}, got {launcher!r}")
        if launcher == "submitit":
            require_submitit()  # here, before anything starts, not when the jobs are submitted
        self.launcher, self.backend = launcher, backend
        if slurm_kwargs is not None and not isinstance(slurm_kwargs, dict):
            raise TypeError(f"slurm_kwargs must be a dict or None, got {type(slurm_kwargs).__name__}")
        self.slurm_kwargs = slurm_kwargs
        if isinstance(tcp_port, str) and tcp_port.strip().isdigit():
            tcp_port = int(tcp_port)  # torchrl keeps the port as a string ("10003")
        if tcp_port is not None and (isinstance(tcp_port, bool) or not isinstance(tcp_port, int)
                                     or not 0 < tcp_port < 65536):
            raise ValueError(f"tcp_port must be a port number in 1..65535, or None to pick a free one; got {tcp_port!r}")
        if tcp_port is None and launcher in ("external", "submitit_delayed"):
            raise ValueError(f"launcher={launcher!r} needs tcp_port: the nodes, started before rank 0, must know it")
        self.tcp_port = tcp_port
        self.master_addr = _master_addr(master_addr, launcher)
        self.timeout = _seconds("timeout", timeout)
        self.heartbeat_timeout = _seconds("heartbeat_timeout", heartbeat_timeout)
        self.node_timeout = None if node_timeout is None else _seconds("node_timeout", node_timeout)
        self.start_timeout = _seconds("start_timeout", start_timeout)
        self.rank0_timeout = _seconds("rank0_timeout", rank0_timeout)
        # -- the run's secret (auth.py) ------------------------------------------------------------
        if secret_file is not None and not isinstance(secret_file, (str, os.PathLike)):
            raise TypeError(f"secret_file must be a path (str or os.PathLike) or None, got {type(secret_file).__name__}")
        self.secret_file = None if secret_file is None else os.path.abspath(os.path.expanduser(os.fspath(secret_file)))
        if self.secret_file is not None:
            try:
                read_secret_file(self.secret_file)
            except SecretError as err:
                raise ValueError(f"secret_file={secret_file!r}: {err}") from None
        elif launcher in ("external", "submitit_delayed") and SECRET_ENV in os.environ:
            try:
                secret_from_env()
            except SecretError as err:
                raise ValueError(str(err)) from None
        elif launcher == "submitit_delayed":
            raise ValueError("launcher='submitit_delayed' needs secret_file=PATH (the file given to "
                             f"submit_nodes(secret_file=PATH)) or the secret in ${SECRET_ENV}")
        # -- failures ---------------------------------------------------------------------------------
        if on_node_failure not in NODE_FAILURE_POLICIES:
            raise ValueError(f"on_node_failure must be one of {NODE_FAILURE_POLICIES}, got {on_node_failure!r}")
        if on_node_failure == "continue" and sync:
            raise ValueError("on_node_failure='continue' needs sync=False: a sync batch holds one part from every "
                             "node, so it cannot go on without one (use 'restart', or sync=False)")
        if on_node_failure == "restart" and launcher not in RELAUNCHING_LAUNCHERS:
            raise ValueError(f"on_node_failure='restart' needs a launcher that starts the nodes itself "
                             f"{RELAUNCHING_LAUNCHERS}, got launcher={launcher!r} (its nodes are started by you: use "
                             "'continue' with sync=False, or 'raise')")
        if isinstance(max_node_restarts, bool) or not isinstance(max_node_restarts, int) or max_node_restarts < 0:
            raise ValueError(f"max_node_restarts must be an int >= 0, got {max_node_restarts!r}")
        self.on_node_failure, self.max_node_restarts = on_node_failure, max_node_restarts
        # -- weights ----------------------------------------------------------------------------------
        schemes = validate_schemes(weight_sync_schemes)
        unknown = set(schemes) - {"policy"}
        if unknown:
            raise ValueError(f"weight_sync_schemes: a DistributedCollector has only the 'policy' model, got {sorted(unknown)}")
        scheme = schemes.get("policy", DistributedWeightSyncScheme())
        if not isinstance(scheme, (DistributedWeightSyncScheme, NoWeightSyncScheme)):
            raise ValueError(f"weight_sync_schemes['policy'] must be DistributedWeightSyncScheme ('distributed') or "
                             f"NoWeightSyncScheme ('none') for nodes, got {scheme!r}")
        self.scheme = scheme
        factories = _per_node("policy_factory", policy_factory, n)
        if any(f is not None and not callable(f) for f in factories):
            raise TypeError("policy_factory must be a callable returning the policy (or a per-node list of them)")
        if any(f is not None for f in factories) and policy is not None and "policy" not in schemes:
            raise ValueError("policy and policy_factory were both given but weight_sync_schemes has no 'policy' scheme: "
                             "pass weight_sync_schemes={'policy': DistributedWeightSyncScheme()} (policy is then only "
                             "the source of weights), or give just one of policy / policy_factory")
        self.weight_source = policy if has_weights(policy) else None
        if not isinstance(update_after_each_batch, bool):
            raise TypeError(f"update_after_each_batch must be True or False, got {update_after_each_batch!r}")
        if isinstance(max_weight_update_interval, bool) or not isinstance(max_weight_update_interval, int) or \
                (max_weight_update_interval < 1 and max_weight_update_interval != -1):
            raise ValueError(f"max_weight_update_interval must be a positive int, or -1 for none; got "
                             f"{max_weight_update_interval!r}")
        if update_after_each_batch and max_weight_update_interval != -1:
            raise RuntimeError("update_after_each_batch and max_weight_update_interval cannot be used together: "
                               "the first already updates before every batch")
        self.update_after_each_batch = update_after_each_batch
        self.max_weight_update_interval = max_weight_update_interval
        self.update_interval = optional_positive_int("update_interval", update_interval)
        # -- what each node runs -----------------------------------------------------------------------
        self.collector_class = resolve_collector_class(collector_class)
        single = self.collector_class is Collector or issubclass(self.collector_class, Collector)
        positive_int("num_workers_per_collector", num_workers_per_collector)
        if single and num_workers_per_collector != 1:
            raise ValueError(f"num_workers_per_collector={num_workers_per_collector} needs a multi-process node "
                             "collector_class ('sync' or 'async'); a single Collector node has one worker")
        kwargs_lists = _per_node("collector_kwargs", collector_kwargs, n)
        kwargs_lists = [kwargs_arg("collector_kwargs", k) for k in kwargs_lists]
        env_kwargs = _per_node("create_env_kwargs", create_env_kwargs, n)
        devices = {name: _per_node(name, devices[name], n) for name in PER_NODE_ARGS}
        self.storing_device = devices["storing_device"][0] or devices["device"][0]
        self.devices = devices  # {name: one per node}
        if "exploration_type" in inner_options:
            inner_options = {**inner_options, "exploration_type": as_exploration_type(inner_options["exploration_type"])}
        self.payloads: list[bytes] = []
        self._specs: list[dict] = []
        self._single = single
        footprints: list[int] = []
        first_free_block = 0
        for i in range(n):
            kwargs = {"policy_factory": factories[i], "frames_per_batch": self.node_frames, "total_frames": -1,
                      "create_env_kwargs": env_kwargs[i], **{k: devices[k][i] for k in PER_NODE_ARGS},
                      **inner_options}
            if not single:
                kwargs["num_workers"] = num_workers_per_collector
            kwargs.update(kwargs_lists[i])
            # Trajectory ids: a node's collector draws from blocks [w * f, (w + 1) * f) where f is
            # its worker count (multi-process collectors give worker j of collector w block
            # w * f + j); w is chosen so that the nodes' blocks never overlap.
            footprint = 1 if single else positive_int("num_workers", kwargs["num_workers"])
            kwargs["worker_idx"] = math.ceil(first_free_block / footprint)
            first_free_block = (kwargs["worker_idx"] + 1) * footprint
            footprints.append(footprint)
            if single:
                CollectorConfig(**{k: v for k, v in kwargs.items() if k in CollectorConfig.__dataclass_fields__})
            spec = {"collector_class": self.collector_class, "create_env_fn": env_fns[i],
                    "policy": None if factories[i] is not None else policy, "kwargs": kwargs, "slots": self.slots}
            self._specs.append(spec)
            try:
                self.payloads.append(cloudpickle.dumps(spec))
            except Exception as err:
                raise TypeError(f"node {i}'s env factory, policy or collector_kwargs cannot be pickled for the nodes "
                                f"({err}): pass a module-level factory function (or a gymnasium id), and build "
                                "unpicklable policies inside the nodes with policy_factory=<a function>") from err
        # A relaunched node draws trajectory ids from blocks past every node's: incarnation k
        # shifts a node's blocks by k * this (a multiple of every node's footprint).
        common = math.lcm(*footprints)
        self._incarnation_blocks = math.ceil(first_free_block / common) * common
        self._footprints = footprints

    def relaunch_payload(self, i: int, incarnation: int, seed: int | None) -> bytes:
        """Node ``i``'s spec for its ``incarnation`` (>= 1): the same factory and options, a
        fresh block of trajectory ids, and ``seed`` (None: a random one)."""
        spec = copy.copy(self._specs[i])
        kwargs = dict(spec["kwargs"])
        shift = incarnation * self._incarnation_blocks
        if self._single:  # keep worker_idx (what a FaultyEnv targets); move only the ids
            kwargs["traj_id_start"] = (kwargs["worker_idx"] + shift) * TRAJ_ID_BLOCK
        else:
            kwargs["worker_idx"] += shift // self._footprints[i]
        spec["kwargs"] = kwargs
        spec["seed"] = seed if seed is not None else int.from_bytes(os.urandom(4), "little")
        return cloudpickle.dumps(spec)
