"""The worker process: builds its inner collector, then serves commands from its pipe.

Each command has a small handler in ``_Worker.handlers``; every command gets exactly one reply.
A watchdog thread ends the process within ~0.2 s of the main process dying, whatever the main
thread is doing.
"""

from __future__ import annotations

import multiprocessing.util
import os
import random
import signal
import sys
import threading
import time
from typing import Any

import cloudpickle
import numpy as np
import torch
import torch.multiprocessing  # noqa: F401  (registers the shared-memory tensor reductions)

from rlcollect import _context
from rlcollect._pids import pid_alive
from rlcollect.data import BatchLayout, deliver, slot_buffer, with_mask
from rlcollect.inference.client import RemotePolicy, yield_on_wake
from rlcollect.multiprocess import protocol as P

_WATCHDOG_PERIOD_S = 0.1


def _watch_parent(parent_pid: int) -> None:
    # Watch the main process itself rather than os.getppid(): with "forkserver" the parent is
    # the fork server, so getppid() never equals the main process's pid.
    while True:
        time.sleep(_WATCHDOG_PERIOD_S)
        if not pid_alive(parent_pid):
            os._exit(0)


def _exit_now() -> None:
    # Skip the interpreter's teardown: its final garbage collection walks torch's whole object
    # graph, which takes seconds on a loaded machine while shutdown() waits for this exit.
    # Everything this process owns has been closed by then.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _lead_own_group() -> None:
    # Every process the env starts (a simulator server, and what that starts) joins this
    # process's group unless it leaves it (setsid): the pool ends the group once this worker is
    # gone, however it ended (pool.py), and its guard process does when it dies unasked
    # (reaper.py), so that no such process outlives its worker.
    try:
        os.setpgid(0, 0)
    except OSError:
        pass  # already a session or group leader


def _ignore_ctrl_c() -> None:
    # Ctrl-C reaches every process of the terminal's foreground group; the main process handles
    # it and shuts the workers down. The pool starts workers with SIGINT blocked (pool.py), so
    # one pressed during start-up is still pending: ignoring it first discards it, silently.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def _unlink_then_die(signum: int, frame: Any) -> None:
    # The pool terminates a worker that has not exited within most of the shutdown timeout (one
    # still closing a torchrl ParallelEnv, say, which waits for its own processes). Dying by the
    # signal's default action would leave the named semaphores this process made (the
    # ParallelEnv's events) in /dev/shm until the resource tracker exits: run multiprocessing's
    # exit finalizers, which unlink them, then die of SIGTERM as before. If a finalizer blocks,
    # the pool's SIGKILL follows.
    try:
        multiprocessing.util._run_finalizers(0)  # what a normal exit runs first; no public equivalent
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)


def _fresh_random_state() -> None:
    """Seed torch's, numpy's and Python's global generators from the OS, as a fresh interpreter
    does: a forked worker (from the main process or the fork server) starts with its parent's
    states, so every worker would otherwise draw the same random numbers (the same exploration
    noise in a stochastic policy). ``set_seed`` then gives each worker a reproducible stream."""
    torch.seed()
    np.random.seed()
    random.seed()


def worker_main(index: int, payload: bytes, conn: Any, parent_pid: int, num_threads: int,
                environ: dict[str, str] | None = None, inference: list | None = None) -> None:
    """Entry point of a worker process (the target of ``multiprocessing.Process``).

    ``environ`` (forked from a fork server): the main process's environment when the worker was
    started, taken before the payload is unpickled and the env is built. ``inference`` (central
    inference): the worker's pipes to the main process's inference loop, one per env split."""
    _lead_own_group()
    _ignore_ctrl_c()
    signal.signal(signal.SIGTERM, _unlink_then_die)
    if inference:
        yield_on_wake()  # before any thread starts: they inherit it
    if environ is not None:
        os.environ.clear()
        os.environ.update(environ)
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True, name="rlcollect-watchdog").start()
    torch.set_num_threads(num_threads)
    _fresh_random_state()
    _context._worker_index = index
    try:
        spec = cloudpickle.loads(payload)
        if spec.get("init_fn") is not None:  # torchrl's init_fn: this process's set-up, before env and policy
            spec["init_fn"]()
        worker = _Worker(index, spec, conn, inference)
    except BaseException as exc:  # noqa: BLE001  (every start-up failure must reach the main process)
        try:
            conn.send((P.ERROR, P.pack_exception(exc, index)))
        except OSError:
            pass  # the main process is already gone or has given up on this worker
        conn.close()
        _exit_now()
    try:
        conn.send((P.READY, worker.describe()))
        worker.serve()
    except OSError:
        pass  # the main process closed this worker's pipe: it gave up on it, or is gone
    finally:
        worker.close()
        conn.close()
    _exit_now()


