"""torchrl 0.14's ``Evaluator``, its ``PPOTrainer`` / ``DQNTrainer`` and its ``make_trainer`` helper
driving an rlcollect ``Collector``, side by side with torchrl's own ``Collector`` on the same seeded
CartPole and the same seeded torch stream (issue 28): the same evaluation metrics and videos, the
same batches, losses and trained parameters, exactly.

Runs in ``.venv-torchrl`` (``make test-torchrl``); skipped where torchrl is not installed.
"""

from __future__ import annotations

import warnings

import pytest

pytest.importorskip("torchrl.collectors")

import torch  # noqa: E402
from tensordict.nn import TensorDictModule, TensorDictSequential  # noqa: E402
from torch import nn  # noqa: E402
from torchrl import collectors as trc  # noqa: E402
from torchrl.collectors import Evaluator  # noqa: E402
from torchrl.data import LazyTensorStorage, ReplayBuffer, TensorDictReplayBuffer  # noqa: E402
from torchrl.data.replay_buffers.samplers import SamplerWithoutReplacement  # noqa: E402
from torchrl.envs import Compose, GymEnv, RewardSum, TransformedEnv, UnsqueezeTransform  # noqa: E402
from torchrl.modules import MLP, EGreedyModule, ProbabilisticActor, QValueActor, ValueOperator  # noqa: E402
from torchrl.objectives import ClipPPOLoss, DQNLoss, HardUpdate  # noqa: E402
from torchrl.record import VideoRecorder  # noqa: E402
from torchrl.trainers.algorithms import DQNTrainer, PPOTrainer  # noqa: E402
from torchrl.trainers.helpers import make_trainer  # noqa: E402
from torchrl.trainers.helpers.collectors import _make_collector  # noqa: E402
from torchrl.trainers.helpers.trainers import TrainerConfig  # noqa: E402

import rlcollect  # noqa: E402

pytestmark = [pytest.mark.timeout(120), pytest.mark.filterwarnings("ignore::UserWarning"),
              pytest.mark.filterwarnings("ignore::FutureWarning")]
BOTH = [trc.Collector, rlcollect.Collector]
METRICS = ("eval/reward", "eval/reward_std", "eval/num_episodes", "eval/episode_length", "eval/step")


class Lean(nn.Module):
    """Pushes the cart the way the pole leans: deterministic, episodes of varied length."""

    def forward(self, observation):
        return (observation[..., 2] > 0.05).long()


class VideoLog:
    """A logger as ``VideoRecorder`` uses one: records each ``log_video`` call."""

    def __init__(self):
        self.calls = []

    def log_video(self, name, video, step=None, **kwargs):
        self.calls.append((name, step, tuple(video.shape), int(video.sum())))


# -- Evaluator ------------------------------------------------------------------------------------------
def evaluations(collector_cls):
    """Three evaluations (``evaluate``, ``trigger_eval`` + ``wait``, ``trigger_eval`` + ``poll``)
    of a seeded env that records a video of a (1, 4) "pixels" entry, and the videos logged."""
    log = VideoLog()
    env = TransformedEnv(GymEnv("CartPole-v1", categorical_action_encoding=True), Compose(
        UnsqueezeTransform(-2, in_keys=["observation"], out_keys=["pixels"]),
        VideoRecorder(log, "eval/video", in_keys=["pixels"])))
    env.set_seed(0)
    policy = TensorDictModule(Lean(), in_keys=["observation"], out_keys=["action"])
    evaluator = Evaluator(env, policy, num_trajectories=2, max_steps=50, frames_per_batch=20,
                          collector_cls=collector_cls)
    try:
        results = [evaluator.evaluate(step=10)]
        assert evaluator.trigger_eval(step=20)
        results.append(evaluator.wait(timeout=100))
        assert evaluator.trigger_eval(step=30)
        for _ in range(1000):
            result = evaluator.poll(timeout=0.1)
            if result is not None:
                break
        results.append(result)
    finally:
        evaluator.shutdown()
    return [{k: r[k] for k in METRICS} for r in results], log.calls


def test_the_evaluator_gives_torchrls_metrics_and_videos_with_our_collector():
    """``_dump_env_transform`` (torchrl's, called after each evaluation) dumps the recorder with
    the evaluation's step; the env reset once at construction gives torchrl's episodes."""
    (theirs, their_videos), (ours, our_videos) = (evaluations(cls) for cls in (None, rlcollect.Collector))
    assert ours == theirs
    assert [r["eval/num_episodes"] for r in ours] == [2, 2, 2]
    assert our_videos == their_videos
    assert [(name, step) for name, step, _, _ in our_videos] == [("eval/video", 10), ("eval/video", 20),
                                                                  ("eval/video", 30)]
    assert all(shape[:2] == (1, 41) or shape[:2] == (1, 42) for _, _, shape, _ in our_videos)


