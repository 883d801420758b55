"""rlcollect's PettingZoo adapters (``rlcollect.envs``, no torchrl needed) side by side with
torchrl 0.14.1's ``PettingZooWrapper`` and ``Collector`` on the same game and policy.

An AEC game (``tictactoe_v3``, deterministic: no seed to line up): torchrl keeps one group per
player (``("player_1", ...)``, an agent dim of 1), ours one ``"agents"`` group of both players;
agent ``i`` of ours is compared with torchrl's ``player_<i+1>``. A parallel env (MPE's
``simple_spread_v3``): torchrl's group ``"agent"`` against our ``"agents"``, from the same
episode of PettingZoo's seeded stream.
"""

from __future__ import annotations

import pytest

pytest.importorskip("torchrl.envs.libs.pettingzoo")
pytest.importorskip("pettingzoo.classic")

import torch  # noqa: E402
from pettingzoo.classic import tictactoe_v3  # noqa: E402
from tensordict.nn import TensorDictModule, TensorDictSequential  # noqa: E402
from torch import nn  # noqa: E402
from torchrl.collectors import Collector as TorchRLCollector  # noqa: E402
from torchrl.envs.libs.pettingzoo import PettingZooWrapper  # noqa: E402

from rlcollect import Collector  # noqa: E402

pytestmark = pytest.mark.timeout(240)

FRAMES = 20  # three games of tic-tac-toe and the start of a fourth
PLAYERS = ("player_1", "player_2")


class FirstAllowed(nn.Module):
    """The lowest square the action mask allows (0 when it allows none)."""

    def forward(self, action_mask):
        return action_mask.to(torch.int64).argmax(-1)


def torchrl_batch():
    env = PettingZooWrapper(tictactoe_v3.env(), use_mask=True, categorical_actions=True)
    policy = TensorDictSequential(*(TensorDictModule(FirstAllowed(), in_keys=[(p, "action_mask")],
                                                     out_keys=[(p, "action")]) for p in PLAYERS))
    c = TorchRLCollector(env, policy, frames_per_batch=FRAMES, total_frames=FRAMES)
    try:
        return next(iter(c))
    finally:
        c.shutdown()


def our_batch():
    policy = TensorDictModule(FirstAllowed(), in_keys=[("agents", "action_mask")], out_keys=[("agents", "action")])
    c = Collector(tictactoe_v3.env(), policy, frames_per_batch=FRAMES, total_frames=FRAMES)
    try:
        return next(iter(c))
    finally:
        c.shutdown()


def test_an_aec_game_gives_torchrls_values_agent_by_agent():
    theirs, ours = torchrl_batch(), our_batch()
    # the same turns, episodes and trajectory ids
    for key in ("done", "terminated", ("next", "done"), ("next", "terminated"), ("next", "truncated"),
                ("collector", "traj_ids")):
        assert torch.equal(theirs[key], ours[key]), key
    assert ours["next", "done"].sum() == 2
    for i, player in enumerate(PLAYERS):
        same = {("mask",): "mask", ("action",): "action", ("observation",): ("observation", "observation"),
                ("next", "observation"): ("next", "observation", "observation"), ("next", "reward"): ("next", "reward"),
                ("next", "terminated"): ("next", "terminated"), ("next", "truncated"): ("next", "truncated"),
                ("next", "done"): ("next", "done")}
        for ours_key, their_key in same.items():
            nxt = ours_key[0] == "next"
            mine = ours.get(("next", "agents", *ours_key[1:]) if nxt else ("agents", *ours_key))[:, i]
            their_parts = (their_key,) if isinstance(their_key, str) else their_key
            their = theirs.get(("next", player, *their_parts[1:]) if nxt else (player, *their_parts))[:, 0]
            assert torch.equal(mine, their), (player, ours_key)
        acting = ours["agents", "mask"][:, i]
        # the acting player's action mask is the env's in both; the waiting player's: torchrl
        # writes all True, ours the env's observe(agent) (tic-tac-toe: nothing allowed)
        assert torch.equal(ours["agents", "action_mask"][acting, i], theirs[player, "action_mask"][acting, 0])
        assert theirs[player, "action_mask"][~acting, 0].all()
        assert not ours["agents", "action_mask"][~acting, i].any()
        # ("next", ..., "mask"): torchrl's is the player whose turn comes next (the other one,
        # at a game's last step too); ours, the agents in the episode before the turn (whose
        # "next" entries are real): every agent, every turn of tic-tac-toe
        assert torch.equal(theirs["next", player, "mask"][:, 0], ~acting)
        assert ours["next", "agents", "mask"][:, i].all()


# -- a parallel env: MPE's simple_spread ------------------------------------------------------------------
class Towards(nn.Module):
    """A deterministic action from each agent's velocity signs (so both runs act alike)."""

    def forward(self, observation):
        return (observation[..., 0] > 0).to(torch.int64) + 2 * (observation[..., 1] > 0).to(torch.int64)


def spread():
    simple_spread_v3 = pytest.importorskip("mpe2.simple_spread_v3")
    return simple_spread_v3.parallel_env(N=3, max_cycles=5)


def test_a_parallel_env_gives_torchrls_values_agent_by_agent():
    # Both start from the third episode drawn after a reset with seed 0: torchrl's wrapper resets
    # with its seed when built, we reset once more, and its collector resets once; ours is
    # reset with seed 0 here, probed once (a reset: do infos carry action masks?) and reset by
    # the collector. Every later episode continues PettingZoo's stream in both.
    env = PettingZooWrapper(spread(), use_mask=True, categorical_actions=True, seed=0)
    env.reset()
    group = list(env.group_map)[0]  # torchrl's MPE group: "agent"
    c = TorchRLCollector(env, TensorDictModule(Towards(), in_keys=[(group, "observation")],
                                               out_keys=[(group, "action")]), frames_per_batch=12, total_frames=12)
    try:
        theirs = next(iter(c))
    finally:
        c.shutdown()
    raw = spread()
    raw.reset(seed=0)
    c = Collector(raw, TensorDictModule(Towards(), in_keys=[("agents", "observation")],
                                        out_keys=[("agents", "action")]), frames_per_batch=12, total_frames=12)
    try:
        ours = next(iter(c))
    finally:
        c.shutdown()
    assert ours["next", "done"].sum() == 2  # (two episodes of 5 steps end in the batch)
    for key in theirs.keys(include_nested=True, leaves_only=True):
        parts = (key,) if isinstance(key, str) else key
        mine = tuple("agents" if p == group else p for p in parts)
        if mine in (("agents", "done"), ("agents", "terminated"), ("agents", "truncated")):
            continue  # torchrl's copies of the agents' flags at the root: ours has them under "next" only
        if mine == ("next", "agents", "mask"):
            # torchrl's: the agents left after the step (none once the episode ends); ours:
            # the agents that acted, whose "next" entries are real
            assert torch.equal(theirs[key], ~theirs["next", "done"].expand_as(theirs[key]))
            assert ours[mine].all()
            continue
        assert torch.equal(theirs[key], ours[mine]), key
