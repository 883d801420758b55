"""The pixel path: large observations go from the env into the batch without a private copy.

* ``rlcollect/rollout.py`` writes observations of at least ``DIRECT_ROW_BYTES`` per row straight
  into the batch; its batches must be bit-identical to the staged path's (the one every field
  took before, still taken by small fields), for a seeded env with random episode ends, with
  random actions, a policy, a recurrent carry, ``max_frames_per_traj``, ``init_random_frames``
  and preemption. The reference is the same rollout with the threshold raised out of reach.
* ``Collector`` fills a fresh batch (no in-place buffer cloned), ``MultiSyncCollector`` delivers
  a view of the stacked shared slot the workers wrote: asserted on the memory itself (which
  buffers alias which), not on timings or RSS.
"""

from __future__ import annotations

import functools

import gymnasium as gym
import numpy as np
import pytest
import torch
from helpers_collector import assert_td_equal, make_collector  # noqa: F401  (fixture)
from tensordict import TensorDict
from tensordict.nn import TensorDictModuleBase

import rlcollect.data as data_module
from rlcollect.multiprocess.slots import StackedSlots
import rlcollect.multiprocess.slots as slots_module
import rlcollect.rollout as rollout_module
from rlcollect import CountingEnv, GymEnv, MultiSyncCollector
from rlcollect.data import BatchBuffer

pytestmark = pytest.mark.timeout(120)

ROWS, T = 3, 10
SHAPE = (16, 16, 16)  # 4096 bytes: written straight into the batch


class PixelEnv(gym.Env):
    """``pixels`` (uint8, 4096 bytes) = a per-episode tag everywhere, with the step count at
    ``[0, 0, 0]`` and the episode count at ``[0, 0, 1]``; ``state`` = (step, episode, tag).
    Episodes end at random (p=0.15 per step) or are truncated after 12 steps."""

    observation_space = gym.spaces.Dict({
        "pixels": gym.spaces.Box(0, 255, SHAPE, np.uint8),
        "state": gym.spaces.Box(-np.inf, np.inf, (3,), np.float32),
    })
    action_space = gym.spaces.Discrete(3)

    def __init__(self):
        self.episode = self.t = self.tag = 0

    def _obs(self):
        pixels = np.full(SHAPE, self.tag, np.uint8)
        pixels[0, 0, 0], pixels[0, 0, 1] = self.t, self.episode % 256
        return {"pixels": pixels, "state": np.array([self.t, self.episode, self.tag], np.float32)}

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.episode += 1
        self.t = 0
        self.tag = int(self.np_random.integers(2, 250))
        return self._obs(), {}

    def step(self, action):
        self.t += 1
        terminated = bool(self.np_random.random() < 0.15)
        return self._obs(), float(action), terminated, self.t >= 12, {}


class Recurrent(TensorDictModuleBase):
    """``("next", "h") = h + state + 1``, ``logits`` from ``h``, action = step % 3."""

    def __init__(self):
        super().__init__()
        self.in_keys = ["state", "h"]
        self.out_keys = [("next", "h"), "logits", "action"]

    def forward(self, td: TensorDict) -> TensorDict:
        state = td.get("state")
        h = td.get("h", None)
        if h is None:
            h = torch.zeros(*state.shape[:-1], 1)
        td.set(("next", "h"), h + state[..., :1] + 1)
        td.set("logits", torch.cat([h, state], -1))
        td.set("action", (state[..., 0].long() % 3))
        return td


class WritesPixels(TensorDictModuleBase):
    """Carries a value into ``pixels``: ``("next", "pixels") = pixels + 1``."""

    def __init__(self):
        super().__init__()
        self.in_keys = ["pixels"]
        self.out_keys = [("next", "pixels"), "action"]

    def forward(self, td: TensorDict) -> TensorDict:
        pixels = td.get("pixels")
        td.set(("next", "pixels"), pixels + 1)
        td.set("action", torch.zeros(pixels.shape[:-3], dtype=torch.int64))
        return td


