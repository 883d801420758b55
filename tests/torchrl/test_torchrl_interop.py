"""rlcollect with real torchrl objects: torchrl envs and transforms, actors, losses and replay
buffers, compared with torchrl's own ``Collector`` on the same env.

Runs in the venv where torchrl is installed first and rlcollect second (``make test-torchrl``,
``.venv-torchrl``); skipped where torchrl is not installed.
"""

from __future__ import annotations

import gc

import pytest

# (torchrl.collectors, not torchrl: without torchrl installed, "torchrl" would import this very
# folder, tests/torchrl, as a namespace package)
pytest.importorskip("torchrl.collectors")

import torch  # noqa: E402
from tensordict.nn import TensorDictModule, TensorDictSequential  # noqa: E402
from torch import nn  # noqa: E402
from torchrl.collectors import Collector as TorchRLCollector  # noqa: E402
from torchrl.data import LazyTensorStorage, ReplayBuffer  # noqa: E402
from torchrl.envs import (  # noqa: E402
    Compose,
    DoubleToFloat,
    InitTracker,
    ObservationNorm,
    RewardSum,
    StepCounter,
    TransformedEnv,
)
from torchrl.modules import (  # noqa: E402
    EGreedyModule,
    LSTMModule,
    MLP,
    QValueActor,
    ValueOperator,
)
from torchrl.objectives import ClipPPOLoss, DQNLoss  # noqa: E402
from torchrl.objectives.value import GAE  # noqa: E402

from rlcollect import Collector, MultiSyncCollector  # noqa: E402

from helpers_torchrl import Argmax, cartpole, leaves, serial_cartpole  # noqa: E402
from helpers_torchrl import actor as probabilistic_actor  # noqa: E402

pytestmark = pytest.mark.timeout(120)

FRAMES = 100


# -- envs and policies (module level: the multi-process tests send them to workers) --------------
def transformed_cartpole() -> TransformedEnv:
    return TransformedEnv(
        cartpole(),
        Compose(StepCounter(max_steps=50), RewardSum(), DoubleToFloat(),
                ObservationNorm(loc=torch.zeros(4), scale=torch.full((4,), 2.0), in_keys=["observation"])),
    )


def qvalue_actor(env) -> QValueActor:
    torch.manual_seed(0)
    return QValueActor(MLP(in_features=4, out_features=2, num_cells=[16]), in_keys=["observation"],
                       spec=env.action_spec)


def recurrent(env_fn=cartpole):
    """An LSTM policy (deterministic: argmax of a linear head) and its env with InitTracker and
    the LSTM's primer, as torchrl's recurrent tutorial builds them."""
    torch.manual_seed(0)
    lstm = LSTMModule(input_size=4, hidden_size=8, in_key="observation", out_key="embed")
    head = TensorDictModule(nn.Linear(8, 2), in_keys=["embed"], out_keys=["logits"])
    greedy = TensorDictModule(Argmax(), in_keys=["logits"], out_keys=["action"])
    env = TransformedEnv(env_fn(), Compose(InitTracker(), StepCounter()))
    env.append_transform(lstm.make_tensordict_primer())
    return env, TensorDictSequential(lstm, head, greedy)


def recurrent_env():
    return recurrent()[0]


def torchrl_batches(env, policy, n: int = 1, frames: int = FRAMES, seed: int | None = None, **kwargs) -> list:
    if seed is not None:
        env.set_seed(seed)
    c = TorchRLCollector(env, policy, frames_per_batch=frames, total_frames=n * frames, **kwargs)
    try:
        return [b.clone() for b in c]
    finally:
        c.shutdown()


def our_batches(env, policy, n: int = 1, frames: int = FRAMES, seed: int | None = None, **kwargs) -> list:
    c = Collector(env, policy, frames_per_batch=frames, total_frames=n * frames, **kwargs)
    try:
        if seed is not None:
            c.set_seed(seed)  # seeds the env and resets it before the first batch, as torchrl's does
        return [b.clone() for b in c]
    finally:
        c.shutdown()


def assert_same(theirs: list, ours: list) -> None:
    """As many batches, with the same leaves and bit-identical values."""
    assert len(theirs) == len(ours)
    for a, b in zip(theirs, ours):
        assert leaves(a) == leaves(b)
        for key in a.keys(include_nested=True, leaves_only=True):
            assert torch.equal(a[key], b[key]), key


