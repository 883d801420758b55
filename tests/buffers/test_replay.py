"""ReplayBuffer in one process: layout, ring arithmetic, counters, errors, checkpoints, lifetime."""

from __future__ import annotations

import doctest
import os
import pickle
import threading

import pytest
import torch
from tensordict import TensorDict

import rlcollect
from rlcollect.buffers import ReplayBuffer
from rlcollect.buffers import replay as replay_module
from rlcollect.buffers import storage as storage_module
from rlcollect.buffers import lifetime as lifetime_module
from rlcollect.buffers import seqlock


def frames(values, batch=None, extra=None) -> TensorDict:
    """A batch whose frame ``i`` carries ``values[i]`` in every field (so tearing is visible)."""
    values = torch.as_tensor(values, dtype=torch.int64)
    batch = list(values.shape) if batch is None else batch
    values = values.reshape(batch)
    td = TensorDict(
        {
            "obs": values.unsqueeze(-1).expand(*batch, 4).to(torch.float32),
            "action": values,
            ("next", "obs"): (values + 1).unsqueeze(-1).expand(*batch, 4).to(torch.float32),
            ("next", "reward"): values.unsqueeze(-1).to(torch.float64),
            ("next", "done"): (values % 2 == 0).unsqueeze(-1),
            **(extra or {}),
        },
        batch,
    )
    return td


def stored(rb: ReplayBuffer, key="action") -> list:
    """The field ``key`` of every stored frame, in slot order."""
    return rb[:][key].tolist()


@pytest.fixture
def rb():
    buffer = ReplayBuffer(10)
    yield buffer
    buffer.close()


def assert_consistent(sample: TensorDict) -> None:
    a = sample["action"]
    assert torch.equal(sample["obs"], a.unsqueeze(-1).expand(-1, 4).float())
    assert torch.equal(sample["next", "obs"], (a + 1).unsqueeze(-1).expand(-1, 4).float())
    assert torch.equal(sample["next", "reward"], a.unsqueeze(-1).double())
    assert torch.equal(sample["next", "done"], (a % 2 == 0).unsqueeze(-1))


# -- extend / sample --------------------------------------------------------------------------------
def test_extend_returns_slots_and_sample_has_the_batch_structure(rb):
    idx = rb.extend(frames(range(6)))
    assert idx.dtype == torch.long and idx.tolist() == [0, 1, 2, 3, 4, 5]
    assert len(rb) == 6 and rb.write_count == 6
    s = rb.sample(7)
    assert s.batch_size == torch.Size([7])
    assert s["obs"].shape == (7, 4) and s["obs"].dtype == torch.float32
    assert s["action"].shape == (7,) and s["action"].dtype == torch.int64
    assert s["next", "reward"].shape == (7, 1) and s["next", "reward"].dtype == torch.float64
    assert s["next", "done"].dtype == torch.bool
    assert set(s["action"].tolist()) <= set(range(6))
    assert_consistent(s)


def test_sample_is_uniform_over_stored_frames(rb):
    rb.extend(frames(range(5)))
    torch.manual_seed(0)
    counts = torch.bincount(rb.sample(50_000)["action"], minlength=5)
    assert counts.numel() == 5
    assert ((counts - 10_000).abs() < 500).all(), counts


def test_sample_is_reproducible_with_torch_seed(rb):
    rb.extend(frames(range(10)))
    torch.manual_seed(3)
    first = rb.sample(20)["action"]
    torch.manual_seed(3)
    assert torch.equal(first, rb.sample(20)["action"])


def test_rows_stay_contiguous(rb):
    # (2, 5): row 0's five frames, then row 1's.
    batch = frames(torch.tensor([[0, 1, 2, 3, 4], [10, 11, 12, 13, 14]]), batch=[2, 5])
    batch.names = [None, "time"]
    assert rb.extend(batch).tolist() == list(range(10))
    assert stored(rb) == [0, 1, 2, 3, 4, 10, 11, 12, 13, 14]
    assert stored(rb, ("next", "obs"))[5] == [11.0] * 4


