"""torchrl's argument values and methods, accepted with torchrl's meaning (issue 12 item 3):
each test uses torchrl's literal values, on our envs and torchrl-like duck types (the tests
with real torchrl objects are in tests/torchrl/test_torchrl_args_real.py)."""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
from tensordict import TensorDict, TensorDictBase

from rlcollect import (
    Collector,
    CountingEnv,
    DistributedCollector,
    DistributedDataCollector,
    MultiAsyncCollector,
    MultiCollector,
    MultiSyncCollector,
)

START = "forkserver"
counting5 = functools.partial(CountingEnv, max_steps=5)
counting_batched = functools.partial(CountingEnv, max_steps=5, batch_size=[3])
POLICY_VERSION = ("collector", "policy_version")


# -- plain modules whose forward takes a tensordict ---------------------------------------------
class TensordictForward(torch.nn.Module):
    """torchrl uses such a module unwrapped: ``forward(self, tensordict)``."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))

    def forward(self, tensordict):
        obs = tensordict["observation"]
        tensordict["action"] = ((obs[..., 0] + self.w[0]) > 2).long()
        tensordict["value"] = obs * 2 + self.w
        return tensordict


class AnnotatedForward(torch.nn.Module):
    def forward(self, td: TensorDictBase) -> TensorDictBase:
        td.set("action", (td["observation"][..., 0] > 1).long())
        return td


def test_forward_tensordict_module_is_used_unwrapped():
    with Collector(counting5(), TensordictForward(), frames_per_batch=6, total_frames=6) as c:
        batch = c.next()
    assert batch["observation"][:, 0].tolist() == [0, 1, 2, 3, 4, 0]
    assert batch["action"].tolist() == [0, 0, 0, 1, 1, 0]
    assert torch.equal(batch["value"], batch["observation"] * 2)  # an extra output is kept, as in torchrl


def test_annotated_tensordictbase_forward_is_used_unwrapped():
    with Collector(counting5(), AnnotatedForward(), frames_per_batch=5, total_frames=5) as c:
        assert c.next()["action"].tolist() == [0, 0, 1, 1, 1]


def test_forward_tensordict_module_gets_weight_updates():
    policy = TensordictForward()
    with Collector(counting5(), policy, frames_per_batch=5, total_frames=-1) as c:
        c.update_policy_weights_({"w": torch.full((1,), 10.0)})
        assert c.next()["action"].tolist() == [1] * 5
        assert c.policy_version == 1


@pytest.mark.timeout(120)
def test_forward_tensordict_module_in_workers():
    with MultiSyncCollector([counting5] * 2, TensordictForward(), frames_per_batch=10, total_frames=10,
                            mp_start_method=START) as c:
        batch = c.next()
    assert batch.shape == (2, 5)
    assert batch["action"].tolist() == [[0, 0, 0, 1, 1]] * 2


# -- total_frames, max_frames_per_traj, init_random_frames --------------------------------------
@pytest.mark.parametrize("total_frames", [None, -1, -5])
def test_total_frames_none_or_negative_is_endless(total_frames):
    with Collector(counting5(), frames_per_batch=4, total_frames=total_frames) as c:
        assert c.total_frames == -1
        with pytest.raises(TypeError, match="endless"):
            len(c)
        batches = [c.next() for _ in range(30)]  # beyond any finite default
    assert all(b is not None for b in batches) and c.frames == 120


@pytest.mark.timeout(120)
@pytest.mark.parametrize("cls", [MultiSyncCollector, MultiAsyncCollector])
def test_multi_total_frames_none_is_endless(cls):
    with cls([counting5] * 2, frames_per_batch=4, total_frames=None, mp_start_method=START) as c:
        assert c.total_frames == -1
        assert all(c.next() is not None for _ in range(5))


def test_total_frames_zero_is_refused():
    with pytest.raises(ValueError, match="total_frames .*got 0"):
        Collector(counting5(), frames_per_batch=4, total_frames=0)


@pytest.mark.parametrize("value", [-1, None, 0])
def test_max_frames_per_traj_no_limit_values(value):
    endless = functools.partial(CountingEnv, max_steps=None)
    with Collector(endless(), frames_per_batch=20, total_frames=20, max_frames_per_traj=value) as c:
        batch = c.next()
    assert c.config.max_frames_per_traj is None
    assert batch["observation"][:, 0].tolist() == list(range(20))  # never truncated
    assert not batch["next", "truncated"].any()


def test_max_frames_per_traj_still_refuses_other_negatives():
    with pytest.raises(ValueError, match="max_frames_per_traj .*got -3"):
        Collector(counting5(), frames_per_batch=4, max_frames_per_traj=-3)


@pytest.mark.parametrize("value", [-1, None])
def test_init_random_frames_none_values(value):
    with Collector(counting5(), AnnotatedForward(), frames_per_batch=5, total_frames=5, init_random_frames=value) as c:
        assert c.config.init_random_frames == 0
        assert c.next()["action"].tolist() == [0, 0, 1, 1, 1]  # the policy acted, not the random one


@pytest.mark.timeout(120)
def test_multi_init_random_frames_minus_one():
    with MultiSyncCollector([counting5] * 2, AnnotatedForward(), frames_per_batch=10, total_frames=10,
                            init_random_frames=-1, max_frames_per_traj=-1, mp_start_method=START) as c:
        assert c.init_random_frames == 0
        assert c.next()["action"].tolist() == [[0, 0, 1, 1, 1]] * 2


# -- RL_WARNINGS -----------------------------------------------------------------------------------
@pytest.mark.parametrize("value, warns", [("False", False), ("0", False), ("1", True), ("True", True)])
def test_rl_warnings_silences_batch_arithmetic_warnings(monkeypatch, value, warns):
    monkeypatch.setenv("RL_WARNINGS", value)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        Collector(counting5(), frames_per_batch=4, total_frames=10).shutdown()
    messages = [str(w.message) for w in caught if "total_frames=10" in str(w.message)]
    assert len(messages) == (1 if warns else 0)
    if warns:
        assert "RL_WARNINGS=0" in messages[0]


# -- next(), shutdown(...), reset(...) ------------------------------------------------------------------
def test_next_returns_batches_then_none():
    c = Collector(counting5(), frames_per_batch=5, total_frames=10)
    shapes = [c.next(), c.next(), c.next()]
    c.shutdown()
    assert [None if s is None else tuple(s.shape) for s in shapes] == [(5,), (5,), None]


def test_shutdown_takes_torchrls_arguments():
    c = Collector(counting5(), frames_per_batch=5)
    with pytest.raises(ValueError, match="close_env=False.*always closes"):
        c.shutdown(close_env=False)
    c.shutdown(timeout=None, close_env=True, raise_on_error=True)
    with pytest.raises(RuntimeError, match="shut down"):
        c.next()
    c.shutdown(timeout=None, close_env=True, raise_on_error=False)  # idempotent


def test_shutdown_raise_on_error_false_logs_instead(caplog):
    c = Collector(counting5(), frames_per_batch=5)

    def broken_close():
        raise OSError("close failed")

    c.env.close = broken_close
    c.shutdown(raise_on_error=False)
    assert "raise_on_error=False" in caplog.text and "close failed" in caplog.text
    c2 = Collector(counting5(), frames_per_batch=5)
    c2.env.close = broken_close
    with pytest.raises(OSError, match="close failed"):
        c2.shutdown()


def test_collector_reset_index():
    with Collector(counting_batched(), frames_per_batch=6, total_frames=-1) as c:
        c.next()
        c.reset(index=None)
        assert c.next()["observation"][:, 0, 0].tolist() == [0, 0, 0]
        c.next()
        c.reset(index=torch.ones(3, dtype=torch.bool))  # every row: accepted
        assert c.next()["observation"][:, 0, 0].tolist() == [0, 0, 0]
        with pytest.raises(ValueError, match="only some rows"):
            c.reset(index=torch.tensor([True, False, True]))


@pytest.mark.timeout(120)
def test_multi_reset_idx_resets_only_chosen_workers():
    with MultiSyncCollector([counting5] * 2, frames_per_batch=6, total_frames=-1, mp_start_method=START) as c:
        c.next()  # each worker is 3 steps into an episode
        c.reset(reset_idx=[True, False])
        batch = c.next()
        assert batch["observation"][:, 0, 0].tolist() == [0, 3]
        with pytest.raises(ValueError, match="reset_idx must be None or 2 bools"):
            c.reset(reset_idx=[True])
        c.shutdown(timeout=None, close_env=True, raise_on_error=True)
        with pytest.raises(ValueError, match="close_env"):
            c.shutdown(close_env=False)


# -- MultiCollector is a class ---------------------------------------------------------------------------
@pytest.mark.timeout(120)
@pytest.mark.parametrize("sync, cls", [(True, MultiSyncCollector), (False, MultiAsyncCollector)])
def test_multicollector_is_a_class(sync, cls):
    assert isinstance(MultiCollector, type)
    assert issubclass(cls, MultiCollector)
    c = MultiCollector([counting5] * 2, frames_per_batch=4, total_frames=8, sync=sync, mp_start_method=START)
    try:
        assert type(c) is cls and isinstance(c, MultiCollector)
    finally:
        c.shutdown()


# -- async with a per-worker frames_per_batch list ------------------------------------------------------
@pytest.mark.timeout(120)
def test_async_per_worker_frames_per_batch_with_total_frames():
    with MultiAsyncCollector([counting5] * 2, frames_per_batch=[2, 6], total_frames=24, mp_start_method=START) as c:
        assert c.frames_per_batch_worker(0) == 2 and c.frames_per_batch_worker(worker_idx=1) == 6
        assert c.requested_frames_per_batch == 8
        with pytest.raises(TypeError, match="no len"):
            len(c)
        sizes, total = {}, 0
        for batch in c:
            worker = int(batch["collector", "worker_id"][0])
            sizes.setdefault(worker, set()).add(batch.numel())
            total += batch.numel()
    assert sizes.get(0, {2}) == {2} and sizes.get(1, {6}) == {6}
    assert 24 <= total < 24 + 6


@pytest.mark.timeout(120)
def test_sync_frames_per_batch_worker():
    with MultiSyncCollector([counting5] * 2, frames_per_batch=8, mp_start_method=START) as c:
        assert c.requested_frames_per_batch == 8
        assert [c.frames_per_batch_worker(i) for i in range(2)] == [4, 4]
        assert c.frames_per_batch_worker() == 4
        with pytest.raises(ValueError, match="worker_idx"):
            c.frames_per_batch_worker(2)


def test_collector_requested_frames_per_batch_rounds_to_rows():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        c = Collector(counting_batched(), frames_per_batch=10)
    assert c.requested_frames_per_batch == 12 == c.frames_per_batch_worker()
    c.shutdown()


# -- cat_results: any valid int dim -------------------------------------------------------------------------
@pytest.mark.timeout(120)
@pytest.mark.parametrize("cat, shape", [(0, (6, 2)), (-2, (6, 2)), (1, (3, 4)), (-1, (3, 4))])
def test_cat_results_any_int_dim(cat, shape):
    with MultiSyncCollector([counting_batched] * 2, frames_per_batch=12, total_frames=12, cat_results=cat,
                            mp_start_method=START) as c:
        batch = c.next()
    assert batch.shape == shape


@pytest.mark.timeout(120)
def test_cat_results_out_of_range_dim_is_refused_with_the_range():
    with pytest.raises(ValueError, match=r"cat_results=2 is not a dim .*give one in -1..0"):
        MultiSyncCollector([counting5] * 2, frames_per_batch=4, cat_results=2, mp_start_method=START)


# -- policy versions ---------------------------------------------------------------------------------
class PolicyVersionLike:
    """torchrl's ``PolicyVersion`` as a duck type: ``version`` and ``increment_version()``."""

    def __init__(self):
        self.version = 0

    def increment_version(self):
        self.version += 1


