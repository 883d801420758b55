"""Grouped torchrl envs (multi-agent, nested, multi-key: action, reward and done entries under
groups) collected by rlcollect and by torchrl 0.14's collectors, with the same env, policy and
seed: the same batches, every leaf ``torch.equal``, the same sub-TensorDict batch sizes.

torchrl's test envs: ``MultiAgentCountingEnv`` (per-agent groups, a root ``env_done``),
``NestedCountingEnv`` (``("data", ...)`` with a nested dim), ``MultiKeyCountingEnv`` (root and
two groups, each its own action, reward and done), ``HeterogeneousCountingEnv`` (lazily stacked
agents of different shapes: torchrl's batch holds a ``LazyStackedTensorDict`` of the agents,
each its own shapes, and so does ours).
"""

from __future__ import annotations

import pytest

pytest.importorskip("torchrl.collectors")

import torch  # noqa: E402
from tensordict.nn import TensorDictModule, TensorDictModuleBase  # noqa: E402
from torch import nn  # noqa: E402
from torchrl.collectors import Collector as TorchRLCollector  # noqa: E402
from torchrl.collectors import MultiAsyncCollector as TorchRLMultiAsync  # noqa: E402
from torchrl.collectors import MultiSyncCollector as TorchRLMultiSync  # noqa: E402
from torchrl.data import LazyTensorStorage, ReplayBuffer  # noqa: E402
from torchrl.envs import SerialEnv  # noqa: E402
from torchrl.weight_update import MultiProcessWeightSyncScheme, SharedMemWeightSyncScheme  # noqa: E402
from torchrl.testing.mocking_classes import (  # noqa: E402
    HeterogeneousCountingEnv,
    HeterogeneousCountingEnvPolicy,
    MultiAgentCountingEnv,
    MultiKeyCountingEnv,
    MultiKeyCountingEnvPolicy,
    NestedCountingEnv,
)

from rlcollect import Collector, DistributedCollector, MultiAsyncCollector, MultiSyncCollector  # noqa: E402
from rlcollect import ReplayBuffer as OurReplayBuffer  # noqa: E402
from rlcollect import split_trajectories  # noqa: E402

from helpers_torchrl import OURS_ONLY  # noqa: E402

pytestmark = pytest.mark.timeout(180)


# -- envs and policies (module level: the multi-process collectors send them to workers) ----------
def multi_agent():
    return MultiAgentCountingEnv(2, max_steps=3)


def multi_agent_serial():
    return SerialEnv(2, multi_agent)


def nested(batch_size=()):
    return NestedCountingEnv(nested_dim=3, max_steps=3, batch_size=list(batch_size))


def nested_batched():
    return nested((2,))


def multi_key(batch_size=()):
    return MultiKeyCountingEnv(max_steps=3, batch_size=list(batch_size))


def multi_key_batched():
    return multi_key((2,))


class Threshold(nn.Module):
    """Each agent acts 1 when its observation sums past 6 (the observations are random)."""

    def forward(self, obs0, obs1):
        return ((obs0.sum((-1, -2)) > 6)[..., None].to(torch.int8),
                (obs1.sum((-1, -2)) > 6)[..., None].to(torch.int8))


def agents_policy(env=None) -> TensorDictModule:
    keys = [("agents", f"agent_{i}") for i in range(2)]
    return TensorDictModule(Threshold(), in_keys=[(*k, "observation") for k in keys],
                            out_keys=[(*k, "action") for k in keys])


class Parity(nn.Module):
    def forward(self, states):
        return (states % 2).to(torch.int8)


def nested_policy(env=None) -> TensorDictModule:
    return TensorDictModule(Parity(), in_keys=[("data", "states")], out_keys=[("data", "action")])


def multi_key_policy(env) -> MultiKeyCountingEnvPolicy:
    # (stochastic: draws torch.randint once per step, so the draws must line up too)
    return MultiKeyCountingEnvPolicy(full_action_spec=env.full_action_spec)


def multi_key_counting_policy(env=None) -> MultiKeyCountingEnvPolicy:
    """Deterministic (the multi-process collectors seed their workers' streams their own way)."""
    return MultiKeyCountingEnvPolicy(full_action_spec=(env or multi_key()).full_action_spec, deterministic=True)


class Level(nn.Module):
    """Each agent acts 1 when its observation sums past ``level``: a policy with weights."""

    def __init__(self):
        super().__init__()
        self.level = nn.Parameter(torch.tensor(6.0), requires_grad=False)

    def forward(self, obs0, obs1):
        return ((obs0.sum((-1, -2)) > self.level)[..., None].to(torch.int8),
                (obs1.sum((-1, -2)) > self.level)[..., None].to(torch.int8))


def level_policy(env=None) -> TensorDictModule:
    keys = [("agents", f"agent_{i}") for i in range(2)]
    return TensorDictModule(Level(), in_keys=[(*k, "observation") for k in keys],
                            out_keys=[(*k, "action") for k in keys])