def test_any_batch_shape_is_flattened_row_major():
    with ReplayBuffer(30) as rb:
        rb.extend(frames(torch.arange(24).reshape(2, 3, 4), batch=[2, 3, 4]))
        rb.extend(frames(99, batch=[]))  # a single frame, no batch dims
        assert stored(rb) == list(range(24)) + [99]
        assert len(rb) == 25


def test_ring_wraps_around_exactly(rb):
    rb.extend(frames(range(7)))
    idx = rb.extend(frames(range(7, 12)))
    assert idx.tolist() == [7, 8, 9, 0, 1]
    assert stored(rb) == [10, 11, 2, 3, 4, 5, 6, 7, 8, 9]
    assert len(rb) == 10 and rb.write_count == 12
    assert rb.extend(frames([12])).tolist() == [2]
    assert stored(rb) == [10, 11, 12, 3, 4, 5, 6, 7, 8, 9]
    assert set(rb.sample(500)["action"].tolist()) == {3, 4, 5, 6, 7, 8, 9, 10, 11, 12}


def test_a_batch_larger_than_the_ring_keeps_its_last_frames(rb):
    rb.extend(frames(range(3)))
    idx = rb.extend(frames(range(100, 125)))
    assert idx.tolist() == [(3 + i) % 10 for i in range(25)]
    # The last 10 frames (115..124) end in slots 8, 9, 0, ..., 7.
    assert stored(rb) == [117, 118, 119, 120, 121, 122, 123, 124, 115, 116]
    assert len(rb) == 10 and rb.write_count == 28
    assert rb.extend(frames([7])).tolist() == [8]


def test_masked_frames_are_not_written(rb):
    mask = torch.tensor([[True, False, True], [False, False, True]])
    batch = frames(torch.tensor([[0, 1, 2], [3, 4, 5]]), batch=[2, 3], extra={("collector", "mask"): mask})
    assert rb.extend(batch).tolist() == [0, 1, 2]
    assert stored(rb) == [0, 2, 5]
    assert len(rb) == 3 and rb.write_count == 3
    # The mask is consumed, not stored: a later batch without one has the same layout.
    rb.extend(frames([6]))
    assert ("collector", "mask") not in rb.sample(3).keys(include_nested=True)
    all_masked = frames([7, 8], extra={("collector", "mask"): torch.tensor([False, False])})
    assert rb.extend(all_masked).tolist() == []
    assert rb.write_count == 4


def test_underscore_keys_are_skipped(rb):
    batch = frames(range(3), extra={"_hidden": torch.zeros(3), ("next", "_private"): torch.zeros(3)})
    rb.extend(batch)
    keys = set(rb.sample(2).keys(include_nested=True, leaves_only=True))
    assert keys == {"obs", "action", ("next", "obs"), ("next", "reward"), ("next", "done")}


def test_a_batch_with_another_structure_is_rejected(rb):
    rb.extend(frames(range(3)))
    with pytest.raises(ValueError, match=r"missing keys \['obs'\]"):
        rb.extend(frames(range(3)).exclude("obs"))
    with pytest.raises(ValueError, match=r"unexpected keys \['extra'\]"):
        rb.extend(frames(range(3), extra={"extra": torch.zeros(3)}))
    bad_shape = frames(range(3))
    bad_shape["obs"] = torch.zeros(3, 5)
    with pytest.raises(ValueError, match=r"obs: expected shape \(4,\) torch.float32, got \(5,\) torch.float32"):
        rb.extend(bad_shape)
    bad_dtype = frames(range(3))
    bad_dtype["action"] = bad_dtype["action"].to(torch.int32)
    with pytest.raises(ValueError, match="action: expected shape"):
        rb.extend(bad_dtype)
    # Nothing of the rejected batches was counted or written.
    assert rb.write_count == 3 and stored(rb) == [0, 1, 2]


