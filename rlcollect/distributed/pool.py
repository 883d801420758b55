"""``NodePool``: rank 0's nodes, one ``NodeHandle`` each, and everything that keeps them: the
pair groups' store, rank 0's heartbeat, the launcher, the control channel, the handshake, the pair groups.

The pool answers the pool contract of both wings (rlcollect/members.py's ``Pool``: ``serving``,
``ask``, ``ask_all``, through which the collector's ``Members`` seeds, resets, reads and loads
the nodes), and the calls of its own wing: ``start`` (launch and handshake every node),
``ready``/``take`` (a node's batch notice, then the batch itself), ``grant`` (credits),
``restart`` (relaunch a failed node), ``push_weights``, ``close``.  Every wait goes through
``wait_for``, which sorts the channel's messages and runs the liveness check (``check_alive``)
in between: dead or silent nodes, relaunched nodes advancing their handshake.

The pool holds no reference to the collector, so that garbage collection and interpreter exit
can ``close`` it too.  A node's failure is raised as an exception marked with ``failed_node``
(``protocol.mark_failed``); what to do with it is ``recovery.py``'s business: it calls the
pool's ``drop`` and ``restart``, the pool never calls it.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import cloudpickle
from tensordict import TensorDict

from rlcollect.distributed.control import env_state
from rlcollect.distributed.control import protocol as P
from rlcollect.distributed.control import transport
from rlcollect.distributed.control.auth import Keys, remove_secret_file
from rlcollect.distributed.control.channel import Channel
from rlcollect.distributed.control.handshake import Handshake
from rlcollect.distributed.control.heartbeat import Rank0Beat, Silence
from rlcollect.distributed.launch.launchers import make_launcher
from rlcollect.distributed.nodes import NodeHandle, NodeState, Rejoin, node_error
from rlcollect.distributed.control.wire import WireClosed
from rlcollect.errors import WorkerError

logger = logging.getLogger("rlcollect")

#: Seconds between two liveness checks while waiting.
CHECK_S = 0.25
#: How long a node whose connection broke may take to be reported dead by its launcher.
_DEATH_NOTICE_S = 1.0
#: How often rank 0 looks for a second node claiming a taken rank, once serving.
_HELLO_POLL_S = 0.5
#: Weight sends not yet taken by a slow node before we wait for the oldest.
MAX_PENDING_WEIGHTS = 8
_RENDEZVOUS_POLL_S = 0.02


class NodePool:
    """The nodes of one ``DistributedCollector`` (``config``: its ``DistributedConfig``).

    ``secret`` is the run's secret; ``secret_file`` the file the user's nodes read it from
    (None for "mp", whose nodes get it through a pipe); ``own_secret_file`` that file again
    when rank 0 wrote it (removed at ``close``)."""

    def __init__(self, config: Any, secret: bytes, secret_file: Any = None, own_secret_file: Any = None):
        self.config = config
        self.world_size = config.num_nodes + 1
        self.handles = [NodeHandle(i) for i in range(config.num_nodes)]
        self._by_rank = {h.rank: h for h in self.handles}
        self.secret, self.keys, self.run = secret, Keys(secret), secrets.token_hex(16)
        self.secret_file, self.own_secret_file = secret_file, own_secret_file
        self.address = ""
        self.master_port: int | None = None
        self.store: Any = None
        self.heartbeat: Any = None
        self.launcher: Any = None
        self.channel: Channel | None = None
        self.handshake: Handshake | None = None
        self._silence: Silence | None = None
        self.layouts: list = []
        self.started = False  # every node has joined its pair group and serves commands
        self.closed = False
        self._next_check = self._next_hello_poll = 0.0

    # -- start -----------------------------------------------------------------------------------------
    def start(self) -> None:
        """Open the channel listener (``master_port``), start rank 0's heartbeat and the
        launcher, and handshake every node (within ``start_timeout``); then each node serves."""
        cfg = self.config
        addr = cfg.master_addr
        self.address = transport.resolve(addr)
        self.store = transport.pair_store()
        self._silence = Silence(self._by_rank, cfg.heartbeat_timeout)
        self.channel = Channel(self.address, self._by_rank, self.keys, self._attached, self.run, cfg.tcp_port,
                               self.store)
        self.master_port = port = self.channel.port
        self.heartbeat = Rank0Beat(self.channel.beat_all).start()
        self.handshake = Handshake(self.keys, self.run, self.world_size, self.channel)
        self.launcher = make_launcher(cfg.launcher, cfg.launcher_options, self.secret, self.secret_file,
                                      cfg.rank0_timeout)
        # One INFO line per phase: a start that takes a minute on a busy machine is never silent.
        began = time.monotonic()
        logger.info("rlcollect: starting %d node(s) (launcher=%r), rank 0 at %s:%s", len(self.handles), cfg.launcher,
                    addr, port)
        self.launcher.start(addr, port, self.world_size, cfg.timeout, start_timeout=cfg.start_timeout)
        self._rendezvous(time.monotonic() + cfg.start_timeout)
        logger.info("rlcollect: connecting the %d node(s)' process groups", len(self.handles))
        try:
            self._connect_pairs(self.handles)
        except RuntimeError as err:
            self.check_alive()
            raise WorkerError(f"the nodes could not connect to rank 0's process group at {addr} within timeout="
                              f"{cfg.timeout:g} s: {str(err).splitlines()[0]}") from None
        self.started = True
        for h in self.handles:
            h.state, h.recv = NodeState.SERVING, transport.FlatBatch(h.info["layout"])
        self.layouts = [h.info["layout"] for h in self.handles]
        logger.info("rlcollect: %d node(s) serving, %.1f s after the launch", len(self.handles),
                    time.monotonic() - began)

    def _rendezvous(self, deadline: float) -> None:
        """Hello -> configuration -> started, for every node, before ``deadline``."""
        cfg, shake = self.config, self.handshake
        started: set[int] = set()
        attached, n = 0, len(self.handles)
        while len(started) < n:
            self.channel.pump()
            for h in self.handles:
                if not h.configured:
                    if self._poll_hello(h, cfg.payloads[h.index]):
                        attached += 1
                        logger.info("rlcollect: %d/%d node(s) reached rank 0 (node %d, rank %d)", attached, n, h.index,
                                    h.rank)
                elif h.rank not in started and (info := shake.poll_started(h)) is not None:
                    h.info = info
                    started.add(h.rank)
                    logger.info("rlcollect: %d/%d node(s) built their collector (node %d)", len(started), n, h.index)
            self.check_alive()
            if time.monotonic() > deadline:
                missing = [h for h in self.handles if h.rank not in started]
                where = "; ".join(f"node {h.index} (rank {h.rank}): " + ("configured, building its collector"
                                  if h.configured else "has not reached rank 0 (no authentic hello)")
                                  for h in missing)
                forged = (f"; {shake.drops.total} message(s) failed authentication or were replays (a node without "
                          "this run's secret?)") if shake.drops.total else ""
                raise node_error(f"nodes {[h.index for h in missing]} did not start within start_timeout="
                                 f"{cfg.start_timeout:g} s, during start-up ({where}; launcher={cfg.launcher!r}, "
                                 f"rank 0 at {cfg.master_addr}:{self.master_port}){forged}; the nodes still starting "
                                 "are stopped (a node still importing torch on a loaded machine needs a longer "
                                 "start_timeout)",
                                 missing[0].index)
            time.sleep(_RENDEZVOUS_POLL_S)

    def _poll_hello(self, h: NodeHandle, payload: bytes | None) -> bool:
        return self.handshake.poll_hello(h, payload)

    def _attached(self, h: NodeHandle) -> None:
        """Node ``h`` attached its channel: watch its heartbeat from now on, send its spec."""
        self._silence.add(h.rank)
        payload, h.setup = h.setup, None
        try:
            self.channel.send(h.rank, "setup", payload or b"")
        except WireClosed:
            pass  # its channel closed: reported as such by check_alive

    def _connect_pairs(self, handles: list[NodeHandle]) -> None:
        """Build rank 0's side of the pair groups of ``handles`` (whose nodes have started) and
        connect them (the nodes connect theirs right after reporting "started")."""
        for h in handles:
            h.pg = transport.pair_group(self.store, h.rank, h.incarnation, True, self.address, self.config.timeout)
        transport.join([h.pg for h in handles], True, self.config.timeout)

    # -- waiting and liveness ------------------------------------------------------------------------
    def wait_for(self, predicate: Callable[[], bool], what: str, timeout: float | None = None) -> None:
        """Sort messages until ``predicate()`` holds; liveness is checked throughout, and
        ``timeout`` (seconds, None: none besides liveness) bounds the wait."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not predicate():
            self.maybe_check()
            if deadline is not None and time.monotonic() > deadline:
                raise WorkerError(f"{what} took more than {timeout:g} s")
            self.channel.pump(max(1e-3, self._next_check - time.monotonic()))

    def maybe_check(self) -> None:
        """Run the liveness check if the last one is older than ``CHECK_S``."""
        if time.monotonic() >= self._next_check:
            self._next_check = time.monotonic() + CHECK_S
            self.check_alive()

    def check_alive(self) -> None:
        """Raise for a node whose process ended (its own error first, if it reported one) or
        that stopped beating; advance the handshake of relaunched nodes."""
        for rank, cause in sorted(self.launcher.dead().items()):
            self._raise_dead(self._by_rank[rank], cause)
        for rank, seconds, why in self._silence.silent() if self._silence is not None else ():
            h = self._by_rank[rank]
            h.state = NodeState.FAILED
            raise P.mark_failed(node_error(f"node {h.index} stopped answering: no heartbeat for {seconds:.1f} s "
                                           f"(heartbeat_timeout={self.config.heartbeat_timeout:g}); {why}", h.index),
                                h.index)
        for rank, reason in sorted(self.channel.closed.items()) if self.channel is not None else ():
            h = self._by_rank[rank]
            if h.state in (NodeState.DROPPED, NodeState.CLOSED):
                continue
            # A killed process's sockets close a moment before it is reported dead: its
            # launcher's account (with the exit code) is the better report.
            deadline = time.monotonic() + _DEATH_NOTICE_S
            while time.monotonic() < deadline and rank not in self.launcher.dead():
                time.sleep(0.02)
            dead = self.launcher.dead()
            if rank in dead:
                self._raise_dead(h, dead[rank])
            h.state = NodeState.FAILED
            raise P.mark_failed(node_error(f"node {h.index} lost its channel to rank 0 ({reason})", h.index), h.index)
        self._advance_rejoins()
        if self.started and time.monotonic() >= self._next_hello_poll:
            # A second node started for a taken rank is told so (it would wait in vain).
            self._next_hello_poll = time.monotonic() + _HELLO_POLL_S
            for h in self.handles:
                if h.configured and h.state is not NodeState.DROPPED:
                    self._poll_hello(h, None)

    def _raise_dead(self, h: NodeHandle, cause: str) -> None:
        """Raise for node ``h``, whose process ended: its start-up error if it reported one."""
        if h.state is NodeState.DROPPED:
            return
        if self.channel is not None:
            self.channel.pump()
        msg = self.handshake.started_message(h)
        if msg is not None and msg.kind == "failed":
            raise P.rebuild_error(msg["error"], h.index, "start-up")
        h.state = NodeState.FAILED
        process = getattr(self.launcher, "processes", {}).get(h.rank)
        raise P.mark_failed(node_error(f"node {h.index} {cause}", h.index,
                                       None if process is None else process.returncode), h.index)

    def lost(self, i: int, what: str, err: BaseException) -> WorkerError:
        """The error for node ``i``'s broken connection during ``what``: its launcher's account
        of its death when there is one (a killed process's sockets close a moment before it is
        reported dead), else the connection error."""
        h = self.handles[i]
        self.channel.pump()
        deadline = time.monotonic() + _DEATH_NOTICE_S
        while time.monotonic() < deadline and h.rank not in self.launcher.dead():
            time.sleep(0.02)
        self.check_alive()
        h.state = NodeState.FAILED
        return P.mark_failed(node_error(f"node {i} lost its connection {what}: {str(err).splitlines()[0]}", i), i)

    def check_deadlines(self) -> None:
        """Raise for a node that owes a batch it started more than ``node_timeout`` seconds ago
        and has not announced (its heartbeat may be fine: a hung env step)."""
        limit = self.config.node_timeout
        if limit is None:
            return
        now = time.monotonic()
        late = [h for h in self.handles if h.batch_started is not None and now - h.batch_started > limit]
        if late:
            self.channel.pump()  # notices that arrived meanwhile (the trainer was busy) count
        for h in late:
            announced = sum(1 for msg in self.channel.notices if msg.rank == h.rank)
            if announced >= h.outstanding:
                continue  # done, only not taken yet (the trainer was busy)
            h.state = NodeState.FAILED  # hung: killed, not waited for
            raise P.mark_failed(node_error(f"node {h.index} has not delivered a batch it started "
                                           f"{now - h.batch_started:.1f} s ago (node_timeout={limit:g}; its heartbeat "
                                           "may be alive: a hung env step?)", h.index), h.index)

    # -- commands, credits and batches ----------------------------------------------------------------
    # -- the pool contract of both wings (rlcollect/members.py's ``Pool``) -------------------------------
    def __len__(self) -> int:
        return len(self.handles)

    def serving(self) -> list[int]:
        """The nodes that take commands now (not dropped, not on their way back)."""
        return [h.index for h in self.handles if h.serving]

    def ask(self, i: int, command: str, *args: Any) -> Any:
        """Command node ``i`` (``"seed"(seed, static_seed)``, ``"reset"``, ``"state_dict"``,
        ``"load_state_dict"(state)``) and wait (up to ``timeout``) for its reply; a node's
        exception is re-raised here. A state travels as plain data: a node's state is read with
        its pickled env state left out (a node could plant code there that ``load_state_dict``
        would hand every node), and a state to load is cloudpickled (trusted from rank 0)."""
        payload, fields = b"", {}
        if command == "seed":
            seed, static_seed = args
            fields = {"seed": seed, "static_seed": bool(static_seed)}
        elif command == "load_state_dict":
            (state,) = args
            payload = cloudpickle.dumps(state)
        elif args:
            raise TypeError(f"node command {command!r} takes no arguments, got {args!r}")
        value, data = self._command(i, command, payload, **fields)
        return env_state.strip(P.loads_data(data)) if command == "state_dict" else value

    def ask_all(self, command: str, *args: Any, members: Sequence[int] | None = None) -> list[Any]:
        """``command`` to each of ``members`` (None: every node serving), one after the other;
        their replies, in order."""
        return [self.ask(i, command, *args) for i in (self.serving() if members is None else members)]

    def _command(self, i: int, name: str, payload: bytes = b"", **args: Any) -> tuple[Any, bytes]:
        """Command node ``i`` on its channel and wait (up to ``timeout``) for its reply:
        ``(value, payload)``; a node's exception is re-raised here."""
        rank, what = i + 1, f"{name!r}"
        try:
            command_id = self.channel.command(rank, name, payload, **args)
        except WireClosed as err:
            raise self.lost(i, f"while sending it {what}", err) from None
        found: list[P.Message] = []

        def arrived() -> bool:
            if not found and (msg := self.channel.take_reply(rank, command_id)) is not None:
                found.append(msg)
            return bool(found)

        try:
            self.wait_for(arrived, f"node {i}'s answer to {what}", self.config.timeout)
        except WorkerError as err:
            if err.worker_index is None:
                err.worker_index = err.node_index = i
            raise
        msg = found[0]
        if not msg["ok"]:
            raise P.rebuild_error(msg["error"] or {}, i, what)
        return msg["value"], msg.payload

    def grant(self, i: int, credits: int, random: bool) -> None:
        """Let node ``i`` collect ``credits`` more batches (``random``: with random actions)."""
        if credits > 0:
            h = self.handles[i]
            try:
                self.channel.command(h.rank, "collect", credits=credits, random=random)
            except WireClosed as err:
                raise self.lost(i, "while granting it batches", err) from None
            if not h.outstanding:
                h.batch_started = time.monotonic()
            h.outstanding += credits

    def ready(self, i: int | None = None) -> P.Message | None:
        """Pop the first valid batch notice (from node ``i``, or from any); inconsistent ones
        are logged and dropped, never acted upon."""
        notices = self.channel.notices
        for msg in list(notices):
            if i is not None and msg.rank != i + 1:
                continue
            notices.remove(msg)
            h = self._by_rank[msg.rank]
            if (msg["seq"] != h.expected_seq or not 0 <= msg["slot"] < self.config.slots
                    or not 0 <= msg["frames"] <= self.layouts[h.index].frames or h.outstanding < 1):
                logger.error("rlcollect: dropped an inconsistent batch notice from node %d: %s", h.index, msg.fields)
                continue
            h.expected_seq += 1
            return msg
        return None

    def take(self, msg: P.Message) -> TensorDict:
        """Receive the batch ``msg`` announced into its node's buffer (overwritten by that
        node's next batch); account for it (its frames are counted when delivered: gather.py)."""
        h = self._by_rank[msg.rank]
        buf = h.recv
        try:
            work = transport.post_recv(h.pg, buf.flat, transport.NODE_IN_PAIR, transport.BATCH_TAG, h.receives)
            transport.wait(work, transport.transfer_timeout(buf.nbytes))
        except RuntimeError as err:
            raise self.lost(h.index, "while sending a batch", err) from None
        h.receives.remove(work)
        h.outstanding -= 1
        # The node's next batch (if owed) started when this one was announced, at the latest.
        h.batch_started = time.monotonic() if h.outstanding else None
        h.version = msg["version"]
        h.step = (msg["step_mean_s"], msg["step_p95_s"])
        h.since_update += 1
        while h.weight_sends and h.weight_sends[0][0] <= msg["version"]:  # the node has them: those sends are done
            self._wait_send(h, h.weight_sends.popleft()[1])
        return buf.buffer.td

    # -- weights --------------------------------------------------------------------------------------
    def push_weights(self, packed: dict[int, Any], version: int) -> None:
        """Send each node ``i`` of ``packed`` its packed weights ``packed[i]`` as ``version``; a
        node being relaunched gets them when it rejoins."""
        for i, flat in packed.items():
            h = self.handles[i]
            if self.config.on_node_failure == "restart":
                h.last_weights = (version, flat)  # what a relaunched node starts from
            h.version, h.since_update = version, 0
            if h.serving:
                self._send_weights(h, version, flat)

    def _send_weights(self, h: NodeHandle, version: int, flat: Any) -> None:
        try:
            self.channel.command(h.rank, "weights", version=version, nbytes=flat.numel())
            work = h.pg.send([flat], transport.NODE_IN_PAIR, transport.WEIGHTS_TAG)
        except (RuntimeError, WireClosed) as err:  # gloo refuses at once on a pair whose peer is gone
            raise self.lost(h.index, "while receiving weights", err) from None
        h.weight_sends.append((version, work))
        if len(h.weight_sends) > MAX_PENDING_WEIGHTS:
            self._wait_send_watched(h, h.weight_sends.popleft()[1])

    def _wait_send(self, h: NodeHandle, work: Any) -> None:
        """Wait for a weight send that node ``h`` has taken (it acts with those weights)."""
        try:
            transport.wait(work, self.config.timeout)
        except RuntimeError as err:
            raise self.lost(h.index, "while receiving weights", err) from None

    def _wait_send_watched(self, h: NodeHandle, work: Any) -> None:
        """Wait for a weight send node ``h`` may not have taken yet, checking liveness
        meanwhile: a node stopped or dead while it owes the receive is reported within
        ``heartbeat_timeout`` (a blocking wait held rank 0 for the whole ``timeout``).  A gloo
        wait cannot be resumed after a timeout, so a thread waits and this thread watches."""
        done, errors = threading.Event(), []

        def waiter() -> None:
            try:
                transport.wait(work, self.config.timeout)
            except Exception as err:  # noqa: BLE001  (handed to the main thread)
                errors.append(err)
            finally:
                done.set()

        threading.Thread(target=waiter, name=f"rlcollect-weights-{h.rank}", daemon=True).start()
        self.wait_for(done.is_set, f"node {h.index} taking its weights")  # the waiter's timeout bounds it
        if errors:
            raise self.lost(h.index, "while receiving weights", errors[0]) from None

    # -- failure, relaunch and rejoin -----------------------------------------------------------------
    def drop(self, i: int, for_good: bool) -> None:
        """Stop node ``i`` (killed when the launcher owns it, else told to close) and forget
        its messages, its pair group, its weight sends and its batches in flight (counted as
        lost); ``for_good``: never watch it again."""
        h = self.handles[i]
        h.lost_batches += h.outstanding
        h.outstanding, h.batch_started, h.expected_seq = 0, None, 0
        with contextlib.suppress(Exception):
            if not self.launcher.owns_processes and h.configured:
                self.channel.command(h.rank, "close")  # an external node that still listens leaves
        self.launcher.kill(h.rank)
        h.token = ""  # whatever it still sends is stale now
        self._release_pair(h, 1.0)
        h.configured, h.rejoin = False, None
        if self._silence is not None:
            self._silence.forget(h.rank)
        if self.channel is not None:
            self.channel.forget(h.rank)
        h.state = NodeState.DROPPED if for_good else NodeState.FAILED

    def restart(self, i: int, payload: bytes) -> None:
        """Start node ``i`` again (after ``drop``) as its next incarnation, configured with
        ``payload``; it rejoins through ``check_alive`` within ``start_timeout`` seconds, and
        serves again once ``admit`` has checked it."""
        h = self.handles[i]
        h.incarnation += 1
        h.state = NodeState.RELAUNCHING
        self.launcher.relaunch(h.rank)
        self.handshake.forget(h.rank)
        h.rejoin = Rejoin(payload, time.monotonic() + self.config.start_timeout)

    def _advance_rejoins(self) -> None:
        for h in self.handles:
            join = h.rejoin
            if h.state is not NodeState.RELAUNCHING or join is None or join.info is not None:
                continue
            if not join.configured:
                join.configured = self._poll_hello(h, join.payload)
            elif (info := self.handshake.poll_started(h)) is not None:
                try:
                    self._connect_pairs([h])
                except RuntimeError as err:
                    raise self.lost(h.index, "while rejoining", err) from None
                join.info = info
                continue
            if time.monotonic() > join.deadline:
                h.state = NodeState.FAILED
                raise P.mark_failed(node_error(
                    f"node {h.index} was relaunched but did not rejoin within start_timeout="
                    f"{self.config.start_timeout:g} s ({'configured' if join.configured else 'no hello yet'})",
                    h.index), h.index)

    def admit(self) -> None:
        """Make the relaunched nodes that rejoined serve again: check their layout, give them
        the weights the others act with.  Called from every wait's predicate."""
        for h in self.handles:
            info = h.rejoin.info if h.state is NodeState.RELAUNCHING and h.rejoin is not None else None
            if info is None:
                continue
            if info["layout"] != self.layouts[h.index]:
                raise WorkerError(f"relaunched node {h.index} reports another batch layout than before: "
                                  f"{info['layout']} instead of {self.layouts[h.index]}", h.index)
            h.info, h.rejoin, h.state, h.since_update = info, None, NodeState.SERVING, 0
            if h.last_weights is not None:
                self._send_weights(h, *h.last_weights)
            logger.warning("rlcollect: node %d rejoined (pid %s on %s)", h.index, info["pid"], info["host"])

    def settled(self) -> bool:
        """No node is on its way back (admitting those that rejoined)."""
        self.admit()
        return not any(h.state is NodeState.RELAUNCHING for h in self.handles)

    def all_dropped(self) -> bool:
        return all(h.state is NodeState.DROPPED for h in self.handles)

    def alive(self) -> list[bool]:
        """Whether each node lives (its process not known to have ended, not dropped)."""
        dead = self.dead()
        return [h.index not in dead and h.state is not NodeState.DROPPED for h in self.handles]

    def dead(self) -> set[int]:
        """The nodes whose process is known to have ended."""
        return set() if self.launcher is None else {rank - 1 for rank in self.launcher.dead()}

    # -- close ----------------------------------------------------------------------------------------
    def _wait_byes(self, handles: list[NodeHandle], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        waiting = list(handles)
        with contextlib.suppress(Exception):
            while waiting and time.monotonic() < deadline:
                self.channel.pump(0.05)
                waiting = [h for h in waiting if not self.handshake.said_bye(h)]

    def close(self, timeout: float | None = None) -> None:
        """Close every node, stop those rank 0 started, free the store and the process groups.
        ``timeout`` (None: 10 s, or 1 s when the interpreter exits after a Ctrl-C) bounds it.
        Idempotent."""
        if self.closed:
            return
        self.closed = True
        if timeout is None:
            interrupted = isinstance(getattr(sys, "last_value", None), KeyboardInterrupt)
            timeout = 1.0 if interrupted else 10.0
        try:
            self._close(timeout)
        except KeyboardInterrupt:
            # A second Ctrl-C while closing (the first one started it): finish at once (kill what
            # rank 0 started, free the rest), then raise it.  Left half-closed, the store and the
            # process groups were torn down by the interpreter's exit and aborted it.
            self._close(0.0)
            raise

    @staticmethod
    def _release_pair(h: NodeHandle, timeout: float) -> None:
        """Free node ``h``'s pair group with the receives and weight sends still posted on it
        (its node is stopped or told to close); see ``transport.release_group``."""
        refs = [h.pg, *h.receives, *(work for _, work in h.weight_sends)] if h.pg is not None else []
        h.pg = None
        h.receives.clear()
        h.weight_sends.clear()
        if refs:
            transport.release_group(refs, timeout)

    def _close(self, timeout: float) -> None:
        store, channel, handles = self.store, self.channel, self.handles
        if store is not None and channel is not None:
            # Nodes not configured yet need no word: they end when the store goes away.
            for h in handles:
                if h.configured and h.state is not NodeState.DROPPED:
                    with contextlib.suppress(Exception):
                        channel.command(h.rank, "close")
        launcher = self.launcher
        if launcher is not None:
            failed = {h.rank for h in handles if h.state in (NodeState.FAILED, NodeState.DROPPED)}
            joining = {h.rank for h in handles
                       if h.state is NodeState.RELAUNCHING and (h.rejoin is None or h.rejoin.info is None)}
            if store is not None and not launcher.owns_processes and self.started:
                self._wait_byes([h for h in handles if h.configured and h.rank not in failed | joining],
                                0.6 * timeout)
            # Nodes still starting cannot read "close" (they may be blocked joining the process
            # group): stop them at once rather than wait for them.
            starting = joining if self.started else {h.rank for h in handles}
            with contextlib.suppress(Exception):
                launcher.stop(timeout, failed | starting)
        if self.heartbeat is not None:
            self.heartbeat.stop()
        for h in handles:
            self._release_pair(h, timeout)
            h.state = NodeState.CLOSED
        if channel is not None:
            with contextlib.suppress(Exception):
                channel.close()
        self.channel = self.store = self.heartbeat = self.launcher = self._silence = None
        remove_secret_file(self.own_secret_file, folder_too=True)
        self.own_secret_file = None