# -- layout: key sets, shapes and dtypes equal to torchrl's collector -----------------------------
@pytest.mark.parametrize("env_fn", [cartpole, transformed_cartpole, serial_cartpole],
                         ids=["GymEnv", "TransformedEnv", "SerialEnv"])
@pytest.mark.parametrize("policy_fn", [None, probabilistic_actor], ids=["random", "ProbabilisticActor"])
def test_collector_batch_has_torchrls_keys_shapes_and_dtypes(env_fn, policy_fn):
    theirs = torchrl_batches(env_fn(), policy_fn() if policy_fn else None)[0]
    ours = our_batches(env_fn(), policy_fn() if policy_fn else None)[0]
    assert ours.batch_size == theirs.batch_size
    assert leaves(ours) == leaves(theirs)


@pytest.mark.parametrize("env_fn", [cartpole, transformed_cartpole, serial_cartpole],
                         ids=["GymEnv", "TransformedEnv", "SerialEnv"])
def test_multisync_worker_batches_have_torchrls_keys_shapes_and_dtypes(env_fn):
    theirs = torchrl_batches(env_fn(), probabilistic_actor(), frames=50)[0]
    c = MultiSyncCollector([env_fn, env_fn], probabilistic_actor(), frames_per_batch=100, total_frames=100)
    try:
        (batch,) = list(c)
    finally:
        c.shutdown()
    assert batch.shape[0] == 2
    assert leaves(batch[0]) == leaves(theirs)


@pytest.mark.parametrize("env_fn", [cartpole, transformed_cartpole, serial_cartpole],
                         ids=["GymEnv", "TransformedEnv", "SerialEnv"])
def test_collector_values_equal_torchrls_with_a_deterministic_policy(env_fn):
    theirs = torchrl_batches(env_fn(), qvalue_actor(cartpole()), n=2, seed=0)
    ours = our_batches(env_fn(), qvalue_actor(cartpole()), n=2, seed=0)
    for a, b in zip(theirs, ours):
        for key in a.keys(include_nested=True, leaves_only=True):
            assert torch.equal(a[key], b[key]), key


def test_transformed_env_values_are_the_transforms():
    (batch,) = our_batches(transformed_cartpole(), None)
    # StepCounter(max_steps=50) truncates, RewardSum sums the rewards of each episode.
    assert int(batch["next", "step_count"].max()) <= 50
    ends = batch["next", "done"].squeeze(-1)
    assert ends.any()
    assert torch.equal(batch["next", "episode_reward"][ends].squeeze(-1).long(),
                       batch["next", "step_count"][ends].squeeze(-1))


# -- recurrent policies: the carry is torchrl's, exactly -------------------------------------------
@pytest.mark.parametrize("env_fn", [cartpole, serial_cartpole], ids=["GymEnv", "SerialEnv"])
def test_lstm_policy_hidden_states_equal_torchrls_collector_exactly(env_fn):
    env, policy = recurrent(env_fn)
    theirs = torchrl_batches(env, policy, n=3, seed=0)
    env, policy = recurrent(env_fn)
    ours = our_batches(env, policy, n=3, seed=0)
    assert_same(theirs, ours)
    h = torch.cat([b["recurrent_state_h"] for b in ours])
    assert h.abs().sum() > 0  # the memory is not lost
    starts = torch.cat([b["is_init"] for b in ours]).squeeze(-1)
    assert starts.sum() > 3 and h[starts].abs().sum() == 0  # episodes start from zeros


def test_lstm_policy_carry_in_multisync_workers():
    _, policy = recurrent()
    c = MultiSyncCollector([recurrent_env, recurrent_env], policy, frames_per_batch=200, total_frames=400)
    try:
        batches = [b.clone() for b in c]
    finally:
        c.shutdown()
    for batch in batches:
        h, nh = batch["recurrent_state_h"], batch["next", "recurrent_state_h"]
        init = batch["is_init"].squeeze(-1)
        assert h[init].abs().sum() == 0
        assert torch.equal(h[:, 1:][~init[:, 1:]], nh[:, :-1][~init[:, 1:]])  # root at t+1 = next at t
        assert h.abs().sum() > 0


