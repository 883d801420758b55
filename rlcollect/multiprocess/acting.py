"""Where the policy of a multi-process collector acts, behind one interface: ``InWorkers``
(each worker runs its own copy; the collector keeps their weights in sync, docs/weight-sync.md)
or ``Central`` (``inference="central"``: the main process runs the policy for every worker,
rlcollect/inference/). ``acting_for(config)`` picks one; nothing else in the collector knows
which.

The interface, in the order a collector uses it:

- ``channels(context)`` / ``start_guard``: what the ``WorkerPool`` needs to start a worker
  (central: the pipes to the inference loop, and the loop's lock); ``start(pool, models)``
  once the workers have started and reported;
- ``store_for(i)`` / ``attachment(i)``: what worker ``i`` is handed with its slots;
- ``plan(models, worker_ids)`` (everything checked before anything is sent),
  ``shared(model_id)`` (written without pausing the workers), ``push(model_id, targets,
  version)``; ``resend(i)`` (a restarted worker); ``set_weights(state, version, push)`` (an
  outer worker's call); ``lock`` (held while the version moves), ``set_version(v)``,
  ``updating(update, bump)``;
- ``local_policy`` (the module acting in this process, or None), ``module()``, ``get_model``,
  ``cached``, ``weight_spec``, ``shared_weights``, ``check_models()``;
- ``fatal_error`` (the error after which nothing can go on), ``stats()``, ``close()``.

Example:
    >>> import torch
    >>> from rlcollect.multiprocess.shm import allocate_slot
    >>> central = CentralInference(torch.nn.Linear(4, 2), splits=2, device=None, exploration_type="random",
    ...                            allocate=allocate_slot)
    >>> central.set_weights({"weight": torch.ones(2, 4), "bias": torch.zeros(2)}, version=3)
    >>> central.version, central.policy.weight.sum().item()
    (3, 8.0)
    >>> central.close()
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from rlcollect.inference.server import InferenceServer
from rlcollect.multiprocess import protocol as P
from rlcollect.multiprocess.shm import allocate_slot
from rlcollect.policy import has_weights, load_weights
from rlcollect.weights.local import acting_policy
from rlcollect.weights.models import UnknownModelError, resolve_model
from rlcollect.weights.schemes import NoWeightSyncScheme
from rlcollect.weights.store import SharedWeights, as_state_dict


def acting_for(config: Any) -> InWorkers | Central:
    """Where ``config``'s policy acts (``config.inference``)."""
    return Central(config) if config.inference == "central" else InWorkers(config)


class InWorkers:
    """Each worker acts with its own copy of the policy; ``WorkerWeights`` keeps it in sync.

    Args:
        config: the collector's ``MultiConfig``.
    """

    start_guard = None
    lock = contextlib.nullcontext()
    local_policy = None
    fatal_error = None

    def __init__(self, config: Any):
        self.config = config
        self.weights: WorkerWeights | None = None

    def channels(self, context: Any) -> None:
        return None

    def start(self, pool: Any, models: Any) -> None:
        """Once the workers have started: their weight stores (``models``: a weak reference to
        the collector, where extra model ids are looked up)."""
        cfg = self.config
        self.weights = WorkerWeights(pool, cfg.schemes, cfg.policy, cfg.weight_source, cfg.per_worker_weights,
                                     queued=not cfg.sync, models=models)

    def store_for(self, index: int) -> Any:
        return self.weights.store_for(index)

    def attachment(self, index: int) -> None:
        return None

    def check_models(self) -> None:
        self.weights.check_models()

    def plan(self, models: dict[str, Any], worker_ids: Any) -> list[tuple[str, dict[int, Any]]]:
        return self.weights.plan(models, worker_ids)

    def shared(self, model_id: str) -> bool:
        return self.weights.shared(model_id)

    def push(self, model_id: str, targets: dict[int, Any], version: int) -> None:
        self.weights.push(model_id, targets, version)

    def resend(self, index: int) -> None:
        self.weights.resend(index)

    def set_version(self, version: int) -> None:
        """(The workers learn the version with the next weights.)"""

    @contextlib.contextmanager
    def updating(self, update: Callable[[], None], bump: Callable[[], int]) -> Iterator[None]:
        """The user changes the policy in the block; at its end the workers get the weights."""
        yield
        update()

    def set_weights(self, state: Any, version: int, push: Callable) -> int | None:
        """``state`` into the main copy, then to every worker with ``version`` (through ``push``,
        the collector's; None: the version moved with the push, if any was made)."""
        module = self.module()
        if state is not None and has_weights(module):
            load_weights(module, state)  # the main copy stays the one the workers act with
        plan = self.weights.plan({"policy": state}, None)
        if plan:
            push(plan, lambda: version)
        return None

    def module(self) -> Any:
        return self.config.policy

    def get_model(self, model_id: str) -> Any:
        return self.weights.get_model(model_id)

    def cached(self, model_id: str) -> Any:
        return self.weights.cached(model_id)

    @property
    def weight_spec(self) -> dict | None:
        return self.weights.spec

    @property
    def shared_weights(self) -> bool:
        """Whether one shared store serves every worker (an update then reaches all of them)."""
        return self.weights.backend == "shared"

    def stats(self) -> None:
        return None

    def close(self) -> None:
        self.weights = None


