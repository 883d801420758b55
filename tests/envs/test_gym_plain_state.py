"""GymEnv / VectorEnv keep their gymnasium envs' state as plain data where the env allows it
(issue 36, item 2): a checkpoint or a DistributedCollector node's state then carries it without
unpickling anything; an env with an attribute that is not plain data keeps today's pickle."""

from __future__ import annotations

import json
import pickle

import gymnasium as gym
import numpy as np
import pytest
import torch

from rlcollect import Collector, GymEnv, VectorEnv
from rlcollect.envs.gym_state import load_plain_state, plain_state


def _no_bytes(obj) -> bool:
    if isinstance(obj, (bytes, bytearray, memoryview)):
        return False
    if isinstance(obj, dict):
        return all(_no_bytes(k) and _no_bytes(v) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return all(_no_bytes(v) for v in obj)
    if isinstance(obj, np.ndarray):
        return obj.dtype.kind in "biufc"
    return obj is None or isinstance(obj, (bool, int, float, str, np.generic))


def _json(obj):
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, np.generic):
        return obj.item()
    raise TypeError(type(obj).__name__)


def _future(env: GymEnv, td, steps: int):
    out = []
    for _ in range(steps):
        td = env.step(env.rand_action(td.clone()))
        out.append((td["action"].clone(), td["next", "observation"].clone(), td["next", "reward"].clone(),
                    td["next", "done"].clone()))
        td = td["next"].exclude("reward")
    return out


@pytest.mark.parametrize("env_id", ["CartPole-v1", "Acrobot-v1", "Pendulum-v1", "MountainCar-v0",
                                    "MountainCarContinuous-v0"])
def test_state_is_plain_data_and_a_fresh_env_replays_the_same_future(env_id):
    env = GymEnv(env_id, num_envs=2)
    env.set_seed(5)
    td = env.reset()
    for _ in range(7):
        td = env.step(env.rand_action(td))["next"].exclude("reward")
    state = env.state_dict()
    assert all(isinstance(s, dict) for s in state["envs"])
    assert _no_bytes(state["envs"])
    json.dumps(state["envs"], default=_json)  # json-serializable once arrays are lists
    original = _future(env, td, 30)
    fresh = GymEnv(env_id, num_envs=2)
    fresh.load_state_dict(pickle.loads(pickle.dumps(state)))
    for a, b in zip(original, _future(fresh, td, 30)):
        for x, y in zip(a, b):
            assert torch.equal(x, y)
    env.close()
    fresh.close()


class _Opaque:
    pass


class _WithAnObject(gym.Wrapper):
    def __init__(self, env):
        super().__init__(env)
        self.thing = _Opaque()


def test_an_env_with_an_unrepresentable_attribute_keeps_a_pickle():
    env = GymEnv(lambda: _WithAnObject(gym.make("CartPole-v1")), num_envs=2)
    assert plain_state(env._envs[0]) is None
    state = env.state_dict()
    assert all(isinstance(s, bytes) for s in state["envs"])  # every copy pickled, as before
    env.set_seed(3)
    td = env.reset()
    state = env.state_dict()
    original = _future(env, td, 5)
    fresh = GymEnv(lambda: _WithAnObject(gym.make("CartPole-v1")), num_envs=2)
    fresh.load_state_dict(state)
    for a, b in zip(original, _future(fresh, td, 5)):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_old_pickled_states_still_load():
    env = GymEnv("CartPole-v1")
    env.set_seed(2)
    td = env.reset()
    state = {**env.state_dict(), "envs": [pickle.dumps(e) for e in env._envs]}  # a checkpoint of before
    original = _future(env, td, 5)
    fresh = GymEnv("CartPole-v1")
    fresh.load_state_dict(state)
    for a, b in zip(original, _future(fresh, td, 5)):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_another_wrapper_chain_is_refused_naming_the_layer():
    state = GymEnv("CartPole-v1").state_dict()
    other = GymEnv(lambda: gym.make("CartPole-v1", disable_env_checker=True))
    with pytest.raises(ValueError, match="layer 2"):
        other.load_state_dict(state)
    with pytest.raises(ValueError, match="wrapper chain"):
        GymEnv("Acrobot-v1").load_state_dict(state)


