"""A torchrl 0.14 collection script, ported to rlcollect by its import line alone
(docs/migrating-from-torchrl.md, "torchrl 0.14"): torchrl's ``Collector`` with its 0.14
arguments (``track_policy_version``, ``compact_obs``, the collect hooks, ``use_buffers=None``),
``iterator()``, ``increment_version()``, ``stats()``.

Run: ``python examples/torchrl014_port.py`` (needs torchrl for its env; tests/torchrl runs it
with both imports and compares the output).
"""

import torch
from tensordict.nn import TensorDictModule
from torchrl.envs import GymEnv, StepCounter, TransformedEnv

from rlcollect import Collector  # torchrl 0.14: from torchrl.collectors import Collector


class Greedy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(4, 2)

    def forward(self, observation):
        return self.net(observation).argmax(-1)


def main() -> None:
    torch.manual_seed(0)
    env = TransformedEnv(GymEnv("CartPole-v1", categorical_action_encoding=True), StepCounter())
    env.set_seed(0)
    policy = TensorDictModule(Greedy(), in_keys=["observation"], out_keys=["action"])
    batches = []
    collector = Collector(env, policy, frames_per_batch=50, total_frames=150, track_policy_version=True,
                          compact_obs=True, use_buffers=None, weight_recv_schemes=None,
                          pre_collect_hook=lambda: batches.append("start"))
    collector.post_collect_hook = lambda batch: batches.append(batch.numel())
    for batch in collector.iterator():
        print(tuple(batch.shape), "next observation kept:", ("next", "observation") in batch.keys(True),
              "versions:", sorted(set(batch["policy_version"].tolist())),
              "reward:", float(batch["next", "reward"].sum()))
        collector.increment_version()
    stats = collector.stats()
    print({k: stats[k] for k in ("frames", "batches", "total_frames", "completed", "requested_frames_per_batch")})
    print("hooks:", batches)
    collector.shutdown()


if __name__ == "__main__":
    main()