def test_policy_version_methods_on_collector():
    tracker = PolicyVersionLike()
    with Collector(counting5(), TensordictForward(), frames_per_batch=5, track_policy_version=tracker) as c:
        assert c.policy_version == 0 == c.get_policy_version()
        c.increment_version()
        assert c.next()[POLICY_VERSION].tolist() == [1] * 5
        c.update_policy_weights_({"w": torch.zeros(1)})
        assert c.get_policy_version() == 2 == tracker.version


def test_track_policy_version_refuses_other_objects():
    with pytest.raises(TypeError, match="track_policy_version must be a bool or a torchrl PolicyVersion"):
        Collector(counting5(), frames_per_batch=5, track_policy_version="yes")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("cls", [MultiSyncCollector, MultiAsyncCollector])
def test_policy_version_methods_on_multi(cls):
    tracker = PolicyVersionLike()
    with cls([counting5] * 2, TensordictForward(), frames_per_batch=4, track_policy_version=tracker,
             mp_start_method=START) as c:
        assert c.policy_version == 0 == c.get_policy_version()
        c.increment_version()
        assert c.policy_version == 1 == tracker.version
        c.update_policy_weights_()
        assert c.get_policy_version() == 2 == tracker.version
        assert c.next()[POLICY_VERSION].unique().tolist() in ([0], [2], [0, 2])


