"""Replayable async runs (``MultiAsyncCollector(record=path)`` / ``(replay=path)``): the
schedule that made a run, written as JSON lines, and read back to make the same run again.

What makes an async run differ from another with the same envs, seeds and trainer is timing:
which worker's batch is delivered next, and which weights each worker acted with (a batch is
collected with the last weights its worker received before it started). Everything else is
already deterministic per worker: its env and its random numbers advance batch after batch.
So the schedule holds, in delivery order, one line per batch a worker handed in: the worker,
the policy version it acted with, whether it acted randomly (``init_random_frames``), and
whether it was delivered or dropped for lag (``max_policy_lag``); one line per worker restart
(after how many of that worker's batches); one line per ``set_seed``.

Replaying, the gather (gather.py) delivers the recorded workers' batches in the recorded order,
and starts a worker's next batch only when the version the collector last pushed to that
worker equals the recorded one; the weights travel through the worker's pipe (the
``"process"`` scheme, set by the config), queued in order with the requests to collect, so the
worker acts with exactly those weights. A recorded restart replaces the worker at the same
point of its stream (its replacement is seeded from ``set_seed``'s seed and its restart count,
so it starts as the recorded one did). Limits: the trainer must push the same weights at the
same points (same code, seeds and data, one-thread determinism); a worker acts with the weights
of a version the collector pushed while it was running a batch call (a version pushed and
replaced between two batch calls, never seen by a worker in the recording, cannot be acted
with); in-worker inference only (central inference stamps each forward with its version, so a
batch may mix versions); not while running free (``start()``).

Example:
    >>> import os, tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "run.jsonl")
    >>> rec = ScheduleRecorder(path, num_workers=2)
    >>> rec.batch(1, version=0, random=False, outcome="deliver"); rec.restart(1); rec.close()
    >>> plan = ScheduleReplay(path, num_workers=2)
    >>> plan.next_event(), plan.next_for(1), plan.next_for(0)
    ((1, 'deliver'), ('batch', 0, False), None)
"""

from __future__ import annotations

import collections
import json
from typing import Any

#: The format of a schedule file (its first line says which).
SCHEDULE_FORMAT = 1


class ScheduleRecorder:
    """Writes the schedule of one async run to ``path`` (JSON lines, flushed line by line).

    Args:
        path: the file (overwritten).
        num_workers: the collector's workers (checked on replay).
    """

    replaying = False

    def __init__(self, path: Any, num_workers: int):
        self.file = open(path, "w", encoding="utf-8")  # noqa: SIM115  (closed by close())
        self.counts = [0] * num_workers  # batches written per worker
        self._write({"type": "header", "format": SCHEDULE_FORMAT, "num_workers": num_workers})

    def _write(self, line: dict) -> None:
        if self.file is not None:
            self.file.write(json.dumps(line) + "\n")
            self.file.flush()

    def batch(self, worker: int, *, version: int, random: bool, outcome: str) -> None:
        """A batch of ``worker`` handed in: ``"deliver"`` or ``"drop"``."""
        self.counts[worker] += 1
        self._write({"type": "batch", "worker": worker, "version": int(version), "random": bool(random),
                     "outcome": outcome})

    def restart(self, worker: int, pending: int = 0) -> None:
        """``worker`` failed and was replaced after its batches written so far and ``pending``
        more it had handed in (not yet delivered)."""
        self._write({"type": "restart", "worker": worker, "after": self.counts[worker] + pending})

    def seed(self, seed: int) -> None:
        self._write({"type": "seed", "seed": int(seed)})

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None


#: The fields of each line type of a schedule file, with what each accepts.
_FIELDS: dict[str, dict[str, tuple[str, Any]]] = {
    "batch": {"worker": ("a worker index", "worker"), "version": ("an int", int), "random": ("a bool", bool),
              "outcome": ("'deliver' or 'drop'", ("deliver", "drop"))},
    "restart": {"worker": ("a worker index", "worker"), "after": ("an int >= 0", "count")},
    "seed": {"seed": ("an int", int)},
}


def read_schedule(path: Any, num_workers: int) -> list[dict]:
    """The lines of schedule file ``path``, each checked: ``ValueError`` naming the file, the
    line and what is wrong (bytes that are not UTF-8, a line cut mid-way, a missing field, a
    worker index out of range or of the wrong type...)."""
    with open(path, "rb") as f:
        raw = f.read().split(b"\n")
    lines: list[dict] = []
    for n, data in enumerate(raw, 1):
        if not data.strip():
            continue

        def bad(what: str, n: int = n) -> ValueError:
            return ValueError(f"replay={str(path)!r}, line {n}: {what}; a schedule is written by "
                              "MultiAsyncCollector(record=...)")

        try:
            line = json.loads(data.decode("utf-8"))
        except UnicodeDecodeError as err:
            raise bad(f"not UTF-8 text ({err.reason} at byte {err.start})") from None
        except json.JSONDecodeError as err:
            raise bad(f"not a JSON line ({err.msg} at column {err.colno}: cut mid-way?)") from None
        if not isinstance(line, dict):
            raise bad(f"a JSON object is expected, got {type(line).__name__}")
        if not lines:
            if line.get("type") != "header" or line.get("format") != SCHEDULE_FORMAT:
                raise bad(f"the header (type 'header', format {SCHEDULE_FORMAT!r}) is expected")
            if type(line.get("num_workers")) is not int or line["num_workers"] < 1:
                raise bad(f"num_workers must be an int >= 1, got {line.get('num_workers')!r}")
            lines.append(line)
            continue
        fields = _FIELDS.get(line.get("type"))  # type: ignore[arg-type]
        if fields is None:
            raise bad(f"type must be one of {sorted(_FIELDS)}, got {line.get('type')!r}")
        for name, (accepted, kind) in fields.items():
            if name not in line:
                raise bad(f"a {line['type']!r} line needs {name!r} ({accepted})")
            value = line[name]
            ok = (value in kind if isinstance(kind, tuple)
                  else type(value) is int and 0 <= value < num_workers if kind == "worker"
                  else type(value) is int and value >= 0 if kind == "count"
                  else type(value) is kind)
            if not ok:
                if kind == "worker":
                    accepted = f"an int in [0, {num_workers}) (this collector's workers)"
                raise bad(f"{name} must be {accepted}, got {value!r}")
        lines.append(line)
    if not lines:
        raise ValueError(f"replay={str(path)!r} is empty: not a schedule written by MultiAsyncCollector(record=...)")
    return lines


