"""The policies of the real workloads (``bench/workloads.py`` names them): a Nature-CNN for
Pong's frames, a tanh MLP for HalfCheetah's states; both deterministic, built under seed 0.

Example:
    >>> import torch
    >>> from bench.policies import nature_cnn
    >>> nature_cnn()(torch.zeros(2, 4, 84, 84, dtype=torch.uint8)).shape
    torch.Size([2])
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn


class NatureCNN(nn.Module):
    """The DQN paper's network (3 convolutions, 512 hidden, one logit per action) with argmax:
    ``(N, 4, 84, 84)`` uint8 frames -> ``(N,)`` int64 actions."""

    def __init__(self, num_actions: int = 6):
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(4, 32, 8, stride=4), nn.ReLU(),
            nn.Conv2d(32, 64, 4, stride=2), nn.ReLU(),
            nn.Conv2d(64, 64, 3, stride=1), nn.ReLU(),
            nn.Flatten(), nn.Linear(64 * 7 * 7, 512), nn.ReLU(),
            nn.Linear(512, num_actions),
        )

    def forward(self, observation: torch.Tensor) -> torch.Tensor:
        return self.net(observation.float() / 255.0).argmax(-1)


class TanhMLP(nn.Module):
    """A deterministic MLP policy for continuous control (2 tanh layers of 64, tanh on the
    output): ``(N, obs_dim)`` -> ``(N, act_dim)`` float32 actions in [-1, 1]."""

    def __init__(self, obs_dim: int = 17, act_dim: int = 6, hidden: int = 64):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(obs_dim, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(),
                                 nn.Linear(hidden, act_dim), nn.Tanh())

    def forward(self, observation: torch.Tensor) -> torch.Tensor:
        return self.net(observation.float())


def nature_cnn() -> NatureCNN:
    torch.manual_seed(0)
    return NatureCNN(num_actions=6)


def cheetah_mlp() -> TanhMLP:
    torch.manual_seed(0)
    return TanhMLP(obs_dim=17, act_dim=6)


def policy_actions(policy: nn.Module, observations: np.ndarray) -> np.ndarray:
    """Run ``policy`` on a batch of observations (numpy) and return its actions (numpy)."""
    with torch.no_grad():
        return policy(torch.from_numpy(np.asarray(observations))).numpy()
