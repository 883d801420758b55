"""``DistributedCollector``'s arguments, validated once on rank 0 before anything starts, and
the per-node specs (cloudpickled) that travel to the nodes.  Errors name the argument, the
value received and what is accepted."""

from __future__ import annotations

import copy
import dataclasses
import ipaddress
import math
import os
from collections.abc import Callable
from typing import Any

import cloudpickle

from rlcollect.collector import SingleCollector
from rlcollect.torchrl_args import check_hook, check_recv_schemes, random_frames
from rlcollect.trajectories import check_traj_args
from rlcollect.config import (CollectorConfig, callable_or_none, check_policy_sources, flag, kwargs_arg,
                              non_negative_int, optional_positive_int, per_member, positive_int,
                              resolve_collector_class, seconds, total_frames_arg)
from rlcollect.data import TRAJ_ID_BLOCK
from rlcollect.distributed.control.auth import SECRET_ENV, SecretError, read_secret_file, secret_from_env
from rlcollect.distributed.launch.launchers import LAUNCHERS, require_submitit
from rlcollect.distributed.control.transport import default_host_address, resolve
from rlcollect.policy import as_exploration_type, has_weights
from rlcollect.weights.schemes import DistributedWeightSyncScheme, NoWeightSyncScheme, validate_schemes

