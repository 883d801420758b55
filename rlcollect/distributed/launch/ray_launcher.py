"""``launcher="ray"``: each node is a Ray actor (``ray_node.RayNode``) running the same node loop
as ``rlcollect node``.

Ray places, starts, watches and replaces the nodes; batches and weights keep travelling on the
collector's own path (the pair gloo groups with rank 0), control messages stay signed with the
run's secret.  What this module adds to the other launchers:

- ``ray_options`` (checked by ``check_ray_options`` without importing Ray): the actors'
  resources (``num_cpus``, default: the node's workers; ``num_gpus``, ``memory``,
  ``resources``), ``runtime_env``, ``scheduling_strategy`` or a ``placement_group`` strategy
  (one bundle per node), and where the Ray cluster is (``address``, ``init_kwargs``).
- ``RaySession``: ``ray.init`` only when Ray is not initialised (``address`` from
  ``ray_options``, else ``$RAY_ADDRESS``, else a local instance started quietly); a Ray the
  user started stays up, one a collector started is shut down when the last collector using
  it closes.
- ``RayLauncher``: the launcher the pool drives (``start``, ``dead``, ``kill``, ``relaunch``,
  ``stop``).  A node's death is Ray's death notice: the reference of the actor's ``run`` call
  resolves with ``RayActorError`` (process killed, its Ray node lost, out of memory), which
  ``dead()`` reports with Ray's cause.  ``relaunch`` creates a fresh actor (a new incarnation;
  Ray's own ``max_restarts`` stays 0, a restarted actor would not know it must rejoin).
- Ray's own failures (``ray_health.RayHealth``): this host's raylet or the GCS gone, or this
  driver's Ray node declared dead, for ``health_timeout`` seconds raises a ``WorkerError``
  naming it, whatever ``on_node_failure`` says (no relaunch can help); a replacement actor Ray
  has not started within ``schedule_timeout`` seconds raises one naming Ray's state.

- The actors' CPU priority: Ray lowers every worker process's priority to niceness 15 (its
  ``worker_niceness``), so on a host where other jobs run at the normal priority a node gets
  only the CPU they leave (measured: relaunched actors still importing torch after 4 minutes at
  load 9, where the "mp" launcher's nodes start in about 30 s).  The actors keep the priority
  their raylet starts them at instead (``RAY_worker_niceness=0`` in their ``runtime_env``'s
  ``env_vars``), as the other launchers' nodes keep rank 0's; a ``runtime_env`` of
  ``ray_options`` that sets it decides.

Ray is imported only here, and this module only when ``launcher="ray"`` is used.
"""

from __future__ import annotations

import contextlib
import logging
import numbers
import os
import socket
import sys
import time
from typing import Any

from rlcollect.distributed.launch.node_args import LOG_LEVEL_ENV
from rlcollect.distributed.launch.ray_health import RayHealth
from rlcollect.errors import WorkerError

logger = logging.getLogger("rlcollect")

#: The keys ``ray_options`` accepts.
RAY_OPTION_KEYS = ("address", "init_kwargs", "num_cpus", "num_gpus", "memory", "resources", "runtime_env",
                   "scheduling_strategy", "placement_group", "health_timeout", "schedule_timeout")
#: Placement group strategies (``ray_options["placement_group"]``).
PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
#: Seconds a killed actor is given to be reported dead by Ray.
KILL_WAIT_S = 10.0
#: Default ``ray_options["health_timeout"]``: seconds Ray may look dead (this host's raylet
#: refusing connections, the GCS not answering) before the collector raises.  Ray ends a driver
#: 60 s after losing its GCS: this leaves the trainer most of that time to save its state.
HEALTH_TIMEOUT_S = 5.0
#: Default ``ray_options["schedule_timeout"]``: seconds Ray may take to start a replacement
#: actor (a worker process importing Ray: 1-10 s on a loaded 2-core machine).
SCHEDULE_TIMEOUT_S = 30.0