# -- distributed ------------------------------------------------------------------------------------
def test_distributed_data_collector_alias():
    assert DistributedDataCollector is DistributedCollector


def test_distributed_tcp_port_string_and_values():
    from rlcollect.distributed.config import DistributedConfig

    def config(**kw):
        args = dict(num_nodes=None, policy_factory=None, frames_per_batch=10, total_frames=None,
                    devices={"device": "cpu", "storing_device": None, "env_device": None, "policy_device": None},
                    create_env_kwargs=None, inner_options={"max_frames_per_traj": -1}, init_random_frames=-1,
                    postproc=None, split_trajs=False, collector_class="single", collector_kwargs=None,
                    num_workers_per_collector=1, sync=False, slurm_kwargs=None, backend="gloo",
                    update_after_each_batch=False, max_weight_update_interval=-1, update_interval=None,
                    launcher="mp", tcp_port="10003", master_addr=None, timeout=60.0, heartbeat_timeout=5.0,
                    weight_sync_schemes=None, on_node_failure="raise", max_node_restarts=3, node_timeout=None,
                    start_timeout=60.0, rank0_timeout=60.0, secret_file=None)
        args.update(kw)
        return DistributedConfig([counting5] * 2, None, **args)

    cfg = config()
    assert cfg.tcp_port == 10003 and cfg.total_frames == -1 and cfg.init_random_frames == 0
    assert cfg.devices["device"] == ["cpu", "cpu"]
    with pytest.raises(ValueError, match="tcp_port"):
        config(tcp_port="port")