def test_extend_rejects_what_is_not_a_tensordict(rb):
    with pytest.raises(TypeError, match="expects a TensorDict"):
        rb.extend({"obs": torch.zeros(3)})


def test_indexing_reads_slots(rb):
    idx = rb.extend(frames(range(12)))
    assert rb[idx[-3:]]["action"].tolist() == [9, 10, 11]
    assert rb[torch.tensor([[0, 1], [2, 3]])]["action"].tolist() == [[10, 11], [2, 3]]
    assert rb[-1]["action"].item() == 9 and rb[-1].batch_size == torch.Size([])
    assert_consistent(rb[:])
    with pytest.raises(IndexError):
        rb[10]


def test_empty_drops_the_frames_and_keeps_the_storage(rb):
    rb.extend(frames(range(8)))
    rb.empty()
    assert len(rb) == 0 and rb.write_count == 8
    with pytest.raises(RuntimeError, match="empty ReplayBuffer"):
        rb.sample(1)
    assert rb.extend(frames([50, 51])).tolist() == [0, 1]
    assert stored(rb) == [50, 51]
    assert set(rb.sample(100)["action"].tolist()) == {50, 51}


def test_sample_on_an_empty_buffer_raises(rb):
    with pytest.raises(RuntimeError, match=r"sample\(\) on an empty ReplayBuffer"):
        rb.sample(4)


# -- argument validation ----------------------------------------------------------------------------
@pytest.mark.parametrize("capacity", [0, -3, 2.5, "10", True, None])
def test_bad_capacity(capacity):
    with pytest.raises(ValueError, match=f"capacity must be a positive int, got {capacity!r}"):
        ReplayBuffer(capacity)


def test_bad_storage():
    with pytest.raises(ValueError, match=r"storage must be one of \('memory', 'memmap'\), got 'bogus'"):
        ReplayBuffer(10, storage="bogus")


def test_path_needs_memmap(tmp_path):
    with pytest.raises(ValueError, match="path=.* is only used with storage='memmap'"):
        ReplayBuffer(10, path=tmp_path)


def test_bad_shared():
    with pytest.raises(ValueError, match="shared must be True or False, got 'yes'"):
        ReplayBuffer(10, shared="yes")


@pytest.mark.parametrize("batch_size", [0, -1, 1.5, None, True])
def test_bad_batch_size(rb, batch_size):
    rb.extend(frames(range(3)))
    with pytest.raises(ValueError, match=f"batch_size must be a positive int, got {batch_size!r}"):
        rb.sample(batch_size)


def test_memmap_path_must_be_empty_or_a_buffer(tmp_path):
    (tmp_path / "unrelated.txt").write_text("hi")
    with pytest.raises(ValueError, match="not empty and holds no ReplayBuffer"):
        ReplayBuffer(10, storage="memmap", path=tmp_path)


def test_memmap_reopen_checks_the_capacity(tmp_path):
    ReplayBuffer(10, storage="memmap", path=tmp_path).close()
    with pytest.raises(ValueError, match="capacity=20 does not match the buffer stored in .* \\(capacity 10\\)"):
        ReplayBuffer(20, storage="memmap", path=tmp_path)


# -- storage kinds and lifetime ---------------------------------------------------------------------
def test_memory_storage_lives_in_dev_shm_and_close_removes_it():
    rb = ReplayBuffer(10)
    assert rb.path.startswith("/dev/shm/rlcollect-rb-") and os.path.isdir(rb.path)
    rb.extend(frames(range(3)))
    assert sorted(os.listdir(rb.path)) == ["control", "data", "layout.json"]
    path = rb.path
    rb.close()
    assert not os.path.exists(path)
    rb.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        rb.extend(frames([1]))
    with pytest.raises(RuntimeError, match="closed"):
        len(rb)


