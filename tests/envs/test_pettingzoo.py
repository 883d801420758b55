"""PettingZoo's parallel API collected without torchrl (rlcollect/envs/pettingzoo.py): MPE's
simple_spread (mpe2) and a small env whose agents leave one by one (tests/envs/pettingzoo_envs.py)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

pytest.importorskip("pettingzoo")
mpe2 = pytest.importorskip("mpe2")

from pettingzoo_envs import LeavingAgentsEnv, MixedSpacesEnv  # noqa: E402
from tensordict.nn import TensorDictModule  # noqa: E402

from rlcollect import Collector, MultiSyncCollector  # noqa: E402
from rlcollect.envs import PettingZooEnv  # noqa: E402

pytestmark = pytest.mark.timeout(120)


def spread(max_cycles: int = 5):
    from mpe2 import simple_spread_v3

    return simple_spread_v3.parallel_env(N=3, max_cycles=max_cycles)


def collect(env, policy=None, frames: int = 10, n: int = 1, **kwargs) -> list:
    c = Collector(env, policy, frames_per_batch=frames, total_frames=n * frames, **kwargs)
    try:
        c.set_seed(0)
        return [b.clone() for b in c]
    finally:
        c.shutdown()


def test_simple_spread_batch_is_what_stepping_pettingzoo_by_hand_gives():
    (batch,) = collect(spread(), frames=12)
    assert batch.batch_size == (12,) and batch["agents"].batch_size == (12, 3)
    assert batch["agents", "observation"].shape == (12, 3, 18)
    assert batch["agents", "action"].dtype == torch.int64
    # replay the batch's actions on a fresh env seeded alike: the same observations and rewards
    env = spread()
    obs, _ = env.reset(seed=0)
    agents = env.possible_agents
    for t in range(12):
        assert np.array_equal(batch["agents", "observation"][t].numpy(), np.stack([obs[a] for a in agents]))
        actions = {a: int(batch["agents", "action"][t, i]) for i, a in enumerate(agents)}
        obs, rewards, terms, truncs, _ = env.step(actions)
        assert batch["next", "agents", "reward"][t, :, 0].tolist() == [np.float32(rewards[a]) for a in agents]
        assert bool(batch["next", "truncated"][t]) == all(truncs.values())
        if not env.agents:
            obs, _ = env.reset()
    # max_cycles=5: the episode ends every 5 steps, truncated, and each is one trajectory
    assert batch["next", "done"][:, 0].tolist() == [t % 5 == 4 for t in range(12)]
    assert batch["collector", "traj_ids"].tolist() == [0] * 5 + [1] * 5 + [2] * 2


def test_agents_that_leave_early_are_padded_and_masked():
    (batch,) = collect(LeavingAgentsEnv(), frames=8)
    # agent_i leaves after i + 2 steps: it acts at steps 0..i+1 of each 4-step episode
    acted = [[t % 4 <= i + 1 for i in range(3)] for t in range(8)]
    assert batch["agents", "mask"].tolist() == acted
    assert batch["next", "agents", "mask"].tolist() == acted
    assert batch["next", "agents", "terminated"][:, :, 0].tolist() == [[t % 4 == i + 1 for i in range(3)]
                                                                        for t in range(8)]
    # after it left: zeros (observation, reward) until the episode ends
    gone = ~batch["agents", "mask"]
    assert not batch["agents", "observation"][gone].any()
    assert not batch["next", "agents", "reward"][~batch["next", "agents", "mask"]].any()
    assert batch["next", "agents", "observation"][3, 0].tolist() == [0.0, 0.0]
    assert batch["next", "agents", "observation"][1, 0].tolist() == [2.0, 0.0]  # its real last step
    assert batch["next", "done"][:, 0].tolist() == [False, False, False, True] * 2
    assert batch["next", "terminated"][:, 0].tolist() == [False, False, False, True] * 2
    assert batch["collector", "traj_ids"].tolist() == [0] * 4 + [1] * 4


class MaskedArgmax(torch.nn.Module):
    """The highest allowed action (the mask is what the policy reads)."""

    def forward(self, mask):
        return (mask * torch.arange(1, mask.shape[-1] + 1)).argmax(-1)


def test_action_masks_reach_the_policy_and_bound_random_actions():
    policy = TensorDictModule(MaskedArgmax(), in_keys=[("agents", "action_mask")], out_keys=[("agents", "action")])
    (batch,) = collect(LeavingAgentsEnv(), policy, frames=4)
    assert batch["agents", "action_mask"][:, 2].tolist() == [[True, t % 2 == 0, True] for t in range(4)]
    assert not batch["agents", "action_mask"][2:, 0].any()  # agent_0 left after 2 steps
    assert batch["agents", "action"][:, 2].tolist() == [2, 2, 2, 2]
    (randoms,) = collect(LeavingAgentsEnv(), frames=400)
    taken = randoms["agents", "action"][randoms["agents", "mask"]]
    allowed = randoms["agents", "action_mask"][randoms["agents", "mask"]]
    assert allowed.gather(-1, taken[:, None]).all()
    assert set(taken.tolist()) == {0, 1, 2}


def test_a_missing_action_mask_names_the_env_the_agent_and_the_step():
    c = Collector(LeavingAgentsEnv(drop_mask_at=2), frames_per_batch=4)
    try:
        with pytest.raises(ValueError, match=r"env leaving_agents_v0: agent 'agent_2' has no action mask at step 2 of "
                                             r"the episode"):
            next(iter(c))
    finally:
        c.shutdown()


def test_agents_with_different_spaces_are_refused():
    with pytest.raises(TypeError, match=r"env leaving_agents_v0: its agents \['agent_0', 'agent_1', 'agent_2'\] have "
                                        r"different observation or action spaces"):
        PettingZooEnv(MixedSpacesEnv())


class WrongGroup(torch.nn.Module):
    def forward(self, obs):
        return torch.zeros(obs.shape[:-1], dtype=torch.int64)


def test_a_policy_acting_for_a_group_the_env_lacks_is_refused():
    policy = TensorDictModule(WrongGroup(), in_keys=[("agents", "observation")], out_keys=[("team", "action")])
    with pytest.raises(ValueError, match=r"env PettingZooEnv\(leaving_agents_v0, batch_size=\[\]\) has no group "
                                         r"\('team',\), but the policy wrote the action \('team', 'action'\)"):
        Collector(LeavingAgentsEnv(), policy, frames_per_batch=4)


def test_max_frames_per_traj_truncates_every_agent_in_the_episode():
    (batch,) = collect(spread(max_cycles=25), frames=6, max_frames_per_traj=3)
    assert batch["next", "truncated"][:, 0].tolist() == [False, False, True] * 2
    assert batch["next", "agents", "truncated"][:, :, 0].all(-1).tolist() == [False, False, True] * 2
    assert batch["collector", "traj_ids"].tolist() == [0, 0, 0, 1, 1, 1]


def test_split_trajs_gives_one_episode_per_row_with_the_agent_dim():
    (batch,) = collect(LeavingAgentsEnv(), frames=10, split_trajs=True)
    assert batch.batch_size == (3, 4) and batch["agents"].batch_size == (3, 4, 3)
    assert batch["collector", "mask"].sum(-1).tolist() == [4, 4, 2]


@pytest.mark.processes
def test_multi_sync_collector_stacks_workers_batches_of_a_pettingzoo_env():
    c = MultiSyncCollector([spread, spread], frames_per_batch=20, total_frames=20)
    try:
        c.set_seed(0)
        (batch,) = list(c)
    finally:
        c.shutdown()
    assert batch.batch_size == (2, 10) and batch["agents"].batch_size == (2, 10, 3)
    assert batch["next", "done"][..., 0].sum(-1).tolist() == [2, 2]  # max_cycles=5


class Biased(torch.nn.Module):
    """Action ``bias`` for every agent: its weight says which version acted."""

    def __init__(self):
        super().__init__()
        self.bias = torch.nn.Parameter(torch.tensor(1.0), requires_grad=False)

    def forward(self, obs):
        return torch.full(obs.shape[:-1], int(self.bias), dtype=torch.int64)


def test_central_inference_acts_for_a_pettingzoo_env_in_this_process():
    policy = TensorDictModule(Biased(), in_keys=[("agents", "observation")], out_keys=[("agents", "action")])
    worker = MultiSyncCollector([spread, spread], policy, frames_per_batch=20, total_frames=20)
    c = MultiSyncCollector([spread, spread], policy, frames_per_batch=20, total_frames=40, inference="central",
                           env_splits=1, track_policy_version=True)
    try:
        worker.set_seed(0)
        (expected,) = [b.clone() for b in worker]
        c.set_seed(0)
        first, second = None, None
        for i, batch in enumerate(c):
            if i == 0:
                first = batch.clone()
                with torch.no_grad():
                    policy.module.bias.fill_(2.0)
                c.update_policy_weights_()
            else:
                second = batch.clone()
    finally:
        worker.shutdown()
        c.shutdown()
    assert first["agents"].batch_size == (2, 10, 3)
    for key in expected.keys(include_nested=True, leaves_only=True):
        assert torch.equal(first[key], expected[key]), key
    assert second["agents", "action"].unique().tolist() == [2]
    assert second["collector", "policy_version"].unique().tolist() == [1]


# -- the AEC API, by turns ---------------------------------------------------------------------------------
class FirstAllowed(torch.nn.Module):
    """The lowest allowed square (the mask is the policy's only input)."""

    def forward(self, mask):
        return (mask.float() * torch.arange(mask.shape[-1], 0, -1)).argmax(-1)


def test_an_aec_env_is_collected_by_turns_as_stepping_it_by_hand_gives():
    from pettingzoo.classic import tictactoe_v3

    policy = TensorDictModule(FirstAllowed(), in_keys=[("agents", "action_mask")], out_keys=[("agents", "action")])
    (batch,) = collect(tictactoe_v3.env(), policy, frames=9)
    # by hand: each player in turn takes the lowest free square until the game ends (before the
    # 9th frame); then the collector resets the env
    env = tictactoe_v3.env()
    env.reset(seed=0)
    turns, rewards = [], []
    while env.agents:
        agent = env.agent_selection
        if env.terminations[agent] or env.truncations[agent]:
            env.step(None)
            continue
        square = int(np.flatnonzero(env.observe(agent)["action_mask"])[0])
        turns.append((agent, square))
        env.step(square)
        rewards.append([env.rewards[a] for a in env.possible_agents])
    n = len(turns)
    acting = batch["agents", "mask"][:n]
    assert acting.sum(-1).tolist() == [1] * n
    assert [("player_1", "player_2")[int(i)] for i in acting.float().argmax(-1)] == [a for a, _ in turns]
    assert batch["agents", "action"][:n][acting].tolist() == [s for _, s in turns]
    assert batch["next", "agents", "reward"][:n, :, 0].tolist() == rewards
    assert batch["next", "done"][:, 0].tolist() == [False] * (n - 1) + [True] + [False] * (9 - n)
    assert batch["next", "terminated"][n - 1, 0] and batch["next", "agents", "mask"][:n].all()
    assert batch["collector", "traj_ids"].tolist() == [0] * n + [1] * (9 - n)
    assert torch.equal(batch["next", "agents", "observation"][n - 2], batch["agents", "observation"][n - 1])
    assert batch["agents", "mask"][n].tolist() == [True, False]  # reset: player_1 starts again


def test_a_parallel_env_adapter_given_an_aec_env_says_which_adapter_takes_it():
    from pettingzoo.classic import tictactoe_v3

    with pytest.raises(TypeError, match="an AECEnv \\(agents by turns\\) goes in PettingZooAECEnv"):
        PettingZooEnv(tictactoe_v3.env())


@pytest.mark.processes
def test_pettingzoo_is_imported_only_when_used():
    code = ("import sys, rlcollect\nfrom rlcollect import Collector\nc = Collector('CartPole-v1', frames_per_batch=4)\n"
            "next(iter(c)); c.shutdown()\nprint('pettingzoo' in sys.modules, 'vmas' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split() == ["False", "False"]