def require_ray() -> Any:
    """The ``ray`` module; ImportError naming the extra that installs it when it is missing."""
    try:
        import ray
    except ImportError as err:
        raise ImportError("launcher='ray' (and Collector(backend='ray'), RayCollector) needs the ray package, which "
                          "rlcollect does not install by default: pip install 'rlcollect[ray]'") from err
    return ray


def _number(name: str, value: Any, integer: bool = False) -> Any:
    kind = numbers.Integral if integer else numbers.Real
    if isinstance(value, bool) or not isinstance(value, kind) or value < 0:
        what = "a non-negative int" if integer else "a non-negative number"
        raise ValueError(f"ray_options[{name!r}] must be {what}, got {value!r}")
    return value


def check_ray_options(value: Any, node_workers: list[int]) -> dict:
    """``ray_options`` checked and completed: ``num_cpus`` becomes one entry per node (default:
    each node's worker count).  Errors name the key, the value and what is accepted.

    Example:
        >>> opts = check_ray_options({"num_gpus": 0.5, "placement_group": "SPREAD"}, [1, 4])
        >>> opts["num_cpus"], opts["num_gpus"], opts["placement_group"]
        ([1, 4], 0.5, 'SPREAD')
        >>> check_ray_options({"cpus": 2}, [1])
        Traceback (most recent call last):
        ValueError: ray_options has unknown key(s) ['cpus']; accepted: ('address', 'init_kwargs', 'num_cpus', \
'num_gpus', 'memory', 'resources', 'runtime_env', 'scheduling_strategy', 'placement_group', 'health_timeout', \
'schedule_timeout')
    """
    if value is None:
        value = {}
    if not isinstance(value, dict):
        raise TypeError(f"ray_options must be a dict or None, got {type(value).__name__}")
    unknown = sorted(set(value) - set(RAY_OPTION_KEYS), key=str)
    if unknown:
        raise ValueError(f"ray_options has unknown key(s) {unknown}; accepted: {RAY_OPTION_KEYS}")
    out = dict(value)
    cpus = out.get("num_cpus")
    out["num_cpus"] = list(node_workers) if cpus is None else [_number("num_cpus", cpus)] * len(node_workers)
    out["num_gpus"] = _number("num_gpus", out.get("num_gpus", 0))
    if out.get("memory") is not None:
        _number("memory", out["memory"], integer=True)
    for key, default in (("health_timeout", HEALTH_TIMEOUT_S), ("schedule_timeout", SCHEDULE_TIMEOUT_S)):
        out[key] = _number(key, out.get(key, default))
        if not out[key]:
            raise ValueError(f"ray_options[{key!r}] must be a positive number of seconds, got {out[key]!r}")
    resources = out.get("resources") or {}
    if not isinstance(resources, dict) or not all(isinstance(k, str) for k in resources):
        raise ValueError(f"ray_options['resources'] must be a dict of custom resource names to amounts, got "
                         f"{resources!r}")
    for key, amount in resources.items():
        if key in ("CPU", "GPU", "memory"):
            raise ValueError(f"ray_options['resources'] must not hold {key!r}: use ray_options['num_cpus'], "
                             "['num_gpus'] or ['memory']")
        _number(f"resources'][{key!r}", amount)
    out["resources"] = dict(resources)
    for key in ("runtime_env", "init_kwargs"):
        if out.get(key) is not None and not isinstance(out[key], dict):
            raise TypeError(f"ray_options[{key!r}] must be a dict, got {type(out[key]).__name__}")
    address = out.get("address")
    if address is not None and (not isinstance(address, str) or not address):
        raise ValueError(f"ray_options['address'] must be a Ray address string ('host:port', 'ray://host:port', "
                         f"'auto'), got {address!r}")
    group = out.get("placement_group")
    if group is not None and group not in PLACEMENT_STRATEGIES:
        raise ValueError(f"ray_options['placement_group'] must be one of {PLACEMENT_STRATEGIES} (one bundle per "
                         f"node) or None, got {group!r}")
    strategy = out.get("scheduling_strategy")
    if group is not None and strategy is not None:
        raise ValueError("ray_options: give placement_group or scheduling_strategy, not both (the placement group "
                         "schedules each node on its bundle)")
    if isinstance(strategy, str) and strategy not in ("DEFAULT", "SPREAD"):
        raise ValueError(f"ray_options['scheduling_strategy'] must be 'DEFAULT', 'SPREAD' or a Ray scheduling "
                         f"strategy object, got {strategy!r}")
    return out