class _Worker:
    def __init__(self, index: int, spec: dict, conn: Any, inference: list | None = None):
        self.index = index
        self.conn = conn
        self.weights = None
        cls = spec["collector_class"]
        # Central inference (rlcollect/inference/): the policy is the main process's, asked
        # through these pipes; the collector's rollouts call it through RemoteRunners.
        self.remote = RemotePolicy(inference) if inference else None
        policy = self.remote if self.remote is not None else spec["policy"]
        self.collector = cls(spec["create_env_fn"], policy, **spec["kwargs"])
        if spec.get("seed") is not None:  # a restarted worker starts from a fresh seed
            self.collector.set_seed(spec["seed"])
        # Driven only through rlcollect/source.py's BatchSource calls: a Collector, or a nested
        # multi-process collector.
        self.version = 0
        self.model_version = 0  # the last version of a model other than "policy" (weight_sync_schemes)
        self.layout = with_mask(self.collector.layout) if spec.get("preemptive") else self.collector.layout
        self.slots: list = []
        self.stop = None
        # Writing straight into a shared replay buffer (docs/replay-buffer.md): what the main process would
        # otherwise do after receiving the batch, done here, so no batch crosses the pipe.
        self.replay_buffer = spec.get("replay_buffer")
        self.write_options = spec.get("write_options", {})
        self._deferred: list = []
        self.handlers = {
            P.ATTACH: self.attach,
            P.COLLECT: self.collect,
            P.SEED: self.collector.set_seed,
            P.RESET: self.collector.reset,
            P.STATE_DICT: self.collector.state_dict,
            P.LOAD_STATE_DICT: self.collector.load_state_dict,
            P.UPDATE_WEIGHTS: self.update_weights,
            P.GETATTR_POLICY: self.getattr_policy,
            P.GETATTR_ENV: self.getattr_env,
            P.GET_WEIGHTS: self.get_weights,
            P.ENABLE_PROFILE: self.enable_profile,
            P.RUN_FREE: self.run_free,
            P.PAUSE: self.pause,
        }

    def describe(self) -> dict:
        return {"layout": self.layout, "pid": os.getpid(), "weights": self.collector.weight_spec,
                "inference": None if self.remote is None else self.remote.specs()}

    def _pull_weights(self) -> None:
        if self.weights is not None:
            version = self.weights.read_into(self.collector.weights_module(), self.version)
            if version != self.version:
                self.version = version
                self._adopt(None, version)

    def _adopt(self, state: dict | None, version: int) -> None:
        """Make the inner collector act with the policy weights ``state`` (None: read into its
        module in place), version ``version``."""
        # an extra model may have moved the version further
        self.collector.set_weights(state, max(version, self.model_version))

    # -- handlers ------------------------------------------------------------------------------
    def attach(self, flats: list, stop: torch.Tensor | None, weights: Any, inference: tuple | None = None,
               layout: BatchLayout | None = None) -> None:
        """Take the shared slots (``flats``), stop flag, weight store and central-inference
        rows.  ``layout``: the one the main process allocated the slots with, which this
        worker's must equal entry by entry; the worker then writes in its order (a worker whose
        env lists the same entries in another order, as torchrl's composite specs can between
        spawned processes, would otherwise put each entry where another belongs)."""
        if layout is not None:
            if layout != self.layout:
                raise RuntimeError(f"this worker's batch layout differs from the one its slots were allocated "
                                   f"with: {sorted(map(str, self.layout.fields))} vs "
                                   f"{sorted(map(str, layout.fields))}")
            self.layout = layout
        self.slots = [slot_buffer(flat, self.layout) for flat in flats]
        if inference is not None:
            self.remote.attach(*inference)
        self.stop = None if stop is None else stop.numpy()
        if weights is not None:
            self.weights = weights
            self.version = -1  # take the store's weights before the first batch

    def enable_profile(self, path: str, rollouts: tuple, profiler_kwargs: dict) -> None:
        self.collector.enable_profile(path, rollouts=rollouts, **profiler_kwargs)

    def get_weights(self, model_id: str = "policy") -> dict:
        module = self.collector.weights_module(model_id)
        return {k: v.detach().cpu().numpy() for k, v in module.state_dict().items()}

    def collect(self, slot: int, random: bool) -> dict:
        self._pull_weights()
        version = self.collector.policy_version
        started = time.perf_counter()
        frames = self.collector.collect_into(self.slots[slot], random=random, stop=self.stop)
        if self.replay_buffer is not None:
            self._write(self.slots[slot], frames)
        # meta (rlcollect/metrics.py): the frames' versions and the env-step latency, for stats()
        return {"slot": slot, "frames": frames, "version": version, "seconds": time.perf_counter() - started,
                "meta": self.collector.batch_info()}

    def _write(self, buffer: Any, frames: int) -> None:
        """Put a collected batch into the replay buffer (postproc first; only valid frames)."""
        layout = self.layout
        steps = frames // max(1, layout.rows)
        if steps == 0:
            return
        batch = buffer.td if steps == layout.time else buffer.td[..., :steps]
        options = self.write_options
        deliver(batch, split_trajs=options.get("split_trajs", False), postproc=options.get("postproc"),
                replay_buffer=self.replay_buffer, extend_buffer=options.get("extend_buffer", True))

    def run_free(self, init_random_frames: int) -> dict:
        """Collect into the replay buffer until a command arrives (it is served next)."""
        if self.replay_buffer is None:
            raise RuntimeError(f"worker {self.index}: run_free needs a replay buffer the worker can write to")
        batches = frames = 0
        while not self.conn.poll():
            random = self.replay_buffer.write_count < init_random_frames
            info = self.collect(0, random)
            batches += 1
            frames += info["frames"]
            if self.stop is not None:  # read by the main process if this one is killed
                self.stop[P.FREE_FRAMES] = frames
        self._deferred.append(self.conn.recv())
        return {"batches": batches, "frames": frames, "version": self.collector.policy_version,
                "meta": self.collector.batch_info()}

    def pause(self) -> None:
        """Nothing to do: a paused worker is one that is not running free."""

    def update_weights(self, state: dict, version: int, model_id: str = "policy") -> None:
        if model_id != "policy":
            # The shared store was written before this message was sent: apply it first, so
            # that it cannot overwrite this newer update of a part of the policy afterwards.
            self._pull_weights()
        tensors = {k: torch.from_numpy(v) for k, v in state.items()}
        if model_id == "policy":
            self._adopt(tensors, version)
            self.version = version
        else:
            # Not self.version: that tracks the shared policy store, which may hold this version
            # too and must still be read before the next batch.
            self.collector.set_weights(tensors, max(self.collector.policy_version, version), model_id)
            self.model_version = version

    def getattr_policy(self, name: str) -> Any:
        return getattr(self.collector.policy, name)

    def getattr_env(self, name: str) -> Any:
        return self.collector.getattr_env(name)

    # -- loop ------------------------------------------------------------------------------------
    def serve(self) -> None:
        conn = self.conn
        while True:
            try:
                command, args = self._deferred.pop(0) if self._deferred else conn.recv()
            except (EOFError, OSError):
                return  # the main process is gone
            except Exception:  # noqa: BLE001  (a message cut short: the main process was interrupted mid-send)
                return
            if command == P.CLOSE:
                conn.send((P.OK, None))
                return
            handler = self.handlers.get(command)
            try:
                if handler is None:
                    raise ValueError(f"unknown worker command {command!r}; known: {sorted(self.handlers)}")
                result = handler(*args)
            except Exception as exc:  # noqa: BLE001  (sent back and re-raised in the main process)
                conn.send((P.ERROR, P.pack_exception(exc, self.index)))
            else:
                self._reply(command, result)

    def _reply(self, command: str, result: Any) -> None:
        try:
            self.conn.send((P.OK, result))
        except OSError:
            raise
        except Exception as exc:  # noqa: BLE001  (pickled before anything is written: nothing was sent)
            # e.g. getattr_policy of a sub-module whose class only the worker can import: the
            # worker must answer (and live on) rather than die with the reply unsent.
            error = TypeError(f"the reply to {command!r} ({type(result).__name__}) cannot be pickled back to the main "
                              f"process: {type(exc).__name__}: {exc}")
            self.conn.send((P.ERROR, P.pack_exception(error, self.index)))

    def close(self) -> None:
        try:
            self.collector.shutdown()
        except Exception:  # noqa: BLE001  (closing on the way out must not mask the real error)
            pass
