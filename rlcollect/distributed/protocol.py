"""The control protocol between rank 0 and its nodes: store keys and message formats.

Every control message travels through the TCPStore that rank 0 hosts; batches and weights
travel over torch.distributed point-to-point (see ``transport.py``).

A message is ``MAGIC + MAC + JSON header + b"\\n" + payload``: ``MAC`` is an HMAC-SHA256, with
the key of its direction (``auth.Keys``), over everything after it.  ``decode`` checks the MAC
*first* (``hmac.compare_digest``) and parses nothing of a message that fails it; then the header:
``v`` (``PROTOCOL_VERSION``), ``kind``, ``rank`` (the sender), ``to`` (the receiver), ``token``
(the session: a random string a node draws per process, bound to the run at its hello) and ``n``
(the session's message counter, which the receiver requires to grow: a replayed message is
refused), plus the fields ``SCHEMAS`` lists for its kind.  Any failure raises ``ProtocolError``;
the receiver logs it (once per sender) and drops the message, so a forged, replayed, malformed
or foreign message is never acted upon, and nothing a node receives is unpickled before its MAC
was checked.

Trust runs one way.  Nodes execute what rank 0 sends (the cloudpickled env factory, policy and
options: the main process is trusted by its nodes, once authenticated).  Rank 0 never unpickles
freely what a node sends: headers are JSON, and the few payloads that need more (a node's
``state_dict``) go through ``loads_data``, an unpickler that only rebuilds containers, numbers,
strings, numpy arrays and tensors.

Flow: rank 0 beats on ``heartbeat_key(0)`` (its token is the run's nonce); a node beats on its
own key with its session token, reads two of rank 0's beats to learn the run nonce, and says
``hello`` (carrying the nonce, so a hello from another run is refused); rank 0 answers on
``config_key(rank, token)`` with ``config`` (its incarnation: 0, then 1, 2, ... for a node
relaunched after a failure) or ``reject``; the node builds its collector and says ``started``
(with its batch layout and weight shapes) or ``failed``.  Then rank 0 pushes ``command``
messages on the node's command queue, and the node answers on rank 0's inbox queue: a
``reply`` to each command, except ``collect``, answered by a ``ready`` notice per batch (sent
after the batch itself was posted on the process group), and ``weights``; any failure outside a
reply is a ``failed`` message.  A node that leaves after "close" sets its ``bye`` key.
"""

from __future__ import annotations

import io
import json
import pickle
import traceback
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from rlcollect.distributed import auth

PROTOCOL_VERSION = 4  # 4: batch notices carry their frames' versions and the env-step latency
MAGIC = b"RLC:"

# -- store keys ------------------------------------------------------------------------------------
_ROOT = "rlc"
#: Everything nodes send rank 0 once started: replies, batch notices, failures.
INBOX = f"{_ROOT}/inbox"


def hello_key(rank: int) -> str:
    return f"{_ROOT}/hello/{rank}"


def config_key(rank: int, token: str) -> str:
    """Where rank 0 answers the hello of node ``rank``'s session ``token``."""
    return f"{_ROOT}/config/{rank}/{token}"


def started_key(rank: int) -> str:
    return f"{_ROOT}/started/{rank}"


def command_queue(rank: int) -> str:
    return f"{_ROOT}/cmd/{rank}"


def heartbeat_key(rank: int) -> str:
    return f"{_ROOT}/hb/{rank}"


def bye_key(rank: int) -> str:
    return f"{_ROOT}/bye/{rank}"


def refused_key(rank: int, token: str) -> str:
    """Where a refused node acknowledges its refusal (rank 0 waits for it before it exits)."""
    return f"{_ROOT}/refused/{rank}/{token}"


def pg_prefix(rank: int, incarnation: int) -> str:
    """The store prefix of the process group between rank 0 and one incarnation of a node."""
    return f"{_ROOT}/pg/{rank}/{incarnation}/"