class SeesTheAgentDim(TensorDictModuleBase):
    """``nested_policy``, checking that its ``"data"`` sub-TensorDict has the agent dim (3)."""

    in_keys = [("data", "states")]
    out_keys = [("data", "action")]

    def forward(self, td):
        assert td.get("data").batch_size[-1:] == (3,), td.get("data").batch_size
        td.set(("data", "action"), (td.get(("data", "states")) % 2).to(torch.int8))
        return td


ENVS = {
    "MultiAgentCountingEnv": (multi_agent, agents_policy),
    "SerialEnv(MultiAgentCountingEnv)": (multi_agent_serial, agents_policy),
    "NestedCountingEnv": (nested, nested_policy),
    "NestedCountingEnv[2]": (nested_batched, nested_policy),
    "MultiKeyCountingEnv": (multi_key, multi_key_policy),
    "MultiKeyCountingEnv[2]": (multi_key_batched, multi_key_policy),
}


def batches(cls, env_fn, policy_fn, frames=10, n=3, **kwargs) -> list:
    torch.manual_seed(0)
    env = env_fn()
    c = cls(env, policy_fn(env) if policy_fn else None, frames_per_batch=frames, total_frames=n * frames, **kwargs)
    try:
        return [b.clone() for b in c]
    finally:
        c.shutdown()


def structure(td) -> dict:
    """Every entry's shape and dtype, and every sub-TensorDict's batch size."""
    out = {}
    for key, value in td.items(include_nested=True):
        if isinstance(value, torch.Tensor):
            out[key] = (tuple(value.shape), value.dtype)
        else:
            out[key] = tuple(value.batch_size)
    return out


def assert_same(theirs: list, ours: list, same_ids: bool = True) -> None:
    """Equal batches; ``same_ids=False``: the trajectory ids may differ in value (ours are unique
    across workers: docs/migrating-from-torchrl.md) but group the frames alike (the collected
    ones: a split batch's padding carries id 0 in both, which may also be a real id)."""
    assert len(theirs) == len(ours)
    pairs = set()
    for a, b in zip(theirs, ours):
        b = b.exclude(*OURS_ONLY)
        assert b.batch_size == a.batch_size
        assert structure(b) == structure(a)
        for key in a.keys(include_nested=True, leaves_only=True):
            if key == ("collector", "traj_ids") and not same_ids:
                valid = a.get(("collector", "mask"), torch.ones(a.shape, dtype=torch.bool))
                assert torch.equal(a[key][~valid], b[key][~valid])
                pairs |= set(zip(a[key][valid].tolist(), b[key][valid].tolist()))
                continue
            assert torch.equal(a[key], b[key]), key
    assert len({x for x, _ in pairs}) == len({y for _, y in pairs}) == len(pairs)


# -- the single-process Collector -----------------------------------------------------------------------
@pytest.mark.parametrize("name", list(ENVS))
@pytest.mark.parametrize("random", [True, False], ids=["random", "policy"])
@pytest.mark.parametrize("options", [{}, {"split_trajs": True}], ids=["plain", "split_trajs"])
def test_collector_gives_torchrls_batches_for_grouped_envs(name, random, options):
    env_fn, policy_fn = ENVS[name]
    policy_fn = None if random else policy_fn
    assert_same(batches(TorchRLCollector, env_fn, policy_fn, **options),
                batches(Collector, env_fn, policy_fn, **options))


def test_collector_gives_torchrls_batches_with_postproc_and_a_partial_last_batch():
    def postproc(td):
        td.set("seen", td.get(("next", "nested_1", "gift")).sum((-1, -2)))
        return td

    kwargs = dict(frames=7, n=2, postproc=postproc)
    assert_same(batches(TorchRLCollector, multi_key, multi_key_policy, **kwargs),
                batches(Collector, multi_key, multi_key_policy, **kwargs))


@pytest.mark.parametrize("env_fn", [multi_key, multi_key_batched],
                         ids=["MultiKeyCountingEnv", "MultiKeyCountingEnv[2]"])
def test_max_frames_per_traj_gives_torchrls_step_counts(env_fn):
    theirs = batches(TorchRLCollector, env_fn, multi_key_policy, max_frames_per_traj=2)
    ours = batches(Collector, env_fn, multi_key_policy, max_frames_per_traj=2)
    assert_same(theirs, ours)
    assert int(ours[0]["next", "step_count"].max()) == 2