def test_garbage_collection_frees_the_storage():
    rb = ReplayBuffer(10)
    rb.extend(frames(range(3)))
    path = rb.path
    del rb
    import gc

    gc.collect()
    assert not os.path.exists(path)


def test_memmap_without_path_uses_a_temporary_directory_removed_on_close():
    rb = ReplayBuffer(10, storage="memmap")
    assert not rb.path.startswith("/dev/shm") and os.path.basename(rb.path).startswith("rlcollect-rb-")
    rb.extend(frames(range(4)))
    path = rb.path
    rb.close()
    assert not os.path.exists(path)


def test_memmap_with_a_path_keeps_the_files(tmp_path):
    target = tmp_path / "rb"
    with ReplayBuffer(10, storage="memmap", path=target) as rb:
        rb.extend(frames(range(4)))
    assert sorted(os.listdir(target)) == ["control", "data", "layout.json"]


@pytest.mark.parametrize("shared", [True, False])
def test_private_and_shared_memory_behave_alike(shared):
    with ReplayBuffer(10, shared=shared) as rb:
        rb.extend(frames(range(12)))
        assert stored(rb) == [10, 11, 2, 3, 4, 5, 6, 7, 8, 9]
        assert (rb.path is None) == (not shared)


def test_private_buffer_must_be_shared_before_pickling():
    rb = ReplayBuffer(10, shared=False)
    rb.extend(frames(range(12)))
    with pytest.raises(TypeError, match=r"call share\(\) first"):
        pickle.dumps(rb)
    assert rb.share() is rb and rb.path.startswith("/dev/shm/")
    handle = pickle.loads(pickle.dumps(rb))
    assert stored(handle) == [10, 11, 2, 3, 4, 5, 6, 7, 8, 9]
    assert len(handle) == 10 and handle.write_count == 12
    handle.extend(frames([12]))
    assert stored(rb)[2] == 12  # same storage
    path = rb.path
    handle.close()
    assert os.path.isdir(path)  # a handle never removes the owner's storage
    rb.close()
    assert not os.path.exists(path)


def test_pickled_handle_shares_the_storage(rb):
    handle = pickle.loads(pickle.dumps(rb.share()))
    assert len(handle) == 0
    handle.extend(frames(range(3)))  # the handle allocates the storage
    assert len(rb) == 3 and stored(rb) == [0, 1, 2]
    rb.extend(frames([3]))
    assert handle.write_count == 4 and stored(handle) == [0, 1, 2, 3]
    handle.close()
    with pytest.raises(RuntimeError, match="closed"):
        pickle.dumps(handle)


def test_deepcopy_is_a_handle_not_a_copy(rb):
    import copy

    rb.extend(frames(range(3)))
    twin = copy.deepcopy(rb)
    twin.extend(frames([3]))
    assert stored(rb) == [0, 1, 2, 3]
    twin.close()
    assert len(rb) == 4


def test_a_handle_to_a_closed_buffer_reports_it():
    rb = ReplayBuffer(10)
    blob = pickle.dumps(rb)
    rb.close()
    handle = pickle.loads(blob)
    with pytest.raises(RuntimeError, match="no longer exists"):
        handle.extend(frames([1]))


def test_exported_by_rlcollect():
    assert rlcollect.ReplayBuffer is ReplayBuffer


@pytest.mark.parametrize("module", [replay_module, storage_module, lifetime_module, seqlock], ids=lambda m: m.__name__)
def test_docstring_examples(module):
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.attempted >= 5 and result.failed == 0


def test_repr(rb):
    rb.extend(frames(range(3)))
    assert repr(rb).startswith("ReplayBuffer(capacity=10, storage='memory', len=3, write_count=3, path='/dev/shm/")


