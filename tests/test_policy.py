"""Policies in the single-process ``Collector`` (SPEC sections 3, 4 and 6): every policy form,
exploration types, init_random_frames, policy_factory and weight updates."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
import torch
from helpers_collector import (
    POLICY_VERSION,
    leaf_keys,
    make_collector,  # noqa: F401  (fixture)
    take,
)
from tensordict import TensorDict
from tensordict.nn import (
    ProbabilisticTensorDictModule,
    ProbabilisticTensorDictSequential,
    TensorDictModule,
    TensorDictModuleBase,
    TensorDictSequential,
)
from torch import nn

try:  # tensordict >= 0.15 exports it from tensordict.nn; 0.14 only from its probabilistic module
    from tensordict.nn import interaction_type
except ImportError:
    from tensordict.nn.probabilistic import interaction_type

from rlcollect import (
    Collector,
    CountingEnv,
    ExplorationType,
    GymEnv,
    NoWeightSyncScheme,
    SharedMemWeightSyncScheme,
)


# -- policies used below ------------------------------------------------------------------------------
class ThresholdPolicy(nn.Module):
    """action = observation * w + b > 0.5, with ``b`` a registered buffer (weights and buffers
    both decide the action, so an update of either shows in the data)."""

    def __init__(self, w: float = 0.0, b: float = 0.0):
        super().__init__()
        self.w = nn.Parameter(torch.tensor([w]))
        self.register_buffer("b", torch.tensor([b]))

    def forward(self, observation):
        return (observation[..., 0] * self.w[0] + self.b[0] > 0.5).long()


class AlwaysOne(nn.Module):
    def __init__(self):
        super().__init__()
        self.unused = nn.Parameter(torch.zeros(1))

    def forward(self, observation):
        return torch.ones(observation.shape[:-1], dtype=torch.int64)


class Logits(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(1, 2)

    def forward(self, observation):
        return self.linear(observation)


class Argmax(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, observation):
        return self.inner(observation).argmax(-1)


def categorical(bias=(0.0, 0.5), return_log_prob=True):
    """Categorical policy over 2 actions whose mode is ``argmax(bias)`` (weights are zero)."""
    linear = nn.Linear(1, 2)
    with torch.no_grad():
        linear.weight.zero_()
        linear.bias.copy_(torch.tensor(bias))
    return ProbabilisticTensorDictSequential(
        TensorDictModule(linear, in_keys=["observation"], out_keys=["logits"]),
        ProbabilisticTensorDictModule(in_keys=["logits"], out_keys=["action"],
                                      distribution_class=torch.distributions.Categorical,
                                      return_log_prob=return_log_prob),
    )


class InteractionRecorder(TensorDictModuleBase):
    """Records the interaction type every call runs under."""

    in_keys = ["observation"]
    out_keys = ["action"]

    def __init__(self):
        super().__init__()
        self.seen = []

    def forward(self, td):
        self.seen.append(interaction_type())
        td.set("action", torch.zeros(td.batch_size, dtype=torch.int64))
        return td


class DictObsEnv(gym.Env):
    """Dict observation {"pos": (2,), "vel": (1,)}; pos = [t, -t], vel = [10]; ends after 4 steps."""

    def __init__(self):
        self.observation_space = gym.spaces.Dict({
            "pos": gym.spaces.Box(-100, 100, (2,), np.float32),
            "vel": gym.spaces.Box(-100, 100, (1,), np.float32),
        })
        self.action_space = gym.spaces.Discrete(2)
        self.t = 0

    def _obs(self):
        return {"pos": np.array([self.t, -self.t], np.float32), "vel": np.array([10.0], np.float32)}

    def reset(self, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return self._obs(), {}

    def step(self, action):
        self.t += 1
        return self._obs(), 1.0, self.t >= 4, False, {}


# -- policy forms ------------------------------------------------------------------------------------------
def test_random_policy(make_collector):
    c = make_collector(CountingEnv(batch_size=[4]), None, frames_per_batch=40)
    batch = next(c)
    assert batch["action"].dtype == torch.int64
    assert sorted(batch["action"].unique().tolist()) == [0, 1]
    assert c.policy is None


def test_tensordict_module_with_sampler(make_collector):
    policy = TensorDictSequential(
        TensorDictModule(nn.Linear(1, 2), in_keys=["observation"], out_keys=["logits"]),
        TensorDictModule(lambda logits: logits.argmax(-1), in_keys=["logits"], out_keys=["action"]),
    )
    c = make_collector(CountingEnv(max_steps=5, batch_size=[2, 3]), policy, frames_per_batch=24)
    batch = next(c)
    assert "logits" in leaf_keys(batch)
    assert batch["logits"].shape == (2, 3, 4, 2)
    assert batch["logits"].dtype == torch.float32
    assert torch.equal(batch["action"], batch["logits"].argmax(-1))
    with torch.no_grad():
        expected = policy[0].module(batch["observation"])
    torch.testing.assert_close(batch["logits"], expected)  # computed on the row's own observation


def test_private_keys_never_appear(make_collector):
    policy = TensorDictModule(lambda o: (o[..., 0].long() % 2, o * 2), in_keys=["observation"],
                              out_keys=["action", "_hidden"])
    batch = next(make_collector(CountingEnv(max_steps=10), policy, frames_per_batch=4))
    assert not any(k.startswith("_") for key in leaf_keys(batch) for k in ((key,) if isinstance(key, str) else key))
    assert batch["action"].tolist() == [0, 1, 0, 1]


@pytest.mark.parametrize("exploration", [ExplorationType.DETERMINISTIC, ExplorationType.MODE, "MODE", "deterministic"])
def test_probabilistic_policy_deterministic(make_collector, exploration):
    c = make_collector(CountingEnv(batch_size=[4]), categorical(), frames_per_batch=40, exploration_type=exploration)
    batch = next(c)
    assert (batch["action"] == 1).all()
    assert torch.equal(batch["action"], batch["logits"].argmax(-1))


def test_probabilistic_policy_random_samples(make_collector):
    c = make_collector(CountingEnv(batch_size=[4]), categorical(), frames_per_batch=80,
                       exploration_type=ExplorationType.RANDOM)
    c.set_seed(0)
    batch = next(c)
    assert sorted(batch["action"].unique().tolist()) == [0, 1]  # mode is 1; 0 has p ~ 0.38
    assert {"logits", "action_log_prob"} <= leaf_keys(batch)
    log_probs = torch.log_softmax(batch["logits"], -1).gather(-1, batch["action"].unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(batch["action_log_prob"], log_probs)


@pytest.mark.parametrize("exploration", list(ExplorationType))
def test_every_rollout_runs_under_the_exploration_type(make_collector, exploration):
    policy = InteractionRecorder()
    c = make_collector(CountingEnv(), policy, frames_per_batch=3, exploration_type=exploration)
    take(c, 2)
    assert len(policy.seen) == 1 + 6  # the construction dry run, then one call per step
    assert set(policy.seen) == {exploration}


def test_default_exploration_is_random(make_collector):
    policy = InteractionRecorder()
    next(make_collector(CountingEnv(), policy, frames_per_batch=2))
    assert set(policy.seen) == {ExplorationType.RANDOM}


def test_plain_module_forward_observation(make_collector):
    policy = Logits()
    c = make_collector(CountingEnv(batch_size=[3]), Argmax(policy), frames_per_batch=12)
    batch = next(c)
    with torch.no_grad():
        expected = policy(batch["observation"]).argmax(-1)
    assert torch.equal(batch["action"], expected)
    assert leaf_keys(batch) == leaf_keys(next(make_collector(CountingEnv(batch_size=[3]), frames_per_batch=12)))


def test_plain_function(make_collector):
    c = make_collector(CountingEnv(max_steps=10, batch_size=[2]), lambda observation: (observation[..., 0] >= 2).long(),
                       frames_per_batch=8)
    assert next(c)["action"].tolist() == [[0, 0, 1, 1]] * 2


def test_single_argument_with_any_name_takes_the_only_observation(make_collector):
    c = make_collector(CountingEnv(max_steps=10), lambda x: (x[..., 0] >= 1).long(), frames_per_batch=3)
    assert next(c)["action"].tolist() == [0, 1, 1]


@pytest.mark.parametrize("order", ["pos_vel", "vel_pos"])
def test_forward_arguments_matched_to_dict_observation_keys(make_collector, order):
    if order == "pos_vel":
        def policy(pos, vel):
            return (pos[..., 0] + vel[..., 0] > 11).long()
    else:
        def policy(vel, pos):
            return (pos[..., 0] + vel[..., 0] > 11).long()
    c = make_collector(GymEnv(DictObsEnv), policy, frames_per_batch=6)
    batch = next(c)
    assert {"pos", "vel", ("next", "pos"), ("next", "vel")} <= leaf_keys(batch)
    assert batch["pos"][:, 0].tolist() == [0, 1, 2, 3, 0, 1]
    assert batch["action"].tolist() == [0, 0, 1, 1, 0, 0]


def test_unmatched_forward_argument_lists_available_keys():
    env = GymEnv(DictObsEnv)
    with pytest.raises(TypeError, match=r"'x'.*\['pos', 'vel'\]"):
        Collector(env, lambda x: x[..., 0].long(), frames_per_batch=4)
    assert env._closed  # the failed construction closed the env
    with pytest.raises(TypeError, match=r"\['speed'\].*\['pos', 'vel'\]"):
        Collector(GymEnv(DictObsEnv), lambda pos, speed: pos[..., 0].long(), frames_per_batch=4)
    with pytest.raises(TypeError, match="no observation argument"):
        Collector(GymEnv(DictObsEnv), lambda: 0, frames_per_batch=4)


def test_logits_instead_of_action_is_a_shape_error():
    with pytest.raises(TypeError, match=r"shape \(2,\).*expects \(\)"):
        Collector(CountingEnv(), Logits(), frames_per_batch=4)


def test_float_action_for_discrete_env():
    with pytest.raises(TypeError, match="integer"):
        Collector(CountingEnv(), lambda observation: observation[..., 0] * 0.5, frames_per_batch=4)


def test_policy_returning_no_tensor():
    with pytest.raises(TypeError, match="must return the action tensor"):
        Collector(CountingEnv(), lambda observation: [1], frames_per_batch=4)


def test_tensordict_module_without_action():
    policy = TensorDictModule(nn.Linear(1, 2), in_keys=["observation"], out_keys=["logits"])
    with pytest.raises(TypeError, match="did not write 'action'"):
        Collector(CountingEnv(), policy, frames_per_batch=4)


def test_policy_of_wrong_type():
    with pytest.raises(TypeError, match="policy must be"):
        Collector(CountingEnv(), 42, frames_per_batch=4)


def test_user_policy_is_not_copied(make_collector):
    policy = ThresholdPolicy(w=0.0)
    c = make_collector(CountingEnv(max_steps=10), policy, frames_per_batch=4)
    assert c.policy is policy
    assert next(c)["action"].tolist() == [0, 0, 0, 0]
    with torch.no_grad():
        policy.w.fill_(1.0)  # the collector acts with the user's own module
    assert next(c)["action"].tolist() == [1, 1, 1, 1]


def test_policy_device_cpu(make_collector):
    c = make_collector(CountingEnv(batch_size=[2]), categorical(), frames_per_batch=4, policy_device="cpu",
                       exploration_type="MODE")
    assert (next(c)["action"] == 1).all()


def test_compile_policy_eager_backend(make_collector):
    policy = Argmax(Logits())
    c = make_collector(CountingEnv(batch_size=[2]), policy, frames_per_batch=8, compile_policy={"backend": "eager"})
    batch = next(c)
    with torch.no_grad():
        assert torch.equal(batch["action"], policy(batch["observation"]))


@pytest.mark.slow  # inductor's first compile takes ~30 s on a cold cache
@pytest.mark.processes  # torch.compile starts its compile workers
def test_compile_policy_true(make_collector):
    policy = Argmax(Logits())
    c = make_collector(CountingEnv(batch_size=[2]), policy, frames_per_batch=8, compile_policy=True)
    batch = next(c)
    with torch.no_grad():
        assert torch.equal(batch["action"], policy(batch["observation"]))


# -- init_random_frames --------------------------------------------------------------------------------------
def test_init_random_frames_whole_batches(make_collector):
    c = make_collector(CountingEnv(batch_size=[4]), AlwaysOne(), frames_per_batch=40, init_random_frames=50,
                       total_frames=160)
    c.set_seed(0)
    actions = [b["action"] for b in c]
    assert len(actions) == 4
    for random_batch in actions[:2]:  # ceil(50 / 40) = 2 random batches
        assert sorted(random_batch.unique().tolist()) == [0, 1]
    for policy_batch in actions[2:]:
        assert (policy_batch == 1).all()


def test_init_random_frames_zeroes_policy_outputs(make_collector):
    policy = TensorDictSequential(
        TensorDictModule(nn.Linear(1, 2), in_keys=["observation"], out_keys=["logits"]),
        TensorDictModule(lambda logits: logits.argmax(-1), in_keys=["logits"], out_keys=["action"]),
    )
    c = make_collector(CountingEnv(batch_size=[2]), policy, frames_per_batch=10, init_random_frames=10)
    random_batch, policy_batch = take(c, 2)
    assert (random_batch["logits"] == 0).all()
    assert not (policy_batch["logits"] == 0).all()
    assert torch.equal(policy_batch["action"], policy_batch["logits"].argmax(-1))


# -- policy_factory and weight updates ---------------------------------------------------------------------------
def test_policy_factory_builds_the_policy(make_collector):
    built = []

    def factory():
        built.append(ThresholdPolicy(w=1.0))
        return built[-1]

    c = make_collector(CountingEnv(max_steps=10), policy_factory=factory, frames_per_batch=4)
    assert len(built) == 1
    assert c.policy is built[0]
    assert next(c)["action"].tolist() == [0, 1, 1, 1]


def test_policy_with_policy_factory_needs_a_scheme():
    with pytest.raises(ValueError, match="weight_sync_schemes"):
        Collector(CountingEnv(), ThresholdPolicy(), policy_factory=ThresholdPolicy, frames_per_batch=4)


def test_policy_is_only_the_weight_source_with_policy_factory(make_collector):
    source = ThresholdPolicy(w=1.0, b=0.0)
    c = make_collector(CountingEnv(max_steps=10), source, policy_factory=lambda: ThresholdPolicy(w=0.0),
                       frames_per_batch=4, weight_sync_schemes={"policy": SharedMemWeightSyncScheme()},
                       track_policy_version=True)
    assert c.policy is not source
    first = next(c)
    assert first["action"].tolist() == [0, 0, 0, 0]  # the built policy acts, with its own weights
    c.update_policy_weights_()
    assert torch.equal(c.policy.w, source.w)
    second = next(c)
    assert second["action"].tolist() == [1, 1, 1, 1]  # observations 4..7 with w = 1
    assert second[POLICY_VERSION].tolist() == [1] * 4
    with torch.no_grad():
        source.b.fill_(-10.0)  # a buffer travels too
    c.update_policy_weights_()
    assert c.policy.b.item() == -10.0
    assert next(c)["action"].tolist() == [0, 0, 0, 0]


def _as_module(w, b):
    return ThresholdPolicy(w=w, b=b)


def _as_tensordict(w, b):
    return TensorDict.from_module(ThresholdPolicy(w=w, b=b))


def _as_state_dict(w, b):
    return {"w": torch.tensor([w]), "b": torch.tensor([b])}


@pytest.mark.parametrize("form", [_as_module, _as_tensordict, _as_state_dict])
def test_update_policy_weights_forms(make_collector, form):
    policy = ThresholdPolicy(w=0.0, b=0.0)
    c = make_collector(CountingEnv(max_steps=10), policy, frames_per_batch=4, track_policy_version=True)
    assert next(c)["action"].tolist() == [0, 0, 0, 0]
    c.update_policy_weights_(form(2.0, 1.0))
    assert policy.w.item() == 2.0
    assert policy.b.item() == 1.0  # the buffer too
    assert c.policy_version == 1
    batch = next(c)
    assert batch["action"].tolist() == [1, 1, 1, 1]
    assert batch[POLICY_VERSION].tolist() == [1, 1, 1, 1]


def test_update_without_weights_bumps_the_version(make_collector):
    c = make_collector(CountingEnv(batch_size=[2]), ThresholdPolicy(), frames_per_batch=4, track_policy_version=True)
    versions = [next(c)[POLICY_VERSION]]
    c.update_policy_weights_()
    versions.append(next(c)[POLICY_VERSION])
    c.update_policy_weights_()
    c.update_policy_weights_()
    versions.append(next(c)[POLICY_VERSION])
    assert [v.tolist() for v in versions] == [[[0, 0], [0, 0]], [[1, 1], [1, 1]], [[3, 3], [3, 3]]]
    assert c.policy_version == 3
    assert c.stats()["policy_version"] == 3
    assert c.state_dict()["policy_version"] == 3


@pytest.mark.parametrize("policy", [None, lambda observation: observation[..., 0].long() * 0])
def test_update_without_parameters_raises(make_collector, policy):
    c = make_collector(CountingEnv(), policy, frames_per_batch=4)
    with pytest.raises(RuntimeError, match="no parameters"):
        c.update_policy_weights_()
    assert c.policy_version == 0


@pytest.mark.parametrize("scheme", [NoWeightSyncScheme(), "none"])
def test_no_weight_sync_scheme_makes_updates_no_ops(make_collector, scheme):
    policy = ThresholdPolicy(w=0.0)
    c = make_collector(CountingEnv(max_steps=10), policy, frames_per_batch=4,
                       weight_sync_schemes={"policy": scheme}, track_policy_version=True)
    c.update_policy_weights_(ThresholdPolicy(w=5.0, b=5.0))
    assert policy.w.item() == 0.0 and policy.b.item() == 0.0
    assert c.policy_version == 0
    batch = next(c)
    assert batch["action"].tolist() == [0, 0, 0, 0]
    assert batch[POLICY_VERSION].tolist() == [0, 0, 0, 0]


def test_update_policy_weights_bad_arguments(make_collector):
    policy = ThresholdPolicy()
    c = make_collector(CountingEnv(), policy, frames_per_batch=4)
    with pytest.raises(ValueError, match="model_id"):
        c.update_policy_weights_(model_id="critic")
    with pytest.raises(ValueError, match="worker_ids"):
        c.update_policy_weights_(worker_ids=[1])
    with pytest.raises(TypeError, match="weights"):
        c.update_policy_weights_(42)
    with pytest.raises(RuntimeError):
        c.update_policy_weights_({"w": torch.zeros(3)})  # wrong shape
    assert c.policy_version == 0
    c.update_policy_weights_(worker_ids=0)
    assert c.policy_version == 1


class TwoLayers(nn.Module):
    def __init__(self, hidden: int = 3):
        super().__init__()
        self.first = nn.Linear(1, hidden)
        self.second = nn.Linear(hidden, 2)

    def forward(self, observation):
        return self.second(self.first(observation)).argmax(-1)


@pytest.mark.parametrize("form", ["module", "tensordict", "state_dict"])
def test_failed_update_changes_nothing(make_collector, form):
    policy = TwoLayers()
    c = make_collector(CountingEnv(), policy, frames_per_batch=4)
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    wrong = TwoLayers(hidden=4)  # first.bias fits nowhere, second.bias (2,) fits
    with torch.no_grad():
        wrong.second.bias.fill_(5.0)
    weights = {"module": wrong, "tensordict": TensorDict.from_module(wrong).data,
               "state_dict": wrong.state_dict()}[form]
    with pytest.raises(RuntimeError, match="size mismatch"):
        c.update_policy_weights_(weights)
    for key, value in policy.state_dict().items():
        assert torch.equal(value, before[key]), f"{key} was half-updated"
    assert c.policy_version == 0
    next(c)  # still usable