def _collect(make_collector, monkeypatch, staged: bool, policy=None, batches: int = 4, **kwargs):
    with monkeypatch.context() as patch:
        if staged:
            patch.setattr(rollout_module, "DIRECT_ROW_BYTES", 1 << 62)
        collector = make_collector(GymEnv(PixelEnv, num_envs=ROWS), policy, frames_per_batch=ROWS * T,
                                   total_frames=ROWS * T * batches, **kwargs)
    collector.set_seed(0)
    out = list(collector)
    return collector, out


POLICIES = {
    "random": lambda: None,
    "recurrent": Recurrent,
}


@pytest.mark.parametrize("options", [{}, {"max_frames_per_traj": 5}, {"init_random_frames": 2 * ROWS * T}],
                         ids=["plain", "max_frames_per_traj", "init_random_frames"])
@pytest.mark.parametrize("policy", list(POLICIES))
def test_direct_batches_identical_to_staged(make_collector, monkeypatch, policy, options):
    if policy == "random" and "init_random_frames" in options:
        pytest.skip("a random policy acts randomly anyway")
    direct, got = _collect(make_collector, monkeypatch, False, POLICIES[policy](), **options)
    staged, want = _collect(make_collector, monkeypatch, True, POLICIES[policy](), **options)
    assert direct._rollout._direct == ["pixels"] and staged._rollout._direct == []
    assert "pixels" not in direct._rollout._obs  # no staging of the pixels
    for a, b in zip(got, want, strict=True):
        assert_td_equal(a, b)
    state, ref = direct._rollout.state_dict(), staged._rollout.state_dict()
    assert set(state["obs"]) == set(ref["obs"])
    for key in state["obs"]:
        np.testing.assert_array_equal(state["obs"][key], ref["obs"][key])
    np.testing.assert_array_equal(state["traj_ids"], ref["traj_ids"])


def test_next_pixels_true_final_and_reset_in_next_row(make_collector, monkeypatch):
    """Against the env itself: ``("next", "pixels")`` is the true final frame at episode ends,
    the following row starts with the reset frame, and the carry crosses batch boundaries."""
    _, batches = _collect(make_collector, monkeypatch, False, None, batches=6)
    td = torch.cat(batches, -1)  # (ROWS, 6 T): the rows are continuous across batches
    pixels, nxt = td["pixels"].numpy(), td["next", "pixels"].numpy()
    state, next_state = td["state"].numpy(), td["next", "state"].numpy()
    done = td["next", "done"][..., 0].numpy()
    assert done.sum() >= 6 and (~done).sum() > 0
    for frames, states in ((pixels, state), (nxt, next_state)):  # every frame is the env's
        expect = np.broadcast_to(states[..., 2, None, None, None], frames.shape).astype(np.uint8).copy()
        expect[..., 0, 0, 0], expect[..., 0, 0, 1] = states[..., 0], states[..., 1] % 256
        np.testing.assert_array_equal(frames, expect)
    np.testing.assert_array_equal(next_state[..., 0], state[..., 0] + 1)  # the final frame, not the reset one
    steps = td.shape[-1]
    for r in range(ROWS):
        for t in range(steps - 1):
            if done[r, t]:
                assert state[r, t + 1, 0] == 0 and state[r, t + 1, 1] == state[r, t, 1] + 1
            else:
                np.testing.assert_array_equal(pixels[r, t + 1], nxt[r, t])


def test_carried_pixels_are_staged_and_identical(make_collector, monkeypatch):
    direct, got = _collect(make_collector, monkeypatch, False, WritesPixels(), batches=3)
    _, want = _collect(make_collector, monkeypatch, True, WritesPixels(), batches=3)
    assert direct._rollout._direct == []  # what the policy overwrites after the step is staged
    for a, b in zip(got, want, strict=True):
        assert_td_equal(a, b)


