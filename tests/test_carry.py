"""The carry between steps (``rlcollect/rollout.py``): what a policy writes under ``"next"``
becomes the root input of the next step, per row, and rows that start an episode get the env's
reset value, as torchrl's collectors do for recurrent modules (``("next", "recurrent_state_h")``).

The policies here accumulate ``h' = h + observation + 1``, so every frame's carried value says
exactly which frames of its episode it has seen; the expected values are recomputed from the
batch's own observations and episode starts."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers_collector import TRAJ_IDS, leaf_keys, make_collector  # noqa: F401  (fixture)
from tensordict import TensorDict
from tensordict.nn import TensorDictModuleBase

from rlcollect import Collector, CountingEnv, MultiSyncCollector

sys.path.insert(0, str(Path(__file__).parent))
from helpers_torchrl_env import DuckCountingEnv  # noqa: E402

pytestmark = pytest.mark.timeout(60)


class Accumulate(TensorDictModuleBase):
    """Writes ``("next", key) = key + observation + 1`` (``key`` missing counts as zeros, as
    torchrl's recurrent modules treat a missing hidden state) and action 0."""

    def __init__(self, key: str = "h"):
        super().__init__()
        self.key = key
        self.in_keys = ["observation", key]
        self.out_keys = [("next", key), "action"]

    def forward(self, td: TensorDict) -> TensorDict:
        obs = td.get("observation")
        h = td.get(self.key, None)
        if h is None:
            h = torch.zeros(*obs.shape[:-1], 1)
        td.set(("next", self.key), h + obs[..., :1] + 1)
        td.set("action", torch.zeros(obs.shape[:-1], dtype=torch.int64))
        return td


class PrimedCountingEnv(DuckCountingEnv):
    """``DuckCountingEnv`` with a torchrl-primer-like ``"h"``: ``reset`` writes ``reset_value``
    into the reset rows, ``step`` copies the root's ``"h"`` under ``"next"`` (what torchrl's
    ``TensorDictPrimer`` does when nothing else wrote it)."""

    def __init__(self, *args, reset_value: float = 5.0, **kwargs):
        super().__init__(*args, **kwargs)
        self.reset_value = reset_value
        self.h = torch.zeros(*self.batch_size, 1)

    def reset(self, td=None):
        out = super().reset(td)
        mask = self.reset_masks[-1]
        if mask is None:
            self.h.fill_(self.reset_value)
        else:
            self.h[mask] = self.reset_value
        out.set("h", self.h.clone())
        return out

    def step(self, td):
        td = super().step(td)
        td.get("next").set("h", td.get("h", self.h).clone())
        return td


def expected_carry(batches: list[TensorDict], reset_value: float) -> tuple[np.ndarray, np.ndarray]:
    """The root and next ``"h"`` of every frame, recomputed: ``h`` starts each episode at
    ``reset_value``, and ``next h = h + observation + 1``."""
    td = torch.cat([b.reshape(-1, b.shape[-1]) for b in batches], -1)
    obs = td["observation"][..., 0].numpy()
    ids = td[TRAJ_IDS].numpy()
    root, nxt = np.zeros_like(obs), np.zeros_like(obs)
    for row in range(obs.shape[0]):
        h = reset_value
        for t in range(obs.shape[1]):
            if t > 0 and ids[row, t] != ids[row, t - 1]:
                h = reset_value
            root[row, t] = h
            h = h + obs[row, t] + 1
            nxt[row, t] = h
    return root, nxt


def carried(batches: list[TensorDict]) -> tuple[np.ndarray, np.ndarray]:
    td = torch.cat([b.reshape(-1, b.shape[-1]) for b in batches], -1)
    return td["h"][..., 0].numpy(), td["next", "h"][..., 0].numpy()


@pytest.mark.parametrize("env_fn", [lambda: CountingEnv(max_steps=3, batch_size=[2]),
                                    lambda: DuckCountingEnv(batch_size=[3], max_steps=2)],
                         ids=["native", "tensordict_env"])
def test_a_key_only_the_policy_writes_is_carried_and_zeroed_at_episode_starts(make_collector, env_fn):
    # 7 steps per batch: episodes (3 to 4 steps) cross the batch boundary.
    c = make_collector(env_fn(), policy=Accumulate(), frames_per_batch=7 * env_fn().batch_size[0])
    batches = [next(c).clone() for _ in range(3)]
    root, nxt = carried(batches)
    want_root, want_next = expected_carry(batches, 0.0)
    np.testing.assert_array_equal(root, want_root)
    np.testing.assert_array_equal(nxt, want_next)
    assert root.max() > 0  # the carry really carried something
    assert {"h", ("next", "h")} <= leaf_keys(batches[0])


def test_an_env_key_is_overridden_by_the_policy_and_reset_to_the_envs_value(make_collector):
    env = PrimedCountingEnv(batch_size=[3], max_steps=2, reset_value=5.0)
    c = make_collector(env, policy=Accumulate(), frames_per_batch=21)
    batches = [next(c).clone() for _ in range(3)]
    root, nxt = carried(batches)
    want_root, want_next = expected_carry(batches, 5.0)
    np.testing.assert_array_equal(root, want_root)
    np.testing.assert_array_equal(nxt, want_next)


def test_carry_in_multisync_workers():
    c = MultiSyncCollector([lambda: DuckCountingEnv(batch_size=[2], max_steps=2)] * 2, policy=Accumulate(),
                           frames_per_batch=20, total_frames=60, cat_results="stack")
    try:
        batches = [b.clone() for b in c]
    finally:
        c.shutdown()
    assert len(batches) == 3
    for w in range(2):
        worker = [b[w] for b in batches]
        root, nxt = carried(worker)
        want_root, want_next = expected_carry(worker, 0.0)
        np.testing.assert_array_equal(root, want_root)
        np.testing.assert_array_equal(nxt, want_next)


def test_the_carry_is_in_state_dict_and_resume_is_exact(make_collector):
    def build():  # (a native env: its own state is restored too)
        return make_collector(CountingEnv(batch_size=[3], max_steps=4), policy=Accumulate(), frames_per_batch=15)

    straight = build()
    want = [next(straight).clone() for _ in range(3)]
    first = build()
    next(first)
    state = first.state_dict()
    assert "h" in state["rollout"]["obs"]
    resumed = build()
    next(resumed)
    next(resumed)  # move the carry away from the saved one, so that the load must restore it
    resumed.load_state_dict(state)
    for expected in want[1:]:
        got = next(resumed)
        for key in ("h", ("next", "h"), "observation"):
            assert torch.equal(got[key], expected[key]), key


def test_a_policy_writing_nothing_under_next_adds_no_key(make_collector):
    class Plain(TensorDictModuleBase):
        in_keys, out_keys = ["observation"], ["action"]

        def forward(self, td):
            td.set("action", torch.zeros(td.batch_size, dtype=torch.int64))
            return td

    c = make_collector(CountingEnv(max_steps=3, batch_size=[2]), policy=Plain(), frames_per_batch=8)
    batch = next(c)
    assert c._rollout._carried == [] and c._rollout._policy_only == []
    assert not any(isinstance(k, tuple) and k[0] == "next" and k[1] not in
                   ("observation", "reward", "done", "terminated", "truncated") for k in leaf_keys(batch))


def test_random_frames_keep_a_policy_only_carry(make_collector):
    c = make_collector(CountingEnv(max_steps=100, batch_size=[2]), policy=Accumulate(), frames_per_batch=8,
                       init_random_frames=8)
    first = next(c).clone()  # random: the policy does not run; its key keeps its value (0)
    second = next(c).clone()
    assert torch.equal(first["h"], torch.zeros_like(first["h"]))
    assert torch.equal(first["next", "h"], torch.zeros_like(first["next", "h"]))
    root, nxt = carried([second])
    obs = second["observation"][..., 0].numpy()
    np.testing.assert_array_equal(nxt, np.cumsum(obs + 1, axis=-1))
    np.testing.assert_array_equal(root[:, 1:], nxt[:, :-1])


def test_a_carried_key_that_does_not_match_the_envs_is_refused():
    class Wide(Accumulate):
        def forward(self, td):
            td = super().forward(td)
            td.set(("next", "h"), torch.zeros(*td.batch_size, 3))
            return td

    env = PrimedCountingEnv(batch_size=[2])
    with pytest.raises(TypeError, match=r"\('next', 'h'\) with shape \(3,\).*env's 'h' has shape \(1,\)"):
        Collector(env, policy=Wide(), frames_per_batch=4)


def test_a_policy_writing_the_envs_outcome_under_next_is_refused():
    class Cheat(Accumulate):
        def forward(self, td):
            td = super().forward(td)
            td.set(("next", "reward"), torch.zeros(*td.batch_size, 1))
            return td

    with pytest.raises(TypeError, match=r"\('next', 'reward'\)"):
        Collector(CountingEnv(batch_size=[2]), policy=Cheat(), frames_per_batch=4)
