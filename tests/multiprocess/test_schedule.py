"""Replayable async runs (issue 26): MultiAsyncCollector(record=path) writes the schedule of
a run; MultiAsyncCollector(replay=path) with the same envs, seeds and weight updates gives the
same batches, bit for bit, although the workers' speeds are swapped (so the real timing is
another); also across a recorded worker restart, and with batches dropped for lag."""

from __future__ import annotations

import functools
import json

import pytest
import torch
from mp_helpers import running
from torch import nn

from rlcollect import MultiAsyncCollector, MultiSyncCollector
from rlcollect.envs.testing import FaultyEnv, SleepEnv

pytestmark = pytest.mark.timeout(240)

FRAMES, BATCHES = 8, 30


class NoisyPolicy(nn.Module):
    """Acts ``round(w)`` plus a random 0..99 (the worker's torch generator): a batch's actions
    show which weights acted and where the worker's random stream stood."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(1))

    def forward(self, observation: torch.Tensor) -> torch.Tensor:
        noise = torch.randint(0, 100, observation.shape[:-1])
        return (observation[..., 0] * 0 + self.w[0]).round().long() * 1000 + noise


def sleepy(step_time):
    return functools.partial(SleepEnv, step_time=step_time, obs_dim=1)


def run(envs, **kwargs):
    """Seeded, weights updated after every batch (to the batch count): the delivered batches."""
    policy = NoisyPolicy()
    out = []
    with running(MultiAsyncCollector, envs, policy, frames_per_batch=FRAMES, total_frames=FRAMES * BATCHES,
                 track_policy_version=True, init_random_frames=3 * FRAMES, **kwargs) as collector:
        collector.set_seed(7)
        for batch in collector:
            out.append(batch.clone())
            with torch.no_grad():
                policy.w.fill_(len(out))
            collector.update_policy_weights_()
        stats = collector.stats()
    return out, stats


def assert_same_batches(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert set(x.keys(True, True)) == set(y.keys(True, True))
        for key in x.keys(True, True):
            assert torch.equal(x[key], y[key]), key


def test_a_replayed_run_gives_the_same_batches(tmp_path):
    path = tmp_path / "run.jsonl"
    first, _ = run([sleepy(0.0), sleepy(0.001), sleepy(0.004)], record=path)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert lines[0]["type"] == "header" and {"type": "seed", "seed": 7} in lines
    assert sum(line["type"] == "batch" for line in lines) == BATCHES
    # the timing differs: the slow worker is now the fast one
    again, _ = run([sleepy(0.004), sleepy(0.001), sleepy(0.0)], replay=path)
    assert_same_batches(first, again)
    unreplayed, _ = run([sleepy(0.004), sleepy(0.001), sleepy(0.0)])
    with pytest.raises(AssertionError):  # (the test can fail: timing does change the run)
        assert_same_batches(first, unreplayed)


def test_a_replayed_run_with_drops_and_a_restart_gives_the_same_batches(tmp_path):
    path = tmp_path / "run.jsonl"
    killer = functools.partial(FaultyEnv, fault="kill", at_step=20, worker_ids=[2], times=1,
                               counter_file=str(tmp_path / "fired"), max_steps=None)
    envs = [sleepy(0.0), sleepy(0.001), killer]
    first, stats = run(envs, record=path, on_worker_failure="restart", max_policy_lag=1)
    assert stats["restarts"] == 1 and stats["lag_dropped_frames"] > 0
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [line["worker"] for line in lines if line["type"] == "restart"] == [2]
    # replayed: the FaultyEnv has fired its one time; the worker is restarted as recorded
    again, replayed = run([sleepy(0.003), sleepy(0.0), killer], replay=path, on_worker_failure="restart",
                          max_policy_lag=1)
    assert_same_batches(first, again)
    assert (replayed["restarts"], replayed["lag_dropped_frames"]) == (1, stats["lag_dropped_frames"])


def test_record_and_replay_arguments_are_checked(tmp_path):
    with pytest.raises(ValueError, match="record or replay, not both"):
        MultiAsyncCollector(sleepy(0.0), num_workers=1, frames_per_batch=4, record=tmp_path / "a",
                            replay=tmp_path / "b")
    with pytest.raises(ValueError, match="MultiSyncCollector runs are reproducible"):
        MultiSyncCollector(sleepy(0.0), num_workers=1, frames_per_batch=4, record=tmp_path / "a")
    with pytest.raises(ValueError, match="weight_sync_schemes must be None or"):
        MultiAsyncCollector(sleepy(0.0), NoisyPolicy(), num_workers=1, frames_per_batch=4, replay=tmp_path / "a",
                            weight_sync_schemes={"policy": "shared"})


# Issue 36, item 6: a damaged replay file is an error naming the file, the line and what is wrong
# (a raw JSONDecodeError, IndexError, TypeError, KeyError or UnicodeDecodeError before).
_HEADER = '{"type": "header", "format": %d, "num_workers": 2}\n'
_BATCH = '{"type": "batch", "worker": 0, "version": 0, "random": true, "outcome": "deliver"}\n'


@pytest.mark.parametrize("body,what", [
    (_BATCH[:30], r"line 2: not a JSON line \(.* cut mid-way\?\)"),
    (_BATCH.replace('"worker": 0', '"worker": 5'), r"line 2: worker must be an int in \[0, 2\) \(this collector's "
                                                   r"workers\), got 5"),
    (_BATCH.replace('"worker": 0', '"worker": "0"'), r"line 2: worker must be an int in \[0, 2\) .*got '0'"),
    (_BATCH.replace('"worker": 0', '"worker": true'), r"line 2: worker must be an int in \[0, 2\) .*got True"),
    (_BATCH.replace('"version": 0, ', ''), r"line 2: a 'batch' line needs 'version' \(an int\)"),
    ('{"type": "restart", "worker": 1}\n', r"line 2: a 'restart' line needs 'after' \(an int >= 0\)"),
    ('{"type": "seed", "seed": 1.5}\n', r"line 2: seed must be an int, got 1.5"),
    ('{"type": "launch"}\n', r"line 2: type must be one of \['batch', 'restart', 'seed'\], got 'launch'"),
    ('[1, 2]\n', r"line 2: a JSON object is expected, got list"),
    (_BATCH + '{"type": "seed", "seed": "\xff"}\n', r"line 3: not UTF-8 text \(invalid start byte at byte 26\)"),
], ids=["cut", "worker-range", "worker-str", "worker-bool", "missing", "missing-after", "seed-float", "type", "list",
        "not-utf8"])
def test_a_damaged_replay_file_names_the_file_the_line_and_what_is_wrong(tmp_path, body, what):
    from rlcollect.multiprocess.schedule import SCHEDULE_FORMAT, ScheduleReplay

    path = tmp_path / "run.jsonl"
    path.write_bytes((_HEADER % SCHEDULE_FORMAT + body).encode("utf-8").replace(b"\xc3\xbf", b"\xff"))
    with pytest.raises(ValueError, match=rf"^replay='{path}', {what}; a schedule is written by "
                                         r"MultiAsyncCollector\(record=\.\.\.\)$"):
        ScheduleReplay(path, 2)