# -- exploration and Q-value actors -------------------------------------------------------------------
def test_qvalue_actor_with_egreedy():
    env = cartpole()
    actor = qvalue_actor(env)
    policy = TensorDictSequential(actor, EGreedyModule(env.action_spec, eps_init=0.5, eps_end=0.5))
    theirs = torchrl_batches(cartpole(), policy)[0]
    (ours,) = our_batches(cartpole(), policy)
    assert leaves(ours) == leaves(theirs)
    greedy = ours["action_value"].argmax(-1)
    explored = (ours["action"] != greedy).float().mean()
    assert 0.1 < explored < 0.45  # eps 0.5: half the actions random, half of those differ


# -- losses on our batches --------------------------------------------------------------------------
def test_gae_and_clip_ppo_loss_on_our_batch():
    actor = probabilistic_actor()
    value = ValueOperator(MLP(in_features=4, out_features=1, num_cells=[16]), in_keys=["observation"])
    (batch,) = our_batches(cartpole(), actor, frames=200)
    gae = GAE(gamma=0.99, lmbda=0.95, value_network=value)
    with torch.no_grad():
        gae(batch)
    assert batch["advantage"].shape == (200, 1) and torch.isfinite(batch["advantage"]).all()
    loss_fn = ClipPPOLoss(actor, value)
    losses = loss_fn(batch)
    total = losses["loss_objective"] + losses["loss_critic"] + losses["loss_entropy"]
    total.backward()
    assert torch.isfinite(total)
    assert all(p.grad is not None for p in actor.parameters())


def test_dqn_loss_on_our_batch():
    env = cartpole()
    actor = qvalue_actor(env)
    (batch,) = our_batches(cartpole(), actor, frames=100)
    loss = DQNLoss(actor, action_space=env.action_spec, delay_value=False)(batch)["loss"]
    loss.backward()
    assert torch.isfinite(loss) and loss > 0


# -- torchrl replay buffers fed by our collectors -------------------------------------------------------
def test_collector_fills_a_torchrl_buffer_as_torchrls_collector_does():
    theirs, ours = ReplayBuffer(storage=LazyTensorStorage(1000)), ReplayBuffer(storage=LazyTensorStorage(1000))
    c = TorchRLCollector(cartpole(), None, frames_per_batch=FRAMES, total_frames=2 * FRAMES, replay_buffer=theirs)
    list(c)
    c.shutdown()
    c = Collector(cartpole(), None, frames_per_batch=FRAMES, total_frames=2 * FRAMES, replay_buffer=ours)
    assert list(c) == [None, None]
    c.shutdown()
    assert len(ours) == len(theirs) == 2 * FRAMES
    assert ours.sample(4).shape == theirs.sample(4).shape == (4,)
    assert leaves(ours.sample(4)) == leaves(theirs.sample(4))


def test_multisync_fills_a_torchrl_buffer_with_frames():
    rb = ReplayBuffer(storage=LazyTensorStorage(1000))
    c = MultiSyncCollector([cartpole] * 4, None, frames_per_batch=4 * FRAMES, total_frames=4 * FRAMES,
                           replay_buffer=rb)
    try:
        assert list(c) == [None]
    finally:
        c.shutdown()
    assert len(rb) == 4 * FRAMES  # torchrl's: each worker extends its own 100 frames
    assert rb.sample(4).shape == (4,)
    ids = rb[:][("collector", "traj_ids")]
    assert len(ids) == 4 * FRAMES


def test_multisync_with_a_batched_env_stores_env_rows_as_torchrl_does():
    rb = ReplayBuffer(storage=LazyTensorStorage(1000))
    c = MultiSyncCollector([serial_cartpole] * 2, None, frames_per_batch=200, total_frames=200, replay_buffer=rb)
    try:
        list(c)
    finally:
        c.shutdown()
    assert len(rb) == 4  # 2 workers x 2 env rows, each a 50-step row
    assert rb.sample(3).shape == (3, 50)


# -- rlcollect.GymEnv against torchrl's GymEnv ----------------------------------------------------------
@pytest.mark.parametrize("categorical", [True, False], ids=["index", "one-hot"])
def test_our_gymenv_batches_have_torchrls_gymenv_layout(categorical):
    from rlcollect import GymEnv as OurGymEnv

    theirs = torchrl_batches(cartpole(categorical), None)[0]
    ours = our_batches(OurGymEnv("CartPole-v1", categorical_action_encoding=categorical), None)[0]
    assert leaves(ours) == leaves(theirs)
    if not categorical:
        assert ours["action"].sum(-1).eq(1).all()


