"""The single-process ``Collector`` as an iterator and a service: postproc, split_trajs, buffers,
storing device, len/total_frames, shutdown, replay buffers, stats, profiling, the env forms it
accepts (a duck-typed torchrl-style env included) and argument validation (SPEC sections 1, 4, 10)."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings

import gymnasium as gym
import pytest
from loadscale import scaled
import torch
from helpers_collector import (
    BASE_KEYS,
    MASK,
    TRAJ_IDS,
    assert_td_equal,
    cat_time,
    flag,
    leaf_keys,
    make_collector,  # noqa: F401  (fixture)
    next_obs,
    obs,
    take,
)
from helpers_torchrl_env import DuckCountingEnv

from rlcollect import Collector, CountingEnv


class ClosingCountingEnv(CountingEnv):
    """A CountingEnv that counts its close() calls."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.closed = 0

    def close(self) -> None:
        self.closed += 1


class ListBuffer:
    """The smallest replay buffer: anything with extend()."""

    def __init__(self):
        self.items = []

    def extend(self, td):
        self.items.append(td.clone())


# -- postproc and split_trajs ----------------------------------------------------------------------
def test_postproc_is_applied_to_every_batch(make_collector):
    seen = []

    def postproc(td):
        seen.append(td.batch_size)
        td.set("double_reward", td["next", "reward"] * 2)
        return td

    c = make_collector(CountingEnv(batch_size=[2]), frames_per_batch=6, total_frames=12, postproc=postproc)
    batches = list(c)
    assert seen == [torch.Size([2, 3])] * 2
    for batch in batches:
        assert leaf_keys(batch) == BASE_KEYS | {"double_reward"}
        assert (batch["double_reward"] == 2.0).all()


def test_postproc_return_value_is_what_is_yielded(make_collector):
    c = make_collector(CountingEnv(), frames_per_batch=4, postproc=lambda td: td[..., :2])
    assert next(c).batch_size == torch.Size([2])


def test_split_trajs(make_collector):
    c = make_collector(CountingEnv(max_steps=3, batch_size=[2]), frames_per_batch=10, split_trajs=True)
    batch = next(c)
    # ids [[0,0,0,2,2],[1,1,1,3,3]]: rows by first appearance in row-major order -> 0, 2, 1, 3
    assert batch.batch_size == torch.Size([4, 3])
    assert batch.names == [None, "time"]
    assert batch[TRAJ_IDS].tolist() == [[0, 0, 0], [2, 2, 0], [1, 1, 1], [3, 3, 0]]
    assert batch[MASK].tolist() == [[True] * 3, [True, True, False], [True] * 3, [True, True, False]]
    assert obs(batch).tolist() == [[0, 1, 2], [0, 1, 0], [0, 1, 2], [0, 1, 0]]
    assert leaf_keys(batch) == BASE_KEYS | {MASK}


def test_split_trajs_then_postproc(make_collector):
    c = make_collector(CountingEnv(max_steps=2), frames_per_batch=4, split_trajs=True,
                       postproc=lambda td: td.set("n", td[MASK].cumsum(-1)))
    assert next(c)["n"].tolist() == [[1, 2], [1, 2]]


# -- buffers and devices -----------------------------------------------------------------------------
def test_use_buffers_yields_independent_copies(make_collector):
    c = make_collector(CountingEnv(max_steps=10, batch_size=[2]), frames_per_batch=6)
    first = next(c)
    snapshot = first.clone()
    second = next(c)
    assert second is not first
    assert_td_equal(first, snapshot)  # refilling the buffer did not touch the yielded batch
    first["observation"] += 100  # editing a yielded batch does not touch the next ones
    third = next(c)
    assert obs(second).tolist() == [[3, 4, 5]] * 2
    assert obs(third).tolist() == [[6, 7, 8]] * 2


def test_return_same_td_yields_the_buffer(make_collector):
    c = make_collector(CountingEnv(max_steps=10), frames_per_batch=3, return_same_td=True)
    first = next(c)
    assert obs(first).tolist() == [0, 1, 2]
    second = next(c)
    assert second is first
    assert obs(first).tolist() == [3, 4, 5]


@pytest.mark.parametrize("use_buffers", [True, False])
def test_use_buffers_same_stream(make_collector, use_buffers):
    ref = make_collector(CountingEnv(max_steps=3, batch_size=[2]), frames_per_batch=8)
    c = make_collector(CountingEnv(max_steps=3, batch_size=[2]), frames_per_batch=8, use_buffers=use_buffers)
    got = take(c, 3)
    assert len({id(b) for b in got}) == 3
    assert_td_equal(cat_time(take(ref, 3)), cat_time(got))