@pytest.mark.parametrize("field, value, match", [
    ("attrs", {"state": _Opaque()}, "not plain data"),
    ("attrs", {"__class__": 1}, "not an attribute"),
    ("attrs", {"env": 1}, "not an attribute"),
    ("rngs", {"_np_random": {"bit_generator": "os.system", "state": {}}}, "bit generator"),
    ("spaces", {"action_space": [None, None]}, "more generator states"),
    ("rngs", {"_np_random": {"bit_generator": "PCG64", "state": {"state": "x"}}}, "bit generator"),
])
def test_a_tampered_plain_state_is_refused_and_leaves_the_env_as_it_was(field, value, match):
    env = GymEnv("CartPole-v1")
    env.set_seed(0)
    env.reset()
    state = env.state_dict()
    before = env._envs[0].unwrapped.state.copy()
    tampered = pickle.loads(pickle.dumps(state))
    tampered["envs"][0]["layers"][3]["attrs"]["state"] = np.zeros(4)
    tampered["envs"][0]["layers"][3][field].update(value)
    with pytest.raises(ValueError, match=match):
        env.load_state_dict(tampered)
    np.testing.assert_array_equal(env._envs[0].unwrapped.state, before)


def test_sync_vector_env_sub_envs_are_plain_data():
    env = VectorEnv(gym.make_vec("Pendulum-v1", num_envs=2, vectorization_mode="sync"))
    env.set_seed(4)
    td = env.reset()
    for _ in range(3):
        td = env.step(env.rand_action(td))["next"].exclude("reward")
    state = env.state_dict()
    assert all(isinstance(s, dict) for s in state["envs"]) and _no_bytes(state["envs"])
    original = _future(env, td, 10)
    fresh = VectorEnv(gym.make_vec("Pendulum-v1", num_envs=2, vectorization_mode="sync"))
    fresh.load_state_dict(state)
    for a, b in zip(original, _future(fresh, td, 10)):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_a_collector_state_round_trips_with_plain_env_state():
    def policy(observation):
        return (observation[..., 2] > 0).long()

    c = Collector(lambda: GymEnv("CartPole-v1", num_envs=2), policy, frames_per_batch=20, total_frames=-1)
    c.set_seed(9)
    it = iter(c)
    next(it)
    state = c.state_dict()
    assert _no_bytes(state["env"]["envs"])
    expected = next(it)
    restored = Collector(lambda: GymEnv("CartPole-v1", num_envs=2), policy, frames_per_batch=20, total_frames=-1)
    restored.load_state_dict(state)
    got = next(iter(restored))
    assert torch.equal(got["next", "observation"], expected["next", "observation"])
    assert torch.equal(got["next", "reward"], expected["next", "reward"])
    c.shutdown()
    restored.shutdown()


def test_load_plain_state_on_a_bare_gymnasium_env():
    env = gym.make("Acrobot-v1")
    env.reset(seed=1)
    env.step(1)
    fresh = gym.make("Acrobot-v1")
    load_plain_state(fresh, plain_state(env))
    assert np.array_equal(fresh.step(0)[0], env.step(0)[0])


@pytest.mark.timeout(180)
def test_a_distributed_node_state_carries_plain_env_state_and_restores_it():
    import functools
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
    from dist_helpers import ValuePolicy

    from rlcollect import DistributedCollector

    env = functools.partial(GymEnv, "CartPole-v1", num_envs=2)
    c = DistributedCollector([env], ValuePolicy(), frames_per_batch=20, total_frames=-1, sync=True,
                             launcher="mp", timeout=120.0)
    try:
        next(iter(c))
        state = c.state_dict()
        envs = state["node0"]["env"]["envs"]  # the envs themselves, not a digest of kept pickles
        assert len(envs) == 2 and all(isinstance(s, dict) for s in envs) and _no_bytes(envs)
        expected = next(iter(c))
        next(iter(c))
        c.load_state_dict(state)
        assert torch.equal(next(iter(c))["observation"], expected["observation"])
    finally:
        c.shutdown()


def test_a_pixel_env_state_is_plain_data_too():
    # (its pygame render caches could not be pickled: state_dict raised before)
    env = GymEnv("CartPole-v1", from_pixels=True)
    env.set_seed(6)
    td = env.reset()
    td = env.step(env.rand_action(td))["next"].exclude("reward")
    state = env.state_dict()
    assert _no_bytes(state["envs"])
    fresh = GymEnv("CartPole-v1", from_pixels=True)
    fresh.load_state_dict(state)
    td1 = env.step(env.rand_action(td.clone()))
    td2 = fresh.step(fresh.rand_action(td.clone()))
    assert torch.equal(td1["next", "pixels"], td2["next", "pixels"])