class Central:
    """The main process runs the policy for every worker (``inference="central"``).

    Args:
        config: the collector's ``MultiConfig``.
    """

    shared_weights = False

    def __init__(self, config: Any):
        self.config = config
        options = config.inner_options
        self.central = CentralInference(
            config.policy, splits=config.env_splits, device=config.central_device,
            exploration_type=options.get("exploration_type", "random"), allocate=allocate_slot,
            max_wait_us=config.max_wait_us, compile_policy=options.get("compile_policy"),
            trust_policy=options.get("trust_policy"))
        self.start_guard = self.central.lock
        self.models: Any = None

    @property
    def lock(self) -> Any:
        return self.central.lock

    @property
    def local_policy(self) -> Any:
        return self.central.policy

    @property
    def fatal_error(self) -> BaseException | None:
        """The error the policy raised in the main process (a worker waiting for it failed)."""
        return self.central.error

    def channels(self, context: Any) -> Callable:
        return self.central.channels(context)

    def start(self, pool: Any, models: Any) -> None:
        self.models = models
        self.central.attach([h.info for h in pool.handles])

    def store_for(self, index: int) -> None:
        return None

    def attachment(self, index: int) -> tuple:
        return self.central.attachments[index]

    def check_models(self) -> None:
        """(The workers hold no model: ``weight_sync_schemes`` is refused with central inference.)"""

    def plan(self, models: dict[str, Any], worker_ids: Any) -> list[tuple[str, dict[int, Any]]]:
        unknown = sorted(set(models) - {"policy"})
        if unknown:
            raise ValueError(f"model_id {unknown[0]!r}: with inference='central' only 'policy' is updated (the "
                             "workers hold no model)")
        return [("policy", dict.fromkeys(range(self.config.num_workers), models["policy"]))]

    def shared(self, model_id: str) -> bool:
        return True  # loaded under the loop's lock: the workers need not pause

    def push(self, model_id: str, targets: dict[int, Any], version: int) -> None:
        """The weights are loaded into the acting policy (a no-op when it is the trainer's own,
        updated in place), the version moves, the next forward uses both."""
        self.central.update(next(iter(targets.values())), version)

    def resend(self, index: int) -> None:
        """(A restarted worker asks the loop: nothing to send.)"""

    def set_version(self, version: int) -> None:
        self.central.set_version(version)

    @contextlib.contextmanager
    def updating(self, update: Callable[[], None], bump: Callable[[], int]) -> Iterator[None]:
        """The block holds the inference loop's lock (forwards wait for it); the version moves
        at its end."""
        with self.central.lock:
            yield
            self.central.set_version(bump())

    def set_weights(self, state: Any, version: int, push: Callable) -> int:
        self.central.set_weights(state, version)
        return version

    def module(self) -> Any:
        return self.central.policy

    def get_model(self, model_id: str) -> Any:
        if model_id == "policy":
            return self.config.policy
        return resolve_model(self.models(), model_id)

    def cached(self, model_id: str) -> None:
        return None

    @property
    def weight_spec(self) -> dict | None:
        return self.central.weight_spec

    def stats(self) -> dict:
        return self.central.stats()

    def close(self) -> None:
        self.central.close()