# -- PPOTrainer / DQNTrainer ----------------------------------------------------------------------------
def trained(trainer, loss):
    """Train; return the batches the trainer processed, its losses and the parameters."""
    batches, losses = [], []
    trainer.register_op("batch_process", lambda batch: batches.append(batch.clone()) or batch)
    trainer.register_op("post_loss", lambda out: losses.append(out.detach().clone()) or out)
    before = [p.detach().clone() for p in loss.parameters()]
    trainer.train()
    after = [p.detach().clone() for p in loss.parameters()]
    assert any(not torch.equal(a, b) for a, b in zip(before, after))  # it trained
    return trainer.collected_frames, batches, losses, after


def assert_same_run(ours, theirs, batches):
    (frames, our_batches, our_losses, our_params), (their_frames, their_batches, their_losses, their_params) = \
        ours, theirs
    assert frames == their_frames
    assert len(our_batches) == len(their_batches) == batches
    for a, b in zip(our_batches, their_batches):
        assert sorted(map(str, a.keys(True, True))) == sorted(map(str, b.keys(True, True)))
        for key in b.keys(True, True):
            assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key
    assert len(our_losses) == len(their_losses) > 0
    assert all((a == b).all() for a, b in zip(our_losses, their_losses))
    assert all(torch.equal(a, b) for a, b in zip(our_params, their_params))


def ppo_run(collector_cls):
    torch.manual_seed(0)
    env = GymEnv("CartPole-v1", categorical_action_encoding=True)
    env.set_seed(0)
    actor = ProbabilisticActor(
        TensorDictModule(MLP(in_features=4, out_features=2, num_cells=[16]), in_keys=["observation"],
                         out_keys=["logits"]),
        in_keys=["logits"], out_keys=["action"], spec=env.action_spec,
        distribution_class=torch.distributions.Categorical, return_log_prob=True)
    critic = ValueOperator(MLP(in_features=4, out_features=1, num_cells=[16]), in_keys=["observation"])
    loss = ClipPPOLoss(actor, critic)
    collector = collector_cls(env, actor, frames_per_batch=32, total_frames=96)
    buffer = ReplayBuffer(storage=LazyTensorStorage(32), sampler=SamplerWithoutReplacement(), batch_size=16)
    trainer = PPOTrainer(collector=collector, total_frames=96, frame_skip=1, optim_steps_per_batch=2,
                         loss_module=loss, optimizer=torch.optim.Adam(loss.parameters(), lr=1e-2),
                         replay_buffer=buffer, num_epochs=2, progress_bar=False)
    return trained(trainer, loss)


def test_ppo_trainer_trains_on_our_collector_exactly_as_on_torchrls():
    """GAE, the replay buffer, the weight updates (``UpdateWeights`` -> ``update_policy_weights_``)
    and the logging hooks run; the torch stream is seeded before the collector is built (ours
    draws nothing from it while building, as torchrl's does for this actor)."""
    assert_same_run(ppo_run(rlcollect.Collector), ppo_run(trc.Collector), batches=3)


def dqn_run(collector_cls, one_hot):
    torch.manual_seed(0)
    env = TransformedEnv(GymEnv("CartPole-v1", categorical_action_encoding=not one_hot),
                         RewardSum(in_keys=["reward"], out_keys=["reward_sum"]))  # (the trainer logs reward_sum)
    env.set_seed(0)
    value = QValueActor(MLP(in_features=4, out_features=2, num_cells=[16]), in_keys=["observation"],
                        spec=env.action_spec)
    greedy = EGreedyModule(env.action_spec, eps_init=1.0, eps_end=0.05, annealing_num_steps=64)
    loss = DQNLoss(value, delay_value=True, action_space=env.action_spec)
    collector = collector_cls(env, TensorDictSequential(value, greedy), frames_per_batch=16, total_frames=64,
                              init_random_frames=16)
    # Seeded again once the collector is built: torchrl's Collector, building, runs this policy
    # once (it has no spec for all its outputs) and EGreedyModule then draws from torch's stream
    # (no exploration type is set yet); ours draws nothing while building.
    torch.manual_seed(1)
    trainer = DQNTrainer(collector=collector, total_frames=64, frame_skip=1, optim_steps_per_batch=2,
                         loss_module=loss, optimizer=torch.optim.Adam(loss.parameters(), lr=1e-2),
                         replay_buffer=ReplayBuffer(storage=LazyTensorStorage(256), batch_size=8),
                         target_net_updater=HardUpdate(loss, value_network_update_interval=2),
                         greedy_module=greedy, progress_bar=False)
    frames, batches, losses, params = trained(trainer, loss)
    return (frames, batches, losses, params), float(greedy.eps)