def test_max_frames_per_traj_where_torchrls_collector_fails_nested_env():
    # torchrl 0.14.1: "out.batch_size and stacked batch size must match" (its StepCounter's
    # step_count under the nested "data" group); ours collects, truncating every 2 steps
    with pytest.raises(RuntimeError, match="stacked batch size must match"):
        batches(TorchRLCollector, nested, nested_policy, max_frames_per_traj=2)
    (batch,) = batches(Collector, nested, nested_policy, n=1, max_frames_per_traj=2)
    counts = batch["next", "data", "step_count"][:, 0, 0]
    assert counts.tolist() == [1, 2] * 5
    assert batch["next", "data", "truncated"][:, 0, 0].tolist() == [False, True] * 5
    assert batch["collector", "traj_ids"].tolist() == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]


def test_max_frames_per_traj_on_an_env_without_a_root_done_is_refused_clearly():
    # torchrl's own collector fails there with KeyError('done') from its StepCounter
    with pytest.raises(KeyError, match="done"):
        batches(TorchRLCollector, multi_agent, agents_policy, max_frames_per_traj=2)
    with pytest.raises(ValueError, match=r"max_frames_per_traj=2: env MultiAgentCountingEnv\(batch_size=\[\]\) has no "
                                         r"'done' entry under \[\(\)\]"):
        Collector(multi_agent(), agents_policy(), frames_per_batch=10, max_frames_per_traj=2)


# -- the multi-process collectors ------------------------------------------------------------------------
def multi_batches(cls, env_fn, policy_fn, **kwargs) -> list:
    c = cls([env_fn, env_fn], policy_fn(), frames_per_batch=20, total_frames=40, **kwargs)
    try:
        c.set_seed(3)
        return [b.clone() for b in c]
    finally:
        c.shutdown()


def test_multi_sync_collector_gives_torchrls_batches_for_a_multi_agent_env():
    assert_same(multi_batches(TorchRLMultiSync, multi_agent, agents_policy),
                multi_batches(MultiSyncCollector, multi_agent, agents_policy), same_ids=False)


def test_multi_sync_collector_collects_the_nested_env_torchrls_fails_on():
    # torchrl 0.14.1's MultiSyncCollector on NestedCountingEnv: its workers die with "Failed to
    # update 'done'" (a written-to tensor with overlapping memory) and it never returns a batch
    # (not run here: its dead workers leave processes behind). Ours: each worker's share is what
    # our single-process collector gives with that worker's seed.
    ours = multi_batches(MultiSyncCollector, nested, nested_policy)
    alone = seeded_single(nested, nested_policy, 10, 2)
    assert [tuple(b.batch_size) for b in ours] == [(2, 10)] * 2
    assert_same(alone, [b[0] for b in ours])


def seeded_single(env_fn, policy_fn, frames: int, n: int) -> list:
    c = Collector(env_fn(), policy_fn(), frames_per_batch=frames, total_frames=n * frames)
    try:
        c.set_seed(3)
        return [b.clone() for b in c]
    finally:
        c.shutdown()


def test_multi_async_collector_gives_torchrls_layout_for_a_multi_agent_env():
    # (which worker delivers when is the OS's: compare the layout, and worker 0's batches with
    # our single-process collector's under worker 0's seed)
    theirs = multi_batches(TorchRLMultiAsync, multi_agent, agents_policy)
    ours = multi_batches(MultiAsyncCollector, multi_agent, agents_policy)
    assert [structure(b) for b in theirs] == [structure(b.exclude(*OURS_ONLY)) for b in ours]
    first = [b.exclude(*OURS_ONLY) for b in ours if int(b["collector", "worker_id"][0]) == 0]
    assert_same(seeded_single(multi_agent, agents_policy, 20, 2)[: len(first)], first)


def test_multi_async_collector_collects_the_nested_env_torchrls_fails_on():
    # torchrl 0.14.1's MultiAsyncCollector fails there as its MultiSyncCollector does (not run)
    ours = multi_batches(MultiAsyncCollector, nested, nested_policy)
    first = [b.exclude(*OURS_ONLY) for b in ours if int(b["collector", "worker_id"][0]) == 0]
    assert [tuple(b.batch_size) for b in ours] == [(20,)] * 2
    assert_same(seeded_single(nested, nested_policy, 20, 2)[: len(first)], first)


# -- DistributedCollector ---------------------------------------------------------------------------------
def torchrl_seeded(env_fn, policy_fn, frames: int, n: int, seed: int) -> tuple[list, int]:
    """torchrl's ``Collector`` on an env seeded as a node's is, and the seed the env returns
    (which a distributed collector hands to its next node). The env is seeded before the
    collector is built, so that its first root is drawn after the seed: our ``set_seed`` resets
    the envs on the next batch (documented), torchrl's ``Collector.set_seed`` does not."""
    env = env_fn()
    seed = env.set_seed(seed)
    c = TorchRLCollector(env, policy_fn(), frames_per_batch=frames, total_frames=n * frames)
    try:
        return [b.clone() for b in c], seed
    finally:
        c.shutdown()