def _address(options: dict) -> str | None:
    """The Ray cluster to use: ``ray_options["address"]``, else ``$RAY_ADDRESS``, else None."""
    return options.get("address") or os.environ.get("RAY_ADDRESS") or None


def default_master_addr(options: dict) -> str:
    """Where rank 0 listens when ``master_addr`` is not given: Ray's address of this host when
    Ray is initialised here, the interface facing the cluster's address when one is given,
    loopback when a local instance will be started (every node on this host)."""
    from rlcollect.distributed.control.transport import default_host_address, local_address_towards

    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        return ray.util.get_node_ip_address()
    address = _address(options)
    if address is None:
        return "127.0.0.1"
    host, _, port = address.rpartition("://")[2].rpartition(":")
    if host and port.isdigit():
        with contextlib.suppress(OSError, ValueError):
            return local_address_towards(host, int(port))
    return default_host_address()


#: Ray's increment of a worker process's niceness (``RayConfig.worker_niceness``, default 15: the
#: worker calls ``nice(15)`` once started).
NICENESS_ENV = "RAY_worker_niceness"


def actor_runtime_env(user: dict | None) -> dict:
    """The nodes' actors' ``runtime_env``: ``user``'s (``ray_options["runtime_env"]``) with
    ``RAY_worker_niceness=0`` in ``env_vars`` (the actors keep the priority their raylet starts
    them at) unless it sets ``RAY_worker_niceness`` itself.

    Example:
        >>> actor_runtime_env({"env_vars": {"A": "1"}})
        {'env_vars': {'A': '1', 'RAY_worker_niceness': '0'}}
        >>> actor_runtime_env({"env_vars": {"RAY_worker_niceness": "15"}})
        {'env_vars': {'RAY_worker_niceness': '15'}}
    """
    env = dict(user or {})
    env["env_vars"] = {**(env.get("env_vars") or {})}
    env["env_vars"].setdefault(NICENESS_ENV, "0")
    return env


