"""Central inference (``inference="central"``, rlcollect/inference/): the env workers only step
their envs; the main process's policy object runs one batched forward for every ready split.

The policies here compute row by row with elementwise operations only, so a batch of any
size gives bit-identical results: the data must equal worker inference's exactly."""

from __future__ import annotations

import functools
import gc
import os
import signal
import threading
import time

import pytest
import torch
from mp_helpers import assert_gone, running, shm_entries, take
from tensordict import TensorDict
from tensordict.nn import TensorDictModuleBase

from rlcollect import GymEnv, MultiAsyncCollector, MultiSyncCollector
from rlcollect.errors import WorkerError

pytestmark = pytest.mark.timeout(120)

CARTPOLE4 = functools.partial(GymEnv, "CartPole-v1", num_envs=4)
CARTPOLE2 = functools.partial(GymEnv, "CartPole-v1", num_envs=2)


class RowPolicy(torch.nn.Module):
    """``logits = observation[:, :2] * w + b`` (elementwise), action = which logit is larger;
    records the rows of every call, and in which process and thread it ran."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor([1.0, -1.0]))
        self.b = torch.nn.Parameter(torch.zeros(2))
        self.calls: list[tuple[int, int, str]] = []

    def forward(self, observation: torch.Tensor) -> dict:
        self.calls.append((observation.shape[0], os.getpid(), threading.current_thread().name))
        logits = observation[..., :2] * self.w + self.b
        return {"action": (logits[..., 1] > logits[..., 0]).long(), "logits": logits}


class Accumulate(TensorDictModuleBase):
    """A recurrent-like module: ``("next", "h") = h + observation[:1] + 1`` (h missing: zeros)."""

    def __init__(self):
        super().__init__()
        self.in_keys = ["observation", "h"]
        self.out_keys = [("next", "h"), "action"]

    def forward(self, td: TensorDict) -> TensorDict:
        obs = td.get("observation")
        h = td.get("h", None)
        if h is None:
            h = torch.zeros(*obs.shape[:-1], 1)
        td.set(("next", "h"), h + obs[..., :1] + 1)
        td.set("action", (h[..., 0] > 20).long())
        return td


class Failing(torch.nn.Module):
    def __init__(self, after: int):
        super().__init__()
        self.after, self.count = after, 0

    def forward(self, observation):
        self.count += 1
        if self.count > self.after:
            raise ArithmeticError("the policy broke on purpose")
        return torch.zeros(observation.shape[0], dtype=torch.int64)


def _stream(cls, env, policy, batches: int, update=None, **kwargs) -> list[TensorDict]:
    with running(cls, env, policy, num_workers=2, frames_per_batch=64, track_policy_version=True, **kwargs) as c:
        c.set_seed(7)
        out = []
        for i, batch in enumerate(c):
            out.append(batch.clone())
            if len(out) == batches:
                break
            if update is not None:
                update(c, policy, i)
    return out


def _bump(collector, policy, i) -> None:
    with torch.no_grad():
        policy.b.add_(0.01 * (i + 1))
    collector.update_policy_weights_()


KEYS = ["observation", "action", "logits", ("next", "observation"), ("next", "reward"), ("next", "done"),
        ("collector", "policy_version")]


@pytest.mark.parametrize("central_env, splits", [(CARTPOLE2, 2), (CARTPOLE4, 1)])
def test_sync_data_equals_worker_inference(central_env, splits):
    expected = _stream(MultiSyncCollector, CARTPOLE4, RowPolicy(), 4, update=_bump)
    got = _stream(MultiSyncCollector, central_env, RowPolicy(), 4, update=_bump, inference="central",
                  env_splits=splits)
    for a, b in zip(expected, got):
        assert a.shape == b.shape == torch.Size([2, 4, 8])
        for key in KEYS:
            assert torch.equal(a[key], b[key]), key
    assert [b["collector", "policy_version"].unique().tolist() for b in got] == [[0], [1], [2], [3]]


def test_unbatched_envs_give_the_batch_of_worker_inference():
    expected = _stream(MultiSyncCollector, "CartPole-v1", RowPolicy(), 2, update=_bump)
    got = _stream(MultiSyncCollector, "CartPole-v1", RowPolicy(), 2, update=_bump, inference="central",
                  env_splits=1)
    for a, b in zip(expected, got):
        assert a.shape == b.shape == torch.Size([2, 32])
        for key in KEYS:
            assert torch.equal(a[key], b[key]), key
    split = _stream(MultiSyncCollector, "CartPole-v1", RowPolicy(), 1, inference="central")
    assert split[0].shape == torch.Size([2, 2, 16])  # two unbatched envs per worker, side by side


def test_async_data_equals_worker_inference_per_worker():
    def per_worker(batches):
        out = {0: [], 1: []}
        for b in batches:
            out[int(b["collector", "worker_id"][0, 0])].append(b)
        return out

    expected = per_worker(_stream(MultiAsyncCollector, CARTPOLE4, RowPolicy(), 8))
    got = per_worker(_stream(MultiAsyncCollector, CARTPOLE2, RowPolicy(), 8, inference="central"))
    for worker in (0, 1):
        n = min(len(expected[worker]), len(got[worker]))
        assert n >= 1
        for a, b in zip(expected[worker][:n], got[worker][:n]):
            for key in KEYS:
                assert torch.equal(a[key], b[key]), (worker, key)


def test_recurrent_carry_equals_worker_inference():
    env = functools.partial(GymEnv, "CartPole-v1", num_envs=2)
    expected = _stream(MultiSyncCollector, functools.partial(GymEnv, "CartPole-v1", num_envs=4), Accumulate(), 3)
    got = _stream(MultiSyncCollector, env, Accumulate(), 3, inference="central")
    for a, b in zip(expected, got):
        for key in ["observation", "action", "h", ("next", "h"), ("next", "done")]:
            assert torch.equal(a[key], b[key]), key
    assert got[-1]["h"].abs().sum() > 0


def test_the_main_process_policy_runs_one_forward_for_every_worker():
    policy = RowPolicy()
    # max_wait_us: each forward waits (up to 0.5 s) until every worker's split is in
    with running(MultiSyncCollector, CARTPOLE4, policy, num_workers=2, frames_per_batch=64, inference="central",
                 env_splits=1, max_wait_us=500_000) as c:
        take(iter(c), 3)
        stats = c.stats()["inference"]
    discovery, forwards = policy.calls[:2], policy.calls[2:]
    assert [rows for rows, _, _ in discovery] == [4, 4]  # each worker's dry run
    assert len(forwards) == 3 * 8  # 3 batches of 8 steps, each step one forward for both workers
    assert {(rows, pid, thread) for rows, pid, thread in forwards} == {(8, os.getpid(), "rlcollect-inference")}
    assert stats["forward_calls"] == 24 and stats["mean_batch_rows"] == 8.0


def test_weight_updates_are_seen_at_the_next_forward_and_tagged():
    class Bias(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.b = torch.nn.Parameter(torch.zeros(1))

        def forward(self, observation):
            return {"action": torch.zeros(observation.shape[0], dtype=torch.int64),
                    "logits": self.b.expand(observation.shape[0], 1).clone()}

    policy = Bias()
    with running(MultiAsyncCollector, CARTPOLE2, policy, num_workers=2, frames_per_batch=32, inference="central",
                 track_policy_version=True) as c:
        seen = set()
        for i, batch in zip(range(30), c):
            version = batch["collector", "policy_version"]
            # every frame's logits are the bias of the version it says it was computed with
            assert torch.equal(batch["logits"][..., 0], version.float()), i
            seen.update(version.unique().tolist())
            with c.updating_weights(), torch.no_grad():  # forwards wait for the step; the version moves with it
                policy.b.fill_(i + 1)
        assert c.worker_policy_versions() == [30, 30]
    assert len(seen) > 10  # the versions move during collection, not only between batches


def test_an_in_place_change_is_seen_by_the_next_forward():
    policy = RowPolicy()
    with running(MultiSyncCollector, CARTPOLE2, policy, num_workers=2, frames_per_batch=32, inference="central",
                 track_policy_version=True) as c:
        it = iter(c)
        assert (next(it)["logits"][..., 0] != 7.0).any()
        with torch.no_grad():
            policy.w.zero_()
            policy.b.fill_(7.0)
        batch = next(it)  # no update_policy_weights_(): the trainer's own object acts
        assert (batch["logits"] == 7.0).all()
        assert (batch["collector", "policy_version"] == 0).all()  # the version moves only when told
        c.increment_version()
        assert (next(it)["collector", "policy_version"] == 1).all()


def test_weights_given_are_loaded_into_the_acting_policy():
    policy = RowPolicy()
    with running(MultiSyncCollector, CARTPOLE2, policy, num_workers=2, frames_per_batch=32,
                 inference="central") as c:
        c.update_policy_weights_({"w": torch.tensor([0.0, 0.0]), "b": torch.tensor([5.0, -5.0])})
        batch = next(iter(c))
    assert policy.b.tolist() == [5.0, -5.0]
    assert (batch["action"] == 0).all() and (batch["logits"][..., 0] == 5.0).all()


def test_a_worker_killed_mid_step_is_restarted():
    with running(MultiSyncCollector, CARTPOLE2, RowPolicy(), num_workers=2, frames_per_batch=400,
                 inference="central", on_worker_failure="restart") as c:
        it = iter(c)
        next(it)
        victim = c.worker_pids()[0]
        killer = threading.Timer(0.05, os.kill, (victim, signal.SIGKILL))  # while it steps the next batch
        killer.start()
        batches = take(it, 3)
        killer.join()
        assert c.stats()["restarts"] == 1
        assert all(b.shape == torch.Size([2, 4, 50]) for b in batches)
        assert c.worker_pids()[0] != victim
    assert_gone([victim])


def test_a_worker_killed_mid_step_raises_with_its_index():
    with running(MultiSyncCollector, CARTPOLE2, RowPolicy(), num_workers=2, frames_per_batch=400,
                 inference="central") as c:
        it = iter(c)
        next(it)
        os.kill(c.worker_pids()[1], signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(WorkerError) as info:
            take(it, 5)
        assert info.value.worker_index == 1 and time.monotonic() - started < 10


@pytest.mark.parametrize("cls", [MultiSyncCollector, MultiAsyncCollector])
def test_the_policy_error_reaches_the_trainer(cls):
    with running(cls, CARTPOLE2, Failing(after=10), num_workers=2, frames_per_batch=64, inference="central",
                 on_worker_failure="restart") as c:
        with pytest.raises(ArithmeticError, match="broke on purpose"):
            take(iter(c), 10)
        assert c._closed and c.stats()["restarts"] == 0  # no worker is restarted for the policy's error


def test_the_first_call_failing_fails_the_constructor():
    started = time.monotonic()
    with pytest.raises(ArithmeticError, match="broke on purpose"):
        MultiSyncCollector(CARTPOLE2, Failing(after=0), num_workers=2, frames_per_batch=64, inference="central")
    assert time.monotonic() - started < 30


def test_init_random_frames_do_not_call_the_policy():
    policy = RowPolicy()
    with running(MultiSyncCollector, CARTPOLE2, policy, num_workers=2, frames_per_batch=64, inference="central",
                 init_random_frames=128) as c:
        it = iter(c)
        take(it, 2)
        assert len(policy.calls) == 4  # the dry runs only (2 workers x 2 splits)
        next(it)
        assert len(policy.calls) > 4


def test_exploration_type_applies_to_the_forward():
    from tensordict.nn import InteractionType, interaction_type

    class Records(TensorDictModuleBase):
        in_keys, out_keys = ["observation"], ["action"]

        def __init__(self):
            super().__init__()
            self.seen = set()

        def forward(self, td):
            self.seen.add(interaction_type())
            td.set("action", torch.zeros(td.batch_size, dtype=torch.int64))
            return td

    policy = Records()
    with running(MultiSyncCollector, CARTPOLE2, policy, num_workers=2, frames_per_batch=32, inference="central",
                 exploration_type="deterministic") as c:
        next(iter(c))
    assert policy.seen == {InteractionType.DETERMINISTIC}


def test_an_unpicklable_policy_works_with_central_inference():
    policy = RowPolicy()
    policy.lock = threading.Lock()  # cannot be pickled: with worker inference this is refused
    with pytest.raises(TypeError, match="inference='central'"):
        MultiSyncCollector(CARTPOLE2, policy, num_workers=2, frames_per_batch=32)
    with running(MultiSyncCollector, CARTPOLE2, policy, num_workers=2, frames_per_batch=32,
                 inference="central") as c:
        assert next(iter(c)).shape == torch.Size([2, 4, 4])


def test_a_dropped_collector_stops_its_inference_thread():
    shm_before = shm_entries()
    c = MultiSyncCollector(CARTPOLE2, RowPolicy(), num_workers=2, frames_per_batch=32, inference="central",
                           mp_start_method="forkserver")
    pids = c.worker_pids()
    next(iter(c))
    del c
    gc.collect()
    assert_gone(pids)
    deadline = time.monotonic() + 5
    while any(t.name == "rlcollect-inference" for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(t.name == "rlcollect-inference" for t in threading.enumerate())
    assert shm_entries() <= shm_before


@pytest.mark.parametrize("kwargs, message", [
    ({"inference": "gpu"}, r"inference must be one of \('worker', 'central'\), got 'gpu'"),
    ({"env_splits": 2}, "env_splits=2 needs inference='central'"),
    ({"max_wait_us": 10}, "max_wait_us=10 needs inference='central'"),
    ({"inference": "central", "env_splits": 0}, "env_splits must be a positive int"),
    ({"inference": "central", "max_wait_us": -1}, "max_wait_us must be a number of microseconds >= 0"),
    ({"inference": "central", "policy": None, "policy_factory": RowPolicy},
     "policy_factory cannot be used with inference='central'"),
    ({"inference": "central", "per_worker_weights": True}, "per_worker_weights cannot be used"),
    ({"inference": "central", "policy_device": ["cpu", "meta"]}, "one policy device"),
])
def test_bad_arguments_are_refused_before_any_worker_starts(kwargs, message):
    started = time.monotonic()
    kwargs = {"policy": RowPolicy(), **kwargs}
    with pytest.raises(ValueError, match=message):
        MultiSyncCollector(CARTPOLE2, num_workers=2, frames_per_batch=32, **kwargs)
    assert time.monotonic() - started < 1.0


def test_central_inference_needs_a_policy():
    with pytest.raises(ValueError, match="inference='central' needs a policy"):
        MultiSyncCollector(CARTPOLE2, None, num_workers=2, frames_per_batch=32, inference="central")


def test_split_stop_ends_every_split_after_the_same_step():
    import numpy as np

    from rlcollect.inference.split import _SharedStop

    flag = np.zeros(1, np.uint8)
    shared = _SharedStop(flag, 2)
    a, b = shared.view(0), shared.view(1)
    assert not a[0] and not b[0] and not a[0]  # split 0 began steps 0 and 1, split 1 step 0
    flag[0] = 1
    assert not b[0]  # split 1 sees it first: both stop once they made 2 steps
    assert b[0] and a[0]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_central_inference_on_a_gpu_gives_the_cpu_data():
    # policy_device="cuda": the forward runs on the GPU (a copy of the policy there, pinned
    # staging for gathered rows, non-blocking copies back); elementwise ops are exact on both
    expected = _stream(MultiSyncCollector, CARTPOLE2, RowPolicy(), 3, update=_bump, inference="central")
    got = _stream(MultiSyncCollector, CARTPOLE2, RowPolicy(), 3, update=_bump, inference="central",
                  policy_device="cuda", max_wait_us=2000)
    for a, b in zip(expected, got):
        for key in KEYS:
            assert torch.equal(a[key], b[key]), key


def test_getattr_policy_reads_the_policy_the_main_process_runs():
    policy = RowPolicy()
    with running(MultiSyncCollector, CARTPOLE2, policy, num_workers=2, frames_per_batch=40, inference="central") as c:
        next(iter(c))
        policy.note = "set after the workers started"
        assert c.getattr_policy("note") == "set after the workers started"
        assert c.getattr_policy("calls") is policy.calls and len(policy.calls) > 0


@pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="SCHED_BATCH is Linux's")
def test_central_env_workers_run_sched_batch_and_the_main_process_does_not():
    with running(MultiSyncCollector, CARTPOLE2, RowPolicy(), num_workers=2, frames_per_batch=40,
                 inference="central") as c:
        next(iter(c))
        assert [os.sched_getscheduler(pid) for pid in c.worker_pids()] == [os.SCHED_BATCH] * 2
        assert os.sched_getscheduler(0) == os.SCHED_OTHER  # the trainer and the inference thread keep theirs
    with running(MultiSyncCollector, CARTPOLE2, RowPolicy(), num_workers=2, frames_per_batch=40) as c:
        assert [os.sched_getscheduler(pid) for pid in c.worker_pids()] == [os.SCHED_OTHER] * 2