def test_storing_device_cpu(make_collector):
    batch = next(make_collector(CountingEnv(batch_size=[2]), frames_per_batch=4, storing_device="cpu"))
    assert batch.device == torch.device("cpu")
    assert batch["next", "observation"].device == torch.device("cpu")
    batch = next(make_collector(CountingEnv(batch_size=[2]), frames_per_batch=4, device="cpu"))
    assert batch.device == torch.device("cpu")


# -- iteration, len, total_frames, shutdown -------------------------------------------------------------
def test_next_without_iter(make_collector):
    c = make_collector(CountingEnv(max_steps=10), frames_per_batch=3)
    assert obs(next(c)).tolist() == [0, 1, 2]
    assert obs(next(c)).tolist() == [3, 4, 5]
    assert c.frames == 6


def test_len_and_exact_iteration(make_collector):
    c = make_collector(CountingEnv(), frames_per_batch=4, total_frames=12)
    assert len(c) == 3
    assert [b.numel() for b in c] == [4, 4, 4]
    assert c.frames == 12
    assert list(c) == []  # total reached: nothing more
    with pytest.raises(StopIteration):
        next(c)


def test_total_not_divisible_warns_and_overshoots(make_collector):
    with pytest.warns(UserWarning, match="total_frames=10"):
        c = make_collector(CountingEnv(), frames_per_batch=4, total_frames=10)
    assert len(c) == 3
    assert [b.numel() for b in c] == [4, 4, 4]
    assert c.frames == 12


def test_len_counts_the_batches_iterated_when_rows_round_up(make_collector):
    # 3 rows and frames_per_batch=10: every batch holds 12 frames; 36 frames take 3 batches.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        c = make_collector(CountingEnv(batch_size=[3]), frames_per_batch=10, total_frames=36)
    batches = list(c)
    assert [b.numel() for b in batches] == [12, 12, 12]
    assert len(c) == len(batches)


def test_endless_collector_has_no_len(make_collector):
    c = make_collector(CountingEnv(), frames_per_batch=4)
    with pytest.raises(TypeError, match="endless"):
        len(c)
    assert len(take(c, 5)) == 5  # and iterates without end


def test_context_manager_shuts_down():
    env = ClosingCountingEnv()
    with Collector(env, frames_per_batch=4) as c:
        next(c)
        assert env.closed == 0
    assert env.closed == 1
    with pytest.raises(RuntimeError, match="shut down"):
        next(c)


def test_shutdown_is_idempotent_and_final():
    env = ClosingCountingEnv()
    c = Collector(env, frames_per_batch=4, total_frames=40)
    next(c)  # an iterator is alive when the collector shuts down
    c.shutdown()
    c.shutdown()
    assert env.closed == 1
    with pytest.raises(RuntimeError, match="shut down"):
        next(c)
    with pytest.raises(RuntimeError, match="shut down"):
        list(c)
    for call in (c.reset, lambda: c.set_seed(0), c.update_policy_weights_):
        with pytest.raises(RuntimeError, match="shut down"):
            call()


def test_shutdown_closes_gym_env():
    c = Collector("CartPole-v1", frames_per_batch=4)
    next(c)
    c.shutdown()
    assert c.env._closed


#: A script that leaves two collectors open at exit: one in ``__main__``, one held by ``os`` (a
#: module imported before rlcollect's, so wiped after them: the collector is finalized once
#: rlcollect.collector's globals are gone, which printed "Exception ignored in ... __del__").
LEFT_OPEN = """
import os
from rlcollect import Collector, CountingEnv
c = Collector(CountingEnv(), frames_per_batch=4)
next(iter(c))
os._rlcollect_left_open = Collector("CartPole-v1", frames_per_batch=4)
next(iter(os._rlcollect_left_open))
print("collected")
"""


@pytest.mark.timeout(120)
def test_a_collector_left_open_at_exit_prints_nothing():
    proc = subprocess.run([sys.executable, "-c", LEFT_OPEN], capture_output=True, text=True,
                          timeout=scaled(100, cap=400))
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "collected\n", "")


# -- replay buffer -----------------------------------------------------------------------------------------
def test_replay_buffer_receives_batches(make_collector):
    rb = ListBuffer()
    c = make_collector(CountingEnv(max_steps=4, batch_size=[2]), frames_per_batch=6, total_frames=12, replay_buffer=rb)
    assert list(c) == [None, None]
    assert [item.batch_size for item in rb.items] == [torch.Size([2, 3])] * 2
    ref = make_collector(CountingEnv(max_steps=4, batch_size=[2]), frames_per_batch=6, total_frames=12)
    assert_td_equal(cat_time(rb.items), cat_time(list(ref)))


