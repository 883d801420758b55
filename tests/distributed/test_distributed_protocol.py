"""The store protocol on its own: message validation, restricted decoding of node payloads,
exceptions, layouts and weight packing.  No process is started."""

from __future__ import annotations

import json
import os
import pickle

import numpy as np
import pytest
import torch

from rlcollect.data import BatchLayout
from rlcollect.distributed.control import protocol as P
from rlcollect.distributed.control import transport
from rlcollect.envs.base import ArraySpec
from rlcollect.envs.testing import InjectedFault
from rlcollect.errors import WorkerError


KEY = b"k" * 32
OTHER_KEY = b"o" * 32


def enc(kind, rank, token="tok", payload=b"", n=9, to=0, key=KEY, **fields):
    return P.encode(kind, rank, key, token, n, payload, to=to, **fields)


def test_round_trip_of_every_kind():
    data = enc("ready", 2, seq=3, slot=1, frames=10, version=4, seconds=0.5, version_min=4, version_mean=4.0,
               step_mean_s=None, step_p95_s=0.25)
    msg = P.decode(data, KEY, kinds=("ready",), to=0, ranks=range(1, 3), token="tok")
    assert (msg.kind, msg.rank, msg["seq"], msg["frames"], msg.n) == ("ready", 2, 3, 10, 9)
    cmd = enc("command", 0, payload=b"payload", to=1, id=1, name="collect", args={"credits": 2, "random": False})
    msg = P.decode(cmd, KEY, kinds=("command",), to=1, rank=0, token="tok")
    assert msg.payload == b"payload" and msg["args"] == {"credits": 2, "random": False}


def _unsigned(header: dict) -> bytes:
    return P.MAGIC + b"\0" * 32 + json.dumps(header).encode() + b"\n"


def _resigned(data: bytes, **changes) -> bytes:
    """``data`` with its header changed and its MAC left as it was (a tampered message)."""
    body = data[len(P.MAGIC) + 32:]
    head, _, payload = body.partition(b"\n")
    header = {**json.loads(head), **changes}
    return data[:len(P.MAGIC) + 32] + json.dumps(header).encode() + b"\n" + payload


READY = dict(seq=0, slot=0, frames=1, version=0, seconds=0.1, version_min=0, version_mean=0.0, step_mean_s=0.01,
             step_p95_s=None)


@pytest.mark.parametrize("data, match", [
    (b"garbage", "not an rlcollect message"),
    (_unsigned({"v": P.PROTOCOL_VERSION, "kind": "ready", "rank": 1}), "MAC does not verify"),
    (P.MAGIC + b"short", "MAC does not verify"),
    (enc("ready", 1, key=OTHER_KEY, **READY), "MAC does not verify"),
    (_resigned(enc("ready", 1, **READY), frames=10**6), "MAC does not verify"),
    (enc("ready", 1, payload=b"x", **READY)[:-1] + b"y", "MAC does not verify"),
    (enc("hello", 1, world_size=3, pid=1, host="h", run="r"), "unexpected message kind 'hello'"),
    (enc("ready", 7, **READY), "unknown rank 7"),
    (enc("ready", 1, token="other", **READY), "another session"),
    (enc("ready", 1, to=2, **READY), "addressed to rank 2"),
    (enc("ready", 1, n=5, **READY), "a replay"),
    (enc("ready", 1, n=4, **READY), "a replay"),
    (enc("ready", 1, **{**READY, "seq": "0"}), "field 'seq'"),
    (enc("ready", 1, **{**READY, "seq": True}), "field 'seq'"),
    (enc("ready", 1, slot=0, frames=1, version=0, seconds=0.1), "field 'seq' missing"),
])
def test_malformed_forged_or_foreign_messages_are_rejected(data, match):
    with pytest.raises(P.ProtocolError, match=match):
        P.decode(data, KEY, kinds=("ready",), to=0, ranks=range(1, 3), token="tok", after=5)


def test_a_message_signed_for_one_direction_fails_in_the_other():
    from rlcollect.distributed.control.auth import Keys

    keys = Keys(b"s" * 32)
    data = P.encode("ready", 1, keys.to_rank0, "tok", 1, to=0, **READY)
    P.decode(data, keys.to_rank0, kinds=("ready",), to=0, ranks=range(1, 3))
    with pytest.raises(P.AuthError):
        P.decode(data, keys.to_node, kinds=("ready",), to=0, ranks=range(1, 3))


@pytest.mark.parametrize("name, args, match", [
    ("rm -rf", {}, "unknown command"),
    ("collect", {"credits": "2", "random": False}, "takes"),
    ("collect", {"credits": 2}, "takes"),
    ("seed", {"seed": 1, "static_seed": False, "extra": 1}, "takes"),
])
def test_bad_commands_are_rejected(name, args, match):
    data = enc("command", 0, to=1, id=1, name=name, args=args)
    with pytest.raises(P.ProtocolError, match=match):
        P.decode(data, KEY, kinds=("command",), to=1, rank=0, token="tok")


def test_commands_only_from_rank_0():
    data = enc("command", 1, to=1, id=1, name="reset", args={})
    with pytest.raises(P.ProtocolError, match="expected rank 0"):
        P.decode(data, KEY, kinds=("command",), to=1, rank=0, token="tok")