class _StopAfter:
    """A preemption flag that is set once ``steps`` steps were checked."""

    def __init__(self, steps: int):
        self.steps, self.seen = steps, 0

    def __getitem__(self, index):
        self.seen += 1
        return self.seen > self.steps


def test_preempted_fill_identical_to_staged(make_collector, monkeypatch):
    out = []
    for staged in (False, True):
        collector, _ = _collect(make_collector, monkeypatch, staged, Recurrent(), batches=1)
        first = BatchBuffer(collector.layout)
        steps = collector._rollout.fill(first, stop=_StopAfter(4))
        second = BatchBuffer(collector.layout)
        collector._rollout.fill(second)
        out.append((steps, first.td[..., :steps].clone(), first.td["collector", "traj_ids"].clone(), second.td))
    (s1, a1, ids1, b1), (s2, a2, ids2, b2) = out
    assert s1 == s2 == 4
    assert_td_equal(a1, a2)
    assert torch.equal(ids1, ids2) and (ids1[:, 4:] == -1).all()
    assert_td_equal(b1, b2)  # the carry after a preempted batch is the same


def _pixel_arrays(obj, min_bytes: int) -> list[np.ndarray]:
    """The numpy arrays of at least ``min_bytes`` that ``obj``'s attributes hold (in dicts, lists)."""
    found, seen = [], set()

    def visit(value):
        if isinstance(value, np.ndarray):
            base = value if value.base is None else value.base
            if id(base) not in seen and value.nbytes >= min_bytes:
                seen.add(id(base))
                found.append(value)
        elif isinstance(value, dict):
            for v in value.values():
                visit(v)
        elif isinstance(value, (list, tuple)):
            for v in value:
                visit(v)
        elif hasattr(value, "__dict__") and type(value).__module__.startswith("rlcollect.rollout"):
            for v in vars(value).values():
                visit(v)

    for v in vars(obj).values():
        visit(v)
    return found


def test_collector_holds_no_second_copy(make_collector, monkeypatch):
    """The rollout keeps two frames of pixels (the carry and the policy's input), the collector
    no batch buffer: the batch the user gets is the only copy of its pixels."""
    monkeypatch.setattr(data_module, "MAP_BYTES", 1)  # these batches are small: map them anyway
    collector, batches = _collect(make_collector, monkeypatch, False, Recurrent(), batches=2)
    frame_rows = ROWS * int(np.prod(SHAPE))
    big = _pixel_arrays(collector._rollout, frame_rows)
    assert sorted(a.shape for a in big) == [(ROWS, *SHAPE)] * 2
    assert collector._buffer is None
    a, b = batches
    assert a["pixels"].untyped_storage().data_ptr() != b["pixels"].untyped_storage().data_ptr()
    # one memory map per batch, returned to the system when the batch is freed
    assert {t.untyped_storage().data_ptr() for t in a.values(True, True)} == {a["pixels"].untyped_storage().data_ptr()}
    assert not a["pixels"].untyped_storage().resizable()  # (a buffer's memory, not malloc'd by torch)


def test_collector_return_same_td_refills_one_buffer(make_collector):
    collector = make_collector(GymEnv(PixelEnv, num_envs=ROWS), None, frames_per_batch=ROWS * T, total_frames=-1,
                               return_same_td=True)
    it = iter(collector)
    a, b = next(it), next(it)
    assert a["pixels"].data_ptr() == b["pixels"].data_ptr() == collector._buffer.tensors["pixels"].data_ptr()


def _sync(stacked: bool, monkeypatch, cat_results="stack", workers: int = 2):
    with monkeypatch.context() as patch:
        if not stacked:
            patch.setattr(slots_module, "_use_count", None)  # the copying gather
        collector = MultiSyncCollector(
            functools.partial(CountingEnv, max_steps=7, batch_size=[ROWS], obs_dim=1024), None,
            num_workers=workers, frames_per_batch=workers * ROWS * T, total_frames=-1, cat_results=cat_results,
            mp_start_method="fork")
    assert isinstance(collector.slots, StackedSlots) is stacked
    return collector


