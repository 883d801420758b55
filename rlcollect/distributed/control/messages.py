"""The control messages of a distributed run, framed and signed: ``encode``, ``decode`` (MAC
first, then the header), their kinds and fields (``SCHEMAS``), the commands a node serves
(``COMMANDS``), and ``Endpoint``, one side of a channel (``wire.py``) signing what it sends
with a growing counter.

Only the standard library and ``auth.py`` are imported here: a node's watcher uses this module
without importing torch.  ``protocol.py`` re-exports every name (``P.encode``, ...).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from rlcollect.distributed.control import auth

PROTOCOL_VERSION = 6  # 6: no store; the hello and the pair groups' rendezvous travel on the channel too
MAGIC = b"RLC:"

# -- message formats -------------------------------------------------------------------------------
_NONE = type(None)
_NUMBER = (int, float)
#: The header fields of each kind of message, and the types they must have.
SCHEMAS: dict[str, dict[str, Any]] = {
    "beat": {},
    # Rank 0's first message on every connection to its listener (its token: the run's nonce):
    # a fresh challenge, which the connection's first message must repeat (a replay on another
    # connection is refused).
    "welcome": {"challenge": str},
    # A node's first message on its connection (its channel from then on).
    "hello": {"world_size": int, "pid": int, "host": str, "run": str, "challenge": str},
    # Rank 0's answer to a hello, on the same connection.
    "config": {"node_index": int, "incarnation": int},
    # A watcher's first message on its connection ("watch": the only role left).
    "attach": {"role": str, "challenge": str},
    "setup": {},  # payload: the cloudpickled node spec
    "state": {"state": str, "pid": int},  # a watcher's report of its node process (/proc state letter)
    "reject": {"reason": str},
    "started": {"layout": dict, "weights": (dict, _NONE), "pid": int, "host": str},
    "failed": {"error": dict},
    "command": {"id": int, "name": str, "args": dict},  # payload: see COMMANDS
    "reply": {"id": int, "ok": bool, "value": object, "error": (dict, _NONE)},  # payload: loads_data
    # version: the node's weights version when it started the batch; version_min/_mean: its
    # frames' (rlcollect/metrics.py); step_*_s: the node's env-step latency (None: not yet known)
    "ready": {"seq": int, "slot": int, "frames": int, "version": int, "seconds": _NUMBER, "version_min": int,
              "version_mean": _NUMBER, "step_mean_s": (*_NUMBER, _NONE), "step_p95_s": (*_NUMBER, _NONE)},
    "bye": {},
    # The pair group's rendezvous (``channel_store.py``): a node's store call ("set", "get" or
    # "check"; payload: the value set) and rank 0's answer (payload: the value got).
    "store": {"id": int, "op": str, "keys": list},
    "stored": {"id": int, "found": bool},
}
#: Commands a node serves, with the arguments each takes (node.py has the handlers).
COMMANDS: dict[str, dict[str, Any]] = {
    "collect": {"credits": int, "random": bool},  # collect this many batches, each answered by "ready"
    "weights": {"version": int, "nbytes": int},  # then receive the packed weights on the process group
    "seed": {"seed": int, "static_seed": bool},
    "reset": {},
    "state_dict": {},
    "load_state_dict": {},  # payload: the cloudpickled state
    "close": {},
}
#: Rank 0 is the collector; nodes are ranks 1..world_size-1.
MASTER_RANK = 0
#: The receiver of what rank 0 says to whoever connects (its "welcome").
EVERYONE = -1


class ProtocolError(ValueError):
    """A control message that is malformed, of another protocol version or run, or from a
    rank that has no business sending it."""


class AuthError(ProtocolError):
    """A message whose MAC does not verify: forged, corrupted, or signed with another secret."""


@dataclass
class Message:
    kind: str
    rank: int
    token: str = ""
    fields: dict[str, Any] = field(default_factory=dict)
    payload: bytes = b""
    n: int = 0  # the session's message counter
    to: int = 0

    def __getitem__(self, name: str) -> Any:
        return self.fields[name]


def encode(kind: str, rank: int, key: bytes, token: str, n: int, payload: bytes = b"", *, to: int,
           **fields: Any) -> bytes:
    """Sign and frame one message from ``rank`` to ``to`` (``key``: the direction's key)."""
    if kind not in SCHEMAS:
        raise ValueError(f"unknown message kind {kind!r}; known: {sorted(SCHEMAS)}")
    header = {"v": PROTOCOL_VERSION, "kind": kind, "rank": rank, "to": to, "token": token, "n": n, **fields}
    body = json.dumps(header, separators=(",", ":")).encode() + b"\n" + payload
    return MAGIC + auth.mac(key, body) + body


def claimed_sender(data: Any) -> str:
    """Who an (unauthenticated) message says it is from, for the log only: never trusted."""
    try:
        head = bytes(data[len(MAGIC) + auth.MAC_BYTES:]).partition(b"\n")[0]
        rank = json.loads(head[:4096]).get("rank")
        return f"rank {rank}" if isinstance(rank, int) and not isinstance(rank, bool) else "an unknown sender"
    except Exception:  # noqa: BLE001  (anything goes in a foreign message)
        return "an unknown sender"


def _is(value: Any, expected: Any) -> bool:
    if expected is object:
        return True
    kinds = expected if isinstance(expected, tuple) else (expected,)
    if isinstance(value, bool) and bool not in kinds:
        return False  # json's true is not an int here
    return isinstance(value, kinds)


def decode(data: Any, key: bytes, *, kinds: tuple[str, ...], to: int, rank: int | None = None,
           ranks: range | None = None, token: str | None = None, after: int | None = None) -> Message:
    """Authenticate, parse and check one message.  ``key``: the direction's key; ``kinds``:
    the kinds acceptable here; ``to``: this receiver's rank; ``rank``: the only sender
    acceptable, or ``ranks``: the senders acceptable; ``token``: the session expected;
    ``after``: the last counter taken from that session (a counter not above it is a replay)."""
    if not isinstance(data, (bytes, bytearray)) or not data.startswith(MAGIC):
        raise ProtocolError(f"not an rlcollect message (no {MAGIC!r} prefix): {bytes(data[:40])!r}")
    data = bytes(data)
    tag, body = data[len(MAGIC):len(MAGIC) + auth.MAC_BYTES], data[len(MAGIC) + auth.MAC_BYTES:]
    if len(tag) != auth.MAC_BYTES or not auth.verify(key, tag, body):
        raise AuthError("its MAC does not verify (forged, corrupted, or signed without this run's secret)")
    head, sep, payload = body.partition(b"\n")
    if not sep:
        raise ProtocolError("message has no header terminator")
    try:
        header = json.loads(head)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ProtocolError(f"message header is not JSON: {err}") from None
    if not isinstance(header, dict):
        raise ProtocolError(f"message header is not a JSON object: {head[:80]!r}")
    if header.get("v") != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {header.get('v')!r}, expected {PROTOCOL_VERSION} "
                            "(rank 0 and the node run different rlcollect versions)")
    kind, sender, receiver, counter = header.get("kind"), header.get("rank"), header.get("to"), header.get("n")
    if kind not in kinds:
        raise ProtocolError(f"unexpected message kind {kind!r} here; expected one of {list(kinds)}")
    if not _is(sender, int):
        raise ProtocolError(f"message has no integer sender rank: {sender!r}")
    if receiver != to:
        raise ProtocolError(f"{kind!r} message from rank {sender} is addressed to rank {receiver!r}, not {to}")
    if not _is(counter, int) or not isinstance(header.get("token"), str):
        raise ProtocolError(f"{kind!r} message from rank {sender} has no session token and counter")
    if rank is not None and sender != rank:
        raise ProtocolError(f"{kind!r} message from rank {sender}, expected rank {rank}")
    if ranks is not None and sender not in ranks:
        raise ProtocolError(f"{kind!r} message from unknown rank {sender} (known: {ranks.start}..{ranks.stop - 1})")
    if token is not None and header["token"] != token:
        raise ProtocolError(f"{kind!r} message from rank {sender} belongs to another session (run or incarnation)")
    if after is not None and counter <= after:
        raise ProtocolError(f"{kind!r} message from rank {sender} is a replay (counter {counter}, already at {after})")
    fields = {}
    for name, expected in SCHEMAS[kind].items():
        if name not in header or not _is(header[name], expected):
            raise ProtocolError(f"{kind!r} message from rank {sender}: field {name!r} missing or not "
                                f"{getattr(expected, '__name__', expected)}: {header.get(name)!r}")
        fields[name] = header[name]
    if kind == "command":
        check_command(fields["name"], fields["args"])
    return Message(kind, sender, header["token"], fields, payload, counter, receiver)