def distributed_batches(env_fn, policy_fn, sync: bool) -> list:
    c = DistributedCollector([env_fn, env_fn], policy_fn(), frames_per_batch=20, total_frames=40, sync=sync,
                             launcher="mp", timeout=240.0)
    try:
        c.set_seed(3)
        return [b.clone() for b in c]
    finally:
        c.shutdown()


@pytest.mark.timeout(420)
@pytest.mark.parametrize("name", ["MultiAgentCountingEnv", "NestedCountingEnv"])
def test_distributed_collector_gives_torchrls_batches_for_grouped_envs(name):
    # torchrl 0.14.1's own DistributedCollector cannot be seeded (its nodes fail on set_seed:
    # int(instruction.split(b"seeding_")) on a list), so each node's share is compared with
    # torchrl's Collector seeded as that node is: 3 for node 0, then the seed node 0 returned
    env_fn, policy_fn = ENVS[name]
    node0, seed = torchrl_seeded(env_fn, policy_fn, 10, 2, 3)
    node1, _ = torchrl_seeded(env_fn, policy_fn, 10, 2, seed)
    ours = distributed_batches(env_fn, policy_fn, sync=True)
    assert [structure(b.exclude(*OURS_ONLY)) for b in ours] == [structure(torch.stack(ab)) for ab in zip(node0, node1)]
    for node, theirs in enumerate([node0, node1]):  # (trajectory ids: ours are unique across nodes)
        assert_same(theirs, [b[node] for b in ours], same_ids=False)
    if name == "NestedCountingEnv":  # (the agent dim the nodes' layouts carry to rank 0)
        assert ours[0]["data"].batch_size == ours[0]["next", "data"].batch_size == (2, 10, 3)


@pytest.mark.timeout(420)
def test_distributed_async_collector_gives_torchrls_batches_per_node_for_a_nested_env():
    ours = distributed_batches(nested, nested_policy, sync=False)
    assert [tuple(b.batch_size) for b in ours] == [(20,)] * 2
    theirs, _ = torchrl_seeded(nested, nested_policy, 20, 2, 3)
    first = [b.exclude(*OURS_ONLY) for b in ours if int(b["collector", "node_id"][0]) == 0]
    assert_same(theirs[: len(first)], first)


# -- central inference (torchrl has none: compared with its MultiSyncCollector, whose batches ours give) -----
def test_central_inference_gives_torchrls_batches_for_a_multi_agent_env():
    theirs = multi_batches(TorchRLMultiSync, multi_agent, agents_policy)
    ours = multi_batches(MultiSyncCollector, multi_agent, agents_policy, inference="central", env_splits=1)
    assert_same(theirs, ours, same_ids=False)


def test_central_inference_on_the_nested_env_gives_the_worker_inference_batches():
    # (torchrl's MultiSyncCollector fails on this env: compared with ours, whose workers' batches
    # are our single-process Collector's, test_multi_sync_collector_collects_the_nested_env_torchrls_fails_on)
    central = multi_batches(MultiSyncCollector, nested, nested_policy, inference="central", env_splits=1)
    assert_same(multi_batches(MultiSyncCollector, nested, nested_policy), central)
    # two env splits per worker (the default): the envs side by side, the policy (in this
    # process) sees the agent dim as torchrl's collector gives it to a policy
    split = multi_batches(MultiSyncCollector, nested, lambda: SeesTheAgentDim(), inference="central")
    assert split[0].batch_size == (2, 2, 5)
    assert split[0]["data"].batch_size == split[0]["next", "data"].batch_size == (2, 2, 5, 3)


def async_batched(cls) -> list:
    c = cls(create_env_fn=[multi_agent] * 2, policy=agents_policy(), frames_per_batch=8, total_frames=16)
    try:
        return [b.clone() for b in c]
    finally:
        c.shutdown()


def test_async_batched_collector_gives_torchrls_layout_for_a_multi_agent_env():
    # (torchrl's AsyncBatchedCollector batches whichever envs are ready, ours one worker's envs:
    # docs/migrating-from-torchrl.md#asyncbatchedcollector; the layout, every key, is the same)
    from torchrl.collectors import AsyncBatchedCollector as TorchRLAsyncBatched

    from rlcollect import AsyncBatchedCollector

    theirs, ours = async_batched(TorchRLAsyncBatched), async_batched(AsyncBatchedCollector)
    assert len(theirs) == len(ours) == 2
    ours_only = ("collector", ("next", "policy_version"))  # (documented: ours adds them)
    assert [structure(b) for b in theirs] == [structure(b.exclude(*ours_only)) for b in ours]
    assert ours[0]["agents"].batch_size == theirs[0]["agents"].batch_size == (8,)


# -- replay buffers, free running ---------------------------------------------------------------------------
def buffered(cls, env_fn, policy_fn, frames=10, n=3, **kwargs) -> ReplayBuffer:
    torch.manual_seed(0)
    env = env_fn()
    rb = ReplayBuffer(storage=LazyTensorStorage(100))
    c = cls(env, policy_fn(env), frames_per_batch=frames, total_frames=n * frames, replay_buffer=rb, **kwargs)
    try:
        assert set(map(type, c)) == {type(None)}
    finally:
        c.shutdown()
    return rb