def incarnation_keys(rank: int) -> list[str]:
    """What one incarnation of node ``rank`` leaves in the store: cleared before a relaunch so
    that the new process can say hello afresh (its answer key is per session: see ``config_key``)."""
    return [hello_key(rank), started_key(rank), bye_key(rank), heartbeat_key(rank), command_queue(rank)]


# -- message formats -------------------------------------------------------------------------------
_NONE = type(None)
_NUMBER = (int, float)
#: The header fields of each kind of message, and the types they must have.
SCHEMAS: dict[str, dict[str, Any]] = {
    "beat": {},
    "hello": {"world_size": int, "pid": int, "host": str, "run": str},
    "config": {"node_index": int, "incarnation": int},  # payload: the cloudpickled node spec
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


def check_command(name: str, args: dict) -> None:
    schema = COMMANDS.get(name)
    if schema is None:
        raise ProtocolError(f"unknown command {name!r}; known: {sorted(COMMANDS)}")
    if set(args) != set(schema) or not all(_is(args[k], t) for k, t in schema.items()):
        raise ProtocolError(f"command {name!r} takes {{{', '.join(f'{k}: {t.__name__}' for k, t in schema.items())}}}, "
                            f"got {args!r}")


# -- errors ----------------------------------------------------------------------------------------
def error_info(exc: BaseException) -> dict[str, str]:
    """What a node sends back about an exception: JSON only."""
    return {"type": f"{type(exc).__module__}.{type(exc).__qualname__}", "message": str(exc),
            "traceback": "".join(traceback.format_exception(exc))}


def mark_failed(err: BaseException, node_index: int) -> BaseException:
    """Mark ``err`` as the failure of node ``node_index`` (its process died, it went silent, or
    its collection raised): what ``on_node_failure`` acts on.  Errors of commands (a bad
    ``load_state_dict``, say) are not marked: they are raised whatever the policy."""
    err.failed_node = node_index
    return err


def rebuild_error(info: dict, node_index: int, context: str) -> BaseException:
    """The exception rank 0 raises for a node's ``error_info``: the original type when that
    type is already loaded in this process (nothing is imported on a node's say-so) and takes
    a message, else ``WorkerError``; the node's traceback is in the message."""
    import sys

    from rlcollect.errors import WorkerError

    type_name, message = str(info.get("type", "?")), str(info.get("message", ""))
    tb = str(info.get("traceback", ""))
    text = f"{message}\n\n[node {node_index}, during {context}; its traceback:]\n{tb}"
    module, _, qualname = type_name.rpartition(".")
    cls = getattr(sys.modules.get(module), qualname, None) if "." not in qualname else None
    if isinstance(cls, type) and issubclass(cls, Exception) and cls is not WorkerError:
        try:
            exc = cls(text)
        except Exception:  # noqa: BLE001  (a constructor with other arguments)
            exc = None
        if type(exc) is cls:
            exc.node_index = exc.worker_index = node_index
            exc.worker_traceback = tb
            return exc
    err = WorkerError(f"node {node_index} raised {type_name}: {text}", node_index, None, tb)
    err.node_index = node_index
    return err


# -- batch layouts and weight shapes (JSON) ----------------------------------------------------------
def _dtype(name: Any) -> np.dtype:
    try:
        dtype = np.dtype(name)
    except TypeError:
        raise ProtocolError(f"unknown dtype {name!r}") from None
    if dtype.kind not in "biufc":
        raise ProtocolError(f"dtype {name!r} is not a plain number type")
    return dtype


def _shape(value: Any) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(_is(v, int) and v >= 0 for v in value):
        raise ProtocolError(f"a shape must be a list of non-negative ints, got {value!r}")
    return tuple(value)


def layout_to_json(layout: Any) -> dict:
    return {
        "fields": [[list(k) if isinstance(k, tuple) else k, list(s.shape), s.dtype.str]
                   for k, s in layout.fields.items()],
        "batch_size": list(layout.batch_size),
        "time": layout.time,
    }


def layout_from_json(data: dict) -> Any:
    from rlcollect.data import BatchLayout
    from rlcollect.envs.base import ArraySpec

    try:
        fields = {}
        for key, shape, dtype in data["fields"]:
            if isinstance(key, list) and key and all(isinstance(k, str) for k in key):
                key = tuple(key)
            elif not isinstance(key, str):
                raise ProtocolError(f"a field key must be a string or a list of strings, got {key!r}")
            fields[key] = ArraySpec(_shape(shape), _dtype(dtype))
        time = data["time"]
        if not _is(time, int) or time < 1:
            raise ProtocolError(f"layout time must be a positive int, got {time!r}")
        return BatchLayout(fields, torch.Size(_shape(data["batch_size"])), time)
    except (KeyError, TypeError, ValueError) as err:
        if isinstance(err, ProtocolError):
            raise
        raise ProtocolError(f"malformed batch layout: {err!r}") from None


_TORCH_DTYPES = {str(d): d for d in (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.uint8,
                                     torch.int8, torch.int16, torch.int32, torch.int64, torch.bool,
                                     torch.complex64, torch.complex128)}


def weights_to_json(state: dict[str, torch.Tensor]) -> dict:
    return {name: [list(t.shape), str(t.dtype)] for name, t in state.items()}


def weights_from_json(data: dict) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    out = {}
    for name, spec in data.items():
        if not (isinstance(spec, list) and len(spec) == 2 and spec[1] in _TORCH_DTYPES):
            raise ProtocolError(f"malformed weight spec for {name!r}: {spec!r}")
        out[name] = (_shape(spec[0]), _TORCH_DTYPES[spec[1]])
    return out


# -- restricted pickling of what nodes send back ----------------------------------------------------
def _rebuild_tensor(array: np.ndarray, dtype: str) -> torch.Tensor:
    if dtype not in _TORCH_DTYPES:
        raise pickle.UnpicklingError(f"tensor of unknown dtype {dtype!r}")
    tensor = torch.from_numpy(np.array(array, copy=True))
    return tensor.view(_TORCH_DTYPES[dtype]) if tensor.dtype != _TORCH_DTYPES[dtype] else tensor


_SAFE_GLOBALS = {
    ("collections", "OrderedDict"),
    ("numpy", "ndarray"),
    ("numpy", "dtype"),
    *((m, n) for m in ("numpy.core.multiarray", "numpy._core.multiarray") for n in ("_reconstruct", "scalar")),
    *((m, "_frombuffer") for m in ("numpy.core.numeric", "numpy._core.numeric")),
    (__name__, "_rebuild_tensor"),
}


class _DataPickler(pickle.Pickler):
    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            tensor = obj.detach().cpu().contiguous()
            as_numpy = tensor.view(torch.int16) if tensor.dtype == torch.bfloat16 else tensor
            return _rebuild_tensor, (as_numpy.numpy(), str(tensor.dtype))
        return NotImplemented


class _Refused(pickle.UnpicklingError):
    pass


class _DataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in _SAFE_GLOBALS:
            raise _Refused(f"a node's payload refers to {module}.{name}, which is not plain data")
        return super().find_class(module, name)


def dumps_data(obj: Any) -> bytes:
    """Pickle plain data (containers, numbers, strings, bytes, numpy arrays, tensors)."""
    buffer = io.BytesIO()
    _DataPickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buffer.getvalue()


def loads_data(data: bytes) -> Any:
    """Unpickle what ``dumps_data`` made, refusing anything that is not plain data."""
    try:
        return _DataUnpickler(io.BytesIO(data)).load()
    except _Refused as err:
        raise ProtocolError(str(err)) from None
    except Exception as err:  # noqa: BLE001  (truncated or corrupted bytes raise many types)
        raise ProtocolError(f"malformed data payload: {err!r}") from None
