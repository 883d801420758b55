"""ReplayBuffer across spawned processes: lazy allocation by a worker, concurrent writers, and
sampling while the ring laps.  Each spawned child imports torch (seconds on 2 cores): few of them.

Every wait here is for spawned interpreters importing torch, which on a loaded machine takes
many times a quiet one's seconds (fixed 60-s and 90-s bounds failed at load 2-13, issue 38): each
is stretched by the load when it starts (``tests/loadscale.py``), and the tests' pytest-timeout
bounds leave room for the stretched waits."""

from __future__ import annotations

import contextlib
import multiprocessing
import time

import pytest
import tensordict  # noqa: F401  (imported now: sample() would import it on the clock)
import torch
from loadscale import scaled
from replay_workers import check_frames, extend_once, write_for, writer_batch

from rlcollect.buffers import ReplayBuffer

CTX = multiprocessing.get_context("spawn")
# A spawned child's start (an interpreter importing torch, tensordict and rlcollect): 60 s on a
# quiet machine is generous; stretched by the load, capped so that the test's own bound (below)
# still holds the waits of four children and their work.
START_S, START_CAP_S = 60.0, 300.0
TEST_TIMEOUT_S = 900


def start_wait() -> float:
    return scaled(START_S, cap=START_CAP_S)


@contextlib.contextmanager
def processes(target, arg_lists):
    """Start one spawned process per argument list, each with a pipe; stop them all on exit."""
    pipes = [CTX.Pipe() for _ in arg_lists]
    procs = [CTX.Process(target=target, args=(*args, child)) for args, (_, child) in zip(arg_lists, pipes)]
    try:
        for p in procs:
            p.start()
        for _, child in pipes:
            child.close()  # the child has its copy; ours would keep recv() from seeing EOF
        yield [parent for parent, _ in pipes]
    finally:
        for p in procs:
            p.join(timeout=scaled(20, cap=120))
            if p.is_alive():
                p.kill()
                p.join()
            p.close()
        for parent, _ in pipes:
            parent.close()


def receive(conn, timeout: float | None = None):
    """The worker's answer, within ``timeout`` seconds (default: a child's start, scaled)."""
    timeout = start_wait() if timeout is None else timeout
    assert conn.poll(timeout), f"no answer from the worker within {timeout:.0f} s"
    answer = conn.recv()
    assert answer[0] == "ok", answer
    return answer[1:]


@pytest.mark.timeout(TEST_TIMEOUT_S)
@pytest.mark.parametrize("storage", ["memory", "memmap"])
def test_first_write_from_a_worker(storage):
    with ReplayBuffer(16, storage=storage) as rb:
        with processes(extend_once, [(rb.share(),)]) as (conn,):
            idx, length, count = receive(conn)
        assert idx == list(range(10)) and length == 10 and count == 10
        # The main process maps the storage the worker allocated.
        assert len(rb) == 10 and rb.write_count == 10
        assert rb[:]["a"].tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]
        sample = rb.sample(50)
        assert check_frames(sample) == 0 and set(sample["w"].tolist()) == {7}
        rb.extend(writer_batch(7, 10, 1, 8))  # the main process can write to it too
        assert rb[:]["a"].tolist() == [16, 17] + list(range(2, 16))


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_concurrent_writers_never_lose_tear_or_duplicate_a_frame():
    writers, max_frames = 4, 150_000
    with ReplayBuffer(writers * max_frames) as rb:
        handle = rb.share()
        with processes(write_for, [(handle, w, 2.5, max_frames) for w in range(writers)]) as conns:
            for conn in conns:
                assert conn.poll(start_wait()) and conn.recv() == "ready"
            for conn in conns:
                conn.send("go")
            written = [receive(conn) for conn in conns]
        total = sum(steps for steps, _ in written)
        assert all(calls > 10 for _, calls in written), written  # they really overlapped in time
        assert rb.write_count == total and len(rb) == total
        everything = rb[:]
        assert check_frames(everything) == 0
        pairs = (everything["w"] * 1_000_000 + everything["a"]).sort().values
        expected = torch.cat([w * 1_000_000 + torch.arange(steps) for w, (steps, _) in enumerate(written)])
        assert torch.equal(pairs, expected.sort().values)  # each (writer, step) exactly once
        # Each extend() call's frames are consecutive, in order, in the ring.
        a, w = everything["a"], everything["w"]
        same = (w[1:] == w[:-1]) & (a[1:] == a[:-1] + 1)
        assert int(same.sum()) >= total - sum(calls for _, calls in written)


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_sampling_while_the_ring_laps_never_returns_a_torn_frame():
    writers, capacity = 2, 64
    with ReplayBuffer(capacity) as rb:
        handle = rb.share()
        with processes(write_for, [(handle, w, 2.5, 10**9) for w in range(writers)]) as conns:
            for conn in conns:
                assert conn.poll(start_wait()) and conn.recv() == "ready"
            for conn in conns:
                conn.send("go")
            samples = torn = 0
            deadline = time.monotonic() + scaled(10, cap=60)
            while not all(conn.poll() for conn in conns) and time.monotonic() < deadline:
                if len(rb):
                    batch = rb.sample(32)
                    torn += check_frames(batch)
                    samples += 1
            written = [receive(conn) for conn in conns]
        assert torn == 0 and samples > 50, (torn, samples)
        total = sum(steps for steps, _ in written)
        assert total > 20 * capacity  # the ring lapped many times
        assert rb.write_count == total and len(rb) == capacity
        assert check_frames(rb[:]) == 0
