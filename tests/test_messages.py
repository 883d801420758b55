"""Issue 25, item 8: each message names the user's own argument and value. torchrl's semantics
stay (a batch is always whole); what changes is what the warnings and errors say."""

from __future__ import annotations

import warnings

import pytest
import torch

from rlcollect import Collector, MultiSyncCollector


def _warnings(build) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        collector = build()
    collector.shutdown()
    return [str(w.message) for w in caught]


def test_fewer_total_frames_than_a_batch_says_so():
    messages = _warnings(lambda: Collector("CartPole-v1", frames_per_batch=1000, total_frames=500))
    assert [m.split(" (set RL_WARNINGS")[0] for m in messages] == [
        "total_frames=500 is less than frames_per_batch=1000: the only batch has 1000 frames"]


def test_the_multi_warning_names_the_frames_per_batch_the_user_wrote():
    messages = _warnings(lambda: MultiSyncCollector(["CartPole-v1"] * 2, frames_per_batch=1001, total_frames=3000))
    assert [m.split(" (set RL_WARNINGS")[0] for m in messages] == [
        "frames_per_batch=1001 is not divisible by num_workers=2: each worker collects 501 frames",
        "total_frames=3000 is not a multiple of frames_per_batch=1001 (a batch of 1002: 2 workers x 501): the last "
        "batch overshoots to a whole batch",
    ]
    messages = _warnings(lambda: MultiSyncCollector(["CartPole-v1"] * 2, frames_per_batch=1000, total_frames=500))
    assert [m.split(" (set RL_WARNINGS")[0] for m in messages] == [
        "total_frames=500 is less than frames_per_batch=1000: the only batch has 1000 frames"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a torch that sees no CUDA device")
@pytest.mark.parametrize("cls", [Collector, MultiSyncCollector])
def test_a_cuda_device_without_cuda_is_refused_at_the_call(cls):
    kwargs = {"num_workers": 2} if cls is MultiSyncCollector else {}
    with pytest.raises(ValueError, match=r"^policy_device='cuda', but this torch \(.*\) sees no CUDA device "
                                         r"\(torch.cuda.is_available\(\) is False\): pass 'cpu'"):
        cls("CartPole-v1", frames_per_batch=10, policy_device="cuda", **kwargs)
