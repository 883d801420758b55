"""The control protocol between rank 0 and its nodes: the message formats (``messages.py``,
re-exported here), the pair groups' rendezvous keys, and the decoding of what nodes send back.

Rank 0 opens one port (``master_port``): its channel listener (``wire.py``).  Everything of the
control plane travels on a per-node channel, a TCP connection from the node to that listener:
the hello and rank 0's answer, the node's spec, commands, replies, "batch ready" notices,
failures, heartbeats in both directions, and the pair process groups' rendezvous (gloo's store
calls: ``channel_store.py``).  Batches and weights travel over torch.distributed point-to-point
(see ``transport.py``).  Rank 0 hosts no store server: nothing of the run is reachable without
the secret but the listener, which holds at most ``wire.MAX_PENDING`` strangers' connections.

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

Flow: a node connects to rank 0's listener; rank 0 sends every connection a signed ``welcome``
(its token: the run's nonce; a fresh ``challenge``), before it has read anything.  The node
checks it and says ``hello`` (the nonce and the challenge repeated, its session token, world
size, pid and host).  Rank 0's listener thread checks that first message (MAC, run, challenge)
and closes the connection unless it verifies; an authentic hello waits for the main thread
(beaten meanwhile), which answers on the same connection with ``config`` (the node's index and
incarnation: 0, then 1, 2, ... for a node relaunched after a failure) or ``reject``.  That
connection is the node's channel from then on: rank 0 sends its spec (``setup``); the node
builds its collector and says ``started`` (with its batch layout and weight shapes) or
``failed``, builds its pair group (``store`` calls, answered by ``stored``) and joins it.  Then
rank 0 sends ``command`` messages and the node answers: a ``reply`` to each command, except
``collect``, answered by a ``ready`` notice per batch (sent after the batch itself was posted on
the process group), and ``weights``; any failure outside a reply is a ``failed`` message.  Both
sides send a ``beat`` every 0.5 s; a node's watcher (``watcher.py``) connects too, its first
message an ``attach`` repeating its own connection's challenge, and reports the node process's
``state``.  A node that leaves after "close" says ``bye``.
"""

from __future__ import annotations

import io
import pickle
import sys
import traceback
from typing import Any

import numpy as np
import torch

from rlcollect.distributed.control.messages import (  # noqa: F401  (re-exported: P.encode, P.decode, ...)
    COMMANDS, EVERYONE, MAGIC, MASTER_RANK, PROTOCOL_VERSION, SCHEMAS, AuthError, Endpoint, Message, ProtocolError,
    _is, check_command, claimed_sender, decode, encode, unverified_challenge)


# -- the pair groups' rendezvous keys ----------------------------------------------------------------
_ROOT = "rlc"


def pg_prefix(rank: int, incarnation: int) -> str:
    """The store prefix of the process group between rank 0 and one incarnation of a node."""
    return f"{_ROOT}/pg/{rank}/{incarnation}/"


# -- errors ----------------------------------------------------------------------------------------
def error_info(exc: BaseException) -> dict[str, str]:
    """What a node sends back about an exception: JSON only."""
    return {"type": f"{type(exc).__module__}.{type(exc).__qualname__}", "message": str(exc),
            "traceback": "".join(traceback.format_exception(exc))}


#: What a failed node's error says of its fix.
FAILURE_HINT = ("on_node_failure='restart' relaunches a failed node and 'continue' goes on without it (the default, "
                "'raise', ends the run)")


def mark_failed(err: BaseException, node_index: int) -> BaseException:
    """Mark ``err`` as the failure of node ``node_index`` (its process died, it went silent, or
    its collection raised): what ``on_node_failure`` acts on.  Errors of commands (a bad
    ``load_state_dict``, say) are not marked: they are raised whatever the policy.  A
    ``WorkerError``'s message names that fix (``FAILURE_HINT``)."""
    from rlcollect.errors import WorkerError

    err.failed_node = node_index
    message = err.args[0] if isinstance(err, WorkerError) and err.args else None
    if isinstance(message, str) and "on_node_failure" not in message:
        err.args = (f"{message}; {FAILURE_HINT}", *err.args[1:])
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
        # a grouped env's sub-TensorDict batch dims (an agent dim): without them rank 0's
        # batches would give ("agents",) the batch size (n, T) instead of torchrl's (n, T, agents)
        "groups": [[list(_parts(k)), list(dims)] for k, dims in layout.groups],
        # lazily stacked agents of different shapes (data.BatchLayout.lazy): the group, its
        # agents, its stack dim; without them rank 0's batch would hold the agents side by side
        "lazy": [[list(_parts(k)), agents, stack] for k, agents, stack in getattr(layout, "lazy", ())],
    }


def _parts(key: Any) -> tuple:
    return (key,) if isinstance(key, str) else tuple(key)


def _field_key(key: Any) -> Any:
    if isinstance(key, list) and key and all(isinstance(k, str) for k in key):
        return tuple(key)
    if not isinstance(key, str):
        raise ProtocolError(f"a field key must be a string or a list of strings, got {key!r}")
    return key


def layout_from_json(data: dict) -> Any:
    from rlcollect.data import BatchLayout
    from rlcollect.envs.base import ArraySpec

    try:
        fields = {}
        for key, shape, dtype in data["fields"]:
            fields[_field_key(key)] = ArraySpec(_shape(shape), _dtype(dtype))
        time = data["time"]
        if not _is(time, int) or time < 1:
            raise ProtocolError(f"layout time must be a positive int, got {time!r}")
        groups = tuple((_parts(_field_key(key)), _shape(dims)) for key, dims in data.get("groups", []))
        lazy = []
        for key, agents, stack in data.get("lazy", []):
            if not (_is(agents, int) and agents > 0 and _is(stack, int) and stack >= 0):
                raise ProtocolError(f"a lazy group needs a positive agent count and a stack dim >= 0, got "
                                    f"{agents!r}, {stack!r}")
            lazy.append((_parts(_field_key(key)), agents, stack))
        return BatchLayout(fields, torch.Size(_shape(data["batch_size"])), time, groups, tuple(lazy))
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


def _rebuild_tensordict(items: dict, batch_size: list) -> Any:
    """A TensorDict (a torchrl env's state holds some) from its plain nested dict."""
    from tensordict import TensorDict

    return TensorDict(items, batch_size=batch_size)


_SAFE_GLOBALS = {
    ("collections", "OrderedDict"),
    ("numpy", "ndarray"),
    ("numpy", "dtype"),
    *((m, n) for m in ("numpy.core.multiarray", "numpy._core.multiarray") for n in ("_reconstruct", "scalar")),
    *((m, "_frombuffer") for m in ("numpy.core.numeric", "numpy._core.numeric")),
    (__name__, "_rebuild_tensor"),
    (__name__, "_rebuild_tensordict"),
}


class _DataPickler(pickle.Pickler):
    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            tensor = obj.detach().cpu().contiguous()
            as_numpy = tensor.view(torch.int16) if tensor.dtype == torch.bfloat16 else tensor
            return _rebuild_tensor, (as_numpy.numpy(), str(tensor.dtype))
        tensordict = sys.modules.get("tensordict")  # (a TensorDict means tensordict is imported)
        if tensordict is not None and isinstance(obj, tensordict.TensorDictBase):
            return _rebuild_tensordict, (obj.to_dict(), list(obj.batch_size))
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
