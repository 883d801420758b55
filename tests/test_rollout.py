"""The rollout's hot loop (``rlcollect/rollout.py``): every field of a batch is written, the
trajectory ids come from the recorded resets, and the carry survives preemption and errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers_collector import MASK, TRAJ_IDS, make_collector  # noqa: F401  (fixture)
from tensordict.nn import TensorDictModule

from rlcollect import CountingEnv, GymEnv
from rlcollect.data import BatchLayout
from rlcollect.envs import FaultyEnv, InjectedFault
from rlcollect.envs.base import ArraySpec
from rlcollect.data import slot_buffer
from rlcollect.multiprocess.shm import POISON, allocate_slot
from rlcollect.rollout import frame_traj_ids


def poisoned_buffer(layout: BatchLayout, mask: bool = False):
    """A batch slot as the workers get it: every byte set to the poison value."""
    if mask:
        layout = BatchLayout({**layout.fields, MASK: ArraySpec((), np.dtype(np.bool_))}, layout.batch_size, layout.time)
    return slot_buffer(allocate_slot(layout), layout)


def unwritten(buf) -> list:
    """The fields in which some element still holds the poison bytes."""
    left = []
    for key, array in buf.arrays.items():
        raw = np.ascontiguousarray(array).reshape(-1).view(np.uint8).reshape(array.size, array.itemsize)
        if (raw == POISON).all(axis=1).any():
            left.append(key)
    return left


class Logits(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(1, 3)

    def forward(self, observation):
        logits = self.linear(observation)
        return logits, logits.argmax(-1) % 2


def logits_policy():
    return TensorDictModule(Logits(), in_keys=["observation"], out_keys=["logits", "action"])


CASES = {
    "random": (lambda: CountingEnv(max_steps=3, batch_size=[2]), None, {}),
    "step_count_and_version": (lambda: CountingEnv(max_steps=4, batch_size=[3]), None,
                               {"max_frames_per_traj": 2, "track_policy_version": True}),
    "policy": (lambda: CountingEnv(max_steps=3, batch_size=[2]), logits_policy, {}),
    "set_truncated": (lambda: CountingEnv(max_steps=None, batch_size=[2]), None, {"set_truncated": True}),
    "gym": (lambda: GymEnv("CartPole-v1", num_envs=2), None, {}),
}


@pytest.mark.parametrize("random", [False, True])
@pytest.mark.parametrize("case", sorted(CASES))
def test_every_field_of_a_poisoned_slot_is_written(make_collector, case, random):
    make_env, policy, options = CASES[case]
    c = make_collector(make_env(), None if policy is None else policy(), frames_per_batch=12, **options)
    buf = poisoned_buffer(c.layout, mask=True)
    for _ in range(2):  # the second batch starts from the carry
        assert c.collect_into(buf, random=random) == 12
        assert unwritten(buf) == []
        # the root done family describes states that go on: ended rows were reset
        for name in ("done", "terminated", "truncated"):
            assert not buf.td[name].any()
        assert buf.td[MASK].all()
    if policy is not None and random:  # a random batch of a real policy: its other outputs are zero
        assert (buf.td["logits"] == 0).all()


def test_frame_traj_ids_follow_the_resets_step_by_step():
    rng = np.random.default_rng(0)
    n, steps, first_new = 4, 15, 100
    start = np.array([10, 11, 12, 13])
    ids, next_id, expected, resets = start.copy(), first_new, [], []
    for t in range(steps):
        expected.append(ids.copy())
        rows = np.flatnonzero(rng.random(n) < 0.3)
        if len(rows):
            resets.append((t, rows))
            ids[rows] = np.arange(next_id, next_id + len(rows))
            next_id += len(rows)
    assert np.array_equal(frame_traj_ids(start, resets, steps, first_new), np.array(expected))


def test_frame_traj_ids_do_not_assume_ids_grow():
    # A loaded state may carry ids above the ones handed out next.
    ids = frame_traj_ids(np.array([500, 3]), [(0, np.array([0])), (1, np.array([0, 1]))], 3, 7)
    assert ids.tolist() == [[500, 3], [7, 3], [8, 9]]
    assert frame_traj_ids(np.array([5]), [], 2, 6).tolist() == [[5], [5]]


class StopAt(CountingEnv):
    """Raises the collector's preemption flag after ``at`` steps."""

    def __init__(self, stop: np.ndarray, at: int, **kwargs):
        super().__init__(**kwargs)
        self.stop, self.at, self.steps = stop, at, 0

    def step_rows(self, action, obs_out, reward, terminated, truncated) -> None:
        super().step_rows(action, obs_out, reward, terminated, truncated)
        self.steps += 1
        if self.steps == self.at:
            self.stop[0] = 1


def test_a_preempted_batch_keeps_the_carry(make_collector):
    stop = np.zeros(1, np.uint8)
    c = make_collector(StopAt(stop, 3, max_steps=5, batch_size=[2]), frames_per_batch=12)
    buf = poisoned_buffer(c.layout, mask=True)
    assert c.collect_into(buf, stop=stop) == 6
    td = buf.td
    assert td["observation"][:, :3, 0].tolist() == [[0, 1, 2]] * 2
    assert td[MASK].tolist() == [[True] * 3 + [False] * 3] * 2
    assert (td[TRAJ_IDS][:, 3:] == -1).all() and (td[TRAJ_IDS][:, :3] >= 0).all()
    stop[0] = 0
    c.collect_into(buf, stop=stop)
    assert td["observation"][:, :, 0].tolist() == [[3, 4, 0, 1, 2, 3]] * 2
    assert td["next", "observation"][:, :, 0].tolist() == [[4, 5, 1, 2, 3, 4]] * 2


def test_an_env_error_leaves_the_carry_at_the_failed_step(make_collector):
    c = make_collector(FaultyEnv(fault="raise", at_step=5, max_steps=None), frames_per_batch=10)
    with pytest.raises(InjectedFault):
        next(c)
    assert c.state_dict()["rollout"]["obs"]["observation"].tolist() == [[4.0]]
