"""Weight synchronisation of the multi-process collectors (docs/weight-sync.md): the
shared-memory stores the workers read from, pushing through the pipes, per-worker weights, and
what a restarted worker is sent again.  Where weights are applied: in the worker, between two
batches (worker.py ``_pull_weights`` / ``update_weights``)."""

from __future__ import annotations

from typing import Any

import torch

from rlcollect.multiprocess import protocol as P
from rlcollect.weights.models import UnknownModelError, resolve_model
from rlcollect.weights.schemes import NoWeightSyncScheme
from rlcollect.weights.store import SharedWeights, as_state_dict


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
            initial = {k: torch.from_numpy(v) for k, v in self.pool.request(0, P.GET_WEIGHTS).items()}
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
                self.pool.request(0, P.GET_WEIGHTS, mid)

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
            self.pool.request(index, P.UPDATE_WEIGHTS, state, version)
        for (i, model_id), (state, version) in self.last_model_weights.items():
            if i == index:
                self.pool.request(index, P.UPDATE_WEIGHTS, state, version, model_id)

    def _send(self, index: int, state: dict, version: int, model_id: str) -> None:
        if self.queued:  # queued behind the worker's running batches: applied between two batches
            self.pool.send(index, P.UPDATE_WEIGHTS, state, version, model_id)
        else:
            self.pool.request(index, P.UPDATE_WEIGHTS, state, version, model_id)

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