def test_slice_sampler_on_our_trajectory_ids():
    from torchrl.data import SliceSampler

    rb = ReplayBuffer(storage=LazyTensorStorage(1000), batch_size=40,
                      sampler=SliceSampler(num_slices=4, traj_key=("collector", "traj_ids"), strict_length=True))
    c = Collector(cartpole(), None, frames_per_batch=200, total_frames=400, replay_buffer=rb)
    list(c)
    c.shutdown()
    sample = rb.sample()
    ids = sample["collector", "traj_ids"].reshape(4, 10)
    assert (ids == ids[:, :1]).all()  # each slice lies within one of our trajectories
    steps = sample["observation"].reshape(4, 10, 4)
    assert torch.equal(sample["next", "observation"].reshape(4, 10, 4)[:, :-1], steps[:, 1:])


# -- weights reaching workers ---------------------------------------------------------------------------
def test_updated_probabilistic_actor_weights_reach_multisync_workers():
    actor = probabilistic_actor()
    c = MultiSyncCollector([cartpole, cartpole], actor, frames_per_batch=40, total_frames=80)
    try:
        it = iter(c)
        next(it)
        with torch.no_grad():
            for p in actor.parameters():
                p.add_(1.0)
        c.update_policy_weights_()
        batch = next(it)
    finally:
        c.shutdown()
    with torch.no_grad():
        want = actor.module[0](batch.select("observation").clone())["logits"]
    assert torch.allclose(batch["logits"], want, atol=1e-6)


def test_lstm_policy_with_central_inference_equals_torchrls_collector():
    # central inference: the main process runs torchrl's LSTM policy for both workers at once (rows
    # of the two workers in one batch); the carried state crosses with the observations
    env, policy = recurrent()
    theirs = torchrl_batches(env, policy, n=2, frames=100, seed=0)
    _, policy = recurrent()
    c = MultiSyncCollector([recurrent_env, recurrent_env], policy, frames_per_batch=200, total_frames=400,
                           inference="central", env_splits=1)
    try:
        c.set_seed(0)
        ours = [b[0].clone() for b in c]  # worker 0's part: seeded 0, as torchrl's env
        calls = c.stats()["inference"]
    finally:
        c.shutdown()
    assert calls["mean_batch_rows"] > 1  # forwards spanned both workers
    for a, b in zip(theirs, ours):
        assert leaves(a) == leaves(b)
        for key in a.keys(include_nested=True, leaves_only=True):
            if a[key].is_floating_point():  # one batched matmul for two rows may round differently
                torch.testing.assert_close(a[key], b[key], rtol=1e-5, atol=1e-6, msg=str(key))
            else:
                assert torch.equal(a[key], b[key]), key
    assert ours[1]["recurrent_state_h"].abs().sum() > 0


# -- torchrl 0.14's auto_register_policy_transforms, init_fn, interruptor ------------------------
def lstm_policy():
    return recurrent()[1]


def test_auto_register_policy_transforms_adds_torchrls_transforms_with_torchrls_values():
    # a bare CartPole and an LSTM policy: True appends InitTracker and the LSTM's primer, as torchrl
    theirs = torchrl_batches(cartpole(), lstm_policy(), n=3, seed=0, auto_register_policy_transforms=True)
    ours = our_batches(cartpole(), lstm_policy(), n=3, seed=0, auto_register_policy_transforms=True)
    assert_same(theirs, ours)
    assert {"is_init", "recurrent_state_h", "recurrent_state_c"} <= set(ours[0].keys())
    assert ours[2]["recurrent_state_h"].abs().sum() > 0
    # an env that has them already gets nothing twice: the values of recurrent()'s hand-built env
    env, policy = recurrent()
    assert_same(torchrl_batches(env, policy, n=2, seed=0), our_batches(recurrent()[0], lstm_policy(), n=2, seed=0,
                                                             auto_register_policy_transforms=True))


@pytest.mark.parametrize("flag", [None, False])
def test_auto_register_policy_transforms_none_or_false_adds_nothing(flag):
    # a non-recurrent module: torchrl adds only InitTracker, and only when True
    policy = qvalue_actor(cartpole())
    for value in (flag, True):
        theirs = torchrl_batches(cartpole(), policy, n=1, seed=0, auto_register_policy_transforms=value)
        ours = our_batches(cartpole(), policy, n=1, seed=0, auto_register_policy_transforms=value)
        assert_same(theirs, ours)
        assert ("is_init" in ours[0].keys()) is (value is True)