@pytest.mark.parametrize("cat_results", ["stack", 0])
def test_multisync_view_identical_to_copy(monkeypatch, cat_results):
    out = []
    for stacked in (True, False):
        collector = _sync(stacked, monkeypatch, cat_results)
        try:
            collector.set_seed(0)
            it = iter(collector)
            out.append([next(it).clone() for _ in range(4)])
        finally:
            collector.shutdown()
    for a, b in zip(*out, strict=True):
        assert_td_equal(a, b)
        assert a.names == b.names


def _storage(td) -> int:
    return td["observation"].untyped_storage().data_ptr()


def test_multisync_batches_alias_the_slots_and_are_never_overwritten(monkeypatch):
    collector = _sync(True, monkeypatch)
    try:
        it = iter(collector)
        slots = [flat.untyped_storage().data_ptr() for flat, _ in collector.slots.sets]
        assert len(slots) == 2
        a = next(it)
        # the workers wrote into the memory the user got: every field is a view of one slot
        assert {t.untyped_storage().data_ptr() for t in a.values(True, True)} == {slots[collector.slots.current]}
        a_copy = a.clone()
        b = next(it)  # a is still held: b goes into the other slot
        assert _storage(b) != _storage(a) and {_storage(a), _storage(b)} == set(slots)
        held = [next(it) for _ in range(3)]  # a and b are held: the reserve slot, copied out
        assert len(collector.slots.sets) == 3  # one reserve, however many batches are kept
        reserve = collector.slots.sets[2][0].untyped_storage().data_ptr()
        for c in held:
            assert _storage(c) not in (*slots, reserve)
        assert len({_storage(c) for c in held}) == 3
        assert_td_equal(a, a_copy)
        del a, b, a_copy, held, c
        for _ in range(4):  # released batches: the two slots take turns again
            c = next(it)
            assert _storage(c) in slots
        assert [flat.untyped_storage().data_ptr() for flat, _ in collector.slots.sets][:2] == slots
    finally:
        collector.shutdown()


def test_multiasync_lends_views_and_copies_when_one_is_held(monkeypatch):
    from rlcollect import MultiAsyncCollector

    collector = MultiAsyncCollector(functools.partial(CountingEnv, max_steps=7, batch_size=[ROWS], obs_dim=1024),
                                    None, num_workers=2, frames_per_batch=ROWS * T, total_frames=-1,
                                    mp_start_method="fork")
    try:
        slots = {flat.untyped_storage().data_ptr(): (i, s) for i, flats in enumerate(collector.slots.flats)
                 for s, flat in enumerate(flats)}
        it = iter(collector)
        held, copies = [], 0
        for _ in range(8):  # hold every batch: one view per worker, the rest copied out
            batch = next(it)
            held.append((batch, batch.clone()))
            copies += _storage(batch) not in slots
        worker_of = [int(b["collector", "worker_id"].flatten()[0]) for b, _ in held]
        views = [slots[_storage(b)] for b, _ in held if _storage(b) in slots]
        assert len(views) == 2 and {i for i, _ in views} == {0, 1} and copies == 6
        assert all(worker_of[k] == slots[_storage(b)][0] for k, (b, _) in enumerate(held) if _storage(b) in slots)
        for b, copy in held:  # nothing the user holds was overwritten
            assert_td_equal(b.exclude(("collector", "worker_id")), copy.exclude(("collector", "worker_id")))
        held.clear()
        del batch, b, copy
        seen = set()
        for _ in range(8):  # released: every batch a view again (the previous one is let go each time)
            batch = next(it)
            seen.add(_storage(batch))
            del batch
        assert seen <= set(slots)
    finally:
        collector.shutdown()