# -- checkpoints ------------------------------------------------------------------------------------
@pytest.mark.parametrize("shared", [True, False])
def test_memory_state_dict_round_trip(shared, tmp_path):
    with ReplayBuffer(10, shared=shared) as rb:
        rb.extend(frames(range(13)))
        state = rb.state_dict()
    torch.save(state, tmp_path / "rb.pt")
    state = torch.load(tmp_path / "rb.pt")
    with ReplayBuffer(10) as other:
        other.load_state_dict(state)
        assert len(other) == 10 and other.write_count == 13
        assert stored(other) == [10, 11, 12, 3, 4, 5, 6, 7, 8, 9]
        assert other.extend(frames([13])).tolist() == [3]  # the cursor came back too
        assert_consistent(other.sample(64))


def test_memory_state_dict_of_an_empty_buffer(rb):
    state = rb.state_dict()
    with ReplayBuffer(10) as other:
        other.load_state_dict(state)
        assert len(other) == 0
        other.extend(frames([1]))


def test_memmap_storage_survives_reopen_via_state_dict(tmp_path):
    rb = ReplayBuffer(10, storage="memmap", path=tmp_path / "rb")
    rb.extend(frames(range(13)))
    state = rb.state_dict()
    assert state["path"] == str(tmp_path / "rb") and "data" not in state
    rb.close()
    reopened = ReplayBuffer(10, storage="memmap", path=tmp_path / "rb")
    reopened.load_state_dict(state)
    assert len(reopened) == 10 and reopened.write_count == 13
    assert stored(reopened) == [10, 11, 12, 3, 4, 5, 6, 7, 8, 9]
    assert reopened.extend(frames([13])).tolist() == [3]
    assert_consistent(reopened.sample(64))
    # load_state_dict rewinds the counters to the checkpoint.
    reopened.load_state_dict(state)
    assert reopened.write_count == 13
    reopened.close()


def test_load_state_dict_rejects_mismatches_and_stays_usable(rb, tmp_path):
    rb.extend(frames(range(4)))
    good = rb.state_dict()
    with ReplayBuffer(5) as small:
        with pytest.raises(ValueError, match="capacity=10, this buffer's is 5"):
            small.load_state_dict(good)
    with ReplayBuffer(10, storage="memmap", path=tmp_path / "m") as mm:
        with pytest.raises(ValueError, match="storage='memory', this buffer's is 'memmap'"):
            mm.load_state_dict(good)
        other_dir = {**mm.state_dict(), "path": str(tmp_path / "elsewhere")}
        with pytest.raises(ValueError, match="the memmap buffer at"):
            mm.load_state_dict(other_dir)
    with pytest.raises(ValueError, match="expects a dict"):
        rb.load_state_dict([1, 2])
    with pytest.raises(ValueError, match=r"lacks \['cursor'\]"):
        rb.load_state_dict({k: v for k, v in good.items() if k != "cursor"})
    with pytest.raises(ValueError, match="inconsistent counters"):
        rb.load_state_dict({**good, "size": 7})
    with pytest.raises(ValueError, match="data for .* must be"):
        rb.load_state_dict({**good, "data": [d[:2] for d in good["data"]]})
    with ReplayBuffer(10) as other:
        other.extend(frames(range(2), extra={"extra": torch.zeros(2)}))
        with pytest.raises(ValueError, match=r"unexpected keys \['extra'\]|missing keys \['extra'\]"):
            other.load_state_dict(good)
    # Unchanged and usable after every rejection.
    assert len(rb) == 4 and rb.write_count == 4 and stored(rb) == [0, 1, 2, 3]
    rb.load_state_dict(good)
    assert stored(rb) == [0, 1, 2, 3]


