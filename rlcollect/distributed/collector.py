"""``DistributedCollector``: rank 0 of a collection spread over nodes (processes or hosts)
joined over torch.distributed.  Rank 0 never builds an env or runs the policy: it hands each
node its configuration, allocates receive buffers from the layouts the nodes report, and
delivers their batches."""

from __future__ import annotations

import logging
import sys
import traceback
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any


from rlcollect.base import CollectorBase
from rlcollect.collector import SingleCollector
from rlcollect.distributed.control import env_state
from rlcollect.distributed.control.auth import new_secret, read_secret_file, secret_from_env, write_secret_file
from rlcollect.distributed.config import DOC, DistributedConfig
from rlcollect.distributed.gather import NODE_ID, Gather  # noqa: F401  (NODE_ID: its old home)
from rlcollect.distributed.node_weights import NodeWeights
from rlcollect.distributed.pool import NodePool
from rlcollect.distributed.recovery import Recovery
from rlcollect.distributed.stats import distributed_stats
from rlcollect.members import Members, MemberStats
from rlcollect.torchrl_args import DISTRIBUTED_ATTRIBUTES
from rlcollect.weights.models import UnknownModelError, make_weight_updater
from rlcollect.weights.schemes import NoWeightSyncScheme

if TYPE_CHECKING:
    import os

    from rlcollect.typing import DeviceLike, EnvSource, ExplorationLike, PolicyLike

logger = logging.getLogger("rlcollect")



