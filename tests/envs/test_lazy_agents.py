"""Agents of different shapes (a group the env gives as a ``LazyStackedTensorDict``), without
torchrl: each agent's entries are fields of their own in the batch layout, the delivered batch
stacks them lazily again, through ``Collector`` and the multi-process collectors' shared memory.
(Side by side with torchrl's collectors on its ``HeterogeneousCountingEnv``:
tests/torchrl/test_torchrl_marl.py.)"""

from __future__ import annotations

import pytest
import torch

tensordict = pytest.importorskip("tensordict")

from tensordict import LazyStackedTensorDict, TensorDict  # noqa: E402

from rlcollect import Collector, MultiAsyncCollector, MultiSyncCollector, ReplayBuffer, split_trajectories  # noqa: E402

#: each agent's observation size: agent 0 sees 3 numbers, agent 1 sees 2
SIZES = (3, 2)
STEPS = 3


class TwoShapes:
    """Two agents under ``"agents"``, lazily stacked: agent ``i``'s ``"obs"`` is ``SIZES[i]``
    copies of the step count, its ``"action"`` one float; both are done after ``STEPS`` steps
    (a root ``"done"`` too), and the env resets then."""

    def __init__(self, batch_size=()):
        self.batch_size = torch.Size(batch_size)
        self.count = torch.zeros(self.batch_size, dtype=torch.int64)
        self.action_keys = [("agents", "action")]
        self.reward_keys = [("agents", "reward")]
        self.done_keys = ["done", ("agents", "done")]

    def _agents(self, fill, action: bool = False, outcome: bool = False) -> LazyStackedTensorDict:
        tds = []
        for size in SIZES:
            td = TensorDict({"obs": fill[..., None].expand(*self.batch_size, size).float().clone()}, self.batch_size)
            if action:
                td.set("action", torch.zeros(*self.batch_size, 1))
            td.set("done", (fill >= STEPS)[..., None].clone())
            if outcome:
                td.set("reward", torch.ones(*self.batch_size, 1))
            tds.append(td)
        return LazyStackedTensorDict(*tds, stack_dim=len(self.batch_size))

    def _root(self) -> TensorDict:
        td = TensorDict({"agents": self._agents(self.count)}, self.batch_size)
        td.set("done", torch.zeros(*self.batch_size, 1, dtype=torch.bool))
        return td

    def fake_tensordict(self) -> TensorDict:
        td = TensorDict({"agents": self._agents(self.count, action=True)}, self.batch_size)
        td.set("done", torch.zeros(*self.batch_size, 1, dtype=torch.bool))
        nxt = TensorDict({"agents": self._agents(self.count, outcome=True)}, self.batch_size)
        nxt.set("done", torch.zeros(*self.batch_size, 1, dtype=torch.bool))
        td.set("next", nxt)
        return td

    def reset(self, td=None):
        self.count.zero_()
        return self._root()

    def rand_action(self, td):
        for agent in td.get("agents").tensordicts:
            agent.set("action", torch.rand(*self.batch_size, 1))
        return td

    def step(self, td):
        return self.step_and_maybe_reset(td)[0]

    def step_and_maybe_reset(self, td):
        for agent in td.get("agents").tensordicts:  # (each agent's action is its own tensor)
            assert agent.get("action").shape == (*self.batch_size, 1)
        self.count += 1
        nxt = TensorDict({"agents": self._agents(self.count, outcome=True)}, self.batch_size)
        nxt.set("done", (self.count >= STEPS)[..., None].clone())
        td.set("next", nxt)
        if bool((self.count >= STEPS).any()):
            self.count[self.count >= STEPS] = 0
        return td, self._root()

    def set_seed(self, seed, static_seed=False):
        return seed + 1


def act(tensordict):
    """Each agent's action: its first observation (so the batch shows who acted on what)."""
    for agent in tensordict.get("agents").tensordicts:
        agent.set("action", agent.get("obs")[..., :1].clone())
    return tensordict


def expected_obs(agent: int, frames: int) -> torch.Tensor:
    counts = torch.arange(frames) % STEPS
    return counts[:, None].expand(frames, SIZES[agent]).float()


