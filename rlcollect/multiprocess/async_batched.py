"""``AsyncBatchedCollector``: torchrl 0.14's env pool + inference server collector by name, built
as ``MultiAsyncCollector(..., inference="central")`` with torchrl's arguments mapped.

torchrl runs ``len(create_env_fn)`` envs, ``envs_per_worker`` to a worker, and one inference
server that batches whatever observations are waiting. Ours is the same design: each worker
process steps ``envs_per_worker`` envs (our ``env_splits``: one env per split, stepped
alternately), and the main process's inference thread runs one forward over every waiting env.
What maps, what is accepted without effect, and what is refused is decided here, before any
process starts (``async_batched_options``); each refusal names the argument, the value and what
is accepted.

A batch is what torchrl yields: ``frames_per_batch`` transitions as a flat ``(frames,)`` batch
with ``"env_index"``. Ours are one worker's ``envs_per_worker`` envs over ``frames_per_batch /
envs_per_worker`` steps, flattened step by step (``FlatTransitions``), so the transitions come
in the order they were made, as torchrl's arrival order has them. With
``yield_completed_trajectories=True`` the collector yields each trajectory once it ends
(``Trajectories``), as torchrl's does.

Example:
    >>> opts = async_batched_options(["CartPole-v1"] * 4, policy=lambda observation: observation.sum(-1) > 0,
    ...                              frames_per_batch=64, envs_per_worker=2)
    >>> len(opts["create_env_fn"]), opts["env_splits"], opts["inference"], opts["max_wait_us"]
    (2, 2, 'central', 0.0)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

from rlcollect.buffers.replay import ReplayBuffer
from rlcollect.multiprocess.collector import MultiAsyncCollector

#: torchrl's backends that run envs in processes or threads of this machine: ours always runs
#: env workers in processes and the policy in a thread of this process, which is what each of
#: these gives (threads or processes only change where torchrl's envs step).
LOCAL_BACKENDS = (None, "threading", "multiprocessing")
#: torchrl's ``env_exchange`` values: ours always exchanges through shared memory.
ENV_EXCHANGES = ("auto", "shm", "queue")
#: torchrl's ``transport`` strings (a transport object is refused: ours is built in).
TRANSPORTS = (None, "auto", "driver")
#: torchrl's ``InferenceServerConfig.service_backend`` values that ours honours.
SERVICE_BACKENDS = ("thread",)


def _refuse(name: str, value: Any, accepted: str, why: str = "") -> ValueError:
    return ValueError(f"AsyncBatchedCollector: {name}={value!r} is not supported; accepted: {accepted}"
                      + (f" ({why})" if why else ""))


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"AsyncBatchedCollector: {name} must be a positive int, got {value!r}")
    return value


class EnvGroup:
    """One worker's env factories (and their keyword arguments): each call builds the next
    env of the group, in turn, so the worker's ``envs_per_worker`` splits get one each. The
    turn is not pickled: every worker process starts at the group's first env."""

    def __init__(self, fns: list[Callable], kwargs: list[dict]):
        self.fns, self.kwargs = list(fns), list(kwargs)
        self._turn = 0

    def __getstate__(self) -> dict:
        return {"fns": self.fns, "kwargs": self.kwargs, "_turn": 0}

    def __call__(self, **extra: Any) -> Any:
        i = self._turn % len(self.fns)
        self._turn += 1
        fn, kwargs = self.fns[i], {**self.kwargs[i], **extra}
        if isinstance(fn, str):  # a gymnasium id, as our collectors take it
            from rlcollect.envs.gym import GymEnv

            return GymEnv(fn, **kwargs)
        return fn(**kwargs)


