"""The seqlock over a replay buffer's ring slots: how concurrent writers and readers stay exact.

``ReplayBuffer`` (replay.py) calls :func:`reserve` and :func:`finish` around each ``extend`` and
:func:`read` for ``sample`` and indexing; the slots' sequence numbers and writer pids live in the
region's control file (storage.py).

A writer takes the cross-process lock only to reserve its slots (advance the cursor and the
counters, mark the slots odd in their sequence numbers) and again to commit them (make them
even); the copying itself happens outside the lock, so writers copy in parallel.  A reader checks
each sampled slot's sequence number before and after copying it and redraws slots that were odd
or changed.  A writer never reserves a slot that another live writer has not yet committed (it
waits, at most ``STALL_TIMEOUT_S``), so two writes never interleave in one slot even when the
ring laps itself.

Example (one writer, by hand: what ``ReplayBuffer.extend`` and ``sample`` do)::

    >>> import torch
    >>> from rlcollect.buffers.storage import Layout, Region
    >>> region = Region.private(4)
    >>> region.allocate(Layout.of({("x",): torch.zeros(1)}, 4))
    >>> start, slots = reserve(region, 3)        # slots 0..2 in flight: odd sequence numbers
    >>> start, region.seq.tolist()
    (0, [1, 1, 1, 0])
    >>> region.tensors[("x",)][0:3] = torch.tensor([1.0, 2.0, 3.0])
    >>> finish(region, slots, committed=True)    # committed: even again, readable
    >>> region.seq.tolist()
    [2, 2, 2, 0]
    >>> read(region, torch.tensor([2, 0]), redraw_below=None)[("x",)].tolist()
    [3.0, 1.0]
    >>> region.close()
"""

from __future__ import annotations

import logging
import os
import time

import numpy as np
import torch

from rlcollect._pids import pid_alive
from rlcollect.buffers.storage import CURSOR, SIZE, WRITE_COUNT, NestedKey, Region

logger = logging.getLogger("rlcollect")

#: A writer waits this long for a live process to commit slots it wants before taking them over.
STALL_TIMEOUT_S = 30.0
#: sample() gives up if it cannot read a complete frame for this long (every slot in flight).
SAMPLE_TIMEOUT_S = 30.0


def reserve(region: Region, count: int) -> tuple[int, list]:
    """Advance the cursor and counters by ``count``; mark the slots to write as in flight.

    Returns the first slot of the call and ``[(a, b, reserved_seq)]`` for the slices actually
    written (the last ``capacity`` frames when ``count`` exceeds it).
    """
    cap, pid = region.capacity, os.getpid()
    written = min(count, cap)
    waiting_since = None
    while True:
        with region.lock():
            header, seq, owner = region.header, region.seq, region.owner
            start = int(header[CURSOR])
            segs = ring_segments((start + count - written) % cap, written, cap)
            blockers = slot_writers(region, segs)
            if blockers and waiting_since is None:
                waiting_since = time.monotonic()
            if not blockers or time.monotonic() - waiting_since > STALL_TIMEOUT_S:
                if blockers:
                    logger.warning(
                        "ReplayBuffer: process(es) %s held slots for over %.0f s without finishing "
                        "their write; taking the slots over",
                        sorted(blockers),
                        STALL_TIMEOUT_S,
                    )
                slots = []
                for a, b in segs:
                    s = seq[a:b]
                    s += 1 + (s & 1)  # odd: in flight (odd already: abandoned -> next odd)
                    owner[a:b] = pid
                    slots.append((a, b, s.copy()))
                header[CURSOR] = (start + count) % cap
                header[SIZE] = min(int(header[SIZE]) + count, cap)
                header[WRITE_COUNT] += count
                return start, slots
        time.sleep(0.0005)

def finish(region: Region, slots: list, committed: bool) -> None:
    """Commit (seq -> even) or abandon (owner -> 0) the slots this call reserved.

    Under the lock so that it is atomic against a writer taking over a stalled slot: only
    slots whose sequence number is still ours change.
    """
    with region.lock():
        for a, b, reserved in slots:
            s = region.seq[a:b]
            ours = s == reserved
            all_ours = bool(ours.all())
            if committed:
                if all_ours:
                    s += 1
                else:
                    s[ours] += 1
            else:
                region.owner[a:b][ours] = 0


def read(region: Region, idx: torch.Tensor, redraw_below: int | None) -> dict[NestedKey, torch.Tensor]:
    """Copy the frames in slots ``idx``, none of them torn.

    Seqlock read: a slot is good if its sequence number was even before the copy and
    unchanged after it; bad ones are copied again, from a fresh random slot below
    ``redraw_below`` (sampling) or from the same slot (indexing).  On x86-64 stores become
    visible in program order and loads are not reordered with loads, so a writer's data
    stores cannot show after its commit; the numpy and torch calls are opaque to the
    compiler, so nothing is reordered across them either.
    """
    n = idx.numel()
    seq = torch.from_numpy(region.seq)
    before = seq[idx]
    out = {key: tensor.index_select(0, idx) for key, tensor in region.tensors.items()}
    bad = ((before & 1) == 1) | (seq[idx] != before)
    deadline = None
    while bool(bad.any()):
        deadline = deadline or time.monotonic() + SAMPLE_TIMEOUT_S
        pos = bad.nonzero().squeeze(1)
        if redraw_below is not None:
            # Redraw rather than retry: a slot a dead writer abandoned must not stall us, and
            # rejection keeps the draw uniform over the complete frames.
            idx = idx.clone()
            idx[pos] = torch.randint(redraw_below, (pos.numel(),))
        else:
            check_not_abandoned(region, idx[pos])
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"ReplayBuffer: no complete frame could be read for {SAMPLE_TIMEOUT_S:.0f} s "
                "(every slot tried was being written or was abandoned by a failed write)"
            )
        sub = idx[pos]
        before = seq[sub]
        for key, tensor in region.tensors.items():
            out[key][pos] = tensor.index_select(0, sub)
        still = ((before & 1) == 1) | (seq[sub] != before)
        bad = torch.zeros(n, dtype=torch.bool)
        bad[pos] = still
        if bool(still.all()):
            time.sleep(0.0001)
    return out


def ring_segments(first: int, count: int, capacity: int) -> list[tuple[int, int]]:
    """The ring slots ``first, first+1, ... (count of them)`` as at most two slices.

    Example:
        >>> ring_segments(6, 4, capacity=8), ring_segments(0, 3, capacity=8)
        ([(6, 8), (0, 2)], [(0, 3)])
    """
    end = first + count
    if end <= capacity:
        return [(first, end)]
    return [(first, capacity), (0, end - capacity)]


def slot_writers(region: Region, segs: list[tuple[int, int]]) -> set[int]:
    """Live processes still writing into the given slots (whose seq is odd)."""
    pids: set[int] = set()
    for a, b in segs:
        busy = (region.seq[a:b] & 1).astype(bool)
        if busy.any():
            pids.update(int(p) for p in np.unique(region.owner[a:b][busy]))
    return {p for p in pids if pid_alive(p)}


def check_not_abandoned(region: Region, slots) -> None:
    """Raise RuntimeError for a slot (of ``slots``, a LongTensor) whose writer died mid-write."""
    for slot in slots.tolist():
        if region.seq[slot] & 1 and not pid_alive(int(region.owner[slot])):
            raise RuntimeError(f"ReplayBuffer slot {slot} holds no complete frame: the write into it failed")
