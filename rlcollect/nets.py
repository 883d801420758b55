"""Small reference networks: the policy of ``rlcollect collect --policy mlp``, which the
benchmark suite (``bench/`` in a source checkout) measures too, so both act the same."""

from __future__ import annotations

import torch
from torch import nn


class ArgmaxMLP(nn.Module):
    """A small MLP policy: observation -> ``depth`` hidden tanh layers of ``hidden`` units ->
    the argmax over ``num_actions`` logits (a discrete action index).

    Example:
        >>> import torch
        >>> torch.manual_seed(0) and None
        >>> policy = ArgmaxMLP(obs_dim=4, num_actions=2)
        >>> action = policy(torch.zeros(3, 4))
        >>> action.shape, action.dtype, bool(((action == 0) | (action == 1)).all())
        (torch.Size([3]), torch.int64, True)
    """

    def __init__(self, obs_dim: int, num_actions: int, hidden: int = 64, depth: int = 2):
        super().__init__()
        layers: list[nn.Module] = []
        width = obs_dim
        for _ in range(depth):
            layers += [nn.Linear(width, hidden), nn.Tanh()]
            width = hidden
        layers.append(nn.Linear(width, num_actions))
        self.net = nn.Sequential(*layers)

    def forward(self, observation: torch.Tensor) -> torch.Tensor:
        return self.net(observation).argmax(-1)
