"""A distributed node: the process behind ``rlcollect node``, the "mp" launcher's processes and
the submitit jobs.

Life of a node: connect to rank 0's listener (waiting up to ``timeout`` for rank 0 to be up),
check rank 0's signed "welcome" (the run's nonce and a challenge of this connection), say hello
on the same connection (signed with the run's secret: see ``auth.py``; repeating the nonce and
the challenge), read rank 0's answer there (this connection is its channel from then on:
``wire.py``), start its watch on rank 0 and its watcher (``watcher.py``), receive its
configuration on the channel (the cloudpickled env factory, policy and collector options:
**the node executes code rank 0 sends**; start nodes only for a rank 0 you trust), build its
inner collector (``Collector``, ``MultiSyncCollector`` or ``MultiAsyncCollector``), report the
batch layout and weight shapes, join its pair process group with rank 0 (its rendezvous through
the channel: ``channel_store.py``; one group per incarnation: 0, or how many times rank 0
relaunched this rank after a failure), then serve commands until "close".

Each command has a small handler in ``Node.handlers``.  "collect" grants credits: the node
collects one batch per credit into a preallocated flat buffer, posts it to rank 0 on the
process group and then announces it on its channel; rank 0 only receives batches that were
announced.  Commands are served between batches, never during one.

The node ends by itself when rank 0 is gone (its channel closed, no authentic heartbeat
of it for ``rank0_timeout`` seconds, or, for nodes rank 0 started itself, its process ended): see
``heartbeat.py`` and the "mp" launcher's bootstrap in ``launchers.py``.  Every message it takes
is authenticated (MAC, session, counter) before anything of it is used; one that is not is
dropped and logged once per sender.
"""

from __future__ import annotations

import argparse
import collections
import gc
import logging
import os
import secrets
import socket
import sys
import time
from typing import Any

import cloudpickle
import torch

from rlcollect.distributed.control import env_state
from rlcollect.distributed.control import protocol as P
from rlcollect.distributed.control import transport, watcher
from rlcollect.distributed.control.channel import NodeInbox
from rlcollect.distributed.control.channel_store import ChannelStore
from rlcollect.distributed.control.wire import MAX_ATTACH_BYTES, Wire, WireClosed
from rlcollect.distributed.control.auth import SECRET_ENV, DropLog, Keys, SecretError, check_secret, read_secret_file
from rlcollect.distributed.control.heartbeat import NodeWatch
from rlcollect.distributed.launch.node_args import LOG_LEVEL_ENV, RANK0_TIMEOUT_S, add_arguments, node_arguments
from rlcollect._pids import remove_multiprocessing_temp_dir
from rlcollect.envs.base import EnvPickleStash

logger = logging.getLogger("rlcollect")

EXIT_OK, EXIT_FAILED, EXIT_ORPHANED, EXIT_REJECTED = 0, 1, 3, 4