class ScheduleReplay:
    """A recorded schedule (``ScheduleRecorder``'s file), consumed as the replay goes.

    Args:
        path: the file.
        num_workers: the collector's workers (must be the recorded number).
    """

    replaying = True

    def __init__(self, path: Any, num_workers: int):
        lines = read_schedule(path, num_workers)
        if lines[0]["num_workers"] != num_workers:
            raise ValueError(f"replay={path!r} was recorded with {lines[0]['num_workers']} workers, this collector "
                             f"has {num_workers}")
        self.path = path
        self.events: collections.deque[tuple[int, str]] = collections.deque()  # (worker, outcome), delivery order
        self.plans: list[collections.deque] = [collections.deque() for _ in range(num_workers)]
        self.seeds: collections.deque[int] = collections.deque()
        restarts: list[list[int]] = [[] for _ in range(num_workers)]
        batches: list[list[tuple]] = [[] for _ in range(num_workers)]
        for line in lines[1:]:
            if line["type"] == "batch":
                self.events.append((line["worker"], line["outcome"]))
                batches[line["worker"]].append(("batch", line["version"], line["random"]))
            elif line["type"] == "restart":
                restarts[line["worker"]].append(line["after"])
            elif line["type"] == "seed":
                self.seeds.append(line["seed"])
        for i in range(num_workers):  # each worker's stream: its batches, restarts where they happened
            for n, entry in enumerate(batches[i]):
                self.plans[i].extend(("restart",) for after in restarts[i] if after == n)
                self.plans[i].append(entry)
            self.plans[i].extend(("restart",) for after in restarts[i] if after == len(batches[i]))

    def next_event(self) -> tuple[int, str] | None:
        """The next batch handed in: ``(worker, "deliver" | "drop")``; None: the schedule ends."""
        return self.events[0] if self.events else None

    def pop_event(self) -> None:
        self.events.popleft()

    def next_for(self, worker: int) -> tuple | None:
        """What ``worker`` does next: ``("batch", version, random)``, ``("restart",)``, or None."""
        plan = self.plans[worker]
        return plan[0] if plan else None

    def pop_for(self, worker: int) -> None:
        self.plans[worker].popleft()

    def start_due(self, parked: Any, in_flight: list[set], pushed: list[int], collect: Any, restart: Any) -> None:
        """Start each worker's next recorded batch once the version last ``pushed`` to it is
        the recorded one and one of its slots is ``parked`` (free): ``collect(worker, slot,
        random)``; ``restart(worker)`` where the recording restarted it (nothing in flight)."""
        progress = True
        while progress:
            progress = False
            for i in range(len(self.plans)):
                step = self.next_for(i)
                if step is None:
                    continue
                if step[0] == "restart":
                    if not in_flight[i]:
                        self.pop_for(i)
                        restart(i)
                        progress = True
                    continue
                _, version, random = step
                slot = next((s for j, s in parked if j == i), None)
                if slot is None or pushed[i] != version:
                    continue
                parked.remove((i, slot))
                self.pop_for(i)
                collect(i, slot, random)
                progress = True

    def take_ready(self, ready: Any, in_flight: list[set], start_due: Any, pushed: list[int]) -> tuple | None:
        """The recorded worker's next batch out of ``ready`` (``(worker, reply)``; None: not
        ready yet); raises when it cannot come (the run diverged from the recording)."""
        event = self.next_event()
        if event is None:
            raise RuntimeError(f"replay={self.path!r}: the recorded run handed in no more batches; this run asks "
                               "for more than it delivered")
        worker = event[0]
        for j, (index, info) in enumerate(ready):
            if index == worker:
                del ready[j]
                return index, info
        if not in_flight[worker]:
            start_due()
            if not in_flight[worker]:
                raise RuntimeError(
                    f"replay={self.path!r} diverged: worker {worker}'s next recorded batch ({self.next_for(worker)}) "
                    f"cannot start: the weights last pushed to it are version {pushed[worker]} (the trainer must "
                    "push the same weights at the same points)")
        return None

    def seed(self, seed: int) -> None:
        """``set_seed(seed)`` replayed: it must be the recorded call."""
        expected = self.seeds.popleft() if self.seeds else None
        if expected != seed:
            raise ValueError(f"replay={self.path!r}: set_seed({seed}) but the recorded run called "
                             f"{'no further set_seed' if expected is None else f'set_seed({expected})'}")

    def close(self) -> None:
        """(Nothing to release.)"""


def schedule_for(config: Any) -> ScheduleRecorder | ScheduleReplay | None:
    """The recorder or the replay ``config`` asks for (``record`` / ``replay``), or None."""
    if getattr(config, "record", None) is not None:
        return ScheduleRecorder(config.record, config.num_workers)
    if getattr(config, "replay", None) is not None:
        return ScheduleReplay(config.replay, config.num_workers)
    return None