# -- concurrency within a process and robustness -----------------------------------------------------
def test_threads_extending_at_once_are_exact():
    per_thread, threads = 400, 4
    with ReplayBuffer(per_thread * threads * 3) as rb:

        def write(w):
            for i in range(per_thread):
                rb.extend(frames([w * 100_000 + 3 * i, w * 100_000 + 3 * i + 1, w * 100_000 + 3 * i + 2]))

        workers = [threading.Thread(target=write, args=(w,)) for w in range(threads)]
        for t in workers:
            t.start()
        for t in workers:
            t.join()
        assert rb.write_count == len(rb) == per_thread * threads * 3
        values = stored(rb)
        assert sorted(values) == sorted(w * 100_000 + j for w in range(threads) for j in range(per_thread * 3))
        # Each call's three frames are consecutive slots.
        for start in range(0, len(values), 3):
            assert values[start + 1] == values[start] + 1 and values[start + 2] == values[start] + 2


def test_a_failed_write_is_never_sampled_and_does_not_block(rb, monkeypatch):
    rb.extend(frames(range(10)))

    class Boom:
        def __getitem__(self, item):
            raise OSError("disk on fire")

    region = rb._data_region()
    real = region.tensors
    monkeypatch.setattr(region, "tensors", {key: Boom() for key in real})
    with pytest.raises(OSError, match="disk on fire"):
        rb.extend(frames([100, 101]))
    monkeypatch.setattr(region, "tensors", real)
    with pytest.raises(RuntimeError, match="slot 0 holds no complete frame"):
        rb[0]
    assert rb[2:4]["action"].tolist() == [2, 3]
    assert rb.write_count == 12  # accepted, then lost: counted, never sampled
    assert 0 not in rb.sample(2000)["action"].tolist() and 1 not in rb.sample(2000)["action"].tolist()
    assert rb.extend(frames(range(20, 30))).tolist() == [2, 3, 4, 5, 6, 7, 8, 9, 0, 1]
    assert stored(rb) == [28, 29, 20, 21, 22, 23, 24, 25, 26, 27]


def test_slots_of_a_dead_writer_are_skipped_and_taken_over(rb):
    rb.extend(frames(range(10)))
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reserves slots 0..2 and dies before writing
        try:
            region = rb._data_region()
            seqlock.reserve(region, 3)
        finally:
            os._exit(0)
    assert os.waitpid(pid, 0)[1] == 0
    assert rb.write_count == 13 and len(rb) == 10
    sampled = set(rb.sample(3000)["action"].tolist())
    assert sampled == set(range(3, 10))
    # The ring comes round to the abandoned slots: writing over them does not wait.
    assert rb.extend(frames(range(40, 50))).tolist() == [3, 4, 5, 6, 7, 8, 9, 0, 1, 2]
    assert stored(rb) == [47, 48, 49, 40, 41, 42, 43, 44, 45, 46]
    assert set(rb.sample(3000)["action"].tolist()) == set(range(40, 50))


def test_a_writer_waits_for_a_live_writer_on_the_same_slots(rb, monkeypatch):
    rb.extend(frames(range(10)))
    region = rb._data_region()
    _, slots = seqlock.reserve(region, 4)  # this thread holds slots 0..3 and has not written yet
    done = threading.Event()

    def lap():
        rb.extend(frames(range(20, 30)))  # needs slots 4..9, 0..3
        done.set()

    t = threading.Thread(target=lap)
    t.start()
    assert not done.wait(0.3)  # blocked on our slots
    for a, b, _ in slots:
        for key, dst in region.tensors.items():
            dst[a:b].copy_(frames(range(100, 104))[key if len(key) > 1 else key[0]][a:b])
    seqlock.finish(region, slots, committed=True)
    assert done.wait(5)
    t.join()
    assert stored(rb) == [26, 27, 28, 29, 20, 21, 22, 23, 24, 25]


def test_fork_child_writes_through_its_own_lock(rb):
    rb.extend(frames(range(2)))
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child
        code = 1
        try:
            for i in range(50):
                rb.extend(frames([1000 + i]))
            code = 0
        finally:
            os._exit(code)
    for i in range(50):
        rb.extend(frames([2000 + i]))
    assert os.waitpid(pid, 0)[1] == 0
    assert rb.write_count == 102 and os.path.isdir(rb.path)