class Node:
    """The inner collector of one node and the command handlers around it."""

    def __init__(self, endpoint: P.Endpoint, rank: int, spec: dict, timeout: float):
        self.endpoint, self.rank, self.timeout = endpoint, rank, timeout
        torch.set_num_threads(int(spec.get("num_threads", 1)))
        self.collector = spec["collector_class"](spec["create_env_fn"], spec["policy"], **spec["kwargs"])
        if spec.get("seed") is not None:  # a relaunched node starts from a fresh seed
            self.collector.set_seed(spec["seed"])
        self.layout = self.collector.layout
        self.slots = [transport.FlatBatch(self.layout) for _ in range(int(spec["slots"]))]
        self.sends: list[Any] = [None] * len(self.slots)
        self.weight_spec = _weight_spec(self.collector)
        self.credits: collections.deque[bool] = collections.deque()  # one "random" flag per batch owed
        self.seq = 0
        self.pg = None
        self.store: Any = None  # the pair group's ChannelStore
        self.receives: list[Any] = []  # weight receives posted and not finished (transport.post_recv)
        self.closing = False
        # Commands answered on the reply queue; "collect" and "weights" are not (batches answer
        # "collect"; the node's next batch shows the weights version it acts with).
        self.handlers = {
            "collect": self.collect,
            "weights": self.weights,
            "seed": self.seed,
            "reset": self.reset,
            "state_dict": self.state_dict,
            "load_state_dict": self.load_state_dict,
            "close": self.close,
        }
        self.silent = {"collect", "weights"}
        self.env_pickles = EnvPickleStash()

    def say_started(self) -> None:
        weights = None if self.weight_spec is None else {k: [list(s), str(d)] for k, (s, d) in self.weight_spec.items()}
        self.endpoint.send("started", layout=P.layout_to_json(self.layout), weights=weights, pid=os.getpid(),
                           host=socket.gethostname())

    # -- handlers ------------------------------------------------------------------------------------
    def collect(self, args: dict, payload: bytes) -> None:
        self.credits.extend([args["random"]] * args["credits"])

    def weights(self, args: dict, payload: bytes) -> None:
        flat = torch.empty(args["nbytes"], dtype=torch.uint8)
        # Rank 0 posted the send with the command: receive it first, whatever follows, so the
        # stream of messages stays aligned even if these weights turn out not to fit.
        work = transport.post_recv(self.pg, flat, P.MASTER_RANK, transport.WEIGHTS_TAG, self.receives)
        transport.wait(work, transport.transfer_timeout(flat.numel()))
        self.receives.remove(work)
        if self.weight_spec is None:
            raise RuntimeError("received weights, but this node's policy has no parameters or buffers")
        if flat.numel() != transport.weights_nbytes(self.weight_spec):
            raise ValueError(f"received {flat.numel()} bytes of weights; this node's policy takes "
                             f"{transport.weights_nbytes(self.weight_spec)}")
        self.collector.set_weights(transport.unpack_weights(flat, self.weight_spec), args["version"])

    def seed(self, args: dict, payload: bytes) -> int:
        return self.collector.set_seed(args["seed"], static_seed=args["static_seed"])

    def reset(self, args: dict, payload: bytes) -> None:
        self.collector.reset()

    def state_dict(self, args: dict, payload: bytes) -> tuple[None, bytes]:
        # A GymEnv's pickled envs stay here; rank 0 gets their digest (pickles never cross the network)
        return None, P.dumps_data(self.env_pickles.keep(self.collector.state_dict()))

    def load_state_dict(self, args: dict, payload: bytes) -> None:
        state = cloudpickle.loads(payload)
        env_state.refuse(state, f"node {self.rank - 1}'s load_state_dict")  # its own pickles come from its stash only
        self.collector.load_state_dict(self.env_pickles.restore(state))

    def close(self, args: dict, payload: bytes) -> None:
        self.closing = True

    # -- the loop -------------------------------------------------------------------------------------
    def serve(self, commands: NodeInbox) -> None:
        """Serve commands (first) and owed batches until "close"."""
        while not self.closing:
            # Without credits, wait for a command (the timeout only bounds each wait).
            msg = commands.get(0 if self.credits else 1.0)
            if msg is not None:
                self.dispatch(msg)
            elif self.credits:
                self.collect_one()

    def dispatch(self, msg: P.Message) -> None:
        """Serve one command (authenticated by the inbox: MAC, session, counter)."""
        if msg.kind != "command":
            logger.error("rlcollect node %d: dropped an unexpected %r message from rank 0", self.rank, msg.kind)
            return
        name, command_id = msg["name"], msg["id"]
        try:
            result = self.handlers[name](msg["args"], msg.payload)
        except Exception as exc:  # noqa: BLE001  (reported to rank 0, which re-raises it)
            if name in self.silent:
                self._fail(exc)
            else:
                self._reply(command_id, False, None, b"", P.error_info(exc))
            return
        if name not in self.silent:
            value, payload = result if isinstance(result, tuple) else (result, b"")
            self._reply(command_id, True, value, payload, None)

    def _reply(self, command_id: int, ok: bool, value: Any, payload: bytes, error: dict | None) -> None:
        self.endpoint.send("reply", payload, id=command_id, ok=ok, value=value, error=error)

    def _fail(self, exc: BaseException) -> None:
        logger.error("rlcollect node %d: %s: %s", self.rank, type(exc).__name__, exc)
        self.endpoint.send("failed", error=P.error_info(exc))

    def collect_one(self) -> None:
        random = self.credits.popleft()
        slot = self.seq % len(self.slots)
        if self.sends[slot] is not None:  # rank 0 has taken it already: it granted this credit after
            transport.wait(self.sends[slot], self.timeout)
            self.sends[slot] = None
        version = self.collector.policy_version
        started = time.perf_counter()
        try:
            frames = self.collector.collect_into(self.slots[slot].buffer, random=random)
        except Exception as exc:  # noqa: BLE001  (rank 0 re-raises it and shuts down)
            self._fail(exc)
            self.credits.clear()
            return
        self.sends[slot] = self.pg.send([self.slots[slot].flat], P.MASTER_RANK, transport.BATCH_TAG)
        meta = self.collector.batch_info()
        self.endpoint.send(
            "ready", seq=self.seq, slot=slot, frames=frames, version=version, seconds=time.perf_counter() - started,
            **{key: meta[key] for key in ("version_min", "version_mean", "step_mean_s", "step_p95_s")})
        self.seq += 1

    def release_pair(self) -> None:
        """Free the pair group with what is still posted on it (see ``transport.release_group``)."""
        if self.pg is not None:
            self.sends = [None] * len(self.slots)  # rank 0 is gone or took them
            refs = [self.pg, *self.receives]
            self.pg, self.receives = None, []
            transport.release_group(refs, 1.0)

    def shutdown(self) -> None:
        try:
            self.collector.shutdown()
        except Exception as exc:  # noqa: BLE001  (closing on the way out must not mask the real error)
            logger.warning("rlcollect node %d: closing its collector failed: %s", self.rank, exc)


