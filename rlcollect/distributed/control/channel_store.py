"""The pair groups' rendezvous over each node's channel, so that rank 0 exposes no store port.

gloo's rendezvous needs a ``torch.distributed.Store``: each side of a pair writes its address
under a key and reads the other's.  Rank 0 keeps the keys in an in-process ``HashStore`` (its
own pair groups use it directly, wrapped in a ``PrefixStore`` per node incarnation); a node's
side is ``ChannelStore``, a ``Store`` whose calls travel as "store" messages on the node's
channel (signed, counted and checked like every message) and are answered by ``StoreServer``
in the channel's reader thread on rank 0.

What torch 2.13's ``ProcessGroupGloo`` calls (measured: tests/distributed/
test_channel_store.py): ``clone`` at construction, ``set`` of its own address, then, when the
lazily connected pair is first used, ``wait`` for the peer's key and ``get`` of it, in the
thread that posts the operation.  ``has_extended_api`` is left False, so gloo never calls
``multi_get``/``multi_set``/``append``; the other calls raise.  A node can only touch its own
incarnation's keys (under its ``pg_prefix``), at most ``MAX_KEYS`` of at most ``MAX_VALUE``
bytes.
"""

from __future__ import annotations

import datetime
import threading
import time
from typing import Any

import torch.distributed as dist

from rlcollect.distributed.control import protocol as P

#: Keys one node incarnation may set on rank 0 (gloo sets one per pair).
MAX_KEYS = 16
#: The longest key and value a node may set (gloo's address is about 150 bytes).
MAX_KEY = 256
MAX_VALUE = 4096
#: How often a node's ``wait`` asks whether the keys are there.
_POLL_S = 0.01


def full_key(rank: int, incarnation: int, key: str) -> str:
    """What a ``PrefixStore`` of ``pg_prefix`` (both sides' pair groups use one) makes of
    gloo's ``key``."""
    return f"{P.pg_prefix(rank, incarnation)}/{key}"


class StoreServer:
    """Rank 0's side: serves nodes' "store" messages from ``store`` (a ``HashStore``)."""

    def __init__(self, store: Any):
        self.store = store
        self._lock = threading.Lock()
        self._keys: dict[tuple[int, int], set[str]] = {}

    def serve(self, rank: int, incarnation: int, msg: P.Message) -> tuple[bool, bytes]:
        """``(found, value)`` for one authenticated "store" message of node ``rank``'s
        ``incarnation``; raises ``ProtocolError`` for a call a node has no business making."""
        op, keys = msg["op"], msg["keys"]
        prefix = P.pg_prefix(rank, incarnation)
        if not keys or len(keys) > MAX_KEYS or not all(isinstance(k, str) and len(k) <= MAX_KEY for k in keys):
            raise P.ProtocolError(f"a store call needs 1..{MAX_KEYS} keys of at most {MAX_KEY} characters")
        if not all(k.startswith(prefix) for k in keys):
            raise P.ProtocolError(f"a store call outside its own pair group's keys ({prefix}...): {keys[:4]}")
        full = list(keys)
        if op == "set":
            if len(keys) != 1 or len(msg.payload) > MAX_VALUE:
                raise P.ProtocolError(f"a store set takes one key and at most {MAX_VALUE} bytes")
            with self._lock:
                mine = self._keys.setdefault((rank, incarnation), set())
                if full[0] not in mine and len(mine) >= MAX_KEYS:
                    raise P.ProtocolError(f"node rank {rank} set more than {MAX_KEYS} store keys")
                mine.add(full[0])
            self.store.set(full[0], msg.payload)
            return True, b""
        if op == "check":
            return bool(self.store.check(full)), b""
        if op == "get":
            if len(keys) != 1:
                raise P.ProtocolError("a store get takes one key")
            if not self.store.check(full):
                return False, b""
            return True, bytes(self.store.get(full[0]))
        raise P.ProtocolError(f"unknown store call {op!r} (set, get, check)")

    def forget(self, rank: int, incarnation: int) -> None:
        """Delete what node ``rank``'s ``incarnation`` and rank 0's side of its pair set."""
        with self._lock:
            mine = self._keys.pop((rank, incarnation), set())
        for key in mine | {full_key(rank, incarnation, f"0/{P.MASTER_RANK}")}:
            try:
                self.store.delete_key(key)
            except Exception:  # noqa: BLE001  (a key never set)
                pass


class ChannelStore(dist.Store):
    """A node's store: each call is a "store" message to rank 0 on ``endpoint`` (this node's
    channel) and waits up to ``timeout`` seconds for the answer, which the node's inbox hands
    to ``deliver`` (from its reader thread).  Keep a reference for as long as the pair group
    lives: torch holds only the C++ half of a Python store."""

    def __init__(self, endpoint: Any, timeout: float):
        super().__init__()
        self.endpoint, self.call_timeout = endpoint, timeout
        self._lock = threading.Lock()
        self._next = 0
        self._answers: dict[int, P.Message | None] = {}
        self._arrived = threading.Condition(self._lock)
        self.closed: str | None = None

    # -- what the inbox calls ------------------------------------------------------------------------
    def deliver(self, msg: P.Message) -> None:
        with self._lock:
            if msg["id"] in self._answers:
                self._answers[msg["id"]] = msg
                self._arrived.notify_all()

    def lost(self, why: str) -> None:
        """The channel closed: every call waiting fails."""
        with self._lock:
            self.closed = why
            self._arrived.notify_all()

    def _call(self, op: str, keys: list[str], value: bytes = b"") -> P.Message:
        with self._lock:
            self._next += 1
            call = self._next
            self._answers[call] = None
        try:
            self.endpoint.send("store", value, id=call, op=op, keys=keys)
            deadline = time.monotonic() + self.call_timeout
            with self._lock:
                while self._answers[call] is None:
                    left = deadline - time.monotonic()
                    if self.closed is not None:
                        raise RuntimeError(f"rank 0's channel closed during a store {op}: {self.closed}")
                    if left <= 0:
                        raise RuntimeError(f"rank 0 did not answer a store {op} of {keys} within "
                                           f"{self.call_timeout:g} s")
                    self._arrived.wait(min(left, 1.0))
                return self._answers[call]
        finally:
            with self._lock:
                self._answers.pop(call, None)

    # -- torch.distributed.Store -----------------------------------------------------------------------
    def set(self, key: str, value: Any) -> None:
        self._call("set", [key], bytes(value.encode() if isinstance(value, str) else value))

    def check(self, keys: list[str]) -> bool:
        return bool(self._call("check", list(keys))["found"])

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        limit = self.call_timeout if timeout is None else timeout.total_seconds()
        deadline = time.monotonic() + limit
        while not self.check(keys):
            if time.monotonic() > deadline:
                raise RuntimeError(f"rank 0's side of the pair group did not show up in the store within "
                                   f"{limit:g} s (keys {list(keys)})")
            time.sleep(_POLL_S)

    def get(self, key: str) -> bytes:
        self.wait([key])
        answer = self._call("get", [key])
        if not answer["found"]:
            raise RuntimeError(f"store key {key!r} vanished on rank 0")
        return answer.payload

    def clone(self) -> ChannelStore:
        return self

    def _unsupported(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("rlcollect's channel store serves gloo's rendezvous only (set, get, check, wait)")

    add = compare_set = delete_key = num_keys = _unsupported
