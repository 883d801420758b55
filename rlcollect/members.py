"""Member control, one part for both wings: a member is a worker process (``multiprocess/``) or a
node (``distributed/``), and each collector holds one ``Members`` over its parts:

- the **pool** (``multiprocess/pool.py``'s ``WorkerPool``, ``distributed/pool.py``'s
  ``NodePool``): the members' processes and their pipes or channels;
- the **gather** (each wing's ``gather.py``): the next batch from the members. A gather never
  repairs a failure: it raises (``MemberFailed``, or an error its recovery recognises) and keeps
  what it gathered, so that it goes on where it stopped once the member is replaced;
- the **recovery** (each wing's ``recovery.py``): ``recover(index, error)`` replaces failed member
  ``index`` (or drops it, as ``on_worker_failure`` / ``on_node_failure`` say) or re-raises
  ``error``; it owns the restart counts and the replacement seeds (``replacement_seed``);
- the **statistics** (``MemberStats``, below): they own every counter of the members (frames
  and batches delivered, per-member frames, lag, wait, drops, losses); the gathers and free
  running report to them (``note_batch``, ``note_lag_dropped``, ...) and nothing else writes
  their fields.

``Members`` runs the gather's steps under recovery (``next_batch``, ``quiesce``, ``discard``,
``run``): the one place of both wings where a failed member is repaired and the step tried again.
It also controls the members, once for both wings, over the one pool contract (``Pool``:
``serving``, ``ask``, ``ask_all``): ``seed``, ``reset``, ``states``, ``load``, ``broadcast`` (a
command to chosen members) and ``push`` (weights, through the wing's weights part); the faces
only call these.

- ``replacement_seed``: the seed of a member's replacement, derived once for both wings.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

from rlcollect.metrics import BatchClock, batch_meta, merge_meta, policy_lag, stats_keys, worker_keys

T = TypeVar("T")

#: Seeds of replaced members: generation ``g`` of a member seeded with ``s`` starts from
#: ``s + g * SEED_STRIDE`` (a prime: the generations' seeds stay apart from the members' own,
#: which the collectors space by 1).
SEED_STRIDE = 7919


def replacement_seed(seed: int, generation: int) -> int:
    """The seed of generation ``generation`` (1 for the first replacement) of a member seeded
    with ``seed``.

    Example:
        >>> replacement_seed(100, 1), replacement_seed(100, 2)
        (8019, 15938)
    """
    return seed + SEED_STRIDE * generation


class MemberFailed(Exception):
    """Raised by a gather (or free running) when member ``index`` failed with ``error`` and may be
    repaired: ``Members`` has the recovery replace it (or re-raise ``error``), tells the gather
    (``recovered(index)``) and runs the step again.

    Example:
        >>> failed = MemberFailed(1, RuntimeError("killed"))
        >>> failed.index, str(failed.error)
        (1, 'killed')
    """

    def __init__(self, index: int, error: BaseException):
        super().__init__(index, error)
        self.index, self.error = index, error


# -- the parts' contracts ----------------------------------------------------------------------
class Pool(Protocol):
    """The one pool contract of both wings (``multiprocess/pool.py``'s ``WorkerPool``,
    ``distributed/pool.py``'s ``NodePool``): what ``Members`` asks of a pool to control its
    members, in the commands every member takes (``"seed"``, ``"reset"``, ``"state_dict"``,
    ``"load_state_dict"``, and the wing's own: ``"getattr_env"``, ...); each pool carries them
    its own way (a pipe, a signed channel) and raises a member's failure as its wing does."""

    def __len__(self) -> int: ...

    def serving(self) -> list[int]:
        """The members that take commands now (a node dropped or on its way back does not)."""

    def ask(self, index: int, command: str, *args: Any) -> Any:
        """Command member ``index`` and wait for its reply (its exception is re-raised here)."""

    def ask_all(self, command: str, *args: Any, members: Sequence[int] | None = None) -> list[Any]:
        """``command`` to each of ``members`` (None: every one serving) and their replies, in order."""

    def alive(self) -> list[bool]:
        """Whether each member lives (``stats()``)."""


class Gather(Protocol):
    """What ``Members`` asks of a gather (both wings' ``gather.py``)."""

    #: a failure met after the batch was taken (``(index, error)``), repaired before the batch
    #: is returned; None: none
    owed: tuple[int, BaseException] | None

    def take_owed(self) -> tuple[int, BaseException]:
        """``owed``, handed over (``owed`` is None again)."""

    def recovered(self, index: int) -> None:
        """Member ``index`` was replaced: collect again what it had lost."""

    def abandon(self) -> None:
        """A failure was raised, not repaired: forget the step in progress."""

    def rejoin(self) -> None:
        """Wait until no member is on its way back (a relaunched node rejoins)."""

    def quiesce(self) -> None:
        """Wait until no member owes a batch (what arrives meanwhile stays for delivery)."""

    def discard(self) -> None:
        """``quiesce``, then drop the batches collected and not delivered yet."""

    def note_seed(self, seed: int) -> None:
        """``set_seed(seed)`` was called (a recorded schedule notes it)."""


class BatchGather(Gather, Protocol):
    """A gather whose ``next_batch`` ``Members.next_batch`` runs under recovery (both wings':
    the faces' ``_collect_next`` is ``Members.next_batch``)."""

    #: whether it holds the version lock (``max_policy_lag``) until the batch is delivered
    held: bool

    def next_batch(self, version: int, update: Callable[[Any], int]) -> tuple[Any, dict]:
        """``(batch, where)``: the next batch and the keyword arguments of its delivery."""

    def release(self) -> None:
        """The batch is delivered (or failed): the version lock is let go."""


class Repairable(Protocol):
    """What ``count_free`` asks of free running (``multiprocess/freerun.py``)."""

    def recovered(self, index: int) -> None:
        """Worker ``index`` was replaced: it runs free again."""


class Recovery(Protocol):
    """What ``Members`` asks of a recovery (both wings' ``recovery.py``)."""

    def member_of(self, error: BaseException) -> int | None:
        """The member ``error`` is the failure of, when it may be repaired (None: raise it)."""

    def recover(self, index: int, error: BaseException) -> None:
        """Replace (or drop) failed member ``index``, or re-raise ``error``."""

    def note_seed(self, index: int, seed: int) -> None:
        """Member ``index`` was given ``seed``: its replacements derive theirs from it."""

    @property
    def counts(self) -> list[int]:
        """The restarts of each member."""


class Members:
    """A collector's members under control: the gather's steps run under recovery.

    Args:
        pool: the members' pool.
        gather: the gather (``Gather``).
        recovery: the recovery (``Recovery``).
        stats: the statistics (``MemberStats``: the counters, and the collector's policy
            version, what a batch's lag is measured against).
        update: the collector's weight update with each batch (``update_at_each_batch``), handed
            to the gather.
        free: free running (``multiprocess/freerun.py``), whose failures ``count_free`` repairs.

    Example:
        >>> class Flaky:  # a gather whose member 0 fails once
        ...     owed, failures, lost = None, 1, []
        ...     def take_owed(self): pass
        ...     def step(self):
        ...         if self.failures:
        ...             self.failures -= 1
        ...             raise MemberFailed(0, RuntimeError("killed"))
        ...         return "batch"
        ...     def recovered(self, index): self.lost.append(index)
        ...     def abandon(self): pass
        >>> class Restarts:
        ...     restarts = [0]
        ...     def member_of(self, error): return None
        ...     def recover(self, index, error): self.restarts[index] += 1
        >>> gather, recovery = Flaky(), Restarts()
        >>> members = Members([0], gather, recovery, MemberStats(1))
        >>> members.run(gather.step), recovery.restarts, gather.lost
        ('batch', [1], [0])
    """

    def __init__(self, pool: Pool, gather: Gather, recovery: Recovery, stats: MemberStats,
                 update: Callable[[Any], int] | None = None, free: Repairable | None = None):
        self.pool, self.gather, self.recovery, self.stats = pool, gather, recovery, stats
        self.update, self.free = update, free

    def next_batch(self) -> tuple[Any, dict]:
        """``(batch, where)``: the gather's next batch under recovery, and the keyword arguments
        of its delivery (the collector's ``_collect_next``, in both wings). A gather may hand its report of the
        batch back with it (``where["report"]``: ``MemberStats.note_batch``'s arguments), noted
        here. With ``max_policy_lag`` the gather holds the version from the check of the batch's
        lag: ``where["after"]`` releases it once the batch is delivered."""
        gather: BatchGather = self.gather  # type: ignore[assignment]  (no cast: a call per batch)
        try:
            batch, where = self.run(gather.next_batch, self.stats.version, self.update)
        except BaseException:
            gather.release()
            raise
        report = where.pop("report", None)
        if report is not None:
            self.stats.note_batch(*report)
        if gather.held:  # (max_policy_lag) no version moves until the batch is delivered
            where["after"] = gather.release
        return batch, where

    def __len__(self) -> int:
        return len(self.pool)

    # -- control of the members, written once for both wings (over the ``Pool`` contract) ------
    def serving(self) -> list[int]:
        """The members that take commands, once none is on its way back (a relaunched node)."""
        self.run(self.gather.rejoin)
        return self.pool.serving()

    def quiesce(self) -> None:
        """Wait until no member owes a batch (a failure met meanwhile is repaired)."""
        self.run(self.gather.quiesce)

    def discard(self) -> None:
        """Drop the batches collected and not delivered yet (before a command that changes what
        the members collect: ``seed``, ``reset``, ``load``, free running's start)."""
        self.run(self.gather.discard)

    def seed(self, seed: int, static_seed: bool) -> int:
        """Seed each member serving in turn, from ``seed`` (each answers the next member's);
        returns the seed after the last. Batches collected before are discarded."""
        self.discard()
        self.gather.note_seed(seed)
        for i in self.pool.serving():
            self.recovery.note_seed(i, seed)
            seed = self.pool.ask(i, "seed", seed, static_seed)
        return seed

    def reset(self, chosen: Sequence[int] | None = None) -> None:
        """Reset the envs of the members ``chosen`` (None: every one serving); batches collected
        before are discarded."""
        self.discard()
        for i in self.pool.serving() if chosen is None else chosen:
            self.pool.ask(i, "reset")

    def states(self) -> dict[int, Any]:
        """``{member: its collector's state}`` of every member serving, once none owes a batch
        (those received meanwhile stay for delivery)."""
        self.quiesce()
        members = self.pool.serving()
        return dict(zip(members, self.pool.ask_all("state_dict", members=members)))

    def load(self, states: dict[int, Any], frames: int, batches: int) -> None:
        """Load ``states`` (``{member: state}``) into the members, batches collected before
        discarded; the statistics count ``frames`` and ``batches`` from then on."""
        self.discard()
        for i, state in states.items():
            self.pool.ask(i, "load_state_dict", state)
        self.stats.restore(frames, batches)

    def broadcast(self, command: str, *args: Any, members: Sequence[int] | None = None) -> list[Any]:
        """``command`` to ``members`` (None: every one serving) once none owes a batch; their replies."""
        self.quiesce()
        return self.pool.ask_all(command, *args, members=members)

    def push(self, send: Callable[[Any, int], None], targets: dict[int, Any], version: int) -> None:
        """Weights ``version`` to the members of ``targets`` (``{member: what it gets}``) through
        ``send(targets, version)`` (the wing's weights part), again after a failure the recovery
        repairs (a relaunched node gets them when it rejoins); the statistics note the push."""
        self.run(send, targets, version)
        self.stats.note_pushed(targets, version)

    def run(self, step: Callable[..., T], *args: Any) -> T:
        """``step(*args)``, again after each member failure the recovery repairs (a failure owed
        by the gather is repaired before the result is returned)."""
        while True:
            try:
                out = step(*args)
            except Exception as err:
                failure = self._failure(err)
                if failure is None:
                    raise  # not a member's failure, or one that may not be repaired
                index, error = failure
            else:
                if self.gather.owed is not None:
                    self.settle()
                return out
            self._recover(index, error)
            error = None  # (its traceback holds the gather's frames: not kept past the repair)

    def settle(self) -> None:
        """Repair the failures the gather owes (met after it took a batch)."""
        gather = self.gather
        while gather.owed is not None:
            index, error = gather.take_owed()
            self._recover(index, error)
            error = None

    def _failure(self, err: Exception) -> tuple[int, BaseException] | None:
        """``(member, error)`` of a failure the recovery may repair (None: any other error)."""
        if isinstance(err, MemberFailed):
            return err.index, err.error
        index = self.recovery.member_of(err)
        return None if index is None else (index, err)

    def count_free(self, step: Callable[[], tuple[int, list]], final: bool = False) -> int:
        """Free running's ``step()`` (``check``, ``suspend`` or ``stop`` of ``free``): the
        workers it found failed are replaced (``final``: only forgiven, at the last stop), then
        the frames it counted go to the statistics; returns them."""
        frames, failures = step()
        try:
            for index, error in failures:
                if final:
                    self.recovery.forgive(index, error)  # type: ignore[attr-defined]
                else:
                    self._recover(index, error, self.free)
        finally:
            # A failure's traceback holds the frames it passed, which may hold shared tensors
            # (each an open fd): not kept until the next garbage collection.
            failures.clear()
            error = None
        self.stats.note_free_frames(frames)
        return frames

    def _recover(self, index: int, error: BaseException, part: Gather | Repairable | None = None) -> None:
        """Replace member ``index`` (the recovery re-raises ``error`` when it may not), then have
        ``part`` (the gather by default) collect again what it lost, as often as replacements
        fail in turn."""
        part = self.gather if part is None else part
        while True:
            try:
                self.recovery.recover(index, error)
            except BaseException:
                self.gather.abandon()
                raise
            try:
                part.recovered(index)
                return
            except Exception as err:  # the replacement failed in turn
                failure = self._failure(err)
                if failure is None:
                    raise
                index, error = failure


class MemberStats:
    """Per-member accounting of one collector's batches (a member: a worker or a node).

    Example:
        >>> stats = MemberStats(2)
        >>> meta = batch_meta(4, 1, 1, (0.001, 0.002))
        >>> stats.note_batch([(0, {"frames": 4, "version": 1, "meta": meta})], version=1)
        >>> stats.worker_frames, stats.worker_versions, stats.lag
        ([4, 0], [1, 0], (0.0, 0))
    """

    def __init__(self, num_workers: int):
        self.num_workers = num_workers
        self.frames = 0  # frames collected (delivered, or written by the workers)
        self.batches = 0  # batches yielded (or written)
        self.worker_frames = [0] * num_workers
        self.worker_versions = [0] * num_workers
        self.pushed = [0] * num_workers  # the version last pushed to each worker
        self.worker_steps: list[tuple[float | None, float | None]] = [(None, None)] * num_workers  # env-step mean, p95
        self.version = 0  # the collector's policy version (the face tells it: note_version)
        # The last batch delivered, as reported: its parts' metadata, the version it was
        # delivered at and the frames kept of each part (None: all). Its policy lag and merged
        # metadata (``lag``, ``last_meta``) are computed when read, not for every batch.
        self.last_metas: list[dict] = []
        self.last_version = 0
        self.last_kept: list[int] | None = None
        self.wait_last_s = self.wait_total_s = 0.0  # the main process blocked waiting for the batches
        self.dropped = 0  # frames dropped by preemptive_threshold
        self.lag_dropped = [0] * num_workers  # frames dropped for being more than max_policy_lag behind
        self.lag_dropped_since = 0  # ... since the last batch delivered (its metadata)
        self.lost = [0] * num_workers  # batches a failed worker was filling
        self.started_at = time.perf_counter()
        self.last_batch_s = 0.0
        self.last_batch_frames = 0
        self.first_batch: tuple[int, float] | None = None  # (frames, seconds since started_at): fps_steady

    def note_batch(self, parts: list[tuple[int, dict]], version: int, waited: float | None = None,
                   started: float | None = None, kept: list[int] | None = None, *, workers: bool = True) -> None:
        """Account for the worker replies ``(worker, info)`` one batch is made of: the frames
        collected and delivered, per-worker frames, versions and env-step latency, the batch's
        policy lag behind ``version``, and ``waited``: the seconds the main process waited for
        it (None: not counted). ``started``: when the main process began the batch (its
        seconds, for ``fps_recent``; None: not timed). ``kept``: the frames of each part
        delivered when fewer than collected (``preemptive_threshold`` cut the batch): the rest
        count as dropped, and the lag is over the frames kept. ``workers`` False: the parts'
        versions and latencies are not the members' (a node reports its own: distributed/)."""
        metas = []
        for i, info in parts:
            if workers:
                self.note_worker(i, info)
            else:
                self.worker_frames[i] += info["frames"]
            metas.append(info["meta"])
        if waited is not None:
            self.wait_last_s = waited
            self.wait_total_s += waited
        self.last_metas, self.last_version, self.last_kept = metas, version, kept
        collected = sum(info["frames"] for _, info in parts)
        delivered = collected if kept is None else sum(kept)
        self.dropped += collected - delivered  # counted out: only delivered frames count
        self.frames += delivered
        self.batches += 1
        self.last_batch_frames = delivered
        if self.first_batch is None:
            self.first_batch = (collected, time.perf_counter() - self.started_at)
        if started is not None:
            self.last_batch_s = time.perf_counter() - started

    def note_worker(self, index: int, info: dict) -> None:
        """A reply of worker ``index`` (a batch, or what it wrote while running free)."""
        meta = info["meta"]
        self.worker_frames[index] += info["frames"]
        self.worker_versions[index] = info["version"]
        self.worker_steps[index] = (meta["step_mean_s"], meta["step_p95_s"])

    @property
    def lag(self) -> tuple[float, int]:
        """The policy lag of the last batch delivered (over the frames kept): mean, max."""
        metas, kept = self.last_metas, self.last_kept
        if not metas:
            return 0.0, 0
        return policy_lag(self.last_version, metas if kept is None else [{**m, "frames": k}
                                                                         for m, k in zip(metas, kept)])

    @property
    def last_meta(self) -> dict:
        """The last batch's metadata (its parts' merged), for an outer collector."""
        return merge_meta(self.last_metas) if self.last_metas else batch_meta(0, 0, 0.0, (None, None))

    @property
    def wait(self) -> BatchClock:
        """The time blocked waiting for the batches: the last batch's and the total."""
        clock = BatchClock()
        clock.last_s, clock.total_s = self.wait_last_s, self.wait_total_s
        return clock

    def note_version(self, version: int) -> None:
        """The collector's policy version moved to ``version``."""
        self.version = version

    def note_free_frames(self, frames: int) -> None:
        """Frames the workers running free wrote into the replay buffer (counted now)."""
        self.frames += frames

    def restore(self, frames: int, batches: int) -> None:
        """The counters of a loaded state (``load_state_dict``)."""
        self.frames, self.batches = frames, batches

    def note_frames(self, index: int, frames: int) -> None:
        """Frames worker ``index`` wrote before it failed (no reply of it tells them)."""
        self.worker_frames[index] += frames

    def note_lag_dropped(self, index: int, info: dict) -> None:
        """Worker ``index``'s batch ``info`` was dropped: too far behind the trainer."""
        self.lag_dropped[index] += info["frames"]
        self.lag_dropped_since += info["frames"]

    def take_lag_dropped(self) -> int:
        """The frames dropped for lag since the last call (what the batch delivered now reports)."""
        dropped, self.lag_dropped_since = self.lag_dropped_since, 0
        return dropped

    def note_lost(self, index: int, batches: int) -> None:
        """Worker ``index`` failed while filling ``batches`` batches."""
        self.lost[index] += batches

    def note_pushed(self, workers: Any, version: int) -> None:
        """Weights ``version`` went to ``workers``."""
        for i in workers:
            self.worker_versions[i] = version
            self.pushed[i] = version

    def batch_info(self) -> dict:
        """The last batch filled for an outer collector (this one nested in a worker or node):
        its frames' versions, and the env-step latency over every worker (the mean of their
        means, the largest of their p95s)."""
        steps = merge_meta([batch_meta(0, 0, 0.0, step) for step in self.worker_steps])
        return {**self.last_meta, "step_mean_s": steps["step_mean_s"], "step_p95_s": steps["step_p95_s"]}

    def summary(self, *, frames: int, batches: int, version: int, alive: list[bool], restarts: list[int],
                replay_buffer: Any, written: list[int] | None = None,
                members: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        """``stats()``'s dict (docs/observability.md defines every key), for both wings.
        ``written``: what each worker running free has written and not yet reported (added to
        the frames). ``members``: per member, what its wing knows of it first hand (a node's
        ``version``, env ``step`` latency and ``lost_batches``, from its handle) and keys of its
        own (a node's ``state``, ``host``, ``pid``), in that member's entry.

        Example:
            >>> stats = MemberStats(1)
            >>> out = stats.summary(frames=0, batches=0, version=0, alive=[True], restarts=[0], replay_buffer=None,
            ...                     members=[{"version": 2, "host": "h"}])
            >>> out["workers"][0]["policy_version"], out["workers"][0]["host"]
            (2, 'h')
        """
        elapsed = time.perf_counter() - self.started_at
        written = written or [0] * self.num_workers
        frames += sum(written)
        own = members or [{}] * self.num_workers
        workers = []
        for i in range(self.num_workers):
            extra = dict(own[i])
            workers.append({**worker_keys(i, frames=self.worker_frames[i] + written[i], alive=alive[i],
                                          restarts=restarts[i], version=extra.pop("version", self.worker_versions[i]),
                                          step=extra.pop("step", self.worker_steps[i]),
                                          lag_dropped_frames=self.lag_dropped[i],
                                          lost_batches=extra.pop("lost_batches", self.lost[i])), **extra})
        return stats_keys(
            frames=frames, batches=batches, elapsed=elapsed,
            recent_fps=self.last_batch_frames / self.last_batch_s if self.last_batch_s else 0.0,
            version=version, workers=workers, restarts=sum(restarts), dropped_frames=self.dropped,
            replay_buffer_write_count=getattr(replay_buffer, "write_count", None), lag=self.lag, wait=self.wait,
            first_batch=self.first_batch, lag_dropped_frames=sum(self.lag_dropped),
            lost_batches=sum(w["lost_batches"] for w in workers))