def test_replay_buffer_per_step(make_collector):
    rb = ListBuffer()
    c = make_collector(CountingEnv(max_steps=10, batch_size=[2]), frames_per_batch=6, replay_buffer=rb,
                       extend_buffer=False)
    assert next(c) is None
    assert [item.batch_size for item in rb.items] == [torch.Size([2])] * 3
    assert [obs(item).tolist() for item in rb.items] == [[0, 0], [1, 1], [2, 2]]


def test_replay_buffer_with_postproc(make_collector):
    rb = ListBuffer()
    c = make_collector(CountingEnv(), frames_per_batch=4, replay_buffer=rb,
                       postproc=lambda td: td.set("p", td["action"]))
    next(c)
    assert "p" in rb.items[0].keys()


def test_replay_buffer_without_extend():
    class AddOnly:
        def add(self, td):
            pass

    with pytest.raises(TypeError, match="replay_buffer"):
        Collector(CountingEnv(), frames_per_batch=4, replay_buffer=AddOnly())


# -- stats and profiling -------------------------------------------------------------------------------------
def test_stats_json_serialisable_with_exact_counts(make_collector):
    c = make_collector(CountingEnv(batch_size=[2]), frames_per_batch=4)
    before = c.stats()
    json.dumps(before)
    assert before["frames"] == 0 and before["batches"] == 0
    take(c, 3)
    stats = json.loads(json.dumps(c.stats()))
    assert stats["frames"] == 12
    assert stats["batches"] == 3
    assert stats["policy_version"] == 0
    assert stats["workers"][0]["frames"] == 12
    assert stats["workers"][0]["alive"] is True
    assert stats["restarts"] == 0
    assert stats["fps"] > 0


def test_enable_profile_writes_chrome_trace(make_collector, tmp_path):
    c = make_collector(CountingEnv(), frames_per_batch=8)
    path = tmp_path / "trace.json"
    c.enable_profile(path)
    next(c)
    trace = json.loads(path.read_text())
    assert "traceEvents" in trace
    path.unlink()
    next(c)  # only the chosen rollout is traced
    assert not path.exists()


def test_enable_profile_several_rollouts(make_collector, tmp_path):
    c = make_collector(CountingEnv(), frames_per_batch=8)
    next(c)  # rollouts count from the next batch, whose index is 1
    c.enable_profile(tmp_path / "trace.json", rollouts=(0, 2))
    take(c, 3)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["trace.1.json", "trace.3.json"]
    for p in tmp_path.iterdir():
        json.loads(p.read_text())
    with pytest.raises(ValueError, match="rollouts"):
        c.enable_profile(tmp_path / "x.json", rollouts=(-1,))


# -- env forms, including a duck-typed torchrl-style env --------------------------------------------------------
def test_env_forms(make_collector):
    assert next(make_collector("CartPole-v1", frames_per_batch=4))["observation"].shape == (4, 4)
    assert next(make_collector(gym.make("CartPole-v1"), frames_per_batch=4))["observation"].shape == (4, 4)
    c = make_collector(CountingEnv, create_env_kwargs={"max_steps": 2, "batch_size": [3]}, frames_per_batch=6)
    assert obs(next(c)).tolist() == [[0, 1]] * 3
    c = make_collector(lambda: CountingEnv(max_steps=2), frames_per_batch=3)
    assert obs(next(c)).tolist() == [0, 1, 0]


def test_duck_env_batched_partial_resets(make_collector):
    env = DuckCountingEnv(batch_size=[3], max_steps=2)  # rows end after 2, 3 and 4 steps
    c = make_collector(env, frames_per_batch=18)
    batch = next(c)
    assert batch.batch_size == torch.Size([3, 6])
    assert leaf_keys(batch) == BASE_KEYS
    assert obs(batch).tolist() == [[0, 1, 0, 1, 0, 1], [0, 1, 2, 0, 1, 2], [0, 1, 2, 3, 0, 1]]
    assert next_obs(batch).tolist() == [[1, 2, 1, 2, 1, 2], [1, 2, 3, 1, 2, 3], [1, 2, 3, 4, 1, 2]]
    assert flag(batch, ("next", "done")).tolist() == [
        [False, True, False, True, False, True],
        [False, False, True, False, False, True],
        [False, False, False, True, False, False],
    ]
    assert batch[TRAJ_IDS].tolist() == [[0, 0, 3, 3, 5, 5], [1, 1, 1, 4, 4, 4], [2, 2, 2, 2, 6, 6]]
    assert batch["action"].dtype == torch.int64
    assert ((batch["action"] == 0) | (batch["action"] == 1)).all()
    # Only the rows that ended were reset.
    partial = [m.tolist() for m in env.reset_masks if m is not None]
    assert partial[:4] == [[True, False, False], [False, True, False], [True, False, True], [True, True, False]]
    second = next(c)
    assert second[TRAJ_IDS][:, 0].tolist() == [7, 8, 6]
    assert obs(second)[:, 0].tolist() == [0, 0, 2]