class CentralInference:
    """The main process's side of central inference for one collector: it owns the inference
    loop (server.py) and the acting policy, starts each worker's pipes, lays out the shared
    block once the workers have reported their slots, and takes new weights (applied under the
    loop's lock, so the next forward uses them, with the new version).

    Args:
        policy: the trainer's policy; it acts itself, or, when ``device`` is not where its
            weights are, a copy on ``device`` does (updated from it by ``update()``).
        splits: env splits per worker (``env_splits``).
        device: ``policy_device`` (None: the CPU, where the policy is).
        exploration_type, allocate, max_wait_us, compile_policy, trust_policy: see ``InferenceServer``.
    """

    def __init__(self, policy: Any, *, splits: int, device: Any, exploration_type: str, allocate: Any,
                 max_wait_us: float = 0.0, compile_policy: Any = None, trust_policy: bool | None = None):
        self.splits = splits
        self.policy, copied_from = acting_policy(policy, None, device)
        self.source = policy if copied_from is not None else None
        self.server = InferenceServer(self.policy, device=device, exploration_type=exploration_type,
                                      allocate=allocate, max_wait_us=max_wait_us, compile_policy=compile_policy,
                                      trust_policy=trust_policy)
        self.attachments: list[tuple] = []

    @property
    def version(self) -> int:
        return self.server.version

    @property
    def error(self) -> BaseException | None:
        return self.server.error

    @property
    def lock(self) -> Any:
        return self.server.lock

    def channels(self, context: Any):
        """``channels(index)`` for the ``WorkerPool``: the pipes of one start of a worker."""
        return lambda index: self.server.connect(index, self.splits, context)

    def attach(self, infos: list[dict]) -> None:
        """Lay out the shared block from the workers' reports (``info["inference"]``)."""
        self.attachments = self.server.allocate([info["inference"] for info in infos])

    @property
    def weight_spec(self) -> dict | None:
        if not has_weights(self.policy):
            return None
        return {k: (tuple(v.shape), v.dtype) for k, v in self.policy.state_dict().items()}

    def set_version(self, version: int) -> None:
        """The version the next forward tags its frames with (the caller holds ``lock``)."""
        self.server.version = version

    def update(self, weights: Any, version: int) -> None:
        """New weights (None: the trainer's policy as it is now; a copy acting on another device
        takes them from it) and ``version``, from the next forward on."""
        if weights is None and self.source is not None:
            weights = self.source
        self.set_weights(weights, version)

    def set_weights(self, state: Any, version: int) -> None:
        """``state`` (None: the acting module was written in place) with ``version``."""
        with self.server.lock:
            if state is not None and has_weights(self.policy):
                load_weights(self.policy, state)
            self.server.version = version

    def stats(self) -> dict:
        return self.server.stats()

    def close(self) -> None:
        self.server.stop()
        self.attachments = []


