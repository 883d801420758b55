"""``DistributedCollector``: rank 0 of a collection spread over nodes (processes or hosts)
joined over torch.distributed.  Rank 0 never builds an env or runs the policy: it hands each
node its configuration, allocates receive buffers from the layouts the nodes report, and
delivers their batches."""

from __future__ import annotations

import logging
import time
import traceback
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import cloudpickle
from tensordict import TensorDict

from rlcollect.base import CollectorBase
from rlcollect.collector import Collector
from rlcollect.distributed import protocol as P
from rlcollect.distributed.auth import new_secret, read_secret_file, secret_from_env, write_secret_file
from rlcollect.distributed.config import DistributedConfig
from rlcollect.distributed.gather import NODE_ID, Gather  # noqa: F401  (NODE_ID: its old home)
from rlcollect.distributed.node_weights import NodeWeights
from rlcollect.distributed.pool import NodePool
from rlcollect.distributed.recovery import Recovery
from rlcollect.distributed.stats import distributed_stats
from rlcollect.weights.models import UnknownModelError, make_weight_updater
from rlcollect.weights.schemes import NoWeightSyncScheme

logger = logging.getLogger("rlcollect")



class DistributedCollector(CollectorBase):
    """Collect on ``num_nodes`` nodes (processes or hosts) joined over torch.distributed.

    Each entry of ``create_env_fn`` is one node (rank ``i + 1``; nodes are numbered from 0 in
    the API) running an inner collector of ``collector_class`` (``Collector``, ``"sync"`` or
    ``"async"`` with ``num_workers_per_collector`` workers).  ``sync=True`` yields one batch
    from every node stacked, ``(num_nodes, *node_batch)``, each node collecting
    ``frames_per_batch / num_nodes`` frames; ``sync=False`` yields each node's batch of
    ``frames_per_batch`` frames as it comes, tagged ``("collector", "node_id")``, and restarts
    that node at once (each node has two batches in flight).

    Launchers: ``"mp"`` (local processes), ``"submitit"`` (``slurm_kwargs``; ``{"executor":
    "local"}`` for local jobs), ``"submitit_delayed"`` and ``"external"`` (nodes started with
    ``rlcollect node``; both need ``tcp_port``) and ``"ray"`` (each node a Ray actor;
    ``ray_options``: its resources and placement, see docs/ray.md).  Rank 0 listens on ``master_addr`` only
    (default: loopback for "mp", the host's address otherwise); ``tcp_port=None`` picks a free
    port.  ``timeout`` bounds start-up and every reply; a node that dies or stops beating for
    ``heartbeat_timeout`` seconds raises ``WorkerError`` naming it, and the rest are shut down
    (``on_node_failure="raise"``); ``"continue"`` (async only) drops it and goes on with the
    others, ``"restart"`` ("mp", "submitit" and "ray" launchers) relaunches it, up to
    ``max_node_restarts`` times per node: see ``recovery.py`` and docs/fault-tolerance.md.
    ``node_timeout=s``: a node that has not announced a batch ``s`` seconds after it started it
    (a hung env step, while its heartbeat goes on) has failed too (default None: no limit).
    ``start_timeout`` (default 120 s) bounds start-up: a node that has not started by then
    raises ``WorkerError`` naming it "during start-up", and is killed.  Nodes exit by themselves
    when rank 0 dies, or has not beaten for ``rank0_timeout`` seconds (default 60: a frozen
    rank 0).

    Every control message is authenticated (HMAC-SHA256) with a per-run secret that never enters
    the store or a command line: "mp" and "submitit" hand it to their nodes themselves; external
    nodes and "submitit_delayed" jobs read ``secret_file`` (the same 0600 file on both sides;
    ``rlcollect node --secret-file``) or ``$RLCOLLECT_SECRET``.  See docs/distributed.md,
    "Trust and the wire", for what this protects against and what it does not (batches travel
    unauthenticated).

    Weights: ``update_policy_weights_`` sends rank 0's ``policy`` weights (or the ones given)
    to every node or to ``worker_ids`` (node indices); nodes pass them to their workers.
    ``update_after_each_batch``, ``max_weight_update_interval=k`` (a node never collects more
    than k batches on the same weights) and ``update_interval=k`` (every k yielded batches)
    automate it.  Nodes execute the code rank 0 sends them: see docs/distributed.md.

    Example:
        >>> from rlcollect import DistributedCollector
        >>> with DistributedCollector(["CartPole-v1"] * 2, frames_per_batch=200, total_frames=400,
        ...                           sync=True) as c:
        ...     shapes = [batch.shape for batch in c]
        >>> shapes
        [torch.Size([2, 100]), torch.Size([2, 100])]
    """

    _updater_hint = ""
    _member_name = "node"

    def __init__(
        self,
        create_env_fn: Any,
        policy: Any = None,
        *,
        policy_factory: Callable | list | None = None,
        frames_per_batch: int,
        total_frames: int = -1,
        device: Any = None,
        storing_device: Any = None,
        env_device: Any = None,
        policy_device: Any = None,
        create_env_kwargs: dict | list | None = None,
        max_frames_per_traj: int | None = None,
        init_random_frames: int | None = None,
        reset_at_each_iter: bool = False,
        postproc: Callable | None = None,
        split_trajs: bool = False,
        exploration_type: Any = "random",
        collector_class: Any = Collector,
        collector_kwargs: dict | list | None = None,
        num_workers_per_collector: int = 1,
        num_nodes: int | None = None,
        sync: bool = False,
        slurm_kwargs: dict | None = None,
        backend: str = "gloo",
        update_after_each_batch: bool = False,
        max_weight_update_interval: int = -1,
        update_interval: int | None = None,
        launcher: str = "mp",
        tcp_port: int | None = None,
        master_addr: str | None = None,
        timeout: float = 300.0,
        heartbeat_timeout: float = 5.0,
        weight_sync_schemes: dict | None = None,
        on_node_failure: str = "raise",
        max_node_restarts: int = 3,
        node_timeout: float | None = None,
        start_timeout: float = 120.0,
        rank0_timeout: float = 60.0,
        secret_file: Any = None,
        weight_updater: Any = None,
        ray_options: dict | None = None,
    ):
        self._closed = True
        self.weight_updater, self._in_updater = None, False
        self._pool: NodePool | None = None
        cfg = self.config = DistributedConfig(
            create_env_fn, policy, num_nodes=num_nodes, policy_factory=policy_factory,
            frames_per_batch=frames_per_batch, total_frames=total_frames,
            devices={"device": device, "storing_device": storing_device, "env_device": env_device,
                     "policy_device": policy_device},
            create_env_kwargs=create_env_kwargs,
            inner_options={"max_frames_per_traj": max_frames_per_traj, "reset_at_each_iter": reset_at_each_iter,
                           "exploration_type": exploration_type},
            init_random_frames=init_random_frames, postproc=postproc, split_trajs=split_trajs,
            collector_class=collector_class, collector_kwargs=collector_kwargs,
            num_workers_per_collector=num_workers_per_collector, sync=sync, slurm_kwargs=slurm_kwargs,
            backend=backend, update_after_each_batch=update_after_each_batch,
            max_weight_update_interval=max_weight_update_interval, update_interval=update_interval,
            launcher=launcher, tcp_port=tcp_port, master_addr=master_addr, timeout=timeout,
            heartbeat_timeout=heartbeat_timeout, weight_sync_schemes=weight_sync_schemes,
            on_node_failure=on_node_failure, max_node_restarts=max_node_restarts, node_timeout=node_timeout,
            start_timeout=start_timeout, rank0_timeout=rank0_timeout, secret_file=secret_file,
            ray_options=ray_options,
        )
        automatic = update_after_each_batch or max_weight_update_interval != -1 or update_interval is not None
        if automatic and cfg.weight_source is None:
            raise ValueError("update_after_each_batch, max_weight_update_interval and update_interval push rank 0's "
                             "policy weights: pass policy=<an nn.Module with parameters> (with policy_factory, also "
                             "weight_sync_schemes={'policy': 'distributed'})")
        if weight_updater is not None and weight_sync_schemes is not None:
            raise ValueError("give weight_sync_schemes or weight_updater, not both (as in torchrl)")
        if weight_updater is not None and not callable(weight_updater):
            raise TypeError(f"weight_updater must be a WeightUpdaterBase instance, a constructor of one, or a "
                            f"function fn(policy_or_weights, worker_ids); got {type(weight_updater).__name__}")
        self.policy = policy
        self.num_nodes, self.sync = cfg.num_nodes, cfg.sync
        self.frames_per_batch, self.total_frames = cfg.frames_per_batch, cfg.total_frames
        self.master_addr, self.master_port = cfg.master_addr, None
        self._iter = self._version = 0
        self._target = self.total_frames
        self._last_batch_s = 0.0
        self._last_batch_frames = 0
        self._started_at = time.perf_counter()
        self._iterator: Iterator | None = None
        secret, secret_file, own_file = _run_secret(cfg)
        pool = self._pool = NodePool(cfg, secret, secret_file, own_file)
        # Collaborators: each gets what it needs here, and none calls another.
        self._recovery = Recovery(cfg, pool)
        self._weights = NodeWeights(cfg, pool)
        self._gather = Gather(cfg, pool, self._push_due, lambda: self._version)
        self._finalizer = weakref.finalize(self, pool.close)
        self._closed = False
        try:
            pool.start()
            self.master_port = pool.master_port
            self.layouts = pool.layouts
            if self.sync and len({(tuple(lay.batch_size), lay.time, tuple(map(str, lay.fields)))
                                  for lay in self.layouts}) > 1:
                raise ValueError("sync=True stacks one batch per node, but the nodes' batches differ in shape or keys: "
                                 f"{[(tuple(lay.batch_size), lay.time) for lay in self.layouts]}")
            self.weight_updater = make_weight_updater(weight_updater, self)
        except BaseException as err:
            self.shutdown(_shutdown_timeout(err))
            # The frames of the failed start-up hold the store and the process group: free
            # their locals so that the sockets close now, not when the traceback is dropped.
            traceback.clear_frames(err.__traceback__)
            raise

    @property
    def _frames(self) -> int:
        return self._gather.frames

    @_frames.setter
    def _frames(self, value: int) -> None:
        self._gather.frames = value

    # -- iteration ----------------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[TensorDict]:
        self._check_open()
        if 0 < self.total_frames and self._frames >= self._target:
            self._target = self._frames + self.total_frames  # a new iteration collects total_frames more
        try:
            while self.total_frames < 0 or self._frames < self._target:
                yield self._next_batch()
        except GeneratorExit:
            raise
        except BaseException as err:
            self.shutdown(_shutdown_timeout(err))
            raise

    def _batch_frames(self) -> int:  # len() (rlcollect/base.py)
        return self.frames_per_batch

    def _next_batch(self) -> TensorDict:
        with self._guard():
            started = time.perf_counter()
            frames_before = self._frames
            batch = self._recovery.run(self._next_one)
            self._last_batch_s = time.perf_counter() - started
            self._last_batch_frames = self._frames - frames_before
        self._iter += 1
        return self._deliver(batch, storing_device=self.config.storing_device)

    def _next_one(self) -> TensorDict:
        self._pool.maybe_check()  # also when batches keep coming from the other nodes
        return self._gather.next_sync(self._iter) if self.sync else self._gather.next_async(self._iter)

    def _quiesce(self) -> None:
        """Receive every batch still owed (within ``timeout``); they stay queued for delivery."""
        self._settle()
        with self._guard():
            self._recovery.run(lambda: self._pool.wait_for(self._gather.drained, "waiting for the batches in flight",
                                                           timeout=self.config.timeout))
        self._settle()  # a node that failed while draining was relaunched

    def _discard_in_flight(self) -> None:
        self._quiesce()
        self._gather.discard()

    # -- control ------------------------------------------------------------------------------------------
    def _settle(self) -> None:
        """Wait until no node is on its way back (before a command meant for every node)."""
        pool = self._pool
        with self._guard():
            self._recovery.run(lambda: pool.wait_for(pool.settled, "waiting for relaunched nodes to rejoin"))

    def _seed(self, seed: int, static_seed: bool) -> int:
        # Async batches in flight are discarded; dropped nodes are skipped.
        self._discard_in_flight()
        with self._guard():
            for i in self._pool.serving_nodes():
                self._pool.handles[i].seed = seed
                seed, _ = self._pool.ask(i, "seed", seed=seed, static_seed=bool(static_seed))
        return seed

    def reset(self) -> None:
        """Reset every node's envs; the next frames start new trajectories (in-flight batches
        are discarded)."""
        self._discard_in_flight()
        with self._guard():
            for i in self._pool.serving_nodes():
                self._pool.ask(i, "reset")

    def state_dict(self) -> dict[str, Any]:
        """``{"node0": ..., ..., "frames", "iter", "policy_version"}`` (no entry for a dropped
        node)."""
        self._quiesce()
        with self._guard():
            out: dict[str, Any] = {f"node{i}": P.loads_data(self._pool.ask(i, "state_dict")[1])
                                   for i in self._pool.serving_nodes()}
        out.update(frames=self._frames, iter=self._iter, policy_version=self._version)
        return out

    def _load(self, state: dict[str, Any]) -> None:
        # A node that rejects its part raises its error; the collector stays usable.  The nodes' parts
        # may hold pickles (a GymEnv's envs), which the nodes unpickle: only load states you trust.
        self._settle()
        nodes = self._pool.serving_nodes()
        missing = [k for k in (*(f"node{i}" for i in nodes), "frames", "iter") if k not in state]
        if missing:
            raise KeyError(f"DistributedCollector.load_state_dict: missing keys {missing}")
        self._discard_in_flight()
        with self._guard():
            for i in nodes:
                self._pool.ask(i, "load_state_dict", cloudpickle.dumps(state[f"node{i}"]))
        self._frames, self._iter = int(state["frames"]), int(state["iter"])
        self._version = int(state.get("policy_version", self._version))
        self._target = self.total_frames  # iteration continues to total_frames (or total_frames more)

    # -- weights ------------------------------------------------------------------------------------------
    def _push_weights(self, models: dict[str, Any], worker_ids: Any) -> None:
        """Send new weights to every node (or the node indices ``worker_ids``), with a new
        version; each node passes them to its workers and acts with them from its next batch.
        A node being relaunched gets them when it rejoins; a dropped node is skipped. Only the
        ``"policy"`` model exists: any other id raises ``UnknownModelError`` (a KeyError)."""
        unknown = sorted(set(models) - {"policy"})
        if unknown:
            raise UnknownModelError(f"model_id {unknown}: a DistributedCollector has only the 'policy' model")
        if isinstance(self.config.scheme, NoWeightSyncScheme):
            return
        targets = self._weights.targets(models["policy"], worker_ids)
        with self._guard():
            # A node that fails meanwhile is dropped or relaunched (on_node_failure) and the
            # push is made again: the relaunched node gets these weights when it rejoins.
            # One version for this update, however often it is retried (it moved by 2).
            version = self._version + 1
            self._recovery.run(lambda: self._push(targets, version))

    def _push(self, targets: dict[int, Any], version: int | None = None) -> None:
        packed = self._weights.pack(targets)
        self._version = self._version + 1 if version is None else version
        self._pool.push_weights(packed, self._version)

    def _push_due(self, nodes: Any, yielded: int) -> None:  # Gather's hook
        due = self._weights.due(nodes, yielded)
        if due:
            self._push(due)

    def get_model(self, model_id: str) -> Any:
        """Rank 0's model ``model_id``: only ``"policy"`` (the ``policy`` given) exists here."""
        if model_id != "policy" or self.policy is None:
            raise UnknownModelError(f"model_id {model_id!r}: a DistributedCollector has only the 'policy' model, "
                                    "given as policy= on rank 0")
        return self.policy

    def get_cached_weights(self, model_id: str) -> Any:
        """None: nothing is cached on rank 0 (weights are sent from the source on each update)."""
        return None

    def worker_policy_versions(self) -> list[int]:
        """The weights version each node acts with (from its next batch on)."""
        return [h.version for h in self._pool.handles]

    # -- observation and torchrl's accessors -------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """JSON-serialisable statistics: the keys of every collector (docs/observability.md; a
        "worker" is a node here, its env-step latency measured on the node), and each node's
        state, lost batches, host and pid, the dropped nodes, the launcher and rank 0's address."""
        return distributed_stats(
            self._pool, closed=self._closed, master=f"{self.master_addr}:{self.master_port}", frames=self._frames,
            batches=self._iter, elapsed=time.perf_counter() - self._started_at,
            recent_fps=self._last_batch_frames / self._last_batch_s if self._last_batch_s else 0.0,
            version=self._version, lag=self._gather.lag, wait=self._gather.wait)

    def iterator(self) -> Iterator[Any]:
        """``iter(collector)`` (torchrl's name)."""
        return iter(self)

    @property
    def requested_frames_per_batch(self) -> int:
        """``frames_per_batch`` as given: a sync batch's frames, or each async node's."""
        return self.frames_per_batch

    def _members(self) -> int:
        return self.num_nodes

    def _member_frames(self, index: int) -> int:
        return self.config.node_frames  # (every node collects the same)

    @property
    def device(self) -> list:
        """One device per node, as given (torchrl's distributed device properties are lists)."""
        return list(self.config.devices["device"])

    @property
    def storing_device(self) -> list:
        return list(self.config.devices["storing_device"])

    @property
    def env_device(self) -> list:
        return list(self.config.devices["env_device"])

    @property
    def policy_device(self) -> list:
        return list(self.config.devices["policy_device"])

    # -- shutdown ---------------------------------------------------------------------------------------
    def _release(self, timeout: float) -> None:
        self._closed = True
        pool = self._pool
        if pool is None or pool.closed:
            return
        self._finalizer.detach()
        pool.close(timeout)

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self.shutdown(_shutdown_timeout(exc))

    def __repr__(self) -> str:
        return (f"DistributedCollector(num_nodes={self.num_nodes}, sync={self.sync}, launcher="
                f"{self.config.launcher!r}, frames_per_batch={self.frames_per_batch}, frames={self._frames})")


