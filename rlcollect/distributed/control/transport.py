"""Where a batch crosses the process (and host) boundary: the gloo pair process groups (their
rendezvous store), the flat batch buffers and the packing of weights.

A batch travels as one flat ``uint8`` tensor (one point-to-point message, whatever the number of
fields), carved into typed fields exactly as the multi-process shared-memory slots are
(``rlcollect.data.carve``), so both sides view the same bytes as the same
``BatchLayout``.  Rank 0 allocates its receive buffers from the layout each node reports; it
never builds an env.

Batches and weights travel on private two-rank ``ProcessGroupGloo`` groups, one between rank 0
(rank 0 of the pair) and each node (rank 1 of the pair), not on torch.distributed's default group
(a trainer may use torch.distributed for itself).  Nodes never talk to each other, and a pair of
its own per node isolates failures: a node that dies breaks only its own pair, and a node
relaunched after a failure joins a new pair (a new store prefix per incarnation) while the other
nodes keep sending on theirs.  Their rendezvous keys live in rank 0's memory (``pair_store``),
which nodes reach through their authenticated channel: rank 0 hosts no store server.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import ipaddress
import logging
import socket
import threading
import time
from typing import Any

import torch
from torch.distributed import HashStore, PrefixStore, ProcessGroupGloo

from rlcollect.data import BatchBuffer, BatchLayout, carve, field_bytes
from rlcollect.distributed.control import pair_ports
from rlcollect.distributed.control.protocol import MASTER_RANK, pg_prefix

logger = logging.getLogger("rlcollect")

BATCH_TAG = 1
WEIGHTS_TAG = 2
JOIN_TAG = 3
_ALIGN = 64


def _seconds(value: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=float(value))


def resolve(host: str) -> str:
    """The numeric address of ``host`` (IPv4 preferred)."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except socket.gaierror as err:
        raise ValueError(f"cannot resolve host {host!r}: {err}") from None
    infos.sort(key=lambda info: info[0] != socket.AF_INET)
    return infos[0][4][0]


def default_host_address() -> str:
    """This host's address as other hosts see it: the name's address, or failing that the
    source address of the default route; loopback as a last resort."""
    try:
        address = resolve(socket.gethostname())
        if not ipaddress.ip_address(address).is_loopback:
            return address
    except ValueError:
        pass
    try:
        return local_address_towards("192.0.2.1", 9)  # TEST-NET-1: never contacted, only routed
    except OSError:
        logger.warning("rlcollect: could not find this host's network address; using 127.0.0.1")
        return "127.0.0.1"


def local_address_towards(host: str, port: int) -> str:
    """The local address this host uses to reach ``host`` (connecting a UDP socket sends
    nothing; it only picks the route)."""
    address = resolve(host)
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((address, port or 9))
        return probe.getsockname()[0]


# -- the pair groups' store ----------------------------------------------------------------------
def pair_store() -> HashStore:
    """Rank 0's in-process store of the pair groups' rendezvous keys: rank 0's side uses it
    directly, the nodes through their channel (``channel_store.py``); no port is opened for it."""
    return HashStore()


#: The soft limit of open files rank 0 raises itself to (within the hard limit) when it listens.
FD_LIMIT = 65536