def test_auto_register_policy_transforms_refusals_name_the_env():
    with pytest.raises(ValueError, match="create_env_fn made a TimeLimit"):
        Collector("CartPole-v1", qvalue_actor(cartpole()), frames_per_batch=10, auto_register_policy_transforms=True)
    with pytest.raises(TypeError, match="auto_register_policy_transforms must be None, True or False, got 'yes'"):
        Collector(cartpole(), frames_per_batch=10, auto_register_policy_transforms="yes")
    with pytest.raises(ValueError, match="cannot be used with inference='central'"):
        MultiSyncCollector([cartpole], lstm_policy(), frames_per_batch=10, inference="central",
                           auto_register_policy_transforms=True)


def init_worker():
    import os

    os.environ["RLCOLLECT_TEST_INIT_FN"] = str(os.getpid())


def cartpole_after_init():
    import os

    # init_fn ran first, in this very process
    assert os.environ.get("RLCOLLECT_TEST_INIT_FN") == str(os.getpid()), "init_fn did not run before the env"
    return cartpole()


def test_multisync_auto_register_and_init_fn_in_workers_equal_torchrls():
    from torchrl.collectors import MultiSyncCollector as TorchRLMultiSync

    theirs = torchrl_batches(cartpole(), lstm_policy(), n=2, seed=0, auto_register_policy_transforms=True)
    c = MultiSyncCollector([cartpole_after_init, cartpole_after_init], lstm_policy(), frames_per_batch=2 * FRAMES,
                           total_frames=4 * FRAMES, auto_register_policy_transforms=True, init_fn=init_worker)
    try:
        c.set_seed(0)
        ours = [b[0].clone() for b in c]  # worker 0's part: seeded 0, as torchrl's env
    finally:
        c.shutdown()
    assert_same(theirs, ours)
    # torchrl's own multi-process collector with the same init_fn and factory: the same order
    t = TorchRLMultiSync([cartpole_after_init], lstm_policy(), frames_per_batch=10, total_frames=10,
                         init_fn=init_worker, auto_register_policy_transforms=True)
    try:
        (batch,) = [b.clone() for b in t]
    finally:
        t.shutdown()
        del t
        gc.collect()  # its semaphores and shared tensors go with it
    assert leaves(batch[0]) == leaves(ours[0][:10])


class StopAfter:
    """torchrl's interruptor face: ``collection_stopped()`` True from its ``n``-th call on."""

    def __init__(self, n: int):
        self.n, self.calls = n, 0

    def collection_stopped(self) -> bool:
        self.calls += 1
        return self.calls >= self.n


def test_interruptor_stops_the_batch_where_torchrls_does():
    policy = qvalue_actor(cartpole())
    theirs = torchrl_batches(cartpole(), policy, n=1, seed=0, frames=10, interruptor=StopAfter(4))
    ours = our_batches(cartpole(), policy, n=1, seed=0, frames=10, interruptor=StopAfter(4))
    # (ours counts the 4 steps taken, then the 6 one-step batches of the stopped interruptor)
    assert len(theirs) == 1 and len(ours) == 7
    a, b = theirs[0], ours[0]
    assert torch.equal(a["collector", "traj_ids"], torch.tensor([0, 0, 0, 0] + [-1] * 6))
    assert torch.equal(b["collector", "traj_ids"], a["collector", "traj_ids"])
    assert torch.equal(b["collector", "mask"], torch.tensor([True] * 4 + [False] * 6))
    for key in a.keys(include_nested=True, leaves_only=True):  # the steps collected: torchrl's values
        assert torch.equal(a[key][:4], b[key][:4]), key
    # unlike torchrl (it counts the whole batch), only collected frames count: a stopped interruptor
    # gives one-step batches (never empty ones), and total_frames counts steps really taken
    c = Collector(cartpole(), policy, frames_per_batch=10, total_frames=30, interruptor=StopAfter(1))
    try:
        shapes = [(b.shape, int(b["collector", "mask"].sum())) for b in c]
        assert shapes == [(torch.Size([10]), 1)] * 30 and c.frames == 30
    finally:
        c.shutdown()
    with pytest.raises(TypeError, match="interruptor must be None or an object with collection_stopped"):
        Collector(cartpole(), frames_per_batch=10, interruptor=object())