class DistributedCollector(CollectorBase):
    __doc__ = DOC

    _updater_hint = ""
    _member_name = "node"

    def __init__(
        self,
        create_env_fn: EnvSource | list[EnvSource],
        policy: PolicyLike = None,
        *,
        policy_factory: Callable | list | None = None,
        frames_per_batch: int,
        total_frames: int = -1,
        device: DeviceLike | list[DeviceLike] = None,
        storing_device: DeviceLike | list[DeviceLike] = None,
        env_device: DeviceLike | list[DeviceLike] = None,
        policy_device: DeviceLike | list[DeviceLike] = None,
        create_env_kwargs: dict | list | None = None,
        max_frames_per_traj: int | None = None,
        init_random_frames: int | None = None,
        reset_at_each_iter: bool = False,
        postproc: Callable | None = None,
        split_trajs: bool = False,
        exploration_type: ExplorationLike = "random",
        collector_class: Any = SingleCollector,
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
        secret_file: str | os.PathLike | None = None,
        weight_updater: Any = None,
        ray_options: dict | None = None,
        pre_collect_hook: Callable | None = None,
        post_collect_hook: Callable | None = None,
        weight_recv_schemes: None = None,
        max_policy_lag: int | None = None,
        lag_policy: str = "drop",
        trajs_per_batch: int | None = None,
        trajs_per_write: int | None = None,
        traj_format: str | None = None,
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
            ray_options=ray_options, pre_collect_hook=pre_collect_hook, post_collect_hook=post_collect_hook,
            weight_recv_schemes=weight_recv_schemes,
            max_policy_lag=max_policy_lag, lag_policy=lag_policy, trajs_per_batch=trajs_per_batch,
            trajs_per_write=trajs_per_write, traj_format=traj_format,
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
        self._version = 0
        self._target = self.total_frames
        self._stats = MemberStats(cfg.num_nodes)  # (its clock starts now: fps counts the start-up)
        self._iterator: Iterator | None = None
        secret, secret_file, own_file = _run_secret(cfg)
        pool = self._pool = NodePool(cfg, secret, secret_file, own_file)
        # Collaborators: each gets what it needs here, and none calls another; Members runs the
        # gather (and every wait that may meet a node's failure) under recovery.
        self._recovery = Recovery(cfg, pool)
        self._weights = NodeWeights(cfg, pool)
        self._gather = Gather(cfg, pool, self._push_due, lambda: self._version, self._stats)
        self._member_control = Members(pool, self._gather, self._recovery, self._stats)
        self._collect_next = self._member_control.next_batch  # (CollectorBase._next_batch delivers it)
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
            # The frames of the failed start-up hold the channel and the process groups: free
            # their locals so that the sockets close now, not when the traceback is dropped.
            traceback.clear_frames(err.__traceback__)
            raise

    # -- the counters, owned by the statistics (the gather reports each batch) ---------------------
    _frames = property(lambda self: self._stats.frames)
    _iter = property(lambda self: self._stats.batches)

    # -- iteration (CollectorBase.__iter__) ---------------------------------------------------------------
    _shutdown_on_error = True

    def _frame_target(self) -> int:
        """Iterating again after ``total_frames`` were collected collects ``total_frames`` more."""
        if self.total_frames < 0:
            return -1
        if self._frames >= self._target:
            self._target = self._frames + self.total_frames
        return self._target

    def _shut_down_after(self, err: BaseException) -> None:
        self.shutdown(_shutdown_timeout(err))

    def _batch_frames(self) -> int:  # len() (rlcollect/base.py)
        return self.frames_per_batch

    # -- control: Members (rlcollect/members.py), over the pool contract both wings share -------------
    def _seed(self, seed: int, static_seed: bool) -> int:
        # Async batches in flight are discarded; dropped nodes are skipped.
        with self._guard():
            return self._member_control.seed(seed, static_seed)

    def reset(self) -> None:
        """Reset every node's envs; the next frames start new trajectories (in-flight batches
        are discarded)."""
        with self._guard():
            self._forget_trajectories()
            self._member_control.reset()

    def state_dict(self) -> dict[str, Any]:
        """``{"node0": ..., ..., "frames", "iter", "policy_version"}`` (no entry for a dropped
        node). ``"frames"`` and ``"iter"`` count the frames and batches delivered to you (what
        ``total_frames`` counts, so that a run resumed with ``load_state_dict`` stops at
        ``total_frames``), as torchrl's ``MultiAsyncCollector`` counts them. ``"node<i>"`` is
        node ``i``'s inner collector's state: its ``"frames"`` counts every frame that node
        collected, including async batches collected ahead and not delivered yet. Async batches
        in flight are received first and stay queued for delivery; they are not in the
        checkpoint (a run resumed from it never sees them, and the nodes' envs continue after
        them). A node's state is plain data: its pickled env state is left out."""
        with self._guard():
            out: dict[str, Any] = {f"node{i}": state for i, state in self._member_control.states().items()}
        out.update(frames=self._frames, iter=self._iter, policy_version=self._version)
        return out

    def _load(self, state: dict[str, Any]) -> None:
        # A node that rejects its part raises its error; the collector stays usable.  Pickled env
        # state is refused (state_dict() never holds it); the rest is cloudpickled for the nodes
        # (trusted from rank 0): only load states you trust.
        with self._guard():
            nodes = self._member_control.serving()
        missing = [k for k in (*(f"node{i}" for i in nodes), "frames", "iter") if k not in state]
        if missing:
            raise KeyError(f"DistributedCollector.load_state_dict: missing keys {missing}")
        env_state.refuse({f"node{i}": state[f"node{i}"] for i in nodes}, "DistributedCollector.load_state_dict")
        with self._guard():
            self._member_control.load({i: state[f"node{i}"] for i in nodes}, int(state["frames"]), int(state["iter"]))
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
            self._member_control.push(self._push, targets, self._version + 1)

    def _push(self, targets: dict[int, Any], version: int) -> None:
        packed = self._weights.pack(targets)
        self._version = version
        self._pool.push_weights(packed, version)

    def _push_due(self, nodes: Sequence[int], yielded: int) -> None:  # Gather's hook
        due = self._weights.due(nodes, yielded)
        if due:
            self._push(due, self._version + 1)

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
        return self._torchrl_stats(distributed_stats(
            self._pool, self._stats, closed=self._closed, master=f"{self.master_addr}:{self.master_port}",
            restarts=self._recovery.counts, version=self._version))

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
        message = (f"rlcollect: wrote this run's secret to {path} (mode 600; removed at shutdown): give it to each "
                   "node with --secret-file")
        print(message, file=sys.stderr, flush=True)  # to act on: not only to the (silent by default) logger
        logger.info(message)
        return secret, path, path
    return new_secret(), None, None  # "mp": through a pipe; "submitit": a 0600 file in the job folder


for _name, _attribute in DISTRIBUTED_ATTRIBUTES.items():  # torchrl's public attributes (num_workers, backend, ...)
    setattr(DistributedCollector, _name, _attribute)