def raise_fd_limit(target: int = FD_LIMIT) -> None:
    """Raise this process's soft limit of open files towards ``target`` (never above the hard
    limit, never lower): room for many nodes' channels and pair groups.  Strangers' connections
    cannot take it (the listener holds at most ``wire.MAX_PENDING`` of them), so a hard limit
    that cannot be raised is no weakness."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = target if hard == resource.RLIM_INFINITY else min(target, hard)
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            logger.debug("rlcollect: raised the open-files limit from %d to %d", soft, want)
        except (ValueError, OSError) as err:
            logger.warning("rlcollect: could not raise the open-files limit from %d: %s", soft, err)


# -- the process groups --------------------------------------------------------------------------
#: The node's rank in its pair group with rank 0 (rank 0 is ``MASTER_RANK`` there too).
NODE_IN_PAIR = 1


#: gloo listeners of pair groups made here and not joined yet (``(fd, inode)``).
_UNSEALED: list[tuple[int, int]] = []


def pair_group(store: Any, node_rank: int, incarnation: int, master: bool, address: str,
               timeout: float) -> ProcessGroupGloo:
    """The gloo group of rank 0 and one incarnation of node ``node_rank`` (``master``: rank 0's
    side), its sockets bound to ``address``; the pair connects on first use (see ``join``, which
    then closes the group's listener: ``pair_ports.py``)."""
    options = ProcessGroupGloo._Options()
    options._timeout = _seconds(timeout)
    options._threads = 1  # point-to-point only: no collective needs worker threads
    own_rank = MASTER_RANK if master else NODE_IN_PAIR
    before = pair_ports.before()
    options._devices = [ProcessGroupGloo.create_device(hostname=address, lazy_init=True)]
    pg = ProcessGroupGloo(PrefixStore(pg_prefix(node_rank, incarnation), store), own_rank, 2, options)
    # gloo's listener of this pair: closed once the pair connected (``join``).
    _UNSEALED.extend(pair_ports.made_since(before, address))
    return pg


def join(groups: list[ProcessGroupGloo], master: bool, timeout: float) -> None:
    """Connect pair ``groups`` (each side calls this for the other): one byte each way.  A
    lazily connected gloo pair only completes its connection once both sides have used it, so
    without this a node's first batch would wait for a receive that rank 0 only posts after that
    batch is announced.  It also proves, at start-up, that the data path works (a firewall, a
    wrong interface) rather than at the first batch."""
    peer = NODE_IN_PAIR if master else MASTER_RANK
    sends = [pg.send([torch.ones(1, dtype=torch.uint8)], peer, JOIN_TAG) for pg in groups]
    received = [torch.zeros(1, dtype=torch.uint8) for _ in groups]
    recvs = [pg.recv([buf], peer, JOIN_TAG) for buf, pg in zip(received, groups)]
    made = _UNSEALED[:]
    _UNSEALED.clear()  # (a group whose join failed is freed: its listener goes with it)
    for work in (*sends, *recvs):
        wait(work, timeout)
    for fd, inode in made:  # connected: their peers came, nobody else may (see pair_ports.py)
        pair_ports.seal(fd, inode)


def post_recv(pg: Any, flat: torch.Tensor, peer: int, tag: int, pending: list) -> Any:
    """Post a receive of ``flat`` from ``peer`` on ``pg`` and return its work, which is also
    appended to ``pending`` (the caller removes it once it finished; ``release_group`` frees
    whatever is left).  The append happens inside one C call (``list.extend`` over ``map``), so no
    ``KeyboardInterrupt`` can land between posting the receive and keeping it: a receive dropped
    while its bytes arrive leaves them unread in the socket, and gloo then never ends the group's
    event loop (see ``release_group``)."""
    pending.extend(map(functools.partial(pg.recv, [flat], peer), (tag,)))
    return pending[-1]


#: How long ``release_group`` waits for a group to be freed before leaving it to a thread.
RELEASE_S = 2.0


def release_group(refs: list, timeout: float) -> bool:
    """Free a pair group and the operations posted on it.  ``refs`` is ``[pg, *works]`` and
    holds the only references left (it is emptied here).  Call it once the peer is stopped or
    told to close.

    gloo frees a lazily connected group by running its event loop until no socket has anything
    left to read; bytes that arrived for a receive whose work was already freed are never read, so
    that loop, and the thread freeing the group, never ended (rank 0 hung for good after a Ctrl-C
    that landed during a batch's receive).  So the receives still posted are first given up to
    ``timeout`` seconds to finish (a stopped peer fails them at once; a live one completes what it
    was sending), and the freeing happens in a daemon thread waited for up to ``RELEASE_S``, the
    group last (its destructor releases the GIL): should gloo still hang, the process does not.
    Returns whether the group was freed in time."""
    _finish(refs[1:], time.monotonic() + max(0.0, timeout))
    with contextlib.suppress(Exception):  # a group whose peer died may refuse; it is freed anyway
        refs[0].shutdown()
    # The works first, the group last: the group's destructor (which ends gloo's loop) runs
    # without the GIL; the last work's, if it ended the loop, would hold the GIL while it waits.
    box = [*refs[1:], refs[0]]
    refs.clear()
    freer = threading.Thread(target=_free_in_order, args=(box,), name="rlcollect-free-group", daemon=True)
    del box
    freer.start()
    freer.join(RELEASE_S)
    if freer.is_alive():
        logger.warning("rlcollect: a pair group still has unread bytes after %.0f s; it is left to a "
                       "background thread (its gloo loop runs until they are read)", RELEASE_S)
        return False
    return True


def _free_in_order(box: list) -> None:
    while box:
        del box[0]


def _finish(works: list, deadline: float) -> None:
    for work in works:
        with contextlib.suppress(Exception):
            wait(work, max(0.001, deadline - time.monotonic()))


def wait(work: Any, timeout: float) -> None:
    """Wait for a point-to-point operation; gloo raises if the peer's connection breaks, and
    on ``timeout`` (seconds)."""
    work.wait(_seconds(timeout))


def transfer_timeout(nbytes: int) -> float:
    """How long moving ``nbytes`` that the sender has already posted may take: generous for a
    slow network, short enough that a peer frozen mid-send is reported within seconds."""
    return 10.0 + nbytes / 20e6


# -- flat batch buffers --------------------------------------------------------------------------
class FlatBatch:
    """One batch of ``layout`` in a single flat ``uint8`` tensor (what travels) and its typed
    ``BatchBuffer`` view (what the rollout fills and rank 0 reads)."""

    def __init__(self, layout: BatchLayout):
        self.layout = layout
        # shm's carving, so that a batch has the same bytes here and in a worker's slot.
        _, nbytes = field_bytes(layout)
        self.flat = torch.zeros(nbytes, dtype=torch.uint8)
        self.buffer = BatchBuffer(layout, tensors=carve(self.flat, layout))

    @property
    def nbytes(self) -> int:
        return self.flat.numel()


# -- weights -------------------------------------------------------------------------------------
WeightSpec = dict[str, tuple[tuple[int, ...], torch.dtype]]


def _weight_offsets(spec: WeightSpec) -> tuple[list[tuple[str, int, int]], int]:
    out, offset = [], 0
    for name, (shape, dtype) in spec.items():
        nbytes = int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
        out.append((name, offset, nbytes))
        offset += (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN
    return out, offset


def weights_nbytes(spec: WeightSpec) -> int:
    return _weight_offsets(spec)[1]


def pack_weights(state: dict[str, torch.Tensor], spec: WeightSpec) -> torch.Tensor:
    """``state`` as one flat ``uint8`` CPU tensor laid out as ``spec`` (the node's own
    parameters and buffers: names, shapes, dtypes); raises ``ValueError`` naming what does not
    fit."""
    unknown, missing = sorted(set(state) - set(spec)), sorted(set(spec) - set(state))
    wrong = [f"{k}: got {tuple(state[k].shape)}, the nodes' policy has {spec[k][0]}"
             for k in spec if k in state and tuple(state[k].shape) != tuple(spec[k][0])]
    if unknown or missing or wrong:
        raise ValueError(f"the weights do not fit the nodes' policy: unexpected {unknown}, missing {missing}, "
                         f"wrong shapes {wrong}")
    offsets, total = _weight_offsets(spec)
    flat = torch.zeros(total, dtype=torch.uint8)
    with torch.no_grad():
        for name, offset, nbytes in offsets:
            shape, dtype = spec[name]
            flat[offset:offset + nbytes].view(dtype).view(shape).copy_(state[name])
    return flat


def unpack_weights(flat: torch.Tensor, spec: WeightSpec) -> dict[str, torch.Tensor]:
    """The ``{name: tensor}`` views of a flat weights tensor."""
    offsets, _ = _weight_offsets(spec)
    return {name: flat[offset:offset + nbytes].view(spec[name][1]).view(spec[name][0])
            for name, offset, nbytes in offsets}