class RaySession:
    """Ray for the collectors of this process: ``acquire`` initialises it if needed (counting
    its users), ``release`` shuts it down when the last user of a Ray this class started goes."""

    users = 0
    started = False  # this class started the Ray in use (ray.init of a local instance)

    @classmethod
    def acquire(cls, options: dict, cpus_needed: float) -> Any:
        ray = require_ray()
        if not ray.is_initialized():
            address = _address(options)
            kwargs = {"logging_level": logging.WARNING, "log_to_driver": True, **(options.get("init_kwargs") or {})}
            if address is None:  # a local instance, quietly; enough logical CPUs for every node
                kwargs.setdefault("include_dashboard", False)
                kwargs.setdefault("num_cpus", max(os.cpu_count() or 1, int(-(-cpus_needed // 1))))
                address = "local"
            ray.init(address=address, **kwargs)
            cls.started = address == "local"
            if cls.started:
                logger.info("rlcollect: started a local Ray instance for launcher='ray'")
        cls.users += 1
        return ray

    @classmethod
    def release(cls) -> None:
        cls.users = max(0, cls.users - 1)
        ray = sys.modules.get("ray")
        if cls.users == 0 and cls.started:
            cls.started = False
            if ray is not None and ray.is_initialized():
                ray.shutdown()


#: What a ``WorkerError`` about Ray's own failure tells the user to do.
_NO_RAY_HINT = ("The collector cannot go on without Ray: save what you need and shut it down (docs/ray.md, "
                "\"Failures\", says what each Ray process's death does)")


def describe_death(err: BaseException) -> str:
    """Ray's cause of an actor's death, in one line."""
    text = getattr(err, "error_msg", None) or str(err)
    for marker in ("The actor is dead because", "The actor died because"):
        if marker in text:
            text = text[text.index(marker):]
            break
    text = text.split(" Some common causes", 1)[0]
    return " ".join(text.split())


class RayLauncher:
    """Nodes as Ray actors (see the module docstring); ``options``: checked ``ray_options``.
    It answers the calls of launchers.py's ``Launcher`` (``start``, ``dead``, ``pids``,
    ``kill``, ``relaunch``, ``stop``)."""

    name = "ray"
    owns_processes = True

    def __init__(self, options: dict | None, secret: bytes = b"", secret_file: Any = None,
                 rank0_timeout: float = 60.0) -> None:
        self.secret, self.secret_file, self.rank0_timeout = secret, None, rank0_timeout
        self.options = options or check_ray_options({}, [])
        self.ray: Any = None
        self.actor_class: Any = None
        self.actors: dict[int, Any] = {}  # rank -> its current actor
        self.runs: dict[int, Any] = {}  # rank -> the reference of its actor's run() call
        self.where: dict[int, Any] = {}  # rank -> reference of (pid, host)
        self.ended: dict[int, str] = {}  # rank -> how its current actor ended (cached)
        self.retired: list[tuple[Any, Any]] = []  # (actor, run reference) of killed incarnations
        self.group: Any = None  # the placement group this launcher created
        self.health: RayHealth | None = None
        self.scheduling: dict[int, float] = {}  # rank -> when its replacement actor was created
        self._launch: tuple | None = None
        self._session = False

    # -- start ---------------------------------------------------------------------------------------
    def start(self, master_addr: str, master_port: int, world_size: int, timeout: float,
              start_timeout: float | None = None) -> None:
        from rlcollect.distributed.launch.ray_node import RayNode

        cpus = self.options["num_cpus"]
        self.ray = ray = RaySession.acquire(self.options, sum(cpus))
        self._session = True
        self.actor_class = ray.remote(RayNode)
        self.health = RayHealth(ray).start()
        parent = (os.getpid(), socket.gethostname(), ray.get_runtime_context().get_node_id())
        self._launch = (master_addr, master_port, world_size, timeout, parent)
        self._check_resources(cpus)
        if self.options.get("placement_group") is not None:
            self._place(timeout)
        for rank in range(1, world_size):
            self.relaunch(rank)

    def _bundle(self, rank: int) -> dict:
        opts = self.options
        bundle = {"CPU": opts["num_cpus"][rank - 1], **opts["resources"]}
        if opts["num_gpus"]:
            bundle["GPU"] = opts["num_gpus"]
        if opts.get("memory"):
            bundle["memory"] = opts["memory"]
        return {k: v for k, v in bundle.items() if v}

    def _check_resources(self, cpus: list) -> None:
        """A warning when the cluster has fewer CPUs than the nodes ask for (the actors would
        wait for resources, and the collector report them as not started)."""
        with contextlib.suppress(Exception):
            total = self.ray.cluster_resources().get("CPU", 0)
            if sum(cpus) > total:
                logger.warning("rlcollect: the %d Ray actors ask for %g CPUs in all, the Ray cluster has %g: some "
                               "will wait for resources (ray_options['num_cpus'] sets each actor's)", len(cpus),
                               sum(cpus), total)

    def _place(self, timeout: float) -> None:
        from ray.util.placement_group import placement_group

        world_size = self._launch[2]
        strategy = self.options["placement_group"]
        bundles = [self._bundle(rank) or {"CPU": 0.001} for rank in range(1, world_size)]
        self.group = placement_group(bundles, strategy=strategy)
        ready, _ = self.ray.wait([self.group.ready()], timeout=timeout)
        if not ready:
            raise RuntimeError(f"launcher='ray': the placement group for {len(bundles)} nodes ({strategy}, bundles "
                               f"{bundles}) could not be placed within timeout={timeout:g} s; the cluster has "
                               f"{self.ray.cluster_resources()}")

    def _actor_options(self, rank: int) -> dict:
        opts = self.options
        out: dict[str, Any] = {"num_cpus": opts["num_cpus"][rank - 1], "num_gpus": opts["num_gpus"],
                               "max_restarts": 0, "max_task_retries": 0}
        if opts.get("memory"):
            out["memory"] = opts["memory"]
        if opts["resources"]:
            out["resources"] = opts["resources"]
        out["runtime_env"] = actor_runtime_env(opts.get("runtime_env"))
        if self.group is not None:
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

            out["scheduling_strategy"] = PlacementGroupSchedulingStrategy(self.group,
                                                                          placement_group_bundle_index=rank - 1)
        elif opts.get("scheduling_strategy") is not None:
            out["scheduling_strategy"] = opts["scheduling_strategy"]
        return out

    def relaunch(self, rank: int) -> None:
        """A fresh actor for node ``rank`` (the first, or a new incarnation after ``kill``);
        a replacement only onto a Ray that looks alive (else a ``WorkerError`` naming what is
        gone), and watched until Ray starts it (``schedule_timeout``)."""
        master_addr, master_port, world_size, timeout, parent = self._launch
        replacing = rank in self.actors
        if replacing and self.health is not None and (found := self.health.probe()) is not None:
            raise WorkerError(f"node {rank - 1} cannot be relaunched: {found}. {_NO_RAY_HINT}", rank - 1)
        level = os.environ.get(LOG_LEVEL_ENV, "WARNING")
        actor = self.actor_class.options(**self._actor_options(rank)).remote(self.secret, list(sys.path), level)
        self.actors[rank] = actor
        self.ended.pop(rank, None)
        self.where[rank] = actor.where.remote()
        self.runs[rank] = actor.run.remote(master_addr, master_port, rank, world_size, timeout,
                                           self.rank0_timeout, parent)
        if replacing:
            self.scheduling[rank] = time.monotonic()

    # -- watching --------------------------------------------------------------------------------------
    def _outcome(self, rank: int) -> str:
        """How node ``rank``'s actor ended (its run reference has resolved)."""
        ray = self.ray
        where = self._where(rank)
        who = "(Ray actor" + (f", pid {where[0]} on {where[1]})" if where else ")")
        try:
            code = ray.get(self.runs[rank], timeout=5.0)
        except ray.exceptions.RayActorError as err:
            return f"{who} died: {describe_death(err)}"
        except Exception as err:  # noqa: BLE001  (the run itself raised: Ray's RayTaskError)
            return f"{who} failed: {type(err).__name__}: {str(err).strip().splitlines()[-1]}"
        return f"{who} ended its node loop with exit code {code}"

    def check_ray(self) -> None:
        """Raise a ``WorkerError`` (not a node's failure: no relaunch can repair it) when Ray
        itself has been unhealthy for ``health_timeout`` s, or has not started a replacement
        actor within ``schedule_timeout`` s."""
        if self.health is None:
            return
        found = self.health.problem(self.options["health_timeout"])
        if found is not None:
            raise WorkerError(f"launcher='ray': Ray itself failed: {found}; health_timeout="
                              f"{self.options['health_timeout']:g} s. {_NO_RAY_HINT}")
        limit = self.options["schedule_timeout"]
        for rank, since in list(self.scheduling.items()):
            if self._where_ready(rank):
                del self.scheduling[rank]
            elif rank not in self.ended and time.monotonic() - since > limit:
                state = self.health.describe(self.actors.get(rank))
                raise WorkerError(f"node {rank - 1}'s replacement Ray actor was not started within schedule_timeout="
                                  f"{limit:g} s (ray_options): {state}. {_NO_RAY_HINT}", rank - 1)

    def _where_ready(self, rank: int) -> bool:
        ref = self.where.get(rank)
        with contextlib.suppress(Exception):
            return ref is not None and bool(self.ray.wait([ref], timeout=0, fetch_local=False)[0])
        return False

    def dead(self) -> dict[int, str]:
        if self.ray is None or not self.runs:
            return {}
        self.check_ray()
        pending = [rank for rank in self.runs if rank not in self.ended]
        if pending:
            refs = [self.runs[rank] for rank in pending]
            with contextlib.suppress(Exception):
                ready, _ = self.ray.wait(refs, num_returns=len(refs), timeout=0, fetch_local=False)
                ready_ids = {ref.hex() for ref in ready}
                for rank in pending:
                    if self.runs[rank].hex() in ready_ids:
                        self.ended[rank] = self._outcome(rank)
        return dict(self.ended)

    def _where(self, rank: int) -> tuple[int, str] | None:
        """``(pid, host)`` of node ``rank``'s actor, once it answered (None before, or if it never will)."""
        ref = self.where.get(rank)
        if ref is None:
            return None
        with contextlib.suppress(Exception):
            ready, _ = self.ray.wait([ref], timeout=0)
            if ready:
                pid, host = self.ray.get(ref, timeout=1.0)
                return int(pid), str(host)
        return None

    def pids(self) -> dict[int, int]:
        return {rank: where[0] for rank in self.actors if (where := self._where(rank)) is not None}

    # -- ending ----------------------------------------------------------------------------------------
    def _kill_and_wait(self, pairs: list[tuple[Any, Any]], timeout: float) -> None:
        """Kill the actors of ``pairs`` and wait (up to ``timeout``) until Ray reports each dead."""
        ray = self.ray
        for actor, _ in pairs:
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)
        deadline = time.monotonic() + timeout
        waiting = [actor for actor, _ in pairs]
        while waiting and time.monotonic() < deadline:
            probes = {}
            for actor in waiting:
                with contextlib.suppress(Exception):
                    probes[actor.where.remote()] = actor
            if not probes:
                return
            ready, _ = ray.wait(list(probes), num_returns=len(probes), timeout=max(0.0, deadline - time.monotonic()))
            still = []
            for ref in ready:
                try:
                    ray.get(ref, timeout=1.0)
                    still.append(probes[ref])  # answered: not dead yet
                except Exception:  # noqa: BLE001  (RayActorError: dead, as wanted)
                    pass
            waiting = still + [probes[ref] for ref in probes if ref not in ready]
            if still:
                time.sleep(0.05)
        if waiting:
            logger.warning("rlcollect: %d Ray actor(s) not reported dead %g s after ray.kill", len(waiting), timeout)

    def kill(self, rank: int, timeout: float = KILL_WAIT_S) -> None:
        actor = self.actors.get(rank)
        if actor is None or self.ray is None:
            return
        self.scheduling.pop(rank, None)
        self._kill_and_wait([(actor, self.runs[rank])], max(timeout, KILL_WAIT_S))
        self.ended.setdefault(rank, "was killed (ray.kill) by rank 0")
        self.retired.append((actor, self.runs[rank]))

    def stop(self, timeout: float, failed: set[int] = frozenset()) -> None:
        ray = self.ray
        try:
            if ray is not None and ray.is_initialized():
                # The nodes were told to close: give their run() calls time to return.
                closing = [self.runs[rank] for rank in self.runs if rank not in failed]
                if closing:
                    with contextlib.suppress(Exception):
                        ray.wait(closing, num_returns=len(closing), timeout=0.6 * timeout, fetch_local=False)
                current = [(self.actors[rank], self.runs[rank]) for rank in self.actors]
                self._kill_and_wait(current, max(0.4 * timeout, 2.0))
                if self.group is not None:
                    from ray.util.placement_group import remove_placement_group

                    with contextlib.suppress(Exception):
                        remove_placement_group(self.group)
        finally:
            if self.health is not None:
                self.health.stop()
            self.group = self.health = None
            self.scheduling.clear()
            self.actors.clear()
            self.runs.clear()
            self.where.clear()
            self.retired.clear()
            if self._session:
                self._session = False
                RaySession.release()