@pytest.mark.parametrize("name", ["MultiAgentCountingEnv", "NestedCountingEnv[2]", "MultiKeyCountingEnv"])
def test_a_torchrl_replay_buffer_gets_torchrls_frames_from_grouped_envs(name):
    env_fn, policy_fn = ENVS[name]
    theirs, ours = buffered(TorchRLCollector, env_fn, policy_fn), buffered(Collector, env_fn, policy_fn)
    assert len(ours) == len(theirs) > 0
    assert_same([theirs[: len(theirs)]], [ours[: len(ours)]])


def test_free_running_into_a_replay_buffer_writes_torchrls_frames():
    theirs = buffered(TorchRLCollector, multi_agent, agents_policy)
    torch.manual_seed(0)
    rb = ReplayBuffer(storage=LazyTensorStorage(1000))
    c = Collector(multi_agent(), agents_policy(), frames_per_batch=10, total_frames=-1, replay_buffer=rb)
    try:
        c.start()
        while len(rb) < len(theirs):
            with c.pause():
                pass
        with c.pause():
            ours = rb[: len(theirs)]
    finally:
        c.async_shutdown()
    assert_same([theirs[: len(theirs)]], [ours])


# -- trajs_per_batch, and the multi-process collectors' split_trajs, postproc, max_frames_per_traj --------
@pytest.mark.parametrize("name", ["MultiAgentCountingEnv", "MultiKeyCountingEnv"])
def test_trajs_per_batch_gives_torchrls_trajectories_for_grouped_envs(name):
    env_fn, policy_fn = ENVS[name]
    assert_same(batches(TorchRLCollector, env_fn, policy_fn, trajs_per_batch=2, traj_format="padded"),
                batches(Collector, env_fn, policy_fn, trajs_per_batch=2, traj_format="padded"))


def mark_seen(td):
    td.set("seen", td.get(("next", "nested_1", "gift")).sum((-1, -2)))
    return td


def test_multi_sync_split_trajs_postproc_and_max_frames_per_traj_give_torchrls_batches():
    kwargs = dict(split_trajs=True, postproc=mark_seen, max_frames_per_traj=2)
    theirs = multi_batches(TorchRLMultiSync, multi_key, multi_key_counting_policy, **kwargs)
    ours = multi_batches(MultiSyncCollector, multi_key, multi_key_counting_policy, **kwargs)
    # (trajectory ids apart: torchrl's workers hand out the same ids, so two of its split rows
    # may share one; ours are unique across workers, one per row)
    ids = ("collector", "traj_ids")
    assert_same([b.exclude(ids) for b in theirs], [b.exclude(ids) for b in ours])
    for batch in ours:
        valid = batch["collector", "mask"]
        firsts = [int(row[m][0]) for row, m in zip(batch[ids], valid)]
        assert all((row[m] == first).all() for row, m, first in zip(batch[ids], valid, firsts))
        assert len(set(firsts)) == len(firsts)


# -- torchrl's weight sync schemes -------------------------------------------------------------------------
def updated_batches(cls, scheme) -> list:
    policy = level_policy()
    c = cls([multi_agent, multi_agent], policy, frames_per_batch=20, total_frames=60,
            weight_sync_schemes={"policy": scheme})
    try:
        c.set_seed(3)
        out = []
        for batch in c:
            out.append(batch.clone())
            with torch.no_grad():
                policy.module.level.add_(1.0)
            c.update_policy_weights_()
        return out
    finally:
        c.shutdown()


@pytest.mark.parametrize("scheme", [SharedMemWeightSyncScheme, MultiProcessWeightSyncScheme])
def test_torchrls_weight_sync_schemes_update_the_policy_on_a_multi_agent_env(scheme):
    theirs = updated_batches(TorchRLMultiSync, scheme())
    ours = updated_batches(MultiSyncCollector, scheme())
    assert_same(theirs, ours, same_ids=False)
    # (the update acted: the last batch's actions are the level-8 policy's, not the level-6 one's)
    obs = ours[-1]["agents", "agent_0", "observation"].sum((-1, -2))
    assert torch.equal(ours[-1]["agents", "agent_0", "action"][..., 0], (obs > 8).to(torch.int8))
    assert not torch.equal((obs > 8), (obs > 6))


# -- agents of different shapes: lazy stacks -----------------------------------------------------------------
def heterogeneous(batch_size=()):
    return HeterogeneousCountingEnv(max_steps=3, batch_size=list(batch_size))


def heterogeneous_batched():
    return heterogeneous((2,))