#: ``DistributedCollector``'s docstring: what it does and every argument (the face, collector.py,
#: holds the signature and the wiring).
DOC = """Collect on ``num_nodes`` nodes (processes or hosts) joined over torch.distributed.

    Each entry of ``create_env_fn`` is one node (rank ``i + 1``; nodes are numbered from 0 in
    the API) running an inner collector of ``collector_class``. ``sync=True`` yields one batch
    from every node stacked, ``(num_nodes, *node_batch)``; ``sync=False`` yields each node's
    batch as it comes, tagged ``("collector", "node_id")``. Nodes are fresh interpreters that
    never import your script: the env factories, policy and options travel to them pickled
    (cloudpickle: what your ``__main__`` defines goes by value). Nodes execute the code rank 0
    sends them, so rank 0 and the nodes must trust each other; every control message is
    authenticated (HMAC-SHA256) with a per-run secret that never enters a message or a command
    line, while batches travel unauthenticated. Nodes exit by themselves when rank 0 dies or
    stops beating. The arguments are torchrl's ``DistributedDataCollector``'s where the names
    agree; rlcollect's own are marked so.

    Args:
        create_env_fn: one env source per node (a list), or one for all ``num_nodes`` nodes:
            an env, a gymnasium id, or a callable returning an env, as for ``Collector``.
        policy: the policy every node acts with (sent pickled), as for ``Collector``; its
            weights on rank 0 are what ``update_policy_weights_()`` sends. Default ``None``
            (random actions).
        policy_factory: a callable building the policy on the node instead, or a list with
            one per node. Default ``None``.
        frames_per_batch: frames per yielded batch (required). ``sync=True``: each node
            collects ``frames_per_batch / num_nodes`` (``RuntimeError`` if that does not
            divide); ``sync=False``: each node's batch has ``frames_per_batch`` frames.
        total_frames: stop after this many frames delivered (async batches the nodes collected
            ahead and not delivered yet are not counted); ``-1`` (the default) collects for
            ever (``len()`` then raises ``TypeError``).
        device: the inner collectors' ``device``: one value, or a list with one per node.
        storing_device: where the yielded batches live (applied on rank 0; batches arrive on
            the CPU); one value or a per-node list.
        env_device: the inner collectors' ``env_device``; one value or a per-node list.
        policy_device: the inner collectors' ``policy_device``; one value or a per-node list.
        create_env_kwargs: keyword arguments of ``create_env_fn``, one dict for all nodes or a
            list with one per node. Default ``None``.
        max_frames_per_traj: passed to the inner collectors (truncate trajectories at this
            length; ``None``: no limit).
        init_random_frames: the first frames act randomly (applied on rank 0, as for
            ``Collector``). Default ``None``.
        reset_at_each_iter: the inner collectors reset their envs at the start of each batch.
            Default ``False``.
        postproc: applied on rank 0 to each batch before it is yielded. Default ``None``.
        split_trajs: yield ``split_trajectories(batch)`` (on rank 0). Default ``False``.
        exploration_type: the ``ExplorationType`` (or name) the nodes' rollouts run under.
            Default ``"random"``.
        collector_class: what runs on a node: ``Collector`` (the default, or ``"single"``),
            ``"sync"`` (``MultiSyncCollector``) or ``"async"`` (``MultiAsyncCollector``).
        collector_kwargs: extra keyword arguments of the inner collector, one dict for all
            nodes or a list with one per node (``{"num_workers": 8}`` on a bigger host,
            ``{"track_policy_version": True}``). Default ``None``.
        num_workers_per_collector: workers of a multi-process inner collector (more than one
            with a single ``Collector`` is a ``ValueError``). Default 1.
        num_nodes: the number of nodes when ``create_env_fn`` is one source; with a list it
            must equal its length. Default ``None``.
        sync: ``True`` stacks one part from every node, all collected with the same weights
            (nodes wait between batches); ``False`` (the default) delivers batches first come,
            first served, each node keeping two batches in flight (it never waits for the
            trainer; batches in flight during an update may use the previous weights).
        slurm_kwargs: submitit executor parameters for ``launcher="submitit"`` (merged into
            ``{"timeout_min": 1440, "nodes": 1, "tasks_per_node": 1}``; ``{"executor":
            "local"}`` runs the jobs as local processes). Default ``None``.
        backend: the torch.distributed backend of the batch transfers: ``"gloo"`` only
            (``"nccl"`` is refused: batches reach rank 0 on the CPU).
        update_after_each_batch: send rank 0's weights to the node whose batch was just taken
            (async) or to every node (sync), after each batch. Default ``False``.
        max_weight_update_interval: a node never collects more than this many batches on the
            same weights (``-1``, the default: no limit); exclusive with
            ``update_after_each_batch``.
        update_interval: send the weights every this many yielded batches (``None``, the
            default: never by itself). The three automatic updates need ``policy`` to be an
            ``nn.Module`` with parameters (``ValueError`` otherwise).
        launcher: how nodes come to exist: ``"mp"`` (local processes rank 0 starts and
            watches; the default), ``"submitit"`` (one SLURM or local job per node,
            ``slurm_kwargs``), ``"submitit_delayed"`` (jobs submitted beforehand with
            ``submit_nodes`` wait for rank 0), ``"external"`` (you start
            ``rlcollect node ...`` on any host; rank 0 prints the commands; these two need
            ``tcp_port``) or ``"ray"`` (each node a Ray actor on the Ray cluster; ``ray_options``).
        tcp_port: the port rank 0 listens on (the nodes' channels); ``None`` (the default) picks a free one
            (the "mp" and "submitit" launchers tell their nodes). A string of digits is
            accepted, as torchrl keeps it.
        master_addr: the address rank 0 listens on, on that interface only (a wildcard such as
            ``"0.0.0.0"`` is a ``ValueError``); ``None``: ``"127.0.0.1"`` for "mp", this host's
            address the other hosts see otherwise.
        timeout: seconds any reply to a control command (``set_seed``, ``reset``,
            ``state_dict``, ...) and any transfer set-up may take. Default 300 (torchrl's are
            days).
        heartbeat_timeout: seconds without a new authentic heartbeat (nodes beat every 0.5 s)
            after which a node has failed. Default 5.
        weight_sync_schemes: ``{"policy": DistributedWeightSyncScheme()}`` (the default: one
            flat tensor over the process group) or ``{"policy": NoWeightSyncScheme()}``
            (updates are no-ops); other schemes are a ``TypeError``.
        on_node_failure: rlcollect's own. What a failed node (died, stopped beating, its
            collection raised, ``node_timeout`` passed) leads to: ``"raise"`` (the default:
            every node is shut down and a ``WorkerError`` naming it is raised, or the node's
            own exception type), ``"continue"`` (``sync=False`` only: the node is dropped and
            the others go on) or ``"restart"`` ("mp", "submitit" and "ray" launchers: the node is
            relaunched and rejoins).
        max_node_restarts: with ``"restart"``, relaunches allowed per node; one more failure
            raises. Default 3.
        node_timeout: rlcollect's own: seconds after which a node that has not announced the
            batch it started has failed (a hung env step, while its heartbeat goes on); give it
            well above twice a batch's collection time. Default ``None``: no limit.
        start_timeout: rlcollect's own: seconds a node may take to start (build its collector
            and report its layout); past it the construction raises a ``WorkerError`` naming
            the node "during start-up" and the nodes still starting are killed. Also bounds a
            relaunched node's rejoin. Default 120.
        rank0_timeout: rlcollect's own: nodes exit when rank 0 has not beaten for this many
            seconds (a frozen rank 0; they exit at once when it dies). "mp" and "submitit"
            nodes get it from rank 0; external ones take ``--rank0-timeout``. Default 60.
        secret_file: rlcollect's own: a path to the run's secret, for ``"external"`` and
            ``"submitit_delayed"`` nodes (the same file, mode 0600, on both sides;
            ``rlcollect node --secret-file``); ``None``: ``$RLCOLLECT_SECRET``, else
            ``"external"`` writes a new secret to a 0600 file (removed at shutdown) and warns
            with its path, and ``"submitit_delayed"`` raises ``ValueError``. "mp" and
            "submitit" hand the secret to their nodes themselves.
        weight_updater: torchrl's ``WeightUpdaterBase`` (instance or class) or a function that
            moves the weights on ``update_policy_weights_`` instead of the scheme (exclusive
            with ``weight_sync_schemes``). Default ``None``.
        ray_options: with ``launcher="ray"``: the actors' resources and placement (``num_cpus``,
            default the node's workers; ``num_gpus``, ``memory``, ``resources``, ``runtime_env``,
            ``scheduling_strategy``, ``placement_group`` with ``"PACK"``/``"SPREAD"``), ``address``
            (else ``$RAY_ADDRESS``, else a local Ray started quietly) and ``init_kwargs``.
            Refused with any other launcher. Default ``None``.
        pre_collect_hook: torchrl 0.14's: called on rank 0 with no argument before each batch
            is asked for (settable as an attribute). Default ``None``.
        post_collect_hook: torchrl 0.14's: called on rank 0 with each batch after
            ``postproc``, before it is yielded (the attribute and ``set_post_collect_hook`` set
            it later). Default ``None``.
        weight_recv_schemes: torchrl 0.14's; only ``None`` (its default) is accepted.
        max_policy_lag: rlcollect's own; ``sync=False`` only: no batch is delivered whose
            frames' policy version is more than this many versions behind rank 0's at delivery
            (``None``, the default: no bound).
        lag_policy: with ``max_policy_lag``: ``"drop"`` (the default: a stale batch is
            discarded, counted per node in ``stats()["workers"][i]["lag_dropped_frames"]`` and
            in the next batch's ``("collector", "lag_dropped_frames")``) or ``"tag"``
            (delivered anyway, tagged with its version); ``"wait"`` is not supported here yet.
        trajs_per_batch: torchrl 0.14's: yield batches of this many whole trajectories,
            assembled on rank 0 from the nodes' batches (``None``, the default: batches of
            ``frames_per_batch`` frames). A trajectory still running when the iteration ends
            is not yielded; ``reset()`` drops the trajectories being assembled.
        trajs_per_write: torchrl 0.14's; with ``trajs_per_batch``: accepted for symmetry
            with the other collectors (this collector writes no replay buffer: ``None``).
        traj_format: with ``trajs_per_batch``: ``"padded"`` (the default: shape
            ``(trajectories, longest)``, ``("collector", "mask")`` True on real steps) or
            ``"cat"`` (the trajectories one after the other, one dim).

    Example:
        >>> from rlcollect import DistributedCollector
        >>> with DistributedCollector(["CartPole-v1"] * 2, frames_per_batch=200, total_frames=400,
        ...                           sync=True) as c:
        ...     shapes = [batch.shape for batch in c]
        >>> shapes
        [torch.Size([2, 100]), torch.Size([2, 100])]
    """

