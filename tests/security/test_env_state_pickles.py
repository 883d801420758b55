"""Pickled env state never crosses the network (issue 23, item 8). A ``GymEnv``'s state holds
pickles of its gymnasium envs (unavoidable for an arbitrary env); a node's ``state_dict`` reply
comes from the network, so a compromised node could plant a pickle there that rank 0 would
forward to every node at the next ``load_state_dict``. Now a node keeps its envs' pickles and
sends their digest; rank 0 leaves any pickle a node sends out of what it collects and refuses to
send a node state that holds one. The round trip within a run stays exact."""

from __future__ import annotations

import functools
import os
import pickle
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
from dist_helpers import ValuePolicy  # noqa: E402

from rlcollect import DistributedCollector, GymEnv  # noqa: E402
from rlcollect.distributed.control import env_state  # noqa: E402
from rlcollect.distributed.control import protocol as P  # noqa: E402

pytestmark = pytest.mark.timeout(180)


class _Payload:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _pickles(obj) -> list:
    """Every ``"envs"`` list of bytes (the pickled envs of a GymEnv / VectorEnv state) in ``obj``."""
    if isinstance(obj, dict):
        found = [v for k, v in obj.items() if k == "envs" and isinstance(v, list) and v
                 and all(isinstance(b, bytes) for b in v)]
        return found + [p for v in obj.values() for p in _pickles(v)]
    if isinstance(obj, (list, tuple)):
        return [p for v in obj for p in _pickles(v)]
    return []


def test_no_pickled_env_state_travels_between_rank_0_and_the_nodes(tmp_path):
    env = functools.partial(GymEnv, "CartPole-v1", num_envs=2)
    c = DistributedCollector([env], ValuePolicy(), frames_per_batch=20, total_frames=-1, sync=True,
                             launcher="mp", timeout=120.0)
    try:
        next(iter(c))
        state = c.state_dict()
        assert _pickles(state) == []  # what the node sent: plain data only
        expected = next(iter(c))
        next(iter(c))
        c.load_state_dict(state)  # the node restores its envs from the plain state it sent
        assert (next(iter(c))["observation"] == expected["observation"]).all()
        # A planted pickle (a tampered checkpoint, or a node that sent one) is refused at rank 0.
        marker = tmp_path / "pwned"
        tampered = pickle.loads(pickle.dumps(state))
        tampered["node0"]["env"] = {**tampered["node0"].get("env", {}), "envs": [pickle.dumps(_Payload(marker))] * 2}
        with pytest.raises(ValueError, match="pickled env state"):
            c.load_state_dict(tampered)
        assert next(iter(c)).shape[-1] == 10
        assert not marker.exists()
    finally:
        c.shutdown()


# Issue 36, item 2: the same refusal whatever container or byte type holds the pickles (a list of
# bytes was refused; a tuple of bytes or a list of bytearray passed and ran code on the node).
def _planted(kind: str, blob: bytes):
    return {
        "tuple of bytes": lambda: (blob, blob),
        "list of bytearray": lambda: [bytearray(blob)] * 2,
        "list of memoryview": lambda: [memoryview(blob)] * 2,
        "tuple of numpy arrays": lambda: tuple(np.frombuffer(blob, dtype=np.uint8) for _ in range(2)),
        "nested lists": lambda: [[blob], [blob]],
        "bytes": lambda: blob,
    }[kind]()


KINDS = ["tuple of bytes", "list of bytearray", "list of memoryview", "tuple of numpy arrays", "nested lists", "bytes"]


@pytest.fixture(scope="module")
def cartpole_run():
    env = functools.partial(GymEnv, "CartPole-v1", num_envs=2)
    c = DistributedCollector([env], ValuePolicy(), frames_per_batch=20, total_frames=-1, sync=True,
                             launcher="mp", timeout=120.0)
    try:
        next(iter(c))
        yield c, c.state_dict()
    finally:
        c.shutdown()


@pytest.mark.parametrize("kind", KINDS)
def test_pickled_env_state_is_refused_whatever_holds_it(cartpole_run, tmp_path, kind):
    c, state = cartpole_run
    marker = tmp_path / "pwned"
    tampered = pickle.loads(pickle.dumps(state))
    tampered["node0"]["env"] = {**tampered["node0"].get("env", {}),
                                "envs": _planted(kind, pickle.dumps(_Payload(marker)))}
    with pytest.raises(ValueError, match="pickled env state"):
        c.load_state_dict(tampered)
    assert next(iter(c)).shape[-1] == 10
    assert not marker.exists()


@pytest.mark.parametrize("kind", [k for k in KINDS if k != "list of memoryview"])  # (no pickle of a memoryview)
def test_pickled_env_state_a_node_sends_is_left_out(tmp_path, kind):
    """What ``protocol.loads_data`` rebuilds from a compromised node's reply loses its pickles."""
    reply = P.loads_data(P.dumps_data({"env": {"envs": _planted(kind, b"\x80pickle"), "rng": 1},
                                       "group": {"envs": [{"envs": _planted(kind, b"\x80"), "rng": 2}]}}))
    assert env_state.find(reply) == ["['env']['envs']", "['group']['envs'][0]['envs']"]
    assert env_state.strip(reply) == {"env": {"rng": 1}, "group": {"envs": [{"rng": 2}]}}


def test_strip_leaves_what_holds_no_pickled_env_state_as_it_is():
    # A torchrl env's state keeps its last root TensorDict (a Mapping); strip() rebuilt every
    # mapping as a dict, and the node then refused its own state ("_rlcollect_root must be a
    # TensorDict"): tests/torchrl/test_torchrl_014.py's distributed state_dict test.
    from collections import OrderedDict

    from tensordict import TensorDict

    root = TensorDict({"observation": np.zeros(4, np.float32), "step_count": np.array([2])}, batch_size=[])
    policy = OrderedDict(w=1)
    state = {"env": {"_rlcollect_root": root, "envs": (b"\x80",)}, "policy": policy, "frames": 3}
    out = env_state.strip(state)
    assert out == {"env": {"_rlcollect_root": root}, "policy": policy, "frames": 3}
    assert out["env"]["_rlcollect_root"] is root and out["policy"] is policy