def heterogeneous_policy(env=None) -> HeterogeneousCountingEnvPolicy:
    """Each agent's action all ones (torchrl's policy for this env: counts every step)."""
    return HeterogeneousCountingEnvPolicy((env or heterogeneous()).full_action_spec)


def assert_same_stacks(theirs: list, ours: list, same_ids: bool = True) -> None:
    """``assert_same`` for batches holding lazy stacks: the same type at every entry (a
    ``LazyStackedTensorDict`` where torchrl has one, with its stack dim), and each agent's
    TensorDict equal, every leaf ``torch.equal``."""
    assert len(theirs) == len(ours)
    for a, b in zip(theirs, ours):
        b = b.exclude(*OURS_ONLY)
        if not same_ids:
            a, b = a.exclude(("collector", "traj_ids")), b.exclude(("collector", "traj_ids"))
        _same_td(a, b, ())


def _same_td(a, b, path: tuple) -> None:
    assert type(a) is type(b), (path, type(a), type(b))
    assert a.batch_size == b.batch_size, (path, a.batch_size, b.batch_size)
    if hasattr(a, "tensordicts"):
        assert (a.stack_dim, len(a.tensordicts)) == (b.stack_dim, len(b.tensordicts)), path
        for i, (x, y) in enumerate(zip(a.tensordicts, b.tensordicts)):
            _same_td(x, y, (*path, f"agent {i}"))
        return
    assert set(a.keys()) == set(b.keys()), (path, set(a.keys()) ^ set(b.keys()))
    for key in a.keys():
        x, y = a.get(key), b.get(key)
        if isinstance(x, torch.Tensor):
            assert (x.shape, x.dtype) == (y.shape, y.dtype), (path, key)
            assert torch.equal(x, y), (path, key)
        else:
            _same_td(x, y, (*path, key))


def mark_agent_0(td):
    td.set("seen", td.get(("next", "lazy")).tensordicts[0].get("vector").sum(-1))
    return td


@pytest.mark.parametrize("env_fn", [heterogeneous, heterogeneous_batched],
                         ids=["HeterogeneousCountingEnv", "HeterogeneousCountingEnv[2]"])
@pytest.mark.parametrize("policy_fn", [None, heterogeneous_policy], ids=["random", "policy"])
@pytest.mark.parametrize("options", [{}, {"max_frames_per_traj": 2, "postproc": mark_agent_0}],
                         ids=["plain", "max_frames_per_traj+postproc"])
def test_collector_gives_torchrls_lazy_stacks_for_agents_of_different_shapes(env_fn, policy_fn, options):
    theirs = batches(TorchRLCollector, env_fn, policy_fn, frames=8, **options)
    ours = batches(Collector, env_fn, policy_fn, frames=8, **options)
    assert type(ours[0]["lazy"]).__name__ == "LazyStackedTensorDict"
    assert ours[0]["lazy"].tensordicts[0]["vector"].shape[-1] == 3  # (agent 0's; the others' are 2)
    assert_same_stacks(theirs, ours)


def test_multi_sync_collector_gives_torchrls_lazy_stacks_for_agents_of_different_shapes():
    theirs = multi_batches(TorchRLMultiSync, heterogeneous, heterogeneous_policy)
    # (spawned workers: torchrl's consolidated specs order an agent's keys by a set, which
    # differs between processes; each worker's fields must still be carved as the main process's)
    ours = multi_batches(MultiSyncCollector, heterogeneous, heterogeneous_policy, mp_start_method="spawn")
    assert ours[0]["lazy"].batch_size == (2, 10, 3) and ours[0]["lazy"].stack_dim == 2
    assert_same_stacks(theirs, ours, same_ids=False)  # (ours are unique across workers)
    for a, b in zip(theirs, ours):  # (they group the frames alike)
        pairs = set(zip(a["collector", "traj_ids"].flatten().tolist(), b["collector", "traj_ids"].flatten().tolist()))
        assert len({x for x, _ in pairs}) == len({y for _, y in pairs}) == len(pairs)


def test_multi_async_collector_gives_torchrls_lazy_stacks_for_agents_of_different_shapes():
    # (which worker delivers when is the OS's: the structure, and worker 0's batches against our
    # single-process collector's under worker 0's seed, itself torchrl's: the test above)
    theirs = multi_batches(TorchRLMultiAsync, heterogeneous, heterogeneous_policy)
    ours = multi_batches(MultiAsyncCollector, heterogeneous, heterogeneous_policy)
    assert_same_stacks(theirs[:1], ours[:1], same_ids=False)
    first = [b for b in ours if int(b["collector", "worker_id"][0]) == 0]
    assert_same_stacks(seeded_single(heterogeneous, heterogeneous_policy, 20, 2)[: len(first)], first)