def _weight_spec(collector: Any) -> transport.WeightSpec | None:
    """Names, shapes and dtypes of the acting policy's parameters and buffers (None: none)."""
    return collector.weight_spec


# -- entry point -----------------------------------------------------------------------------------------
def _parent_watch(parent: tuple[int, str] | None) -> Any:
    """For a node whose rank 0 runs on this host (``parent``: its pid and host name): a check
    that it is still alive."""
    if parent is None or parent[1] != socket.gethostname():
        return None
    from rlcollect._pids import pid_alive

    return lambda: pid_alive(int(parent[0]))


def _orphaned(rank: int):
    def on_lost(reason: str) -> None:
        logger.error("rlcollect node %d: %s; exiting", rank, reason)
        sys.stderr.flush()
        remove_multiprocessing_temp_dir()
        os._exit(EXIT_ORPHANED)

    return on_lost


def node_secret(secret: bytes | None = None, secret_file: str | None = None) -> bytes:
    """The node's secret: ``secret`` (handed over by rank 0's launcher), else the file
    ``secret_file``, else ``$RLCOLLECT_SECRET``; raises ``SecretError`` when there is none.
    The variable is removed from the environment once read (the node's workers need not see it)."""
    from_env = os.environ.pop(SECRET_ENV, None)
    if secret is not None:
        return check_secret(secret, "rank 0's launcher")
    if secret_file:
        return read_secret_file(secret_file)
    if from_env is not None:
        return check_secret(from_env.encode(), f"${SECRET_ENV}")
    raise SecretError(f"no secret: pass --secret-file PATH (the file given to DistributedCollector(secret_file=PATH)) "
                      f"or set ${SECRET_ENV}; see docs/distributed.md, 'Trust and the wire'")


#: How long a node waits for rank 0's "welcome" on a new connection before it connects again.
_WELCOME_S = 10.0


def _recv(wire: Wire, deadline: float) -> bytes:
    """One message of at most ``MAX_ATTACH_BYTES`` before ``deadline`` (``WireClosed``
    otherwise: the connection is then useless, a message may be half read)."""
    wire.sock.settimeout(max(0.01, deadline - time.monotonic()))
    try:
        return wire.recv(MAX_ATTACH_BYTES)
    finally:
        if not wire.closed:
            wire.sock.settimeout(None)


