"""Weight synchronisation of the multi-process collectors (docs/weight-sync.md): the shared-memory stores the
workers read from, pushing through the pipes, per-worker weights, versions."""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from rlcollect.multiprocess import protocol as P
from rlcollect.policy import has_weights, load_weights
from rlcollect.weights.models import UnknownModelError, delegate_to_updater, resolve_model, update_targets
from rlcollect.weights.schemes import NoWeightSyncScheme
from rlcollect.weights.store import SharedWeights, as_state_dict


class WeightSync:
    """Mixin of ``MultiCollectorBase``: everything about pushing weights to the workers."""

    def _scheme_backend(self) -> str | None:
        scheme = self._schemes.get("policy")
        if scheme is None:
            return "shared" if self._pool.handles[0].info["weights"] is not None else None
        return scheme.backend

    def _make_stores(self) -> list | None:
        if self._scheme_backend() != "shared":
            return None
        spec = self._pool.handles[0].info["weights"]
        if spec is None:
            return None
        if self._weight_source is not None:
            initial = as_state_dict(self._weight_source)
        else:
            initial = {k: torch.from_numpy(v) for k, v in self._pool.request(0, P.GET_WEIGHTS).items()}
        if self.per_worker_weights:
            return [SharedWeights.like(initial) for _ in range(self.num_workers)]
        store = SharedWeights.like(initial)
        return [store] * self.num_workers

    # -- weights --------------------------------------------------------------------------------
    def update_policy_weights_(self, policy_or_weights: Any = None, *, weights: Any = None, policy: Any = None,
                               worker_ids: Any = None, model_id: str | None = None,
                               weights_dict: dict | None = None) -> None:
        """Push new weights to the workers (all, or ``worker_ids``) with a new version.

        The weights (positionally, ``weights=`` or ``policy=``): None (the main ``policy``'s),
        an ``nn.Module``, a TensorDict of parameters, a state dict, or with
        ``per_worker_weights=True`` a dict ``{worker_index: weights}``. ``model_id`` names the
        model (default ``"policy"``; any other must be a key of ``weight_sync_schemes``, an
        attribute path in each worker's collector such as ``"policy.module[0]"``);
        ``weights_dict={model_id: weights}`` updates several models with one version. The
        workers take them between two batches; every frame records the version that acted in
        ``("collector", "policy_version")`` when ``track_policy_version=True``. With
        ``weight_updater`` the call goes to it instead (no ``model_id`` / ``weights_dict``).

        Example:
            >>> import torch
            >>> from rlcollect import MultiSyncCollector, CountingEnv
            >>> class Policy(torch.nn.Module):
            ...     def __init__(self):
            ...         super().__init__()
            ...         self.bias = torch.nn.Parameter(torch.zeros(1))
            ...     def forward(self, observation):
            ...         return (observation[..., 0] * 0 + self.bias[0]).long()
            >>> c = MultiSyncCollector(CountingEnv, Policy(), num_workers=2, frames_per_batch=8)
            >>> c.update_policy_weights_(weights={"bias": torch.ones(1)})
            >>> c.worker_policy_versions()
            [1, 1]
            >>> c.shutdown()
        """
        self._check_open()
        if delegate_to_updater(self, policy_or_weights, weights=weights, policy=policy, model_id=model_id,
                               weights_dict=weights_dict, worker_ids=worker_ids,
                               hint="; use weight_sync_schemes for several models"):
            return
        models = update_targets(policy_or_weights, weights=weights, policy=policy, model_id=model_id,
                                weights_dict=weights_dict)
        plan = self._plan(models, worker_ids)
        if plan:
            self._push(plan, lambda: self._version + 1)

    def _plan(self, models: dict[str, Any], worker_ids: Any) -> list[tuple[str, dict[int, Any]]]:
        """``[(model_id, {worker: weights})]``: every target checked before anything is sent."""
        plan = []
        for mid, source in models.items():
            scheme = self._schemes.get(mid)
            if mid != "policy" and scheme is None:
                raise UnknownModelError(f"model_id {mid!r} is not in weight_sync_schemes; registered: "
                                        f"{sorted(set(self._schemes) | {'policy'})}")
            if isinstance(scheme, NoWeightSyncScheme):
                continue
            if mid == "policy":
                if self._pool.handles[0].info["weights"] is None:
                    raise RuntimeError(
                        "update_policy_weights_: the workers' policy has no parameters or buffers, so there are no "
                        "weights to update (a random policy, or a policy without nn.Module state)"
                    )
                plan.append((mid, self._targets(source, worker_ids)))
            else:
                if source is None:
                    source = self._main_model(mid)
                plan.append((mid, self._model_targets(mid, source, worker_ids)))
        return plan

    def _push(self, plan: list[tuple[str, dict[int, Any]]], version: Any) -> None:
        """Send ``plan``'s weights with the version ``version()`` returns (asked once a worker
        that failed while running free has been dealt with)."""
        with self._guard():
            self._check_running_free()
        self._version = version()
        updated: set[int] = set()
        for mid, targets in plan:
            shared = mid == "policy" and self._scheme_backend() == "shared"
            with (contextlib.nullcontext() if shared else self._control()), self._guard():
                if shared:
                    written = set()
                    for i, w in targets.items():
                        if id(self._stores[i]) not in written:
                            self._stores[i].write(w, self._version)
                            written.add(id(self._stores[i]))
                else:
                    for i, w in targets.items():
                        state = {k: v.detach().cpu().numpy() for k, v in as_state_dict(w).items()}
                        if mid == "policy":
                            self._send_weights(i, state, self._version)
                            # Recorded once sent: a restarted worker gets these, so only weights that fit.
                            self._last_weights[i] = (state, self._version)
                        else:
                            self._send_weights(i, state, self._version, mid)
                            self._last_model_weights[(i, mid)] = (state, self._version)
            updated.update(targets)
        for i in updated:
            self._worker_versions[i] = self._version

    # -- driven by an outer worker or node (rlcollect/source.py) ------------------------------------
    @property
    def weight_spec(self) -> dict | None:
        """Names, shapes and dtypes of the workers' policy parameters and buffers (None: none)."""
        info = self._pool.handles[0].info["weights"]
        return None if info is None else {k: (tuple(shape), dtype) for k, (shape, dtype) in info.items()}

    def weights_module(self, model_id: str = "policy") -> Any:
        """The main process's ``policy`` (the source of the workers' weights); only ``"policy"``."""
        if model_id != "policy":
            raise ValueError(f"model_id {model_id!r}: a nested multi-process collector updates only 'policy'")
        return self.policy

    def set_weights(self, state: Any, version: int, model_id: str = "policy") -> None:
        """Have every worker act with ``state`` (None: ``policy``'s weights, as they are now)
        from its next batch on, with ``policy_version`` set to ``version`` (the number of the
        worker or node that runs this collector, not a bump)."""
        self._check_open()
        module = self.weights_module(model_id)
        if state is not None and has_weights(module):
            load_weights(module, state)  # the main copy stays the one the workers act with
        plan = self._plan({"policy": state}, None)
        if plan:
            self._push(plan, lambda: version)

    def _main_model(self, model_id: str) -> Any:
        try:
            return self.get_model(model_id)
        except (UnknownModelError, ValueError) as err:
            raise RuntimeError(f"update_policy_weights_(model_id={model_id!r}) without weights: the model lives only "
                               f"in the workers ({err}); pass its weights") from None

    def _model_targets(self, model_id: str, weights: Any, worker_ids: Any) -> dict[int, Any]:
        ids = self._worker_ids(worker_ids)
        if isinstance(weights, dict) and weights and all(isinstance(k, int) for k in weights):
            bad = [i for i in weights if not 0 <= i < self.num_workers]
            if bad:
                raise ValueError(f"per-worker weights name workers {bad}; worker indices are in [0, {self.num_workers})")
            return {i: w for i, w in weights.items() if i in ids}
        as_state_dict(weights)  # a clear TypeError now rather than in the middle of sending
        return {i: weights for i in ids}

    def _worker_ids(self, worker_ids: Any) -> list[int]:
        n = self.num_workers
        if worker_ids is None:
            return list(range(n))
        ids = [worker_ids] if isinstance(worker_ids, int) else list(worker_ids)
        bad = [i for i in ids if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n]
        if bad:
            raise ValueError(f"worker_ids must be indices in [0, {n}), got {bad}")
        return ids

    def _check_models(self) -> None:
        """Every extra model id of ``weight_sync_schemes`` must name a module with weights in
        the workers' collectors (asked of worker 0 once it has started)."""
        for mid in self._schemes:
            if mid != "policy":
                self._pool.request(0, P.GET_WEIGHTS, mid)

    def get_model(self, model_id: str) -> Any:
        """The main process's model ``model_id``: ``"policy"`` is the ``policy`` given (the source
        of weights), any other an attribute path from this collector (``"policy.module[0]"``);
        models that exist only inside the workers (``"env.x"``) raise ``UnknownModelError``.

        Example (``policy`` a module with a ``head`` sub-module)::

            collector = MultiSyncCollector(make_env, policy, num_workers=2, frames_per_batch=100,
                                           weight_sync_schemes={"policy.head": "process"})
            collector.get_model("policy.head") is policy.head   # True
            collector.update_policy_weights_(model_id="policy.head")  # policy.head's weights, to every worker
        """
        if model_id == "policy":
            if self.policy is None:
                raise UnknownModelError("model_id 'policy': this collector was given no policy in the main process "
                                        "(policy_factory builds it in the workers)")
            return self.policy
        return resolve_model(self, model_id)

    def get_cached_weights(self, model_id: str) -> Any:
        """The shared-memory weights the workers copy from (``{name: tensor}``, worker 0's with
        ``per_worker_weights=True``) for ``"policy"`` with the shared scheme; None otherwise
        (as torchrl: nothing cached)."""
        if model_id != "policy" or self._scheme_backend() != "shared" or not self._stores:
            return None
        return self._stores[0].tensors

    def _send_weights(self, index: int, state: dict, version: int, model_id: str = "policy") -> None:
        self._pool.request(index, P.UPDATE_WEIGHTS, state, version, model_id)

    def _targets(self, weights: Any, worker_ids: Any) -> dict[int, Any]:
        n = self.num_workers
        ids = self._worker_ids(worker_ids)
        if isinstance(weights, dict) and weights and all(isinstance(k, int) for k in weights):
            if not self.per_worker_weights and self._scheme_backend() == "shared":
                raise ValueError("per-worker weights {index: weights} need per_worker_weights=True")
            bad = [i for i in weights if not 0 <= i < n]
            if bad:
                raise ValueError(f"per-worker weights name workers {bad}; worker indices are in [0, {n})")
            return {i: w for i, w in weights.items() if i in ids}
        if weights is None:
            if self._weight_source is None:
                raise RuntimeError("update_policy_weights_() without weights needs a policy with weights in the main "
                                   "process; pass the weights explicitly")
            weights = self._weight_source
        if worker_ids is not None and not self.per_worker_weights and self._scheme_backend() == "shared":
            raise ValueError("worker_ids needs per_worker_weights=True with shared-memory weights (one copy is shared)")
        return {i: weights for i in ids}

    def worker_policy_versions(self) -> list[int]:
        """The weights version each worker acts with (after its next batch starts).

        Example:
            >>> from rlcollect import MultiSyncCollector
            >>> c = MultiSyncCollector("CartPole-v1", num_workers=2, frames_per_batch=20)
            >>> c.worker_policy_versions()
            [0, 0]
            >>> c.shutdown()
        """
        return list(self._worker_versions)