#: Shutdown's bound after a Ctrl-C: the user wants the processes gone now, not a graceful wait.
INTERRUPTED_SHUTDOWN_S = 1.0


#: torchrl's older name, which its migration notes still use.
DistributedDataCollector = DistributedCollector


def _shutdown_timeout(err: BaseException | None) -> float:
    return INTERRUPTED_SHUTDOWN_S if isinstance(err, KeyboardInterrupt) else 10.0


def _run_secret(cfg: DistributedConfig) -> tuple[bytes, Any, Any]:
    """``(secret, secret_file, own_file)``: the run's secret, the file the nodes read it from
    (None for "mp", whose nodes get it through a pipe), and that file again if this collector
    made it (removed at shutdown)."""
    if cfg.secret_file is not None:
        return read_secret_file(cfg.secret_file), cfg.secret_file, None
    if cfg.launcher in ("external", "submitit_delayed"):
        from_env = secret_from_env()
        if from_env is not None:
            return from_env, None, None
        if cfg.launcher == "submitit_delayed":
            raise ValueError("launcher='submitit_delayed' needs secret_file=PATH: the file given to "
                             "submit_nodes(secret_file=PATH), or the secret in $RLCOLLECT_SECRET")
        secret = new_secret()
        path = write_secret_file(secret)
        logger.warning("rlcollect: wrote this run's secret to %s (mode 600; removed at shutdown): give it to each "
                       "node with --secret-file", path)
        return secret, path, path
    return new_secret(), None, None  # "mp": through a pipe; "submitit": a 0600 file in the job folder