class FlatTransitions:
    """The ``postproc`` that gives a worker's batch ``(*rows, T)`` torchrl's layout: a flat
    ``(rows * T,)`` batch in step order (step 0 of every env, then step 1, ...) with
    ``"env_index"`` (the env's position in ``create_env_fn``: worker ``w``'s rows are
    ``w * rows ...``) and ``"policy_version"`` the version that acted (torchrl's server writes
    that; our collectors write the version when the observation came there); cut to the
    frames left of ``total_frames`` (when > 0); then the user's ``postproc``."""

    def __init__(self, total_frames: int, postproc: Callable | None):
        self.total_frames, self.postproc = total_frames, postproc
        self.delivered = 0

    def __call__(self, batch: Any) -> Any:
        steps = batch.shape[-1]
        batch = batch.reshape(-1, steps).clone(False)  # (rows, T): an unbatched env's (T,) is one row; a new dict
        rows = batch.shape[0]
        worker = batch.get(("collector", "worker_id"))[0, 0]
        index = worker * rows + torch.arange(rows, device=worker.device)
        batch.set("env_index", index[:, None].expand(rows, steps))
        if ("next", "policy_version") in batch.keys(True):  # torchrl's: the version that acted
            batch.set("policy_version", batch.get(("next", "policy_version")))
        flat = batch.apply(lambda t: t.transpose(0, 1).reshape(rows * steps, *t.shape[2:]),
                           batch_size=[rows * steps])
        if self.total_frames > 0:
            left = max(self.total_frames - self.delivered, 0)
            if flat.shape[0] > left:
                flat = flat[:left]
        self.delivered += flat.shape[0]
        return flat if self.postproc is None else self.postproc(flat)


class Trajectories:
    """``yield_completed_trajectories=True``: the flat batches cut into the trajectories they
    complete, each ``(L,)`` in step order, in the order they ended; each then goes through
    ``postproc``, ``post_collect_hook`` and into ``replay_buffer`` (None is yielded) as a
    batch would. Unfinished trajectories wait for their next frames; the collector stops once
    ``total_frames`` (when > 0) frames were delivered in whole trajectories."""

    def __init__(self, total_frames: int, postproc: Callable | None, hook: Callable | None, replay_buffer: Any):
        self.total_frames, self.postproc, self.hook, self.replay_buffer = total_frames, postproc, hook, replay_buffer
        self.pending: dict[int, list] = {}
        self.delivered = 0

    def done(self) -> bool:
        return 0 < self.total_frames <= self.delivered

    def cut(self, batch: Any) -> list:
        """The trajectories ``batch`` completes, with what it leaves unfinished kept."""
        ended = []
        env_index = batch.get("env_index")
        done = batch.get(("next", "done")).reshape(batch.shape[0], -1).any(-1)
        for env in env_index.unique().tolist():
            rows = (env_index == env).nonzero().squeeze(-1)
            start = 0
            for end in (done[rows].nonzero().squeeze(-1) + 1).tolist():
                pieces = self.pending.pop(env, []) + [batch[rows[start:end]]]
                ended.append((rows[end - 1].item(), torch.cat(pieces)))
                start = end
            if start < rows.numel():
                self.pending.setdefault(env, []).append(batch[rows[start:]])
        return [trajectory for _, trajectory in sorted(ended, key=lambda pair: pair[0])]

    def deliver(self, trajectory: Any) -> Any:
        self.delivered += trajectory.shape[0]
        if self.postproc is not None:
            trajectory = self.postproc(trajectory)
        if self.hook is not None:
            self.hook(trajectory)
        if self.replay_buffer is None:
            return trajectory
        self.replay_buffer.extend(trajectory)
        return None


def _server_settings(server_config: Any, max_batch_size: Any, min_batch_size: Any,
                     server_timeout: Any) -> tuple[Any, int, float]:
    """(max_batch_size, min_batch_size, timeout) from torchrl's keywords or ``server_config``
    (an ``InferenceServerConfig``, read by its field names); refuses what ours cannot do."""
    if server_config is None:
        return max_batch_size, 1 if min_batch_size is None else min_batch_size, \
            0.01 if server_timeout is None else server_timeout
    if any(v is not None for v in (max_batch_size, min_batch_size, server_timeout)):
        raise ValueError("AsyncBatchedCollector: server_config is mutually exclusive with max_batch_size, "
                         "min_batch_size and server_timeout (as in torchrl)")
    backend = getattr(server_config, "service_backend", "thread")
    if backend not in SERVICE_BACKENDS:
        raise _refuse("server_config.service_backend", backend, "'thread'",
                      "the policy always acts in a thread of this process")
    static = getattr(server_config, "static_batch_size", None)
    if static is not None:
        raise _refuse("server_config.static_batch_size", static, "None", "no CUDA-graph capture of the policy")
    inflight = getattr(server_config, "max_inflight_per_env", None)
    if inflight is not None:
        _positive_int("server_config.max_inflight_per_env", inflight)  # ours: one request per env at a time
    return (getattr(server_config, "max_batch_size", 64), getattr(server_config, "min_batch_size", 1),
            getattr(server_config, "timeout", 0.01))