class WorkerWeights:
    """The weights of one multi-process collector's workers.

    Args:
        pool: the started ``WorkerPool`` (its workers' reports say whether their policy has
            weights; worker 0 gives the initial ones when the main process has none).
        schemes: the validated ``weight_sync_schemes``.
        policy: the main process's ``policy`` (None when the workers build it).
        weight_source: the module ``update_policy_weights_()`` copies from (None: none).
        per_worker_weights: one shared store per worker instead of one for all.
        queued: send pipe updates without waiting for the reply (async: the worker applies
            them after the batches it is filling).
        models: where extra model ids (``"policy.head"``) are looked up in the main process:
            a weak reference to the collector, the root of the user's attribute paths.
    """

    def __init__(self, pool: Any, schemes: dict, policy: Any, weight_source: Any, per_worker_weights: bool,
                 queued: bool, models: Any):
        self.pool, self.schemes, self.policy, self.weight_source = pool, schemes, policy, weight_source
        self.per_worker_weights, self.queued, self.models = per_worker_weights, queued, models
        self.num_workers = len(pool.handles)
        self.has_weights = pool.handles[0].info["weights"] is not None
        self.backend = self._backend()
        self.last_weights: dict[int, tuple[dict, int]] = {}  # what a restarted worker is sent again
        self.last_model_weights: dict[tuple[int, str], tuple[dict, int]] = {}
        self.stores = self._make_stores()

    def _backend(self) -> str | None:
        scheme = self.schemes.get("policy")
        if scheme is None:
            return "shared" if self.has_weights else None
        return scheme.backend

    def _make_stores(self) -> list | None:
        if self.backend != "shared" or not self.has_weights:
            return None
        if self.weight_source is not None:
            initial = as_state_dict(self.weight_source)
        else:
            initial = {k: torch.from_numpy(v) for k, v in self.pool.ask(0, P.GET_WEIGHTS).items()}
        if self.per_worker_weights:
            return [SharedWeights.like(initial) for _ in range(self.num_workers)]
        store = SharedWeights.like(initial)
        return [store] * self.num_workers

    def store_for(self, index: int) -> SharedWeights | None:
        """The store worker ``index`` reads its policy from (None: weights come by pipe)."""
        return None if self.stores is None else self.stores[index]

    def check_models(self) -> None:
        """Every extra model id of ``weight_sync_schemes`` must name a module with weights in
        the workers' collectors (asked of worker 0 once it has started)."""
        for mid in self.schemes:
            if mid != "policy":
                self.pool.ask(0, P.GET_WEIGHTS, mid)

    # -- planning: everything checked before anything is sent ------------------------------------
    def plan(self, models: dict[str, Any], worker_ids: Any) -> list[tuple[str, dict[int, Any]]]:
        """``[(model_id, {worker: weights})]`` for ``models`` (``{model_id: weights or None}``)."""
        plan = []
        for mid, source in models.items():
            scheme = self.schemes.get(mid)
            if mid != "policy" and scheme is None:
                raise UnknownModelError(f"model_id {mid!r} is not in weight_sync_schemes; registered: "
                                        f"{sorted(set(self.schemes) | {'policy'})}")
            if isinstance(scheme, NoWeightSyncScheme):
                continue
            if mid == "policy":
                if not self.has_weights:
                    raise RuntimeError(
                        "update_policy_weights_: the workers' policy has no parameters or buffers, so there are no "
                        "weights to update (a random policy, or a policy without nn.Module state)"
                    )
                plan.append((mid, self._targets(source, worker_ids)))
            else:
                if source is None:
                    source = self._main_model(mid)
                plan.append((mid, self._model_targets(source, worker_ids)))
        return plan

    def shared(self, model_id: str) -> bool:
        """Whether ``model_id``'s weights are written to shared memory (no message is sent)."""
        return model_id == "policy" and self.backend == "shared"

    def push(self, model_id: str, targets: dict[int, Any], version: int) -> None:
        """Write or send ``targets`` (``{worker: weights}``) as version ``version``."""
        if self.shared(model_id):
            written = set()
            for i, w in targets.items():
                if id(self.stores[i]) not in written:
                    self.stores[i].write(w, version)
                    written.add(id(self.stores[i]))
            return
        for i, w in targets.items():
            state = {k: v.detach().cpu().numpy() for k, v in as_state_dict(w).items()}
            self._send(i, state, version, model_id)
            # Recorded once sent: a restarted worker gets these, so only weights that fit.
            if model_id == "policy":
                self.last_weights[i] = (state, version)
            else:
                self.last_model_weights[(i, model_id)] = (state, version)

    def resend(self, index: int) -> None:
        """Give a restarted worker ``index`` the weights last sent to its predecessor."""
        if index in self.last_weights:
            state, version = self.last_weights[index]
            self.pool.ask(index, P.UPDATE_WEIGHTS, state, version)
        for (i, model_id), (state, version) in self.last_model_weights.items():
            if i == index:
                self.pool.ask(index, P.UPDATE_WEIGHTS, state, version, model_id)

    def _send(self, index: int, state: dict, version: int, model_id: str) -> None:
        if self.queued:  # queued behind the worker's running batches: applied between two batches
            self.pool.send(index, P.UPDATE_WEIGHTS, state, version, model_id)
        else:
            self.pool.ask(index, P.UPDATE_WEIGHTS, state, version, model_id)

    def _main_model(self, model_id: str) -> Any:
        try:
            return self.get_model(model_id)
        except (UnknownModelError, ValueError) as err:
            raise RuntimeError(f"update_policy_weights_(model_id={model_id!r}) without weights: the model lives only "
                               f"in the workers ({err}); pass its weights") from None

    def _model_targets(self, weights: Any, worker_ids: Any) -> dict[int, Any]:
        ids, n = self.worker_ids(worker_ids), self.num_workers
        if isinstance(weights, dict) and weights and all(isinstance(k, int) for k in weights):
            bad = [i for i in weights if not 0 <= i < n]
            if bad:
                raise ValueError(f"per-worker weights name workers {bad}; worker indices are in [0, {n})")
            return {i: w for i, w in weights.items() if i in ids}
        as_state_dict(weights)  # a clear TypeError now rather than in the middle of sending
        return {i: weights for i in ids}

    def worker_ids(self, worker_ids: Any) -> list[int]:
        n = self.num_workers
        if worker_ids is None:
            return list(range(n))
        ids = [worker_ids] if isinstance(worker_ids, int) else list(worker_ids)
        bad = [i for i in ids if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n]
        if bad:
            raise ValueError(f"worker_ids must be indices in [0, {n}), got {bad}")
        return ids

    def _targets(self, weights: Any, worker_ids: Any) -> dict[int, Any]:
        n = self.num_workers
        ids = self.worker_ids(worker_ids)
        if isinstance(weights, dict) and weights and all(isinstance(k, int) for k in weights):
            if not self.per_worker_weights and self.backend == "shared":
                raise ValueError("per-worker weights {index: weights} need per_worker_weights=True")
            bad = [i for i in weights if not 0 <= i < n]
            if bad:
                raise ValueError(f"per-worker weights name workers {bad}; worker indices are in [0, {n})")
            return {i: w for i, w in weights.items() if i in ids}
        if weights is None:
            if self.weight_source is None:
                raise RuntimeError("update_policy_weights_() without weights needs a policy with weights in the main "
                                   "process; pass the weights explicitly")
            weights = self.weight_source
        if worker_ids is not None and not self.per_worker_weights and self.backend == "shared":
            raise ValueError("worker_ids needs per_worker_weights=True with shared-memory weights (one copy is shared)")
        return {i: weights for i in ids}

    # -- the main process's models --------------------------------------------------------------------
    def get_model(self, model_id: str) -> Any:
        if model_id == "policy":
            if self.policy is None:
                raise UnknownModelError("model_id 'policy': this collector was given no policy in the main process "
                                        "(policy_factory builds it in the workers)")
            return self.policy
        return resolve_model(self.models(), model_id)

    def cached(self, model_id: str) -> Any:
        if model_id != "policy" or self.backend != "shared" or not self.stores:
            return None
        return self.stores[0].tensors

    @property
    def spec(self) -> dict | None:
        info = self.pool.handles[0].info["weights"]
        return None if info is None else {k: (tuple(shape), dtype) for k, (shape, dtype) in info.items()}
