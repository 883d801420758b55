"""``Members`` (rlcollect/members.py) with in-process parts: the step under recovery, a failure
owed after a batch was taken, a replacement that fails in turn, a failure that may not be
repaired, free running's failures, and ``MemberStats`` computing the lag when read."""

from __future__ import annotations

import pytest

from rlcollect.members import MemberFailed, Members, MemberStats
from rlcollect.metrics import batch_meta


class Gather:
    def __init__(self, failures=(), owed=None, replacement_failures=0):
        self.failures, self.owed = list(failures), owed
        self.replacement_failures = replacement_failures
        self.recovered_log, self.abandoned, self.held = [], 0, False

    def step(self):
        if self.failures:
            raise MemberFailed(*self.failures.pop(0))
        return "batch"

    def next_batch(self, version, update):
        return self.step(), {"storing_device": None, "report": ([(0, _info(4, version))], version)}

    def take_owed(self):
        owed, self.owed = self.owed, None
        return owed

    def recovered(self, index):
        self.recovered_log.append(index)
        if self.replacement_failures:
            self.replacement_failures -= 1
            raise MemberFailed(index, RuntimeError("the replacement died too"))

    def abandon(self):
        self.abandoned += 1

    def release(self):
        pass


class Recovery:
    def __init__(self, allowed=10):
        self.allowed, self.recovered, self.forgiven = allowed, [], []

    def member_of(self, error):
        return getattr(error, "failed_node", None)

    def recover(self, index, error):
        if len(self.recovered) >= self.allowed:
            raise error
        self.recovered.append(index)

    def forgive(self, index, error):
        self.forgiven.append(index)


def _info(frames, version):
    return {"frames": frames, "version": version, "meta": batch_meta(frames, version, float(version), (None, None))}


def test_a_failed_member_is_recovered_and_the_step_runs_again():
    gather, recovery = Gather(failures=[(1, RuntimeError("killed")), (0, RuntimeError("killed"))]), Recovery()
    assert Members([0, 1], gather, recovery, MemberStats(2)).run(gather.step) == "batch"
    assert recovery.recovered == [1, 0] and gather.recovered_log == [1, 0]


def test_a_replacement_that_fails_in_turn_is_replaced_again():
    gather, recovery = Gather(failures=[(0, RuntimeError("killed"))], replacement_failures=1), Recovery()
    Members([0], gather, recovery, MemberStats(1)).run(gather.step)
    assert recovery.recovered == [0, 0] and gather.recovered_log == [0, 0]


def test_a_failure_owed_after_the_batch_is_repaired_before_it_is_returned():
    gather, recovery = Gather(owed=(0, RuntimeError("died after its batch"))), Recovery()
    assert Members([0], gather, recovery, MemberStats(1)).run(gather.step) == "batch"
    assert recovery.recovered == [0] and gather.owed is None


def test_a_failure_that_may_not_be_repaired_is_raised_and_the_gather_abandons_its_step():
    error = RuntimeError("killed")
    gather, recovery = Gather(failures=[(0, error)]), Recovery(allowed=0)
    with pytest.raises(RuntimeError, match="killed") as raised:
        Members([0], gather, recovery, MemberStats(1)).run(gather.step)
    assert raised.value is error and gather.abandoned == 1


def test_an_error_that_is_no_members_failure_is_raised_as_is():
    gather, recovery = Gather(), Recovery()
    with pytest.raises(ValueError, match="not a failure"):
        Members([0], gather, recovery, MemberStats(1)).run(lambda: (_ for _ in ()).throw(ValueError("not a failure")))
    assert recovery.recovered == [] and gather.abandoned == 0


def test_a_failure_the_recovery_recognises_is_repaired():
    error = RuntimeError("node 0 died")
    error.failed_node = 0
    calls = [error]

    def step():
        if calls:
            raise calls.pop()
        return "batch"

    gather, recovery = Gather(), Recovery()
    assert Members([0], gather, recovery, MemberStats(1)).run(step) == "batch"
    assert recovery.recovered == [0]


def test_next_batch_notes_the_report_the_gather_hands_back():
    stats = MemberStats(1)
    stats.note_version(3)
    gather = Gather()
    batch, where = Members([0], gather, Recovery(), stats).next_batch()
    assert batch == "batch" and where == {"storing_device": None}
    assert (stats.frames, stats.batches, stats.lag) == (4, 1, (0.0, 0))


def test_free_running_failures_are_replaced_or_at_the_last_stop_forgiven():
    class Free:
        def __init__(self):
            self.back = []

        def check(self):
            return 5, [(1, RuntimeError("killed while running free"))]

        def recovered(self, index):
            self.back.append(index)

    stats, free, recovery = MemberStats(2), Free(), Recovery()
    members = Members([0, 1], Gather(), recovery, stats, free=free)
    assert members.count_free(free.check) == 5 and recovery.recovered == [1] and free.back == [1]
    assert members.count_free(free.check, final=True) == 5 and recovery.forgiven == [1] and free.back == [1]
    assert stats.frames == 10


def test_the_lag_and_the_merged_metadata_are_computed_when_read():
    stats = MemberStats(2)
    assert stats.lag == (0.0, 0) and stats.last_meta["frames"] == 0
    stats.note_batch([(0, _info(4, 1)), (1, _info(12, 2))], 3, 0.5, None, [4, 4])
    assert stats.lag == (1.5, 2)  # over the frames kept: 4 of each part
    assert stats.last_meta["frames"] == 16 and stats.dropped == 8 and stats.frames == 8
    assert (stats.wait.last_s, stats.wait.total_s) == (0.5, 0.5)
