"""Weight synchronisation of the multi-process collectors (SPEC 6): the shared-memory stores the
workers read from, pushing through the pipes, per-worker weights, versions."""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from rlcollect.multiprocess import protocol as P
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
    def update_policy_weights_(self, weights: Any = None, *, worker_ids: Any = None, model_id: str = "policy") -> None:
        """Push new weights to the workers (all, or ``worker_ids``) with a new version.

        ``weights``: None (the main ``policy``'s), an ``nn.Module``, a TensorDict of parameters,
        a state dict, or with ``per_worker_weights=True`` a dict ``{worker_index: weights}``.
        The workers take them between two batches; every frame records the version that acted
        in ``("collector", "policy_version")`` when ``track_policy_version=True``.

        Example:
            >>> import torch
            >>> from rlcollect import MultiSyncCollector, CountingEnv
            >>> class Policy(torch.nn.Module):
            ...     def __init__(self):
            ...         super().__init__()
            ...         self.bias = torch.nn.Parameter(torch.zeros(1))
            ...     def forward(self, observation):
            ...         return (observation[..., 0] * 0 + self.bias).long()
            >>> c = MultiSyncCollector(CountingEnv, Policy(), num_workers=2, frames_per_batch=8)
            >>> c.update_policy_weights_({"bias": torch.ones(1)})
            >>> c.worker_policy_versions()
            [1, 1]
            >>> c.shutdown()
        """
        self._check_open()
        if model_id != "policy":
            raise ValueError(f"model_id must be 'policy', got {model_id!r}")
        scheme = self._schemes.get("policy")
        if isinstance(scheme, NoWeightSyncScheme):
            return
        if self._pool.handles[0].info["weights"] is None:
            raise RuntimeError(
                "update_policy_weights_: the workers' policy has no parameters or buffers, so there are no weights "
                "to update (a random policy, or a policy without nn.Module state)"
            )
        targets = self._targets(weights, worker_ids)
        with self._guard():
            self._check_running_free()
        shared = self._scheme_backend() == "shared"
        self._version += 1
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
                    self._send_weights(i, state, self._version)
                    # Recorded once sent: a restarted worker gets these, so only weights that fit.
                    self._last_weights[i] = (state, self._version)
        for i in targets:
            self._worker_versions[i] = self._version

    def _send_weights(self, index: int, state: dict, version: int) -> None:
        self._pool.request(index, P.UPDATE_WEIGHTS, state, version)

    def _targets(self, weights: Any, worker_ids: Any) -> dict[int, Any]:
        n = self.num_workers
        if worker_ids is None:
            ids = list(range(n))
        else:
            ids = [worker_ids] if isinstance(worker_ids, int) else list(worker_ids)
            bad = [i for i in ids if not isinstance(i, int) or not 0 <= i < n]
            if bad:
                raise ValueError(f"worker_ids must be indices in [0, {n}), got {bad}")
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