@pytest.mark.timeout(180)
def test_distributed_iterator_next_devices_versions():
    with DistributedCollector([counting5] * 2, frames_per_batch=4, total_frames=8, sync=True, device="cpu",
                              tcp_port=None) as c:
        assert c.device == [torch.device("cpu")] * 2 or c.device == ["cpu"] * 2
        assert c.storing_device == [None, None]
        assert c.requested_frames_per_batch == 4 and c.frames_per_batch_worker(1) == 2
        first = next(c.iterator())
        assert first.numel() == 4
        c.increment_version()
        assert c.policy_version == 1 == c.get_policy_version()
        c.shutdown(timeout=None, close_env=True, raise_on_error=True)


# -- arguments torchrl has that were inert -------------------------------------------------------------
def untyped_policy(td):
    """No annotation, not named ``tensordict``: only ``trust_policy=True`` makes it a tensordict policy."""
    td.set("action", (td["observation"][..., 0] > 3).long())
    return td


def test_trust_policy_true_calls_the_policy_with_a_tensordict():
    with Collector(counting5(), untyped_policy, frames_per_batch=5, total_frames=5, trust_policy=True) as c:
        assert c.next()["action"].tolist() == [0, 0, 0, 0, 1]
    # without it, the single argument is matched to the observation (a tensor), as before
    with pytest.raises(AttributeError):
        Collector(counting5(), untyped_policy, frames_per_batch=5, trust_policy=False)
    with pytest.raises(TypeError, match="trust_policy must be None, True or False"):
        Collector(counting5(), frames_per_batch=5, trust_policy="yes")


@pytest.mark.parametrize("value", [True, False])
def test_no_cuda_sync_accepted(value):
    with Collector(counting5(), AnnotatedForward(), frames_per_batch=5, total_frames=5, no_cuda_sync=value) as c:
        assert c.next()["action"].tolist() == [0, 0, 1, 1, 1]


def test_reset_when_done():
    with Collector(counting5(), frames_per_batch=10, total_frames=10, reset_when_done=True) as c:
        assert c.next()["observation"][:, 0].tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match="reset_when_done=False is not supported.*same-step autoreset"):
        Collector(counting5(), frames_per_batch=10, reset_when_done=False)


def test_multi_reset_when_done_false_refused_before_workers_start():
    with pytest.raises(ValueError, match="reset_when_done=False is not supported"):
        MultiSyncCollector([counting5] * 2, frames_per_batch=4, reset_when_done=False, mp_start_method=START)
    with pytest.raises(TypeError, match="local_init_rb must be None, True or False"):
        MultiSyncCollector([counting5] * 2, frames_per_batch=4, local_init_rb="yes", mp_start_method=START)
    with pytest.raises(TypeError, match="use_buffers must be True, False or None"):  # None: torchrl's default
        MultiSyncCollector([counting5] * 2, frames_per_batch=4, use_buffers="yes", mp_start_method=START)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("cls", [MultiSyncCollector, MultiAsyncCollector])