def test_duck_env_unbatched(make_collector):
    env = DuckCountingEnv(max_steps=3)
    c = make_collector(env, frames_per_batch=7, policy=lambda observation: (observation[..., 0] > 0).long())
    batch = next(c)
    assert batch.batch_size == torch.Size([7])
    assert obs(batch).tolist() == [0, 1, 2, 0, 1, 2, 0]
    assert batch["action"].tolist() == [0, 1, 1, 0, 1, 1, 0]
    assert batch[TRAJ_IDS].tolist() == [0, 0, 0, 1, 1, 1, 2]


def test_duck_env_set_seed_and_shutdown(make_collector):
    def run():
        env = DuckCountingEnv(batch_size=[3])
        c = Collector(env, frames_per_batch=30)
        assert c.set_seed(5) == 6
        assert env.seeds == [5]
        batch = next(c)
        c.shutdown()
        assert env.closed == 1
        return batch

    a, b = run(), run()
    assert_td_equal(a, b)
    assert a["action"].unique().tolist() == [0, 1]


# -- argument validation (SPEC 10) -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"frames_per_batch": 0}, ValueError, "frames_per_batch"),
        ({"frames_per_batch": -1}, ValueError, "frames_per_batch"),
        ({"frames_per_batch": 1.5}, ValueError, "frames_per_batch"),
        ({"frames_per_batch": True}, ValueError, "frames_per_batch"),
        ({"frames_per_batch": "4"}, ValueError, "frames_per_batch"),
        ({"total_frames": 0}, ValueError, "total_frames"),
        ({"total_frames": 2.5}, ValueError, "total_frames"),
        ({"max_frames_per_traj": -3}, ValueError, "max_frames_per_traj"),
        ({"init_random_frames": -2}, ValueError, "init_random_frames"),  # (-1 is torchrl's "none")
        ({"exploration_type": "bogus"}, ValueError, "exploration_type"),
        ({"create_env_kwargs": [{"max_steps": 3}]}, TypeError, "create_env_kwargs"),
        ({"create_env_kwargs": "max_steps=3"}, TypeError, "create_env_kwargs"),
        ({"create_env_fn": 42}, TypeError, "create_env_fn"),
        ({"create_env_fn": None}, TypeError, "create_env_fn"),
        ({"postproc": "not callable"}, TypeError, "postproc"),
        ({"weight_sync_schemes": {"policy": 3}}, TypeError, "weight_sync_schemes"),
        ({"weight_sync_schemes": ["shared"]}, TypeError, "weight_sync_schemes"),
        ({"weight_sync_schemes": {"policy": "bogus"}}, ValueError, "weight_sync_schemes"),
        ({"policy": 42}, TypeError, "policy"),
        ({"policy_factory": 42}, TypeError, "policy_factory"),
        ({"storing_device": "nonsense"}, ValueError, "storing_device"),
        ({"split_trajs": "yes"}, TypeError, "split_trajs"),
        ({"compile_policy": "yes"}, TypeError, "compile_policy"),
        ({"replay_buffer": object()}, TypeError, "replay_buffer"),
        ({"worker_idx": -1}, ValueError, "worker_idx"),
    ],
)
def test_bad_arguments(kwargs, error, match):
    args = {"create_env_fn": CountingEnv, "frames_per_batch": 4} | kwargs
    with pytest.raises(error, match=match) as info:
        Collector(**args)
    bad = next(v for k, v in kwargs.items())
    if isinstance(bad, (int, float, str)) and not isinstance(bad, bool) and error is ValueError:
        assert repr(bad) in str(info.value)  # the value received is named too


def test_create_env_kwargs_with_an_instance():
    with pytest.raises(ValueError, match="create_env_kwargs"):
        Collector(CountingEnv(), frames_per_batch=4, create_env_kwargs={"max_steps": 2})
