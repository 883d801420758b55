"""Functions that spawned processes run against a ReplayBuffer handle (kept out of the test
module so that a child imports only this, torch and rlcollect.buffers)."""

from __future__ import annotations

import time

import torch

#: Sizes of successive extend() calls: (rows, time).  Some exceed a small test ring.
BATCH_SHAPES = [(1, 1), (2, 5), (1, 16), (2, 3), (3, 11), (1, 40), (2, 50), (1, 7)]
VECTOR = 8  # width of the "v" field: a torn frame shows as disagreeing entries


def writer_batch(writer: int, first_step: int, rows: int, time_steps: int):
    """Frames ``first_step ..`` of ``writer``; every field encodes (writer, step)."""
    from tensordict import TensorDict

    step = torch.arange(first_step, first_step + rows * time_steps, dtype=torch.int64).reshape(rows, time_steps)
    tag = step + writer * 1_000_000
    return TensorDict(
        {
            "a": step,
            "b": step.to(torch.float64) * 2,
            "w": torch.full_like(step, writer),
            "v": tag.unsqueeze(-1).expand(rows, time_steps, VECTOR).clone(),
            ("next", "c"): tag.to(torch.float64).unsqueeze(-1),
        },
        [rows, time_steps],
    )


def check_frames(td) -> int:
    """The number of torn frames in ``td`` (fields that disagree about (writer, step))."""
    a, w = td["a"], td["w"]
    tag = a + w * 1_000_000
    ok = (td["b"] == a.to(torch.float64) * 2) & (td["next", "c"].squeeze(-1) == tag.to(torch.float64))
    ok &= (td["v"] == tag.unsqueeze(-1)).all(-1)
    return int((~ok).sum())


def extend_once(rb, conn) -> None:
    """Write the buffer's very first batch (a (2, 5) one) from this process."""
    try:
        idx = rb.extend(writer_batch(7, 0, 2, 5))
        conn.send(("ok", idx.tolist(), len(rb), rb.write_count))
    except BaseException as e:  # report, do not hang the parent
        conn.send(("error", repr(e)))
    finally:
        rb.close()
        conn.close()


def write_for(rb, writer: int, seconds: float, max_frames: int, conn) -> None:
    """After "go": extend with consecutive steps for ``seconds`` (or ``max_frames``); report."""
    try:
        writer_batch(writer, 0, 1, 1)  # import tensordict now, not on the clock
        len(rb)  # map the buffer
        conn.send("ready")
        if conn.recv() != "go":
            return
        step, calls, deadline = 0, 0, time.monotonic() + seconds
        while time.monotonic() < deadline:
            rows, t = BATCH_SHAPES[calls % len(BATCH_SHAPES)]
            if step + rows * t > max_frames:
                break
            rb.extend(writer_batch(writer, step, rows, t))
            step, calls = step + rows * t, calls + 1
        conn.send(("ok", step, calls))
    except BaseException as e:
        conn.send(("error", repr(e)))
    finally:
        rb.close()
        conn.close()
