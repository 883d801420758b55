"""What several torchrl side-by-side tests share: envs, policies and layout readers, at module
level so that the multi-process collectors (ours and torchrl's) can send them to their workers.

Imported only by the tests of this folder, after their ``pytest.importorskip("torchrl...")``
(this module imports torchrl).
"""

from __future__ import annotations

import torch
from tensordict.nn import TensorDictModule
from torch import nn
from torchrl.envs import GymEnv, SerialEnv
from torchrl.modules import MLP, ProbabilisticActor

#: Our async and distributed batches also say which worker / node collected them (documented):
#: the entries they write besides torchrl's (``our_leaves`` checks and drops them).
OURS_ONLY = (("collector", "worker_id"), ("collector", "node_id"))


# -- envs ----------------------------------------------------------------------------------------
def cartpole(categorical: bool = True) -> GymEnv:
    # categorical (the default): the action is an index, as our layout comparisons with torchrl
    # expect (with one-hot actions torchrl's own collector writes the one-hot action).
    return GymEnv("CartPole-v1", categorical_action_encoding=categorical)


def serial_cartpole() -> SerialEnv:
    return SerialEnv(2, cartpole)


# -- policies ------------------------------------------------------------------------------------
class Zero(nn.Module):
    """Always action 0: a batch with any other action was acted randomly."""

    def forward(self, observation):
        return torch.zeros(observation.shape[:-1], dtype=torch.int64)


def zero_policy() -> TensorDictModule:
    return TensorDictModule(Zero(), in_keys=["observation"], out_keys=["action"])


class Argmax(nn.Module):
    def forward(self, logits):
        return logits.argmax(-1)


def actor() -> ProbabilisticActor:
    torch.manual_seed(0)
    net = TensorDictModule(MLP(in_features=4, out_features=2, num_cells=[16]), in_keys=["observation"],
                           out_keys=["logits"])
    return ProbabilisticActor(net, in_keys=["logits"], distribution_class=torch.distributions.Categorical,
                              return_log_prob=True)


# -- layouts -------------------------------------------------------------------------------------
def leaves(td) -> dict:
    return {k: (tuple(v.shape), v.dtype) for k, v in td.items(include_nested=True, leaves_only=True)}


def our_leaves(td) -> dict:
    found = leaves(td)
    for key in OURS_ONLY:
        if key in found:
            assert found.pop(key) == (tuple(td.shape), torch.int64)
    return found
