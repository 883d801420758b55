"""``DistributedCollector``: rank 0 of a collection spread over nodes (processes or hosts)
joined over torch.distributed.  Rank 0 never builds an env or runs the policy: it hands each
node its configuration, allocates receive buffers from the layouts the nodes report, and
delivers their batches."""

from __future__ import annotations

import logging
import sys
import traceback
import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import cloudpickle
from tensordict import TensorDict

from rlcollect.base import CollectorBase
from rlcollect.collector import SingleCollector
from rlcollect.distributed.control import env_state
from rlcollect.distributed.control import protocol as P
from rlcollect.distributed.control.auth import new_secret, read_secret_file, secret_from_env, write_secret_file
from rlcollect.distributed.config import DistributedConfig
from rlcollect.distributed.gather import NODE_ID, Gather  # noqa: F401  (NODE_ID: its old home)
from rlcollect.distributed.node_weights import NodeWeights
from rlcollect.distributed.pool import NodePool
from rlcollect.distributed.recovery import Recovery
from rlcollect.distributed.stats import distributed_stats
from rlcollect.members import Members, MemberStats
from rlcollect.weights.models import UnknownModelError, make_weight_updater
from rlcollect.weights.schemes import NoWeightSyncScheme

if TYPE_CHECKING:
    import os

    from rlcollect.typing import DeviceLike, EnvSource, ExplorationLike, PolicyLike

logger = logging.getLogger("rlcollect")



class DistributedCollector(CollectorBase):
    """Collect on ``num_nodes`` nodes (processes or hosts) joined over torch.distributed.

    Each entry of ``create_env_fn`` is one node (rank ``i + 1``; nodes are numbered from 0 in
    the API) running an inner collector of ``collector_class``. ``sync=True`` yields one batch
    from every node stacked, ``(num_nodes, *node_batch)``; ``sync=False`` yields each node's
    batch as it comes, tagged ``("collector", "node_id")``. Nodes are fresh interpreters that
    never import your script: the env factories, policy and options travel to them pickled
    (cloudpickle: what your ``__main__`` defines goes by value). Nodes execute the code rank 0
    sends them, so rank 0 and the nodes must trust each other; every control message is
    authenticated (HMAC-SHA256) with a per-run secret that never enters the store or a command
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
        tcp_port: the port rank 0's store listens on; ``None`` (the default) picks a free one
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

    def _collect_next(self) -> tuple[TensorDict, dict]:
        with self._guard():
            batch = self._member_control.run(self._next_one)
        return batch, {"storing_device": self.config.storing_device}

    def _next_one(self) -> TensorDict:
        self._pool.maybe_check()  # also when batches keep coming from the other nodes
        return self._gather.next_sync(self._iter) if self.sync else self._gather.next_async(self._iter)

    def _quiesce(self) -> None:
        """Receive every batch still owed (within ``timeout``); they stay queued for delivery."""
        self._settle()
        with self._guard():
            self._member_control.run(self._pool.wait_for, self._gather.drained, "waiting for the batches in flight",
                                     self.config.timeout)
        self._settle()  # a node that failed while draining was relaunched

    def _discard_in_flight(self) -> None:
        self._quiesce()
        self._gather.discard()

    # -- control ------------------------------------------------------------------------------------------
    def _settle(self) -> None:
        """Wait until no node is on its way back (before a command meant for every node)."""
        pool = self._pool
        with self._guard():
            self._member_control.run(pool.wait_for, pool.settled, "waiting for relaunched nodes to rejoin")

    def _seed(self, seed: int, static_seed: bool) -> int:
        # Async batches in flight are discarded; dropped nodes are skipped.
        self._discard_in_flight()
        with self._guard():
            for i in self._pool.serving_nodes():
                self._recovery.note_seed(i, seed)
                seed, _ = self._pool.ask(i, "seed", seed=seed, static_seed=bool(static_seed))
        return seed

    def reset(self) -> None:
        """Reset every node's envs; the next frames start new trajectories (in-flight batches
        are discarded)."""
        self._discard_in_flight()
        self._forget_trajectories()
        with self._guard():
            for i in self._pool.serving_nodes():
                self._pool.ask(i, "reset")

    def state_dict(self) -> dict[str, Any]:
        """``{"node0": ..., ..., "frames", "iter", "policy_version"}`` (no entry for a dropped
        node). ``"frames"`` and ``"iter"`` count the frames and batches delivered to you (what
        ``total_frames`` counts, so that a run resumed with ``load_state_dict`` stops at
        ``total_frames``), as torchrl's ``MultiAsyncCollector`` counts them. ``"node<i>"`` is
        node ``i``'s inner collector's state: its ``"frames"`` counts every frame that node
        collected, including async batches collected ahead and not delivered yet. Async batches
        in flight are received first and stay queued for delivery; they are not in the
        checkpoint (a run resumed from it never sees them, and the nodes' envs continue after
        them)."""
        self._quiesce()
        with self._guard():
            # Plain data only: a GymEnv's pickled envs are left out (a node could plant code there
            # that load_state_dict would hand every node).
            out: dict[str, Any] = {f"node{i}": env_state.strip(P.loads_data(self._pool.ask(i, "state_dict")[1]))
                                   for i in self._pool.serving_nodes()}
        out.update(frames=self._frames, iter=self._iter, policy_version=self._version)
        return out

    def _load(self, state: dict[str, Any]) -> None:
        # A node that rejects its part raises its error; the collector stays usable.  Pickled env
        # state is refused (state_dict() never holds it); the rest is cloudpickled for the nodes
        # (trusted from rank 0): only load states you trust.
        self._settle()
        nodes = self._pool.serving_nodes()
        missing = [k for k in (*(f"node{i}" for i in nodes), "frames", "iter") if k not in state]
        if missing:
            raise KeyError(f"DistributedCollector.load_state_dict: missing keys {missing}")
        env_state.refuse({f"node{i}": state[f"node{i}"] for i in nodes}, "DistributedCollector.load_state_dict")
        self._discard_in_flight()
        with self._guard():
            for i in nodes:
                self._pool.ask(i, "load_state_dict", cloudpickle.dumps(state[f"node{i}"]))
        self._stats.restore(int(state["frames"]), int(state["iter"]))
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
            self._member_control.run(self._push, targets, version)

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