@pytest.mark.parametrize("one_hot", [True, False])
def test_dqn_trainer_trains_on_our_collector_exactly_as_on_torchrls(one_hot):
    """Random frames first (``init_random_frames``), then epsilon-greedy annealed by the trainer
    (``greedy_module``), the target net updated, the replay buffer extended and sampled."""
    (ours, our_eps), (theirs, their_eps) = dqn_run(rlcollect.Collector, one_hot), dqn_run(trc.Collector, one_hot)
    assert_same_run(ours, theirs, batches=4)
    assert our_eps == their_eps == pytest.approx(0.05)


# -- torchrl's trainer helpers ----------------------------------------------------------------------------
def helper_run(collector_cls):
    torch.manual_seed(0)
    env = GymEnv("CartPole-v1")
    env.set_seed(0)
    value = QValueActor(MLP(in_features=4, out_features=2, num_cells=[16]), in_keys=["observation"],
                        spec=env.action_spec)
    greedy = EGreedyModule(env.action_spec, annealing_num_steps=32)
    collector = collector_cls(env, TensorDictSequential(value, greedy), frames_per_batch=16, total_frames=48)
    torch.manual_seed(1)  # (as in the DQN test: torchrl's Collector runs this policy once while building)
    loss = DQNLoss(value, delay_value=True, action_space=env.action_spec)
    cfg = TrainerConfig(optim_steps_per_batch=2, batch_size=8, lr_scheduler="")
    cfg.frame_skip, cfg.total_frames, cfg.frames_per_batch = 1, 48, 16
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = make_trainer(collector, loss, target_net_updater=HardUpdate(loss, value_network_update_interval=2),
                               policy_exploration=greedy, cfg=cfg,
                               replay_buffer=TensorDictReplayBuffer(storage=LazyTensorStorage(100), batch_size=8))
    trainer.progress_bar = False
    return trained(trainer, loss)


def test_make_trainer_takes_our_collector():
    assert_same_run(helper_run(rlcollect.Collector), helper_run(trc.Collector), batches=3)


def test_the_collector_helpers_build_torchrls_classes_only():
    """``sync_sync_collector`` / ``make_collector_onpolicy`` take no collector class; the private
    ``_make_collector`` does, but unwraps its one-env list and kwargs list only for torchrl's own
    ``Collector``: a single ``Collector`` of ours is handed ``create_env_kwargs=[{}]``, and says so."""
    with pytest.raises(TypeError, match="create_env_kwargs must be a dict"):
        _make_collector(rlcollect.Collector, env_fns=lambda: GymEnv("CartPole-v1"), env_kwargs=None, policy=None,
                        frames_per_batch=8, total_frames=16, num_env_per_collector=1, num_collectors=1)


def cartpole_env():
    return GymEnv("CartPole-v1")


@pytest.mark.parametrize(("cls", "per_collector"), [(rlcollect.MultiSyncCollector, 2),
                                                     (rlcollect.MultiAsyncCollector, 1)],
                         ids=["MultiSync-ParallelEnv", "MultiAsync-one-env"])
def test_make_collector_builds_our_multiprocess_collectors(cls, per_collector):
    """With our multi-process classes ``_make_collector`` works as with torchrl's: one env per
    worker, or (``num_env_per_collector=2``) a torchrl ``ParallelEnv`` of two in each (the other
    two pairings were run by hand: (2, 10) batches each; left out for the CI budget, ~11 s each)."""
    c = _make_collector(cls, env_fns=cartpole_env, env_kwargs=None, policy=None, frames_per_batch=20,
                        total_frames=60, num_env_per_collector=per_collector, num_collectors=2)
    try:
        batches = [b.clone() for b in c]
    finally:
        c.shutdown()
    assert sum(b.numel() for b in batches) == 60 and len(batches) == 3
    rows = batches[0]["observation"].shape[:-1]
    assert tuple(rows) == {rlcollect.MultiSyncCollector: (2, 2, 5), rlcollect.MultiAsyncCollector: (20,)}[cls]