def test_multi_use_buffers_false_delivers_fresh_memory(cls):
    from rlcollect import ReplayBuffer

    with cls([counting5] * 2, frames_per_batch=4, total_frames=-1, use_buffers=False, local_init_rb=True,
             mp_start_method=START) as c:
        first = c.next()
        kept = first.clone()
        c.next()
        c.next()
    assert (first == kept).all()  # the next batches did not overwrite it
    rb = ReplayBuffer(100)
    try:
        with cls([counting5] * 2, frames_per_batch=4, total_frames=8, replay_buffer=rb, local_init_rb=False,
                 mp_start_method=START) as c:
            list(c)
        assert rb.write_count == 8
    finally:
        rb.close()


# -- state with torchrl envs (item 5) --------------------------------------------------------------------
class StepCountingEnv(torch.nn.Module):
    """torchrl-like: an ``nn.Module`` env whose transforms' state is a buffer (``scale``, like
    ObservationNorm's loc/scale), a StepCounter-like ``step_count`` in the root tensordict, and a
    simulator state (``t``) that ``nn.Module.state_dict`` does not hold."""

    def __init__(self):
        super().__init__()
        self.batch_size = torch.Size([])
        self.device = torch.device("cpu")
        self.register_buffer("scale", torch.ones(1))
        self.t = 0

    def _flags(self, done: bool) -> dict:
        flag = torch.tensor([done])
        return {"done": flag.clone(), "terminated": flag.clone(), "truncated": torch.tensor([False])}

    def reset(self, td=None):
        self.t = 0
        return TensorDict({"observation": torch.zeros(1), "step_count": torch.zeros(1, dtype=torch.int64),
                           **self._flags(False)}, [])

    def step(self, td):
        self.t += 1
        nxt = {"observation": torch.full((1,), float(self.t)) * self.scale, "step_count": td["step_count"] + 1,
               "reward": torch.ones(1), **self._flags(self.t >= 7)}
        td.set("next", TensorDict(nxt, []))
        return td

    def rand_action(self, td):
        td.set("action", torch.zeros((), dtype=torch.int64))
        return td


class FullStateEnv(StepCountingEnv):
    """Exposes its whole state: its own state_dict includes the simulator's ``t``."""

    def state_dict(self, *args, **kwargs):
        out = dict(super().state_dict(*args, **kwargs))
        out["t"] = self.t
        return out

    def load_state_dict(self, state, strict=True):
        state = dict(state)
        self.t = state.pop("t")
        return super().load_state_dict(state, strict=strict)


def test_torchrl_like_env_with_its_state_resumes_exactly():
    env = FullStateEnv()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "does not expose" warning
        with Collector(env, frames_per_batch=4, total_frames=-1) as c:
            c.next()
            state = c.state_dict()
            expected = c.next()
            env.scale.fill_(5.0)  # the transforms' state changes after the save ...
            c.next()
            c.load_state_dict(state)  # ... and comes back with the load
            again = c.next()
    assert env.scale.item() == 1.0
    assert (expected == again).all()
    assert expected["step_count"].reshape(-1).tolist() == [4, 5, 6, 0]


def test_torchrl_like_env_without_simulator_state_warns_once_and_keeps_what_it_can():
    env = StepCountingEnv()
    with Collector(env, frames_per_batch=4, total_frames=-1) as c:
        c.next()
        with pytest.warns(UserWarning, match=r"StepCountingEnv does not expose its simulator's state .*\['scale'\]"):
            state = c.state_dict()
        expected = c.next()
        env.scale.fill_(5.0)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # once: no second warning
            c.state_dict()
        c.load_state_dict(state)
        again = c.next()
    assert env.scale.item() == 1.0  # transforms' state restored
    # StepCounter's count comes back with the root; the simulator continued from where it was
    assert expected["step_count"].reshape(-1).tolist() == [4, 5, 6, 0]
    assert again["step_count"].reshape(-1).tolist()[:3] == [4, 5, 6]
    assert again["next", "observation"].reshape(-1).tolist() != expected["next", "observation"].reshape(-1).tolist()


def test_sync_is_only_multicollectors_argument():
    with pytest.raises(TypeError, match="sync"):
        MultiSyncCollector([counting5] * 2, frames_per_batch=4, sync=False, mp_start_method=START)
    with pytest.raises(TypeError, match="sync must be True or False"):
        MultiCollector([counting5] * 2, frames_per_batch=4, sync="yes", mp_start_method=START)