def check(batch) -> None:
    frames = batch.shape[-1]
    agents = batch.get("agents")
    assert isinstance(agents, LazyStackedTensorDict)
    assert agents.batch_size == (*batch.batch_size, 2) and agents.stack_dim == batch.batch_dims
    for i, agent in enumerate(agents.tensordicts):
        obs = agent.get("obs").reshape(-1, frames, SIZES[i])
        assert torch.equal(obs, expected_obs(i, frames).expand_as(obs))
        assert torch.equal(agent.get("action").reshape(-1, frames), obs[..., 0])
        nxt = batch.get(("next", "agents")).tensordicts[i].get("obs").reshape(-1, frames, SIZES[i])
        assert torch.equal(nxt, obs + 1)


@pytest.mark.parametrize("batch_size", [(), (2,)], ids=["unbatched", "batched"])
def test_collector_stacks_agents_of_different_shapes_lazily(batch_size):
    c = Collector(TwoShapes(batch_size), act, frames_per_batch=6 * max(1, sum(batch_size)), total_frames=-1)
    try:
        batch = next(iter(c))
    finally:
        c.shutdown()
    check(batch)
    firsts = [0, 0, 0, 1, 1, 1] if batch_size == () else [0, 0, 0, 2, 2, 2]
    assert batch["collector", "traj_ids"].reshape(-1, 6)[0].tolist() == firsts


def test_split_trajs_pads_each_agent_of_a_lazy_stack():
    c = Collector(TwoShapes(), act, frames_per_batch=7, total_frames=7, split_trajs=True)
    try:
        (batch,) = list(c)
    finally:
        c.shutdown()
    agents = batch.get("agents")
    assert batch.batch_size == (3, 3) and isinstance(agents, LazyStackedTensorDict) and agents.stack_dim == 2
    assert [a.get("obs").shape for a in agents.tensordicts] == [(3, 3, 3), (3, 3, 2)]
    assert batch["collector", "mask"].tolist() == [[True] * 3, [True] * 3, [True, False, False]]
    assert torch.equal(agents.tensordicts[1].get("obs")[2], torch.tensor([[0.0, 0.0], [0.0, 0.0], [0.0, 0.0]]))
    assert split_trajectories(batch.exclude("agents", ("next", "agents"))).batch_size == (3, 3)


@pytest.mark.parametrize("cls", [MultiSyncCollector, MultiAsyncCollector])
def test_the_multi_process_collectors_carry_lazy_stacks_through_shared_memory(cls):
    c = cls([TwoShapes, TwoShapes], act, frames_per_batch=12, total_frames=24)
    try:
        batches = [b.clone() for b in c]
    finally:
        c.shutdown()
    assert len(batches) == 2  # (async: each batch is one worker's 12 frames)
    for batch in batches:
        check(batch)


@pytest.mark.parametrize("env_splits", [1, 2])
def test_central_inference_acts_on_lazy_stacks_in_this_process(env_splits):
    # each agent's entries cross the shared block on their own; the policy, here, gets the group
    # lazily stacked again (its actions go back agent by agent)
    c = MultiSyncCollector([TwoShapes, TwoShapes], act, frames_per_batch=12, total_frames=24, inference="central",
                           env_splits=env_splits)
    try:
        batches = [b.clone() for b in c]
    finally:
        c.shutdown()
    assert len(batches) == 2
    for batch in batches:
        assert batch.batch_size == ((2, 6) if env_splits == 1 else (2, 2, 3))
        check(batch)


# -- rlcollect's own ReplayBuffer: each agent's entries stored as fields of their own ------------------------
def check_frames(frames) -> None:
    """Stored frames of ``TwoShapes`` (any order): agent ``i``'s obs is ``SIZES[i]`` copies of one
    count in 0..STEPS-1, its action that count, its next obs one more."""
    agents = frames.get("agents")
    assert isinstance(agents, LazyStackedTensorDict)
    assert agents.batch_size == (*frames.batch_size, 2) and agents.stack_dim == frames.batch_dims
    for i, agent in enumerate(agents.tensordicts):
        obs = agent.get("obs")
        assert obs.shape == (*frames.batch_size, SIZES[i])
        assert torch.equal(obs, obs[..., :1].expand_as(obs)) and bool(((obs >= 0) & (obs < STEPS)).all())
        assert torch.equal(agent.get("action"), obs[..., :1])
        assert torch.equal(frames.get(("next", "agents")).tensordicts[i].get("obs"), obs + 1)