BACKENDS = ("gloo",)
PER_NODE_ARGS = ("device", "storing_device", "env_device", "policy_device")
#: Batches a node may have in flight: async nodes fill one buffer while rank 0 reads the other.
ASYNC_SLOTS = 2
NODE_FAILURE_POLICIES = ("raise", "continue", "restart")
#: The launchers that start the nodes themselves, and so can relaunch one.
RELAUNCHING_LAUNCHERS = ("mp", "submitit", "ray")


def _one_of(name: str, value: Any, accepted: tuple, hint: str = "") -> Any:
    if value not in accepted:
        raise ValueError(f"{name} must be one of {accepted}, got {value!r}{hint}")
    return value


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


def _tcp_port(value: Any, launcher: str) -> int | None:
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)  # torchrl keeps the port as a string ("10003")
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not 0 < value < 65536):
        raise ValueError(f"tcp_port must be a port number in 1..65535, or None to pick a free one; got {value!r}")
    if value is None and launcher in ("external", "submitit_delayed"):
        raise ValueError(f"launcher={launcher!r} needs tcp_port: the nodes, started before rank 0, must know it")
    return value


@dataclasses.dataclass(eq=False)
class DistributedConfig:
    """Every option of a ``DistributedCollector`` (the collector's arguments of the same
    names; the four devices in ``devices``, the inner collectors' own options in
    ``inner_options``), validated in ``__post_init__``; then the node specs (``payloads``).

    Example:
        >>> cfg = DistributedConfig(
        ...     "CartPole-v1", None, num_nodes=2, policy_factory=None, frames_per_batch=100, total_frames=-1,
        ...     devices=dict.fromkeys(PER_NODE_ARGS), create_env_kwargs=None, inner_options={},
        ...     init_random_frames=None, postproc=None, split_trajs=False, collector_class="single",
        ...     collector_kwargs=None, num_workers_per_collector=1, sync=True, slurm_kwargs=None, backend="gloo",
        ...     update_after_each_batch=False, max_weight_update_interval=-1, update_interval=None, launcher="mp",
        ...     tcp_port=None, master_addr=None, timeout=60.0, heartbeat_timeout=5.0, weight_sync_schemes=None)
        >>> cfg.num_nodes, cfg.node_frames, cfg.slots, cfg.master_addr, len(cfg.payloads)
        (2, 50, 1, '127.0.0.1', 2)
    """

    create_env_fn: Any
    policy: Any
    _: dataclasses.KW_ONLY
    num_nodes: int  # given None (the nodes counted from create_env_fn): set in __post_init__
    policy_factory: Callable | list | None
    frames_per_batch: int
    total_frames: int
    devices: dict[str, Any]
    create_env_kwargs: dict | list | None
    inner_options: dict[str, Any]
    init_random_frames: int  # given None (0): set in __post_init__
    postproc: Callable | None
    split_trajs: bool
    collector_class: Any
    collector_kwargs: dict | list | None
    num_workers_per_collector: int
    sync: bool
    slurm_kwargs: dict | None
    backend: str
    update_after_each_batch: bool
    max_weight_update_interval: int
    update_interval: int | None
    launcher: str
    tcp_port: int | None
    master_addr: str | None
    timeout: float
    heartbeat_timeout: float
    weight_sync_schemes: dict | None
    on_node_failure: str = "raise"
    max_node_restarts: int = 3
    node_timeout: float | None = None
    start_timeout: float = 120.0
    rank0_timeout: float = 60.0
    secret_file: Any = None
    ray_options: dict | None = None
    pre_collect_hook: Callable | None = None
    post_collect_hook: Callable | None = None
    weight_recv_schemes: None = None
    max_policy_lag: int | None = None
    lag_policy: str = "drop"
    trajs_per_batch: int | None = None
    trajs_per_write: int | None = None
    traj_format: str | None = None

    def __post_init__(self) -> None:
        check_recv_schemes(self.weight_recv_schemes)
        check_traj_args(self.trajs_per_batch, self.trajs_per_write, self.traj_format, self.split_trajs)
        check_hook("pre_collect_hook", self.pre_collect_hook)
        check_hook("post_collect_hook", self.post_collect_hook)
        env_fns = self._check_nodes()
        self._check_lag()
        self._check_transport()
        self._check_secret()
        self._check_failures()
        self._check_weights()
        self._build_specs(env_fns)
        self._check_launcher_options()

    def _check_lag(self) -> None:
        """``max_policy_lag`` / ``lag_policy``; ``lag_bound``: the bound enforced (None: none)."""
        if self.lag_policy not in ("drop", "wait", "tag"):
            raise ValueError(f"lag_policy must be one of ('drop', 'wait', 'tag'), got {self.lag_policy!r}")
        k = self.max_policy_lag
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 0):
            raise ValueError(f"max_policy_lag must be None or an int >= 0 (versions), got {k!r}")
        self.lag_bound = None if k is None or self.lag_policy == "tag" else k
        if self.lag_bound is None:
            return
        if self.sync:
            raise ValueError(f"max_policy_lag={k}: sync=True delivers batches collected with rank 0's current "
                             "weights already; use it with sync=False")
        if self.lag_policy == "wait":
            raise ValueError("lag_policy='wait' is not supported by DistributedCollector yet; use 'drop' (stale "
                             "batches are discarded and counted) or 'tag'")

    def _check_launcher_options(self) -> None:
        """``launcher_options``: what the launcher is given (``slurm_kwargs``, or the checked
        ``ray_options`` for "ray": ray_launcher.py, imported only then)."""
        self.launcher_options = self.slurm_kwargs
        if self.launcher != "ray":
            if self.ray_options is not None:
                raise ValueError(f"ray_options is for launcher='ray', got launcher={self.launcher!r}")
            return
        from rlcollect.distributed.launch.ray_launcher import check_ray_options, default_master_addr, require_ray

        require_ray()  # here, before anything starts
        self.ray_options = self.launcher_options = check_ray_options(self.ray_options, self._footprints)
        if self._master_addr_given is None:
            self.master_addr = default_master_addr(self.ray_options)

    def _check_nodes(self) -> list:
        if isinstance(self.create_env_fn, (list, tuple)):
            if not self.create_env_fn:
                raise ValueError("create_env_fn is an empty list; give one env factory per node")
            if self.num_nodes is not None and self.num_nodes != len(self.create_env_fn):
                raise ValueError(f"num_nodes={self.num_nodes} but create_env_fn lists {len(self.create_env_fn)} envs "
                                 "(one per node)")
            env_fns = list(self.create_env_fn)
        else:
            env_fns = [self.create_env_fn] * positive_int("num_nodes", 1 if self.num_nodes is None else self.num_nodes)
        n = self.num_nodes = len(env_fns)
        self.sync = flag("sync", self.sync)
        self.slots = 1 if self.sync else ASYNC_SLOTS
        positive_int("frames_per_batch", self.frames_per_batch)
        self.total_frames = total_frames_arg(self.total_frames)
        if self.sync and self.frames_per_batch % n:
            raise RuntimeError(f"frames_per_batch={self.frames_per_batch} is not divisible by the {n} nodes: with "
                               "sync=True each node collects frames_per_batch / num_nodes frames")
        self.node_frames = self.frames_per_batch // n if self.sync else self.frames_per_batch
        self.init_random_frames = random_frames(self.init_random_frames)
        callable_or_none("postproc", self.postproc)
        self.split_trajs = bool(self.split_trajs)
        return env_fns

    def _check_transport(self) -> None:
        hint = " (nccl: batches travel over gloo; GPU nodes deliver on CPU)" if self.backend == "nccl" else ""
        _one_of("backend", self.backend, BACKENDS, hint)
        _one_of("launcher", self.launcher, LAUNCHERS)
        if self.launcher == "submitit":
            require_submitit()  # here, before anything starts, not when the jobs are submitted
        if self.slurm_kwargs is not None and not isinstance(self.slurm_kwargs, dict):
            raise TypeError(f"slurm_kwargs must be a dict or None, got {type(self.slurm_kwargs).__name__}")
        self.tcp_port = _tcp_port(self.tcp_port, self.launcher)
        self._master_addr_given = self.master_addr
        self.master_addr = _master_addr(self.master_addr, self.launcher)
        self.timeout = seconds("timeout", self.timeout)
        self.heartbeat_timeout = seconds("heartbeat_timeout", self.heartbeat_timeout)
        self.node_timeout = None if self.node_timeout is None else seconds("node_timeout", self.node_timeout)
        self.start_timeout = seconds("start_timeout", self.start_timeout)
        self.rank0_timeout = seconds("rank0_timeout", self.rank0_timeout)

    def _check_secret(self) -> None:
        """The run's secret (auth.py): a readable 0600 file, or what the launcher needs."""
        secret_file, launcher = self.secret_file, self.launcher
        if secret_file is not None and not isinstance(secret_file, (str, os.PathLike)):
            raise TypeError(f"secret_file must be a path (str or os.PathLike) or None, got "
                            f"{type(secret_file).__name__}")
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

    def _check_failures(self) -> None:
        _one_of("on_node_failure", self.on_node_failure, NODE_FAILURE_POLICIES)
        if self.on_node_failure == "continue" and self.sync:
            raise ValueError("on_node_failure='continue' needs sync=False: a sync batch holds one part from every "
                             "node, so it cannot go on without one (use 'restart', or sync=False)")
        if self.on_node_failure == "restart" and self.launcher not in RELAUNCHING_LAUNCHERS:
            raise ValueError(f"on_node_failure='restart' needs a launcher that starts the nodes itself "
                             f"{RELAUNCHING_LAUNCHERS}, got launcher={self.launcher!r} (its nodes are started by you: "
                             "use 'continue' with sync=False, or 'raise')")
        non_negative_int("max_node_restarts", self.max_node_restarts)

    def _check_weights(self) -> None:
        schemes = validate_schemes(self.weight_sync_schemes)
        unknown = set(schemes) - {"policy"}
        if unknown:
            raise ValueError(f"weight_sync_schemes: a DistributedCollector has only the 'policy' model, got "
                             f"{sorted(unknown)}")
        scheme = schemes.get("policy", DistributedWeightSyncScheme())
        if not isinstance(scheme, (DistributedWeightSyncScheme, NoWeightSyncScheme)):
            raise ValueError(f"weight_sync_schemes['policy'] must be DistributedWeightSyncScheme ('distributed') or "
                             f"NoWeightSyncScheme ('none') for nodes, got {scheme!r}")
        self.scheme = scheme
        self.factories = factories = per_member("policy_factory", self.policy_factory, self.num_nodes, "node")
        if any(f is not None and not callable(f) for f in factories):
            raise TypeError("policy_factory must be a callable returning the policy (or a per-node list of them)")
        check_policy_sources(self.policy, any(f is not None for f in factories), schemes,
                             scheme="DistributedWeightSyncScheme")
        self.weight_source = self.policy if has_weights(self.policy) else None
        flag("update_after_each_batch", self.update_after_each_batch)
        interval = self.max_weight_update_interval
        if isinstance(interval, bool) or not isinstance(interval, int) or (interval < 1 and interval != -1):
            raise ValueError(f"max_weight_update_interval must be a positive int, or -1 for none; got {interval!r}")
        if self.update_after_each_batch and interval != -1:
            raise RuntimeError("update_after_each_batch and max_weight_update_interval cannot be used together: "
                               "the first already updates before every batch")
        self.update_interval = optional_positive_int("update_interval", self.update_interval)

    def _build_specs(self, env_fns: list) -> None:
        """What each node runs: its collector class and options, cloudpickled (``payloads``)."""
        n = self.num_nodes
        self.collector_class = resolve_collector_class(self.collector_class)
        single = issubclass(self.collector_class, SingleCollector)
        positive_int("num_workers_per_collector", self.num_workers_per_collector)
        if single and self.num_workers_per_collector != 1:
            raise ValueError(f"num_workers_per_collector={self.num_workers_per_collector} needs a multi-process node "
                             "collector_class ('sync' or 'async'); a single Collector node has one worker")
        kwargs_lists = [kwargs_arg("collector_kwargs", k)
                        for k in per_member("collector_kwargs", self.collector_kwargs, n, "node")]
        self._node_postproc(kwargs_lists)
        env_kwargs = per_member("create_env_kwargs", self.create_env_kwargs, n, "node")
        devices = {name: per_member(name, self.devices[name], n, "node") for name in PER_NODE_ARGS}
        self.storing_device = devices["storing_device"][0] or devices["device"][0]
        self.devices = devices  # {name: one per node}
        inner_options = self.inner_options
        if "exploration_type" in inner_options:
            exploration = as_exploration_type(inner_options["exploration_type"])
            inner_options = {**inner_options, "exploration_type": exploration}
        self.payloads: list[bytes] = []
        self._specs: list[dict] = []
        self._single = single
        footprints: list[int] = []
        first_free_block = 0
        for i in range(n):
            kwargs = {"policy_factory": self.factories[i], "frames_per_batch": self.node_frames, "total_frames": -1,
                      "create_env_kwargs": env_kwargs[i], **{k: devices[k][i] for k in PER_NODE_ARGS},
                      **inner_options}
            if not single:
                kwargs["num_workers"] = self.num_workers_per_collector
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
                    "policy": None if self.factories[i] is not None else self.policy, "kwargs": kwargs,
                    "slots": self.slots}
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

    def _node_postproc(self, kwargs_lists: list[dict]) -> None:
        """torchrl's ``collector_kwargs={"postproc": f}`` (each node's collector applies ``f`` to
        its batch): a node writes into rank 0's fixed-size slots, so ``f`` runs on rank 0, on
        each node's batch before ``postproc``; with ``sync=True`` (one batch of every node's
        parts) it is refused rather than applied to the joined batch."""
        given = [k.pop("postproc") for k in kwargs_lists if "postproc" in k]
        if not given or all(f is None for f in given):
            return
        if self.sync:
            raise ValueError("collector_kwargs['postproc'] with sync=True: a sync batch joins every node's part on "
                             "rank 0, so a per-node postproc cannot run; pass postproc=f to DistributedCollector "
                             "(applied on rank 0 to the joined batch), or use sync=False")
        if len(given) != len(kwargs_lists) or any(f is not given[0] for f in given):
            raise ValueError("collector_kwargs['postproc'] must be the same function for every node (it runs on "
                             "rank 0)")
        node_postproc, outer = callable_or_none("collector_kwargs['postproc']", given[0]), self.postproc
        self.postproc = node_postproc if outer is None else (lambda batch: outer(node_postproc(batch)))

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