@pytest.mark.timeout(420)
def test_distributed_collector_gives_torchrls_lazy_stacks_for_agents_of_different_shapes():
    # (each node's share against torchrl's Collector seeded as that node is, as for the other
    # grouped envs: the nodes' layouts carry the lazy stacks to rank 0)
    node0, seed = torchrl_seeded(heterogeneous, heterogeneous_policy, 10, 2, 3)
    node1, _ = torchrl_seeded(heterogeneous, heterogeneous_policy, 10, 2, seed)
    ours = distributed_batches(heterogeneous, heterogeneous_policy, sync=True)
    assert ours[0]["lazy"].batch_size == (2, 10, 3) and ours[0]["lazy"].stack_dim == 2
    for node, theirs in enumerate([node0, node1]):
        assert_same_stacks(theirs, [b[node] for b in ours], same_ids=False)


def test_a_torchrl_replay_buffer_gets_torchrls_frames_from_agents_of_different_shapes():
    theirs = buffered(TorchRLCollector, heterogeneous, heterogeneous_policy)
    ours = buffered(Collector, heterogeneous, heterogeneous_policy)
    assert len(ours) == len(theirs) == 30
    assert_same_stacks([theirs[:30]], [ours[:30]])


def test_free_running_and_multi_sync_write_torchrls_frames_of_agents_of_different_shapes():
    theirs = buffered(TorchRLCollector, heterogeneous, heterogeneous_policy)  # 30 frames
    torch.manual_seed(0)
    rb = ReplayBuffer(storage=LazyTensorStorage(1000))
    c = Collector(heterogeneous(), heterogeneous_policy(), frames_per_batch=10, total_frames=-1, replay_buffer=rb)
    try:
        c.start()
        while len(rb) < 30:
            with c.pause():
                pass
        with c.pause():
            ours = rb[:30]
    finally:
        c.async_shutdown()
    assert_same_stacks([theirs[:30]], [ours])
    # MultiSyncCollector extends each worker's batch on its own, as torchrl's workers do
    multi = ReplayBuffer(storage=LazyTensorStorage(100))
    c = MultiSyncCollector([heterogeneous, heterogeneous], heterogeneous_policy(), frames_per_batch=20,
                           total_frames=20, replay_buffer=multi)
    try:
        assert list(c) == [None]
    finally:
        c.shutdown()
    assert len(multi) == 20
    written = multi[:20]
    assert type(written["lazy"]).__name__ == "LazyStackedTensorDict"
    ids = ("collector", "traj_ids")  # (worker 0's first 10 frames: the counting env is deterministic)
    assert_same_stacks([theirs[:10].exclude(ids)], [written[:10].exclude(ids)])


def test_split_trajs_of_agents_of_different_shapes_where_torchrls_collector_fails():
    # torchrl 0.14.1's split_trajectories stacks the agents densely and fails; ours splits each
    # agent's TensorDict as it splits a dense batch and stacks them lazily again
    with pytest.raises(RuntimeError, match="Failed to stack tensors"):
        batches(TorchRLCollector, heterogeneous, heterogeneous_policy, frames=8, split_trajs=True)
    plain = batches(Collector, heterogeneous, heterogeneous_policy, frames=8)
    split = batches(Collector, heterogeneous, heterogeneous_policy, frames=8, split_trajs=True)
    ids = ("collector", "traj_ids")
    for whole, parts in zip(plain, split):
        assert parts.batch_size == (2, 4) and parts["lazy"].stack_dim == 2
        for key in ("lazy", ("next", "lazy")):
            for i, agent in enumerate(whole.get(key).tensordicts):
                alone = split_trajectories(agent.clone().set(ids, whole.get(ids)))
                _same_td(alone.exclude("collector"), parts.get(key).tensordicts[i], (key, i))
        assert torch.equal(parts["next", "state"], split_trajectories(whole.exclude("lazy", ("next", "lazy")))[
            "next", "state"])


def test_trajs_per_batch_on_agents_of_different_shapes_gives_no_batch_as_torchrls():
    # a trajectory ends at the root ("next", "done"), which this env lacks (only its agents'):
    # torchrl's collector delivers nothing, ours neither
    kwargs = dict(frames=8, trajs_per_batch=2, traj_format="padded")
    assert batches(TorchRLCollector, heterogeneous, heterogeneous_policy, **kwargs) == []
    assert batches(Collector, heterogeneous, heterogeneous_policy, **kwargs) == []


class LazyOnes(TensorDictModuleBase):
    """torchrl's policy for HeterogeneousCountingEnv (each agent's action all ones) for any number
    of rows: torchrl's writes the env's batch size, while central inference calls the policy on
    the rows of every worker at once."""

    def __init__(self, env=None):
        super().__init__()
        env = env or heterogeneous()
        nb = len(env.batch_size)
        acted = heterogeneous_policy(env)(env.reset())
        self.actions = [(a["action"].shape[nb:], a["action"].dtype) for a in acted["lazy"].tensordicts]
        self.in_keys, self.out_keys = [], [("lazy", "action")]

    def forward(self, td):
        for agent, (shape, dtype) in zip(td["lazy"].tensordicts, self.actions):
            agent.set("action", torch.ones((*agent.batch_size, *shape), dtype=dtype))
        return td


