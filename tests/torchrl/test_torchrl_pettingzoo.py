"""rlcollect's PettingZoo adapters (``rlcollect.envs``, no torchrl needed) side by side with
torchrl 0.14.1's ``PettingZooWrapper`` and ``Collector`` on the same game and policy.

An AEC game (``tictactoe_v3``, deterministic: no seed to line up): torchrl keeps one group per
player (``("player_1", ...)``, an agent dim of 1), ours one ``"agents"`` group of both players;
agent ``i`` of ours is compared with torchrl's ``player_<i+1>``.
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