def test_data_payloads_round_trip():
    state = {"a": np.arange(3), "t": torch.arange(4.0), "b": torch.ones(2, dtype=torch.bfloat16),
             "rng": np.random.default_rng(0).bit_generator.state, "nested": [1, (2.5, "x"), {"k": b"raw"}],
             "scalar": np.float32(1.5)}
    out = P.loads_data(P.dumps_data(state))
    assert np.array_equal(out["a"], state["a"]) and torch.equal(out["t"], state["t"])
    assert out["b"].dtype == torch.bfloat16 and torch.equal(out["b"], state["b"])
    assert out["rng"] == state["rng"] and out["nested"] == state["nested"] and out["scalar"] == 1.5


def test_tensordicts_round_trip_as_plain_data():
    """A torchrl env's state holds TensorDicts (its last root tensordict, say)."""
    from tensordict import TensorDict

    td = TensorDict({"obs": torch.ones(2, 3), "inner": {"count": torch.arange(2)}}, batch_size=[2])
    out = P.loads_data(P.dumps_data({"env": td}))["env"]
    assert out.batch_size == (2,) and torch.equal(out["obs"], td["obs"]) and torch.equal(out["inner", "count"],
                                                                                          td["inner", "count"])


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_data_payloads_refuse_code():
    with pytest.raises(P.ProtocolError, match="not plain data"):
        P.loads_data(pickle.dumps({"x": _Evil()}))
    with pytest.raises(P.ProtocolError, match="malformed"):
        P.loads_data(b"\x80\x05garbage")


def test_rebuild_error_keeps_loaded_types_only():
    err = P.rebuild_error(P.error_info(InjectedFault("boom")), 1, "collection")
    assert type(err) is InjectedFault and "boom" in str(err) and "node 1" in str(err) and err.node_index == 1
    err = P.rebuild_error({"type": "some.unloaded.module.Error", "message": "m", "traceback": "tb"}, 0, "x")
    assert isinstance(err, WorkerError) and err.worker_index == 0 and "some.unloaded.module.Error" in str(err)
    err = P.rebuild_error(P.error_info(KeyError("k")), 2, "'load_state_dict'")
    assert type(err) is KeyError


def test_layout_json_round_trip_and_validation():
    layout = BatchLayout({"observation": ArraySpec((4,), np.dtype(np.float32)),
                          ("next", "done"): ArraySpec((1,), np.dtype(np.bool_))}, torch.Size([2]), 5)
    back = P.layout_from_json(json.loads(json.dumps(P.layout_to_json(layout))))
    assert back == layout
    bad = P.layout_to_json(layout)
    bad["fields"][0][2] = "O"
    with pytest.raises(P.ProtocolError, match="not a plain number type"):
        P.layout_from_json(bad)
    with pytest.raises(P.ProtocolError, match="shape"):
        P.layout_from_json({**P.layout_to_json(layout), "batch_size": [-1]})


def test_weights_pack_and_unpack():
    module = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
    spec = P.weights_from_json(json.loads(json.dumps(P.weights_to_json(module.state_dict()))))
    flat = transport.pack_weights(module.state_dict(), spec)
    assert flat.dtype == torch.uint8 and flat.numel() == transport.weights_nbytes(spec)
    out = transport.unpack_weights(flat, spec)
    for name, value in module.state_dict().items():
        assert torch.equal(out[name], value) and out[name].dtype == value.dtype
    with pytest.raises(ValueError, match="missing"):
        transport.pack_weights({"0.weight": torch.zeros(2, 3)}, spec)
    with pytest.raises(ValueError, match="wrong shapes"):
        transport.pack_weights({**module.state_dict(), "0.bias": torch.zeros(5)}, spec)


def test_drops_are_logged_once_per_sender_and_bounded(caplog):
    import logging

    from rlcollect.distributed.control.auth import DropLog

    drops = DropLog("test")
    with caplog.at_level(logging.ERROR, logger="rlcollect"):
        for _ in range(3):
            drops.drop("the inbox", "rank 1", "forged")
        for rank in range(1000):  # a forger claiming ever new senders
            drops.drop("the inbox", f"rank {rank + 2}", "forged")
    assert drops.total == 1003
    assert len(caplog.records) == DropLog.MAX_SENDERS + 1 and len(drops.counts) == DropLog.MAX_SENDERS + 1


def test_a_message_sent_right_after_the_attach_reaches_the_wire():
    """A watcher sends its first report at once after its attach: both may arrive in the
    listener's one read.  The first report is the wire's next message, not a reason to drop
    the connection (that dropped a node's watcher about one run in six, and rank 0 then said
    "no watcher report" for a stopped node)."""
    import socket
    import struct
    import threading

    from rlcollect.distributed.control.wire import Listener

    got: list[bytes] = []
    done = threading.Event()

    def on_first(wire, data, challenge):
        got.extend([data, challenge])
        got.append(wire.recv())
        got.append(wire.recv())
        wire.close()
        done.set()

    listener = Listener("127.0.0.1", on_first, lambda: (b"welcome", "its challenge"))
    try:
        frame = struct.Struct("!Q").pack
        with socket.create_connection(("127.0.0.1", listener.port), timeout=10) as sock:
            big = b"y" * 300_000  # the rest of the second frame comes in later reads
            sock.sendall(frame(6) + b"attach" + frame(5) + b"first" + frame(len(big)) + big)
            assert done.wait(10.0)
            assert sock.recv(100) == frame(7) + b"welcome"  # what rank 0 says first, on every connection
        assert got == [b"attach", "its challenge", b"first", big]
        assert listener.refused == 0
    finally:
        listener.close()
