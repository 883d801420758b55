"""``split_trajectories`` (SPEC section 1): one trajectory per row, right-padded with zeros, a
``("collector", "mask")``, rows ordered by first appearance in row-major order, correct for
non-contiguous ids, invalid (-1) frames dropped."""

from __future__ import annotations

import pytest
import torch
from helpers_collector import MASK, TRAJ_IDS, make_collector  # noqa: F401  (fixture)
from tensordict import TensorDict

from rlcollect import GymEnv, split_trajectories
from rlcollect.data import TRAJ_ID_BLOCK


def frames(ids, batch_size=None) -> TensorDict:
    """A hand-built batch: x = frame index in row-major order, plus entries of every kind."""
    ids = torch.as_tensor(ids, dtype=torch.int64)
    n = ids.numel()
    x = torch.arange(n, dtype=torch.float32).reshape(ids.shape)
    return TensorDict(
        {
            "x": x,
            "obs": torch.stack([x, -x, 2 * x], -1),
            "flag": (torch.arange(n).reshape(ids.shape) % 2 == 0).unsqueeze(-1),
            ("next", "count"): torch.arange(n).reshape(*ids.shape, 1) + 100,
            TRAJ_IDS: ids,
        },
        batch_size=ids.shape,
    )


def test_docstring_example():
    out = split_trajectories(frames([7, 7, 3, 7]))
    assert out.batch_size == torch.Size([2, 3])
    assert out["x"].tolist() == [[0, 1, 3], [2, 0, 0]]
    assert out[MASK].tolist() == [[True, True, True], [True, False, False]]
    assert out[TRAJ_IDS].tolist() == [[7, 7, 7], [3, 0, 0]]
    assert out.names == [None, "time"]


def test_contiguous_ids():
    out = split_trajectories(frames([0, 0, 1, 1, 1, 2]))
    assert out.batch_size == torch.Size([3, 3])
    assert out["x"].tolist() == [[0, 1, 0], [2, 3, 4], [5, 0, 0]]
    assert out[MASK].tolist() == [[True, True, False], [True, True, True], [True, False, False]]


def test_rows_ordered_by_first_appearance_not_id_value():
    out = split_trajectories(frames([30, 30, 10, 10, 20]))
    assert out[TRAJ_IDS][:, 0].tolist() == [30, 10, 20]
    assert out["x"].tolist() == [[0, 1], [2, 3], [4, 0]]


def test_two_dim_batch_row_major():
    # Row-major: row 0 first (ids 4, 4, 9), then row 1 (ids 1, 1, 2).
    out = split_trajectories(frames([[4, 4, 9], [1, 1, 2]]))
    assert out.batch_size == torch.Size([4, 2])
    assert out[TRAJ_IDS][:, 0].tolist() == [4, 9, 1, 2]
    assert out["x"].tolist() == [[0, 1], [2, 0], [3, 4], [5, 0]]
    assert out[MASK].tolist() == [[True, True], [True, False], [True, True], [True, False]]


def test_non_contiguous_ids():
    # Trajectory 5 is interrupted by 8 and comes back, within a row and across rows.
    out = split_trajectories(frames([[5, 8, 5, 5], [8, 2, 2, 5]]))
    assert out[TRAJ_IDS][:, 0].tolist() == [5, 8, 2]
    assert out["x"].tolist() == [[0, 2, 3, 7], [1, 4, 0, 0], [5, 6, 0, 0]]
    assert out[MASK].sum(-1).tolist() == [4, 2, 2]


def test_three_dim_batch():
    ids = torch.tensor([[[0, 0], [1, 1]], [[2, 3], [4, 4]]])
    out = split_trajectories(frames(ids))
    assert out[TRAJ_IDS][:, 0].tolist() == [0, 1, 2, 3, 4]
    assert out["x"].tolist() == [[0, 1], [2, 3], [4, 0], [5, 0], [6, 7]]


def test_invalid_frames_dropped():
    out = split_trajectories(frames([0, -1, 0, 1, -1, 1, -1]))
    assert out.batch_size == torch.Size([2, 2])
    assert out["x"].tolist() == [[0, 2], [3, 5]]
    assert out[MASK].all()
    assert (out[TRAJ_IDS] != -1).all()


def test_masked_frames_dropped():
    td = frames([0, 0, 1, 1])
    td.set(MASK, torch.tensor([True, False, True, True]))
    out = split_trajectories(td)
    assert out["x"].tolist() == [[0, 0], [2, 3]]
    assert out[MASK].tolist() == [[True, False], [True, True]]


def test_all_invalid():
    out = split_trajectories(frames([-1, -1, -1]))
    assert out.shape[0] == 0
    assert out[MASK].numel() == 0


def test_every_entry_split_and_padded_with_zeros():
    td = frames([3, 3, 3, 6])
    out = split_trajectories(td)
    assert set(out.keys(True, True)) == set(td.keys(True, True)) | {MASK}
    assert out["obs"].shape == (2, 3, 3)
    assert out["obs"].tolist() == [[[0, 0, 0], [1, -1, 2], [2, -2, 4]], [[3, -3, 6], [0, 0, 0], [0, 0, 0]]]
    assert out["flag"].dtype == torch.bool
    assert out["flag"].squeeze(-1).tolist() == [[True, False, True], [False, False, False]]
    assert out["next", "count"].dtype == torch.int64
    assert out["next", "count"].squeeze(-1).tolist() == [[100, 101, 102], [103, 0, 0]]
    assert out[MASK].dtype == torch.bool


def test_big_ids_and_input_untouched():
    base = 3 * TRAJ_ID_BLOCK
    td = frames([base + 1, base + 1, base, base + 1])
    before = td.clone()
    out = split_trajectories(td)
    assert out[TRAJ_IDS][:, 0].tolist() == [base + 1, base]
    assert (td == before).all()


