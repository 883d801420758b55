"""``InferenceServer``: the main process's inference loop (``inference="central"``).

One thread waits on every slot's pipe (block.py). When slots are ready it reads what else
arrives within ``max_wait_us``, then runs **one** forward of the policy over the rows of every
ready slot, writes the outputs into their rows of the shared block and wakes their workers.
Consecutive slots are one range of the block: their forward reads and writes views of it.
Other sets are gathered into a staging buffer first (pinned, when the policy is on a GPU).

The policy is the trainer's own object, so its updates are seen at the next forward; ``lock``
is held during each forward, and by the collector while it changes the weights or
``version``, so a forward never sees half an update, and every slot's answer carries the
version it was computed with.

Example:
    >>> import torch
    >>> from rlcollect.multiprocess.shm import allocate_slot
    >>> server = InferenceServer(torch.nn.Linear(3, 2), device=None, exploration_type="random",
    ...                          allocate=allocate_slot)
    >>> server.stats()["forward_calls"]
    0
    >>> server.stop()
"""

from __future__ import annotations

import contextlib
import multiprocessing
import pickle
import threading
import time
from multiprocessing.connection import wait
from typing import Any, Callable

import torch

from rlcollect.data import BatchLayout
from rlcollect.envs.base import NestedKey
from rlcollect.inference.block import ACTIONS, DISCOVER, FAILED, REQUEST, SlotSpec, block_layout, block_views
from rlcollect.errors import pack_exception
from rlcollect.policy import exploration_scope, make_runner


class _Slot:
    """One split of one worker's envs: its rows of the block (its pipe: ``_conns``)."""

    def __init__(self, index: int, worker: int, split: int, offset: int, rows: int):
        self.index, self.worker, self.split, self.offset, self.rows = index, worker, split, offset, rows


