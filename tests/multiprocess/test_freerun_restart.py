"""Workers killed while running free (``start()`` into a shared ReplayBuffer) with
``on_worker_failure="restart"``: the next ``pause()``, ``update_policy_weights_()``, ``stats()``
or ``async_shutdown()`` restarts them (issue 23, item 1), and the frames they wrote before they
were killed are counted."""

from __future__ import annotations

import collections
import os
import signal

import pytest
import torch
from mp_helpers import START, TRAJ_IDS, ValuePolicy, assert_gone, endless
from tensordict import TensorDict
from test_replay_buffer import wait_for

from rlcollect import MultiAsyncCollector, MultiSyncCollector, ReplayBuffer

CLASSES = [MultiSyncCollector, MultiAsyncCollector]
FRAMES_PER_BATCH = 100


def _kill(collector, index: int) -> int:
    pid = collector.worker_pids()[index]
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: not os.path.exists(f"/proc/{pid}") or _zombie(pid))
    return pid


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def _check_counted(collector, rb: ReplayBuffer, kills: int) -> None:
    """Every frame written is counted, except those of a batch a killed worker was writing
    (reserved in the buffer, so in write_count, but never complete)."""
    frames = collector.stats()["frames"]
    assert rb.write_count - kills * FRAMES_PER_BATCH <= frames <= rb.write_count


def _complete_frames(rb: ReplayBuffer, kills: int) -> TensorDict:
    """The frames of every slot whose write completed.  ``rb[...]`` raises RuntimeError for a
    slot a killed worker was writing (documented in ``ReplayBuffer.__getitem__``), and a worker
    killed while running free may be killed mid-write: such slots are skipped here, at most one
    batch per kill."""
    parts, lost = [], 0
    for a in range(0, len(rb), FRAMES_PER_BATCH):
        b = min(a + FRAMES_PER_BATCH, len(rb))
        try:
            parts.append(rb[a:b])
        except RuntimeError as e:
            assert "holds no complete frame: the write into it failed" in str(e)
            for slot in range(a, b):
                try:
                    parts.append(rb[slot:slot + 1])
                except RuntimeError:
                    lost += 1
    assert lost <= kills * FRAMES_PER_BATCH
    return torch.cat(parts)


def _check_each_frame_once(data: TensorDict) -> dict[int, int]:
    """Each (trajectory, count) of the endless CountingEnv is there once, with no gap and no torn
    frame (the checks of test_replay_buffer.check_each_frame_once, on the complete frames only)."""
    obs = data["observation"][:, 0]
    assert torch.equal(data["next", "observation"][:, 0], obs + 1)  # no torn frame
    per_traj: dict[int, list] = collections.defaultdict(list)
    for i, o in zip(data[TRAJ_IDS].tolist(), obs.tolist()):
        per_traj[i].append(o)
    for traj, counts in per_traj.items():
        assert sorted(counts) == list(range(len(counts))), f"trajectory {traj}: lost or duplicated frames"
    return {traj: len(counts) for traj, counts in per_traj.items()}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("call", ["pause", "async_shutdown", "update_policy_weights_", "stats"])
@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_a_worker_killed_while_running_free_is_restarted(cls, call):
    rb = ReplayBuffer(1_000_000)
    policy = ValuePolicy(w=0.0)
    collector = cls(endless, policy, num_workers=2, frames_per_batch=FRAMES_PER_BATCH, replay_buffer=rb,
                    on_worker_failure="restart", mp_start_method=START)
    pids = collector.worker_pids()
    try:
        collector.start()
        wait_for(lambda: rb.write_count >= 4_000, timeout=60)
        pids.append(_kill(collector, 1))
        if call == "pause":
            with collector.pause():
                assert collector.stats()["restarts"] == 1
            mark = rb.write_count
            wait_for(lambda: rb.write_count >= mark + 2_000, timeout=60)
        elif call == "update_policy_weights_":
            collector.update_policy_weights_()
            assert collector.stats()["restarts"] == 1
        elif call == "stats":
            assert collector.stats()["restarts"] == 1
        pids += collector.worker_pids()
        collector.async_shutdown()  # a worker found dead now is counted, not replaced
        assert collector.stats()["restarts"] == (0 if call == "async_shutdown" else 1)
        _check_counted(collector, rb, kills=1)
        # no frame of the dead worker's trajectories duplicated; the batch it was writing when
        # killed (if it was killed mid-write) is not in the buffer
        counts = _check_each_frame_once(_complete_frames(rb, kills=1))
        assert sum(counts.values()) <= rb.write_count
    finally:
        collector.shutdown()
        rb.close()
    assert_gone(pids)


@pytest.mark.timeout(180)
def test_frames_written_by_a_killed_worker_are_counted():
    """Before: stats()["frames"] only counted what a worker reported when it paused, so a killed
    worker's frames (often tens of thousands) were missing from it."""
    rb = ReplayBuffer(1_000_000)
    collector = MultiAsyncCollector(endless, num_workers=2, frames_per_batch=FRAMES_PER_BATCH, replay_buffer=rb,
                                    on_worker_failure="restart", mp_start_method=START)
    pids = collector.worker_pids()
    try:
        collector.start()
        wait_for(lambda: rb.write_count >= 20_000, timeout=60)
        pids.append(_kill(collector, 0))
        assert collector.stats()["restarts"] == 1  # noticed (and worker 0 replaced) here
        mark = rb.write_count
        wait_for(lambda: rb.write_count >= mark + 4_000, timeout=60)
        pids.append(_kill(collector, 1))
        pids += collector.worker_pids()
        collector.async_shutdown()
        assert collector.stats()["restarts"] == 1
        _check_counted(collector, rb, kills=2)
    finally:
        collector.shutdown()
        rb.close()
    assert_gone(pids)
