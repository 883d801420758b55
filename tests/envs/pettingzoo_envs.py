"""Small PettingZoo parallel envs for the adapter's tests (module level: workers import them)."""

from __future__ import annotations

import numpy as np
from gymnasium import spaces
from pettingzoo import ParallelEnv


class LeavingAgentsEnv(ParallelEnv):
    """Three agents; ``agent_i`` terminates after ``i + 2`` steps, so they leave one by one and
    the episode ends after 4 steps. Observation ``[step, i]``, reward ``i + action``, three
    discrete actions of which action 1 is allowed on even steps only (``infos[agent]
    ["action_mask"]``); ``drop_mask_at``: the step whose infos lack agent_2's mask."""

    metadata = {"name": "leaving_agents_v0"}

    def __init__(self, drop_mask_at: int | None = None):
        self.possible_agents = [f"agent_{i}" for i in range(3)]
        self.drop_mask_at = drop_mask_at
        self.agents: list[str] = []
        self.t = 0

    def observation_space(self, agent):
        return spaces.Box(-np.inf, np.inf, (2,), np.float32)

    def action_space(self, agent):
        return spaces.Discrete(3)

    def _obs(self):
        return {a: np.array([self.t, int(a[-1])], np.float32) for a in self.agents}

    def _infos(self):
        mask = np.array([True, self.t % 2 == 0, True])
        infos = {a: {"action_mask": mask.copy()} for a in self.agents}
        if self.drop_mask_at == self.t and "agent_2" in infos:
            infos["agent_2"] = {}
        return infos

    def reset(self, seed=None, options=None):
        self.agents = list(self.possible_agents)
        self.t = 0
        return self._obs(), self._infos()

    def step(self, actions):
        assert set(actions) == set(self.agents), (actions, self.agents)
        self.t += 1
        rewards = {a: float(int(a[-1]) + int(actions[a])) for a in self.agents}
        terms = {a: self.t >= int(a[-1]) + 2 for a in self.agents}
        truncs = {a: False for a in self.agents}
        obs = self._obs()
        self.agents = [a for a in self.agents if not terms[a]]
        return obs, rewards, terms, truncs, self._infos()


class MixedSpacesEnv(LeavingAgentsEnv):
    def observation_space(self, agent):
        return spaces.Box(-1, 1, (2 if agent == "agent_0" else 3,), np.float32)