class InferenceServer:
    """Serves the policy to the env workers of one collector, from a thread of this process.

    Args:
        policy: the module (or callable) that acts, called with a batch of rows of every ready slot.
        device: where the forward runs (``policy_device``; None: where the inputs are, the CPU).
        exploration_type: the ``ExplorationType`` name each forward runs under.
        max_wait_us: once a slot is ready, how long to wait for more before the forward
            (microseconds; 0: run with whatever is ready).
        compile_policy, trust_policy: as for ``Collector``.
        allocate: builds the shared-memory block of a ``BatchLayout`` (the collector's
            ``allocate_slot``, which also reports a full /dev/shm clearly).
    """

    def __init__(self, policy: Any, *, device: torch.device | None, exploration_type: str,
                 allocate: Callable[[BatchLayout], torch.Tensor], max_wait_us: float = 0.0,
                 compile_policy: Any = None, trust_policy: bool | None = None):
        self.policy = policy
        self._allocate = allocate
        self.device = None if device is None else torch.device(device)
        self.exploration_type = exploration_type
        self.max_wait_s = max_wait_us / 1e6
        self.compile_policy, self.trust_policy = compile_policy, trust_policy
        self.lock = threading.Lock()  # a forward, or the collector changing the weights / version
        self.version = 0
        self.error: BaseException | None = None  # the first exception the policy raised
        self.spec: SlotSpec | None = None
        self.slots: list[_Slot] = []
        self._by_member: dict[tuple[int, int], _Slot] = {}
        self._conns: dict[Any, tuple[int, int]] = {}  # live pipe -> (worker, split)
        self._retired: list[Any] = []  # pipes of replaced workers, closed by the loop
        self._changed = threading.Lock()  # guards _conns and _retired
        self._runners: dict[int, Any] = {}
        self._out_keys: list[NestedKey] | None = None
        self._env_keys: list[NestedKey] = []
        self._groups: list | None = None  # a grouped env's sub-TensorDict batch dims (client.py)
        self._lazy: list | None = None  # its lazily stacked groups (client.py)
        self._stage: dict[NestedKey, torch.Tensor] = {}
        self._ins: dict[NestedKey, torch.Tensor] = {}
        self._outs: dict[NestedKey, torch.Tensor] = {}
        self._versions: torch.Tensor | None = None
        self.calls = 0
        self.rows = 0
        self.forward_seconds = 0.0
        self.started_at = time.perf_counter()
        self._wake_r, self._wake_w = multiprocessing.Pipe(duplex=False)
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="rlcollect-inference", daemon=True)
        self._thread.start()

    # -- the collector's calls -------------------------------------------------------------------
    def connect(self, worker: int, splits: int, context: Any) -> list[Any]:
        """New pipes for worker ``worker``'s splits (at each start of its process); returns the
        worker's ends. The pipes of a process it replaces are closed by the loop."""
        pairs = [context.Pipe(duplex=True) for _ in range(splits)]
        with self._changed:
            for conn, member in list(self._conns.items()):
                if member[0] == worker:
                    del self._conns[conn]
                    self._retired.append(conn)
            for split, (here, _) in enumerate(pairs):
                self._conns[here] = (worker, split)
        self._wake()
        return [there for _, there in pairs]

    def allocate(self, specs: list[list[SlotSpec]]) -> list[tuple]:
        """Lay out the block for every worker's splits (``specs[worker][split]``), allocate it,
        and return each worker's ``RemotePolicy.attach`` arguments."""
        first = specs[0][0]
        for worker, splits in enumerate(specs):
            for spec in splits:
                if not spec.same_keys(first):
                    raise ValueError(
                        f"inference='central': worker {worker}'s policy inputs or outputs differ from worker 0's "
                        f"({sorted(map(str, spec.inputs))} -> {sorted(map(str, spec.outputs))} vs "
                        f"{sorted(map(str, first.inputs))} -> {sorted(map(str, first.outputs))}); one forward "
                        "serves every worker, so their envs must observe the same keys")
        slots, offset = [], 0
        for worker, splits in enumerate(specs):
            for split, spec in enumerate(splits):
                slots.append(_Slot(len(slots), worker, split, offset, spec.rows))
                offset += spec.rows
        layout = block_layout(first, offset)
        flat = self._allocate(layout)
        versions = torch.zeros(len(slots), dtype=torch.int64).share_memory_()
        ins, outs = block_views(flat, first, offset)
        pinned = self.device is not None and self.device.type == "cuda"
        with self._changed:
            self.spec, self.slots, self._versions = first, slots, versions
            self._ins, self._outs = ins, outs
            self._stage = {k: torch.empty_like(v, pin_memory=pinned) for k, v in ins.items()}
            self._by_member = {(s.worker, s.split): s for s in slots}
        self._flat = flat
        return [(flat, first, offset, [(s.index, s.offset) for s in slots if s.worker == worker], versions)
                for worker in range(len(specs))]

    def stats(self) -> dict:
        """``forward_calls``, ``forward_rows`` (env rows served), ``forward_calls_per_s``,
        ``mean_batch_rows`` (env rows per forward), ``forward_mean_s`` since the server started."""
        elapsed = time.perf_counter() - self.started_at
        return {"forward_calls": self.calls, "forward_rows": self.rows,
                "forward_calls_per_s": self.calls / elapsed if elapsed > 0 else 0.0,
                "mean_batch_rows": self.rows / self.calls if self.calls else 0.0,
                "forward_mean_s": self.forward_seconds / self.calls if self.calls else 0.0}

    def stop(self, timeout: float = 5.0) -> None:
        """End the loop and close every pipe: workers waiting for actions get an error at once."""
        if self._stopping:
            return
        self._stopping = True
        self._wake()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)
        with self._changed:
            conns, self._conns = list(self._conns) + self._retired, {}
            self._retired = []
        for conn in conns:
            conn.close()
        self._wake_r.close()
        self._wake_w.close()
        self._ins = self._outs = self._stage = {}
        self._versions = self._flat = None

    def _wake(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            self._wake_w.send_bytes(b"w")

    # -- the loop --------------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stopping:
            with self._changed:
                for conn in self._retired:
                    conn.close()
                self._retired = []
                conns = list(self._conns)
            try:
                ready = wait([*conns, self._wake_r])
            except (OSError, ValueError):
                continue  # a pipe was closed meanwhile: look again
            if self._stopping:
                return
            requests = self._read(ready)
            if requests and self.max_wait_s > 0:
                deadline = time.perf_counter() + self.max_wait_s
                while len(requests) < len(conns):
                    left = deadline - time.perf_counter()
                    if left <= 0:
                        break
                    asked = {conn for _, conn in requests}
                    more = wait([c for c in conns if c not in asked], left)
                    if not more:
                        break
                    requests += self._read(more)
            if requests:
                self._forward(requests)

    def _read(self, ready: list) -> list[tuple[_Slot, Any]]:
        """``(slot, pipe)`` of each pipe among ``ready`` that sent a request (discoveries are
        answered at once). The answer goes back on the pipe the request came on: a replaced
        worker's last request must not be answered on its replacement's pipe."""
        requests = []
        for conn in ready:
            if conn is self._wake_r:
                with contextlib.suppress(OSError, EOFError):
                    while self._wake_r.poll():
                        self._wake_r.recv_bytes()
                continue
            try:
                message = conn.recv_bytes()
            except (EOFError, OSError):
                self._drop(conn)  # its worker died; the collector notices through its process
                continue
            member = self._conns.get(conn)
            if member is None:
                continue
            if message == REQUEST:
                slot = self._by_member.get(member)
                if slot is not None:
                    requests.append((slot, conn))
            elif message[:1] == DISCOVER:
                self._discover(conn, message[1:])
        return requests

    def _drop(self, conn: Any) -> None:
        with self._changed:
            if self._conns.pop(conn, None) is not None:
                self._retired.append(conn)

    def _send(self, conn: Any, message: bytes) -> None:
        try:
            conn.send_bytes(message)
        except (OSError, ValueError):
            self._drop(conn)

    def _runner(self, rows: int) -> Any:
        runner = self._runners.get(rows)
        if runner is None:
            keys = self.spec.env_keys if self.spec is not None else self._env_keys
            runner = make_runner(self.policy, list(keys), torch.Size([rows]), self.device, self.compile_policy,
                                 None, self.trust_policy)
            if self._out_keys is not None and hasattr(runner, "out_keys"):
                runner.out_keys = list(self._out_keys)
            if self._groups is not None and hasattr(runner, "groups"):
                runner.groups = [(k, tuple(d)) for k, d in self._groups]
                runner.require_action = False  # (a grouped env's actions lie under its groups)
            if self._lazy and hasattr(runner, "lazy"):
                runner.lazy = [(tuple(key), agents, stack) for key, agents, stack in self._lazy]
            self._runners[rows] = runner
        return runner

    def _call(self, rows: int, inputs: dict[NestedKey, torch.Tensor]) -> dict[NestedKey, torch.Tensor]:
        with exploration_scope(self.exploration_type, thread_local=True), torch.no_grad():
            out = self._runner(rows)(inputs)
        return out if self._out_keys is None else {k: out[k] for k in self._out_keys}

    def _discover(self, conn: Any, payload: bytes) -> None:
        """A worker's dry run: its first observations, answered with the policy's outputs."""
        try:
            if self.error is not None:
                raise RuntimeError("the policy raised in an earlier forward") from self.error
            message = pickle.loads(payload)
            inputs, self._groups, self._lazy = message["inputs"], message.get("groups"), message.get("lazy")
            rows = len(next(iter(inputs.values())))
            self._env_keys = list(inputs)
            with self.lock:
                out = self._call(rows, {k: torch.from_numpy(v) for k, v in inputs.items()})
                reply = {k: v.detach().cpu().numpy() for k, v in out.items()}
            if self._out_keys is None:
                self._out_keys = list(reply)
            message = pickle.dumps(("ok", reply))
        except Exception as exc:  # noqa: BLE001  (the worker re-raises it: its start-up fails with it)
            message = pickle.dumps(("error", pack_exception(exc, None)))
        self._send(conn, message)

    def _forward(self, requests: list[tuple[_Slot, Any]]) -> None:
        requests.sort(key=lambda r: r[0].index)
        slots, conns = [s for s, _ in requests], [c for _, c in requests]
        if self.error is not None or self.spec is None:
            for conn in conns:
                self._send(conn, FAILED)
            return
        rows = sum(s.rows for s in slots)
        consecutive = slots[-1].index - slots[0].index == len(slots) - 1
        lo, hi = slots[0].offset, slots[0].offset + rows
        began = time.perf_counter()
        try:
            with self.lock:
                version = self.version
                if consecutive and not self._pinned:
                    inputs = {k: v[lo:hi] for k, v in self._ins.items()}
                else:
                    inputs = {k: self._gather(k, v, slots, rows) for k, v in self._ins.items()}
                out = self._call(rows, inputs)
                self._scatter(out, slots, consecutive, lo, hi)
                for slot in slots:
                    self._versions[slot.index] = version
        except Exception as exc:  # noqa: BLE001  (the collector re-raises it; the workers are told)
            if self.error is None:
                self.error = exc
            for conn in conns:
                self._send(conn, FAILED)
            return
        self.forward_seconds += time.perf_counter() - began
        self.calls += 1
        self.rows += rows
        for conn in conns:
            self._send(conn, ACTIONS)

    @property
    def _pinned(self) -> bool:
        return self.device is not None and self.device.type == "cuda"

    def _gather(self, key: NestedKey, block: torch.Tensor, slots: list[_Slot], rows: int) -> torch.Tensor:
        stage = self._stage[key][:rows]
        at = 0
        for slot in slots:
            stage[at:at + slot.rows].copy_(block[slot.offset:slot.offset + slot.rows])
            at += slot.rows
        return stage

    def _scatter(self, out: dict[NestedKey, torch.Tensor], slots: list[_Slot], consecutive: bool, lo: int,
                 hi: int) -> None:
        host = {}
        for key, value in out.items():
            value = value.detach()
            if value.device.type != "cpu":
                value = value.to("cpu", non_blocking=True)
            host[key] = value
        if self._pinned:
            torch.cuda.current_stream(self.device).synchronize()
        for key, value in host.items():
            block = self._outs[key]
            value = value.reshape(-1, *block.shape[1:])
            if consecutive:
                block[lo:hi].copy_(value)
                continue
            at = 0
            for slot in slots:
                block[slot.offset:slot.offset + slot.rows].copy_(value[at:at + slot.rows])
                at += slot.rows