def test_missing_traj_ids():
    with pytest.raises(KeyError, match="traj_ids"):
        split_trajectories(TensorDict({"x": torch.zeros(3)}, batch_size=[3]))


def _check_round_trip(td: TensorDict) -> None:
    """Every trajectory row holds exactly that id's frames, in row-major order, then zeros."""
    out = split_trajectories(td)
    flat = td.reshape(-1)
    ids = flat[TRAJ_IDS]
    valid = ids != -1
    order = []
    for i in ids[valid].tolist():
        if i not in order:
            order.append(i)
    assert out.shape[0] == len(order)
    for row, traj in enumerate(order):
        mine = flat[ids == traj]
        n = mine.shape[0]
        assert out[MASK][row].tolist() == [True] * n + [False] * (out.shape[1] - n)
        for key in mine.keys(True, True):
            assert torch.equal(out[row][:n].get(key), mine.get(key)), key
            assert not out[row][n:].get(key).any(), key


@pytest.mark.parametrize("seed", range(5))
def test_random_ids_round_trip(seed):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(-1, 6, (3, 4, 5), generator=gen)
    _check_round_trip(frames(ids))


def test_collector_batch_round_trip(make_collector):
    c = make_collector(GymEnv("CartPole-v1", num_envs=3), frames_per_batch=120)
    c.set_seed(0)
    batch = next(c)
    _check_round_trip(batch)
    out = split_trajectories(batch)
    # Every trajectory but the last of each env row ends with a done.
    done = out["next", "done"].squeeze(-1)
    lengths = out[MASK].sum(-1)
    last = done[torch.arange(out.shape[0]), lengths - 1]
    assert int(last.sum()) == int(batch["next", "done"].sum())


# -- foreign (torchrl-style) replay buffers get frames as torchrl's collectors write them -------
class ItemBuffer:
    """What a torchrl ``ReplayBuffer`` on a ``LazyTensorStorage`` does with what it is given:
    ``extend(td)`` stores ``td``'s dim-0 entries as items, ``add(td)`` stores ``td`` as one item."""

    def __init__(self):
        self.items: list[TensorDict] = []
        self.calls: list[tuple[str, tuple]] = []

    def extend(self, td):
        self.calls.append(("extend", tuple(td.shape)))
        self.items.extend(td.clone().unbind(0))

    def add(self, td):
        self.calls.append(("add", tuple(td.shape)))
        self.items.append(td.clone())

    def __len__(self):
        return len(self.items)


@pytest.mark.timeout(60)
def test_collector_extends_a_foreign_buffer_with_the_whole_batch(make_collector):
    from rlcollect import CountingEnv

    rb = ItemBuffer()
    c = make_collector(CountingEnv(max_steps=3), frames_per_batch=10, total_frames=20, replay_buffer=rb)
    assert list(c) == [None, None]
    assert rb.calls == [("extend", (10,)), ("extend", (10,))]  # an unbatched env: its frames are the items
    assert len(rb) == 20 and rb.items[0].shape == ()
    assert [int(td["observation"][0]) for td in rb.items[:5]] == [0, 1, 2, 0, 1]


@pytest.mark.timeout(60)
def test_collector_adds_each_step_with_extend_buffer_false(make_collector):
    from rlcollect import CountingEnv

    rb = ItemBuffer()
    c = make_collector(CountingEnv(max_steps=3, batch_size=[2]), frames_per_batch=6, total_frames=6,
                       replay_buffer=rb, extend_buffer=False)
    list(c)
    assert rb.calls == [("add", (2,))] * 3  # one item per time step, shaped like the env batch
    assert len(rb) == 3


@pytest.mark.timeout(90)
@pytest.mark.parametrize("env_batch", [None, 2], ids=["unbatched", "batched"])
def test_multisync_extends_a_foreign_buffer_with_each_workers_batch(env_batch):
    from rlcollect import CountingEnv, MultiSyncCollector

    rb = ItemBuffer()
    rows = env_batch or 1
    c = MultiSyncCollector([lambda: CountingEnv(max_steps=4, batch_size=env_batch)] * 2,
                           frames_per_batch=2 * rows * 25, total_frames=2 * rows * 25, replay_buffer=rb)
    try:
        assert list(c) == [None]
    finally:
        c.shutdown()
    worker_batch = (25,) if env_batch is None else (env_batch, 25)
    assert rb.calls == [("extend", worker_batch)] * 2
    # torchrl: an unbatched env's 50 frames are 50 items; a batched env's rows are the items
    assert len(rb) == (50 if env_batch is None else 4)
    assert rb.items[0].shape == (() if env_batch is None else (25,))
    assert rb.items[0].names == ([] if env_batch is None else [None])


def test_a_layouts_groups_give_sub_tensordicts_their_own_dims_and_split_trajectories_keeps_them():
    import numpy as np

    from rlcollect.data import BatchBuffer, BatchLayout
    from rlcollect.envs.base import ArraySpec

    layout = BatchLayout({("agents", "obs"): ArraySpec((3, 2), np.dtype(np.float32)),
                          ("collector", "traj_ids"): ArraySpec((), np.dtype(np.int64))},
                         torch.Size([2]), 4, groups=((("agents",), (3,)),))
    td = BatchBuffer(layout).td
    assert td["agents"].batch_size == (2, 4, 3)
    td["collector", "traj_ids"] = torch.tensor([[0, 0, 1, 1], [2, 2, 2, 2]])
    out = split_trajectories(td)
    assert out.batch_size == (3, 4) and out["agents"].batch_size == (3, 4, 3)
    assert out["collector", "mask"].sum(-1).tolist() == [2, 2, 4]