@pytest.mark.parametrize("batch_size", [(), (2,)], ids=["unbatched", "batched"])
def test_rlcollects_replay_buffer_stores_and_samples_agents_of_different_shapes(batch_size):
    rows = max(1, sum(batch_size))
    c = Collector(TwoShapes(batch_size), act, frames_per_batch=6 * rows, total_frames=-1)
    try:
        batch = next(iter(c)).clone()
    finally:
        c.shutdown()
    with ReplayBuffer(100) as rb:
        assert rb.extend(batch).tolist() == list(range(6 * rows))
        stored = rb[:]
        # row-major: the batch's frames in order, each agent's entries its own
        assert stored.batch_size == (6 * rows,)
        for i in range(2):
            assert torch.equal(stored["agents"].tensordicts[i]["obs"],
                               batch["agents"].tensordicts[i]["obs"].reshape(-1, SIZES[i]))
            assert torch.equal(stored["next", "agents"].tensordicts[i]["reward"],
                               batch["next", "agents"].tensordicts[i]["reward"].reshape(-1, 1))
        assert torch.equal(stored["collector", "traj_ids"], batch["collector", "traj_ids"].reshape(-1))
        check_frames(stored)
        check_frames(rb.sample(5))
        one = rb[3]
        assert one.batch_size == () and one["agents"].batch_size == (2,)
        assert torch.equal(one["agents"].tensordicts[0]["obs"], stored["agents"].tensordicts[0]["obs"][3])


def test_workers_write_agents_of_different_shapes_into_rlcollects_replay_buffer():
    # MultiSync's batches, then two workers running free: the workers allocate the storage, this
    # process reads the lazy groups back from the stored keys alone
    with ReplayBuffer(1000) as rb:
        c = MultiSyncCollector([TwoShapes, TwoShapes], act, frames_per_batch=12, total_frames=24, replay_buffer=rb)
        try:
            assert list(c) == [None, None]
        finally:
            c.shutdown()
        assert len(rb) == 24
        check_frames(rb[:])
    with ReplayBuffer(1000) as rb:
        c = MultiAsyncCollector([TwoShapes, TwoShapes], act, frames_per_batch=6, total_frames=-1, replay_buffer=rb)
        try:
            c.start()
            while len(rb) < 60:
                with c.pause():
                    pass
            with c.pause():
                stored = rb[:]
        finally:
            c.async_shutdown()
        assert stored.batch_size[0] >= 60
        check_frames(stored)


def test_a_memmap_buffer_reopened_elsewhere_stacks_agents_again(tmp_path):
    c = Collector(TwoShapes(), act, frames_per_batch=6, total_frames=6)
    try:
        (batch,) = [b.clone() for b in c]
    finally:
        c.shutdown()
    rb = ReplayBuffer(10, storage="memmap", path=tmp_path / "rb")
    rb.extend(batch)
    rb.close()
    with ReplayBuffer(10, storage="memmap", path=tmp_path / "rb") as again:
        check_frames(again[:])
        assert torch.equal(again[:]["agents"].tensordicts[1]["obs"], batch["agents"].tensordicts[1]["obs"])


def test_what_rlcollects_replay_buffer_cannot_store_of_lazy_stacks_is_refused_clearly():
    agents = [TensorDict({"obs": torch.zeros(4, 1, size)}, [4, 1]) for size in SIZES]
    late = TensorDict({"agents": LazyStackedTensorDict(*agents, stack_dim=2)}, [4])
    with ReplayBuffer(10) as rb, pytest.raises(ValueError, match=r"the group \('agents',\) is lazily stacked along "
                                                                 r"dim 2, not the first dim past the batch's \(1\)"):
        rb.extend(late)
    named = TensorDict({"#0": TensorDict({"g": LazyStackedTensorDict(*[a[:, 0] for a in agents], stack_dim=1)}, [4])},
                       [4])
    with ReplayBuffer(10) as rb, pytest.raises(ValueError, match=r"the key \('#0', 'g'\) has a part of the form "
                                                                 r"'#<int>'"):
        rb.extend(named)