def unverified_challenge(data: Any) -> str:
    """The challenge of a "welcome" without checking its MAC (a watcher, which holds only the
    key it signs with, repeats it in its signed "attach"; the challenge is no secret).  Raises
    ``ProtocolError`` when there is none."""
    try:
        head = bytes(data[len(MAGIC) + auth.MAC_BYTES:]).partition(b"\n")[0]
        header = json.loads(head)
        challenge = header["challenge"] if header.get("kind") == "welcome" else None
    except Exception:  # noqa: BLE001  (anything goes in an unverified message)
        challenge = None
    if not isinstance(challenge, str):
        raise ProtocolError("rank 0's first message is not a welcome")
    return challenge


def check_command(name: str, args: dict) -> None:
    schema = COMMANDS.get(name)
    if schema is None:
        raise ProtocolError(f"unknown command {name!r}; known: {sorted(COMMANDS)}")
    if set(args) != set(schema) or not all(_is(args[k], t) for k, t in schema.items()):
        raise ProtocolError(f"command {name!r} takes {{{', '.join(f'{k}: {t.__name__}' for k, t in schema.items())}}}, "
                            f"got {args!r}")



class Endpoint:
    """One side of a channel: ``wire`` (a ``wire.Wire``), what this side signs with (``key``,
    its ``rank``, the peer ``to``, the session ``token``), and the counter of the last
    message sent (each message carries the next one, assigned under the wire's lock so that
    the counters grow in the order the peer receives them).

    Example (needs a peer)::

        endpoint = Endpoint(Wire.connect(host, port, 30.0), keys.to_rank0, rank, MASTER_RANK, token)
        endpoint.send("attach", role="node")
    """

    def __init__(self, wire: Any, key: bytes, rank: int, to: int, token: str, sent: int = 0):
        self.wire, self.key, self.rank, self.to, self.token, self.sent = wire, key, rank, to, token, sent

    def _make(self, kind: str, payload: bytes, fields: dict) -> Any:
        def make() -> bytes:
            self.sent += 1
            return encode(kind, self.rank, self.key, self.token, self.sent, payload, to=self.to, **fields)

        return make

    def send(self, kind: str, payload: bytes = b"", timeout: float | None = None, **fields: Any) -> None:
        """Sign and send one message (``wire.WireClosed`` if the connection is broken)."""
        self.wire.send(self._make(kind, payload, fields), timeout)

    def try_send(self, kind: str, **fields: Any) -> bool:
        """Send a small message only if that cannot wait (a heartbeat)."""
        return self.wire.try_send(self._make(kind, b"", fields))

    def close(self) -> None:
        self.wire.close()