def _devices(device: Any, device_config: Any) -> dict[str, Any]:
    """Our ``policy_device`` / ``env_device`` / ``storing_device`` from torchrl's ``device`` or
    ``device_config`` (an ``InferenceDeviceConfig``, read by its field names)."""
    if device_config is None:
        return {"policy_device": device}
    if device is not None:
        raise ValueError("AsyncBatchedCollector: device and device_config are mutually exclusive (as in torchrl)")
    output = getattr(device_config, "output_device", None)
    policy = getattr(device_config, "policy_device", None)
    if output is not None and str(output) != str(getattr(device_config, "storing_device", None) or "cpu"):
        raise _refuse("device_config.output_device", output, "None or the storing_device",
                      "the policy's outputs are written next to the observations")
    return {"policy_device": policy, "env_device": getattr(device_config, "env_device", None),
            "storing_device": getattr(device_config, "storing_device", None)}


def async_batched_options(
    create_env_fn: Any,
    *,
    policy: Any = None,
    policy_factory: Callable | None = None,
    frames_per_batch: int,
    total_frames: int = -1,
    max_batch_size: int | None = None,
    min_batch_size: int | None = None,
    server_timeout: float | None = None,
    transport: Any = None,
    device: Any = None,
    backend: str | None = None,
    env_backend: str | None = None,
    env_exchange: str = "auto",
    envs_per_worker: int = 1,
    transition_chunk_size: int | str = "auto",
    policy_backend: str | None = None,
    reset_at_each_iter: bool = False,
    postproc: Callable | None = None,
    exploration_type: Any = "random",
    replay_buffer: Any = None,
    post_collect_hook: Callable | None = None,
    yield_completed_trajectories: bool = False,
    weight_sync: Any = None,
    weight_sync_model_id: str = "policy",
    verbose: bool = False,
    create_env_kwargs: dict | list | None = None,
    worker_affinity: Any = None,
    driver_affinity: Any = None,
    server_config: Any = None,
    device_config: Any = None,
    policy_version: int = 0,
    policy_version_key: Any = "policy_version",
) -> dict[str, Any]:
    """torchrl's ``AsyncBatchedCollector`` arguments as ``MultiAsyncCollector`` keyword
    arguments (plus ``"policy_version"``, the initial version), or the error of the first one
    ours cannot honour. The parameters are ``AsyncBatchedCollector``'s."""
    if isinstance(create_env_fn, (str, bytes)) or not isinstance(create_env_fn, Sequence) or not create_env_fn:
        raise TypeError(f"AsyncBatchedCollector: create_env_fn must be a non-empty list of env factories (one per "
                        f"env), got {create_env_fn!r}")
    fns = list(create_env_fn)
    n = len(fns)
    if (policy is None) == (policy_factory is None):
        raise TypeError("AsyncBatchedCollector: give exactly one of policy and policy_factory (got "
                        f"{'both' if policy is not None else 'neither'})")
    k = _positive_int("envs_per_worker", envs_per_worker)
    if n % k:
        raise _refuse("envs_per_worker", k, f"a divisor of len(create_env_fn)={n}",
                      "every worker steps the same number of envs")
    fpb = _positive_int("frames_per_batch", frames_per_batch)
    if fpb % k:
        raise _refuse("frames_per_batch", fpb, f"a multiple of envs_per_worker={k}",
                      "a batch is one worker's envs over the same number of steps")
    if total_frames is not None and (isinstance(total_frames, bool) or not isinstance(total_frames, int)):
        raise ValueError(f"AsyncBatchedCollector: total_frames must be an int (-1: endless), got {total_frames!r}")
    if create_env_kwargs is None or isinstance(create_env_kwargs, Mapping):
        kwargs = [dict(create_env_kwargs or {})] * n
    elif isinstance(create_env_kwargs, Sequence) and len(create_env_kwargs) == n \
            and all(isinstance(kw, Mapping) for kw in create_env_kwargs):
        kwargs = [dict(kw) for kw in create_env_kwargs]
    else:
        raise ValueError(f"AsyncBatchedCollector: create_env_kwargs must be None, a dict or a list of {n} dicts, got "
                         f"{create_env_kwargs!r}")
    for name, value in (("backend", backend), ("env_backend", env_backend), ("policy_backend", policy_backend)):
        if value not in LOCAL_BACKENDS:
            raise _refuse(name, value, "None, 'threading' or 'multiprocessing'",
                          "envs step in worker processes, the policy in a thread of this process")
    if env_exchange not in ENV_EXCHANGES:
        raise _refuse("env_exchange", env_exchange, "'auto', 'shm' or 'queue'")
    if not (transport is None or isinstance(transport, str)) or transport not in TRANSPORTS:
        raise _refuse("transport", transport, "None, 'auto' or 'driver'",
                      "the transport is built in: shared memory and one-byte pipe messages")
    if transition_chunk_size != "auto":
        _positive_int("transition_chunk_size", transition_chunk_size)  # ours: whole batches
    if not isinstance(yield_completed_trajectories, bool):
        raise TypeError(f"AsyncBatchedCollector: yield_completed_trajectories must be True or False, got "
                        f"{yield_completed_trajectories!r}")
    if weight_sync is not None:
        raise _refuse("weight_sync", weight_sync, "None", "the policy object acts in this process: an update "
                      "is seen by the next forward (update_policy_weights_ moves the version)")
    for name, value in (("worker_affinity", worker_affinity), ("driver_affinity", driver_affinity)):
        if value is not None:
            raise _refuse(name, value, "None", "set the affinity inside create_env_fn with os.sched_setaffinity")
    if not isinstance(verbose, bool):
        raise TypeError(f"AsyncBatchedCollector: verbose must be True or False, got {verbose!r}")
    if not isinstance(weight_sync_model_id, str):
        raise TypeError(f"AsyncBatchedCollector: weight_sync_model_id must be a str, got {weight_sync_model_id!r}")
    if policy_version_key not in ("policy_version", None):
        raise _refuse("policy_version_key", policy_version_key, "'policy_version' or None")
    if isinstance(policy_version, bool) or not isinstance(policy_version, int) or policy_version < 0:
        raise ValueError(f"AsyncBatchedCollector: policy_version must be an int >= 0, got {policy_version!r}")
    cap, least, timeout = _server_settings(server_config, max_batch_size, min_batch_size, server_timeout)
    if cap is not None and (_positive_int("max_batch_size", cap) < n):
        raise _refuse("max_batch_size", cap, f"None or at least len(create_env_fn)={n}",
                      "one forward serves every env that is waiting")
    least = _positive_int("min_batch_size", least)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not math.isfinite(timeout) \
            or timeout < 0:
        raise ValueError(f"AsyncBatchedCollector: server_timeout must be a number of seconds >= 0, got {timeout!r}")
    groups = [EnvGroup(fns[w * k:(w + 1) * k], kwargs[w * k:(w + 1) * k]) for w in range(n // k)]
    # The workers write an rlcollect ReplayBuffer themselves, each its own batches: no cut there.
    cut = -1 if isinstance(replay_buffer, ReplayBuffer) or total_frames is None or total_frames < 0 \
        else total_frames
    trajectories = None
    if yield_completed_trajectories:  # whole trajectories are cut and delivered by the collector itself
        trajectories = Trajectories(-1 if total_frames is None else total_frames, postproc, post_collect_hook,
                                    replay_buffer)
        cut, total_frames, postproc, post_collect_hook, replay_buffer = -1, -1, None, None, None
    return {
        "create_env_fn": groups,
        # torchrl's policy_factory builds the policy of its thread server once: so do we, here.
        "policy": policy if policy is not None else policy_factory(),
        "frames_per_batch": fpb,
        # Whole batches up to total_frames; FlatTransitions cuts the last one (as torchrl does).
        "total_frames": total_frames if cut < 0 else -(-cut // fpb) * fpb,
        **_devices(device, device_config),
        "inference": "central",
        "env_splits": k,
        # min_batch_size > 1: wait up to server_timeout for more envs (ours: for all of them).
        "max_wait_us": 0.0 if least == 1 else float(timeout) * 1e6,
        "reset_at_each_iter": reset_at_each_iter,
        "postproc": FlatTransitions(cut, postproc),
        "exploration_type": exploration_type,
        "replay_buffer": replay_buffer,
        "post_collect_hook": post_collect_hook,
        "track_policy_version": policy_version_key is not None,
        "policy_version": policy_version,
        "trajectories": trajectories,
    }


class AsyncBatchedCollector(MultiAsyncCollector):
    """torchrl 0.14's ``AsyncBatchedCollector`` (an env pool and an inference server) by name:
    ``MultiAsyncCollector(..., inference="central")`` taking torchrl's keyword arguments, its
    batches in torchrl's layout. ``len(create_env_fn) / envs_per_worker`` worker processes
    each step ``envs_per_worker`` envs (alternately, ``env_splits``); the main process runs one
    forward of ``policy`` over every env waiting for an action. Each batch is one worker's
    ``frames_per_batch`` transitions, flat ``(frames_per_batch,)``, step by step, with
    ``"env_index"`` (the env's position in ``create_env_fn``). Every method is
    ``MultiAsyncCollector``'s.

    Args:
        create_env_fn (list[callable | str]): one env factory per env, returning a torchrl or
            rlcollect env (or a gymnasium id, built as ``GymEnv(id)``). Required.
        policy (nn.Module | TensorDictModule | callable | None): the policy, run in this
            process for every env. One of ``policy`` and ``policy_factory`` is required.
        policy_factory (callable | None): called once, here, to build the policy.
        frames_per_batch (int): transitions per batch; a multiple of ``envs_per_worker``.
            Required.
        total_frames (int): frames over the collector's life; the last batch is cut to it
            (unless the workers write an rlcollect ``ReplayBuffer``); -1 (default) or None:
            endless.
        max_batch_size (int | None): the most envs one forward serves: None (default) or at
            least ``len(create_env_fn)`` (ours serves every waiting env in one forward).
        min_batch_size (int | None): None or 1 (default): a forward starts once one env
            waits; more: it waits up to ``server_timeout`` for the other envs.
        server_timeout (float | None): seconds a forward waits for more envs when
            ``min_batch_size`` > 1 (default None: 0.01).
        transport (str | None): None (default), ``"auto"`` or ``"driver"``: ours is built in
            (shared memory); a torchrl transport object is refused.
        device (str | torch.device | None): where the policy runs (default None: CPU).
        backend (str | None): None (default), ``"threading"`` or ``"multiprocessing"``: envs
            always step in worker processes here; ``"ray"`` and ``"monarch"`` are refused.
        env_backend (str | None): as ``backend``, for the envs (default None).
        env_exchange (str): ``"auto"`` (default), ``"shm"`` or ``"queue"``: accepted, ours
            always exchanges through shared memory.
        envs_per_worker (int): envs per worker process (default 1); divides
            ``len(create_env_fn)``.
        transition_chunk_size (int | str): ``"auto"`` (default) or a positive int: accepted,
            ours delivers a worker's whole batch at once.
        policy_backend (str | None): as ``backend``, for the policy (default None): the policy
            always runs in a thread of this process.
        reset_at_each_iter (bool): reset every env at the start of each batch (default False).
        postproc (callable | None): applied to each flat batch before it is yielded or
            written (default None).
        exploration_type (ExplorationType | str): the interaction mode of each forward
            (default ``"random"``).
        replay_buffer (object | None): batches go there and iteration yields None (default
            None).
        post_collect_hook (callable | None): called with each batch after ``postproc``
            (default None).
        yield_completed_trajectories (bool): yield each trajectory once it ends, ``(L,)``
            in step order, instead of batches; ``total_frames`` then stops the collector once
            that many frames were yielded in whole trajectories (default False).
        weight_sync (None): only None (default): the policy acts here, no weights to sync.
        weight_sync_model_id (str): accepted, without effect (default ``"policy"``).
        verbose (bool): accepted, without effect; the ``"rlcollect"`` logger logs (default
            False).
        create_env_kwargs (dict | list[dict] | None): keyword arguments of every factory, or
            one dict per env (default None).
        worker_affinity (None): only None (default).
        driver_affinity (None): only None (default).
        server_config (object | None): torchrl's ``InferenceServerConfig`` (its
            ``max_batch_size``, ``min_batch_size``, ``timeout`` as above;
            ``service_backend="thread"`` and ``static_batch_size=None`` only); exclusive with
            the three keywords (default None).
        device_config (object | None): torchrl's ``InferenceDeviceConfig``: its
            ``policy_device``, ``env_device``, ``storing_device``; ``output_device`` None or
            the storing device; exclusive with ``device`` (default None).
        policy_version (int): the initial policy version (default 0).
        policy_version_key (str | None): ``"policy_version"`` (default) writes the version
            that acted on each step as ``"policy_version"`` (and ``("next",
            "policy_version")``); None writes none.

    Example:
        >>> import torch
        >>> from rlcollect import AsyncBatchedCollector
        >>> policy = torch.nn.Linear(4, 2)
        >>> collector = AsyncBatchedCollector(
        ...     create_env_fn=["CartPole-v1"] * 4, policy=lambda observation: policy(observation).argmax(-1),
        ...     frames_per_batch=40, total_frames=100, envs_per_worker=2)
        >>> batches = list(collector)
        >>> [batch.shape[0] for batch in batches]
        [40, 40, 20]
        >>> sorted(set(batches[0]["env_index"].tolist())) in ([0, 1], [2, 3])
        True
        >>> collector.shutdown()
    """

    def __init__(self, create_env_fn: list, *, policy: Any = None, policy_factory: Callable | None = None,
                 frames_per_batch: int, total_frames: int = -1, max_batch_size: int | None = None,
                 min_batch_size: int | None = None, server_timeout: float | None = None, transport: Any = None,
                 device: Any = None, backend: str | None = None, env_backend: str | None = None,
                 env_exchange: str = "auto", envs_per_worker: int = 1, transition_chunk_size: int | str = "auto",
                 policy_backend: str | None = None, reset_at_each_iter: bool = False,
                 postproc: Callable | None = None, exploration_type: Any = "random", replay_buffer: Any = None,
                 post_collect_hook: Callable | None = None, yield_completed_trajectories: bool = False,
                 weight_sync: Any = None, weight_sync_model_id: str = "policy", verbose: bool = False,
                 create_env_kwargs: dict | list | None = None, worker_affinity: Any = None,
                 driver_affinity: Any = None, server_config: Any = None, device_config: Any = None,
                 policy_version: int = 0, policy_version_key: Any = "policy_version"):
        args = {name: value for name, value in locals().items() if name not in ("self", "__class__")}
        options = async_batched_options(**args)
        version = options.pop("policy_version")
        self._trajectories = options.pop("trajectories")
        super().__init__(**options)
        for _ in range(version):
            self.increment_version()

    def __iter__(self) -> Iterator[Any]:
        trajectories = self._trajectories
        if trajectories is None:
            yield from super().__iter__()
            return
        batches = super().__iter__()
        try:
            for batch in batches:
                for trajectory in trajectories.cut(batch):
                    yield trajectories.deliver(trajectory)
                    if trajectories.done():
                        return
        finally:
            batches.close()