def _hello(master_addr: str, master_port: int, keys: Keys, rank: int, world_size: int, token: str,
           deadline: float, drops: DropLog, watch: Any) -> tuple[Wire, P.Endpoint, P.Message] | None:
    """Connect to rank 0's listener, check its "welcome" (signed: the run's nonce and this
    connection's challenge), say hello (repeating both) and wait for rank 0's answer on the same
    connection (``config`` or ``reject``; rank 0 beats meanwhile: ``watch.news``; ``watch``
    starts once rank 0's port answered).  A connection that closes first (rank 0 not up yet;
    or closed among strangers' connections before the hello came) is made again until
    ``deadline``; then None."""
    while time.monotonic() < deadline:
        try:
            wire = Wire.connect(master_addr, master_port, max(0.1, min(_WELCOME_S, deadline - time.monotonic())))
        except OSError:
            time.sleep(0.2)  # rank 0 is not up (yet)
            continue
        if not watch.started:  # from now on, rank 0 has rank0_timeout to show an authentic word
            watch.start()
        try:
            welcome = P.decode(_recv(wire, min(deadline, time.monotonic() + _WELCOME_S)), keys.to_node,
                               kinds=("welcome",), to=P.EVERYONE, rank=P.MASTER_RANK)
            watch.news()
            endpoint = P.Endpoint(wire, keys.to_rank0, rank, P.MASTER_RANK, token)
            endpoint.send("hello", world_size=world_size, pid=os.getpid(), host=socket.gethostname(),
                          run=welcome.token, challenge=welcome["challenge"])
            last = 0
            while True:
                answer = P.decode(_recv(wire, deadline), keys.to_node, kinds=("beat", "config", "reject"), to=rank,
                                  rank=P.MASTER_RANK, token=token, after=last)
                last = answer.n
                watch.news()
                if answer.kind != "beat":
                    return wire, endpoint, answer
        except P.ProtocolError as err:
            hint = " (is this node's secret the run's? see --secret-file)" if isinstance(err, P.AuthError) else ""
            drops.drop("rank 0's welcome", "rank 0", f"{err}{hint}")
            wire.close()
            time.sleep(1.0)
        except WireClosed:
            wire.close()
            time.sleep(0.1)
    return None