def test_central_inference_gives_torchrls_lazy_stacks_for_agents_of_different_shapes():
    # each agent's entries cross the shared block on their own; the policy, in this process, gets
    # the group lazily stacked again, as in a worker (torchrl has no central inference: its
    # MultiSyncCollector's batches, with one env split per worker, are what ours must equal)
    theirs = multi_batches(TorchRLMultiSync, heterogeneous, heterogeneous_policy)
    ours = multi_batches(MultiSyncCollector, heterogeneous, LazyOnes, inference="central", env_splits=1)
    assert type(ours[0]["lazy"]).__name__ == "LazyStackedTensorDict"
    assert_same_stacks(theirs, ours, same_ids=False)
    # two env splits (the default): the splits side by side, the agents still lazily stacked
    split = multi_batches(MultiSyncCollector, heterogeneous, LazyOnes, inference="central")
    assert split[0]["lazy"].batch_size == (2, 2, 5, 3) and split[0]["lazy"].stack_dim == 3


def test_rlcollects_replay_buffer_stores_agents_of_different_shapes_as_torchrls_buffer_does():
    # each agent's entries stored as fields of their own, read back lazily stacked: the frames a
    # torchrl ReplayBuffer gets from torchrl's Collector, every leaf torch.equal
    theirs = buffered(TorchRLCollector, heterogeneous, heterogeneous_policy)
    torch.manual_seed(0)
    env = heterogeneous()
    rb = OurReplayBuffer(100)
    c = Collector(env, heterogeneous_policy(env), frames_per_batch=10, total_frames=30, replay_buffer=rb)
    try:
        assert list(c) == [None, None, None]
    finally:
        c.shutdown()
    assert len(rb) == 30
    assert_same_stacks([theirs[:30]], [rb[:]])
    sample = rb.sample(4)
    assert sample["lazy"].batch_size == (4, 3) and sample["lazy"].stack_dim == 1
    rb.close()


# -- bad input: clear errors naming the env and the key ----------------------------------------------------
class WrongGroup(nn.Module):
    def forward(self, obs):
        return torch.zeros(obs.shape[:-2] + (1,), dtype=torch.int8)


def test_a_policy_acting_for_a_group_the_env_lacks_is_refused():
    policy = TensorDictModule(WrongGroup(), in_keys=[("agents", "agent_0", "observation")],
                              out_keys=[("adversaries", "agent_0", "action")])
    with pytest.raises(ValueError, match=r"env MultiAgentCountingEnv\(batch_size=\[\]\) has no group "
                                         r"\('adversaries', 'agent_0'\), but the policy wrote the action "
                                         r"\('adversaries', 'agent_0', 'action'\)"):
        Collector(multi_agent(), policy, frames_per_batch=10)


def test_a_policy_missing_a_groups_action_is_refused():
    policy = TensorDictModule(WrongGroup(), in_keys=[("agents", "agent_0", "observation")],
                              out_keys=[("agents", "agent_0", "action")])
    with pytest.raises(ValueError, match=r"the policy did not write the action keys \[\('agents', 'agent_1', "
                                         r"'action'\)\]"):
        Collector(multi_agent(), policy, frames_per_batch=10)


class GrowingAgents(MultiAgentCountingEnv):
    """From its third step on, agent_0's observation gets a row more."""

    def _step(self, tensordict):
        out = super()._step(tensordict)
        if int(self.count.max()) >= 3:
            obs = out.get(("agents", "agent_0", "observation"))
            out.set(("agents", "agent_0", "observation"), torch.cat([obs, obs[..., :1, :]], -2))
        return out


def test_a_group_whose_shapes_change_mid_run_names_the_env_and_the_key():
    env = GrowingAgents(2, max_steps=10)
    c = Collector(env, agents_policy(), frames_per_batch=10)
    try:
        with pytest.raises(ValueError, match=r"env GrowingAgents\(batch_size=\[\]\) returned shape \(4, 4\) for "
                                             r"\('next', 'agents', 'agent_0', 'observation'\) at step 2 of the batch"):
            next(iter(c))
    finally:
        c.shutdown()


# -- the guide's torchrl examples ------------------------------------------------------------------------
def test_the_multi_agent_guides_torchrl_examples_run():
    # (docs/multi-agent.md marks its torchrl examples ```py: tests/test_docs.py runs the ```python
    # ones in the main suite, which has no torchrl)
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "multi-agent.md").read_text()
    blocks = re.findall(r"^```py\n(.*?)^```", text, re.S | re.M)
    assert blocks
    namespace: dict = {"__name__": "__main__"}
    for i, code in enumerate(blocks):
        exec(compile(code, f"multi-agent.md[py block {i}]", "exec"), namespace)