def run_node(master_addr: str, master_port: int, rank: int, world_size: int, timeout: float = 300.0, *,
             secret: bytes | None = None, secret_file: str | None = None,
             rank0_timeout: float = RANK0_TIMEOUT_S, parent: tuple[int, str] | None = None) -> int:
    """Run node ``rank`` of a ``DistributedCollector`` whose rank 0 listens on
    ``master_addr:master_port``; returns the exit code (0 after rank 0 closed it).

    The run's secret comes from ``secret``, ``secret_file`` or ``$RLCOLLECT_SECRET`` (see
    ``node_secret``).  The node exits by itself when rank 0 is gone: its channel broke, it has
    not beaten for ``rank0_timeout`` seconds, or (``parent``: rank 0's pid and
    host, for nodes rank 0 started on its own host) its process ended."""
    if not (isinstance(world_size, int) and world_size >= 2 and isinstance(rank, int) and 1 <= rank < world_size):
        raise ValueError(f"rank must be in 1..world_size-1 (rank 0 is the DistributedCollector), got rank={rank!r} "
                         f"and world_size={world_size!r}")
    try:
        keys = Keys(node_secret(secret, secret_file))
    except SecretError as err:
        logger.error("rlcollect node %d: %s", rank, err)
        return EXIT_FAILED
    token = secrets.token_hex(16)  # this process's session
    drops = DropLog(f"rlcollect node {rank}")
    node = commands = endpoint = watcher_process = None
    deadline = time.monotonic() + timeout
    # The watch on rank 0 starts once rank 0's port answers (a node may be started before its
    # rank 0: it then waits up to ``timeout`` to reach it).
    watch = NodeWatch(rank, rank0_timeout, _orphaned(rank), _parent_watch(parent))
    try:
        said = _hello(master_addr, master_port, keys, rank, world_size, token, deadline, drops, watch)
        if said is None:
            what = "answered its hello" if watch.heard else "showed an authentic welcome (another secret?)"
            logger.error("rlcollect node %d: rank 0 at %s:%s never %s within %g s", rank, master_addr, master_port,
                         what, timeout)
            return EXIT_FAILED
        wire, endpoint, config = said
        if config.kind == "reject":
            wire.close()
            logger.error("rlcollect node %d: rank 0 refused this node: %s", rank, config["reason"])
            return EXIT_REJECTED
        commands = NodeInbox(wire, keys, rank, token, watch, last=config.n)
        store = commands.store = ChannelStore(endpoint, timeout)
        watch.attach(endpoint)
        watcher_process = watcher.start(master_addr, master_port, rank, token, keys.to_rank0)
        setup = _wait_setup(commands, deadline)
        if setup is None:
            logger.error("rlcollect node %d: rank 0 sent no configuration on its channel within %g s", rank, timeout)
            return EXIT_FAILED
        try:  # authenticated by the inbox: rank 0's own configuration
            node = Node(endpoint, rank, cloudpickle.loads(setup.payload), timeout)
        except Exception as exc:  # noqa: BLE001  (rank 0 re-raises it)
            logger.error("rlcollect node %d: building its collector failed: %s: %s", rank, type(exc).__name__, exc)
            endpoint.send("failed", error=P.error_info(exc))
            return EXIT_FAILED
        # What is alive now (torch, the envs, the policy) lives as long as the node: move it out
        # of the garbage collector's reach.  Otherwise the first full collection lands on a
        # batch in progress and scans it all (0.1-0.25 s on a loaded 2-core machine; when it
        # came during start-up or later depended on the handshake's timing).
        gc.freeze()
        address = transport.local_address_towards(master_addr, master_port)
        node.pg = transport.pair_group(store, rank, config["incarnation"], False, address, timeout)
        node.store = store  # torch holds only the C++ half of a Python store: keep this one alive
        node.say_started()
        transport.join([node.pg], False, timeout)
        logger.info("rlcollect node %d: %s collecting for rank 0 at %s:%s", rank, type(node.collector).__name__,
                    master_addr, master_port)
        node.serve(commands)
        endpoint.send("bye")
        return EXIT_OK
    except (RuntimeError, WireClosed) as err:  # the channel or a peer connection broke: rank 0 is gone
        logger.error("rlcollect node %d: lost rank 0: %s", rank, _first_line(err))
        return EXIT_ORPHANED
    finally:
        watch.stop()
        watcher.stop(watcher_process)
        if commands is not None:
            commands.close()
        if node is not None:
            node.shutdown()
            node.release_pair()


def _wait_setup(commands: NodeInbox, deadline: float) -> P.Message | None:
    """Rank 0's "setup" (the node's spec), the first message on a new channel."""
    while time.monotonic() < deadline:
        msg = commands.get(min(1.0, max(0.01, deadline - time.monotonic())))
        if msg is not None:
            if msg.kind == "setup":
                return msg
            logger.error("rlcollect node: dropped a %r message that came before its configuration", msg.kind)
    return None


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0] if text else type(err).__name__


def configure_logging(rank: Any) -> None:
    level = os.environ.get(LOG_LEVEL_ENV, "INFO").upper()
    logging.basicConfig(level=getattr(logging, level, logging.INFO), stream=sys.stderr,
                        format=f"%(asctime)s rlcollect node {rank} %(levelname)s: %(message)s")
    logging.getLogger("rlcollect").propagate = True


def main(argv: list[str] | None = None, secret: bytes | None = None) -> int:
    """``python -m rlcollect.distributed.node`` (and the "mp" launcher's bootstrap, which
    hands over ``secret``)."""
    parser = argparse.ArgumentParser(prog="python -m rlcollect.distributed.node", description="Run a distributed node.")
    add_arguments(parser)
    if secret is not None:
        os.environ[SECRET_ENV] = secret.decode()  # read (and removed) by node_arguments / run_node
    try:
        kwargs = node_arguments(parser.parse_args(argv))
    except ValueError as err:
        parser.error(str(err))
    configure_logging(kwargs["rank"])
    return run_node(**kwargs)


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip the interpreter's teardown (a final walk over torch's objects that takes seconds on
    # a loaded machine while rank 0 waits for this exit); everything was closed above. All but
    # the removal of multiprocessing's temp folder (a multi-process inner collector made one).
    remove_multiprocessing_temp_dir()
    os._exit(code)
