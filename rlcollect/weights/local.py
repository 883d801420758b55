"""Weights and devices of the single-process ``Collector``: torchrl's forms of
``update_policy_weights_``, several models, ``get_model``, ``get_cached_weights``, and
``env_device``."""

from __future__ import annotations

from typing import Any

import torch

from rlcollect.policy import has_weights, load_weights
from rlcollect.weights.models import UnknownModelError, delegate_to_updater, resolve_model, update_targets


class LocalWeights:
    """Mixin of ``Collector``: its weight methods (the policy acts in this process)."""

    def _check_models(self) -> None:
        """Every model id of ``weight_sync_schemes`` must name a module with weights, now."""
        for mid in self._schemes:
            if mid != "policy":
                module = self.get_model(mid)
                if not isinstance(module, torch.nn.Module):
                    raise ValueError(f"weight_sync_schemes[{mid!r}] names a {type(module).__name__}, not an nn.Module")

    def update_policy_weights_(self, policy_or_weights: Any = None, *, weights: Any = None, policy: Any = None,
                               worker_ids: Any = None, model_id: str | None = None,
                               weights_dict: dict | None = None) -> None:
        """Load new weights into the acting policy (or another model of ``weight_sync_schemes``)
        and bump the policy version.

        The weights (positionally, ``weights=`` or ``policy=``) may be None (taken from
        ``policy`` when the acting copy came from ``policy_factory``; otherwise the acting
        policy is the user's own module and only the version moves), an ``nn.Module``, a
        TensorDict of parameters or a state dict. ``model_id`` names the model (default
        ``"policy"``; others must be keys of ``weight_sync_schemes``); ``weights_dict=
        {model_id: weights}`` updates several at once with one version. With ``weight_updater``
        the call goes to it (torchrl's legacy path: no ``model_id`` / ``weights_dict``).

        Example:
            >>> import torch
            >>> from rlcollect import Collector, CountingEnv
            >>> class Policy(torch.nn.Module):
            ...     def __init__(self):
            ...         super().__init__()
            ...         self.w = torch.nn.Parameter(torch.zeros(1))
            ...     def forward(self, observation):
            ...         return (observation[..., 0] * self.w[0] > 0).long()
            >>> from rlcollect import Collector
            >>> c = Collector(CountingEnv(), Policy(), frames_per_batch=10)
            >>> c.update_policy_weights_(weights={"w": torch.ones(1)})
            >>> c.policy_version
            1
        """
        self._check_open()
        if delegate_to_updater(self, policy_or_weights, weights=weights, policy=policy, model_id=model_id,
                               weights_dict=weights_dict, worker_ids=worker_ids,
                               hint="; use weight_sync_schemes for several models"):
            return
        targets = update_targets(policy_or_weights, weights=weights, policy=policy, model_id=model_id,
                                 weights_dict=weights_dict)
        if worker_ids not in (None, 0, [0], (0,)):
            raise ValueError(f"a single-process Collector has only worker 0; got worker_ids={worker_ids!r}")
        loads = []
        for mid, source in targets.items():
            scheme = self._schemes.get(mid)
            if mid != "policy" and scheme is None:
                raise UnknownModelError(f"model_id {mid!r} is not in weight_sync_schemes; registered: "
                                        f"{sorted(set(self._schemes) | {'policy'})}")
            if scheme is not None and not scheme.delivers:
                continue
            module = self.get_model(mid) if mid != "policy" else self._runner.module
            if not has_weights(module):
                raise RuntimeError(
                    f"update_policy_weights_: the model {mid!r} ({type(module).__name__}) has no parameters or "
                    "buffers, so there are no weights to update"
                )
            if source is None and mid == "policy":
                source = self._weight_source
            loads.append((module, source))
        if not loads:
            return
        with self._quiet():  # never between two steps of a running batch
            for module, source in loads:
                if source is not None:
                    load_weights(module, source)
            self._version += 1

    def get_model(self, model_id: str) -> Any:
        """The model ``model_id`` names: ``"policy"`` is the acting policy, anything else an
        attribute path from this collector (``"policy.module[0]"``, ``"env.some_module"``).

        Example:
            >>> import torch
            >>> from rlcollect import Collector, CountingEnv
            >>> class Policy(torch.nn.Module):
            ...     def __init__(self):
            ...         super().__init__()
            ...         self.head = torch.nn.Linear(1, 1)
            ...     def forward(self, observation):
            ...         return (self.head(observation)[..., 0] > 0).long()
            >>> c = Collector(CountingEnv(), Policy(), frames_per_batch=4)
            >>> type(c.get_model("policy.head")).__name__
            'Linear'
        """
        if model_id == "policy":
            return self._runner.module if self._runner.module is not None else self.policy
        return resolve_model(self, model_id)

    @property
    def weight_spec(self) -> dict | None:
        """Names, shapes and dtypes of the acting policy's parameters and buffers (None: none)."""
        module = self._runner.module
        if not has_weights(module):
            return None
        return {k: (tuple(v.shape), v.dtype) for k, v in module.state_dict().items()}

    def weights_module(self, model_id: str = "policy") -> torch.nn.Module | None:
        """The module that acts for ``model_id`` (``"policy"``: the acting policy; else an
        attribute path from this collector, which must have parameters or buffers)."""
        if model_id == "policy":
            return self._runner.module
        module = resolve_model(self, model_id)
        if not has_weights(module):
            raise ValueError(f"weight_sync_schemes[{model_id!r}] names a {type(module).__name__} without parameters "
                             "or buffers in the worker's collector")
        return module

    def set_weights(self, state: Any, version: int, model_id: str = "policy") -> None:
        """Load ``state`` (None: the module was written in place) into ``weights_module(model_id)``
        and act with version ``version`` from the next batch (a worker's or node's call: the
        version is its owner's number, not a bump).

        Example:
            >>> import torch
            >>> from rlcollect import Collector, CountingEnv
            >>> class Policy(torch.nn.Module):
            ...     def __init__(self):
            ...         super().__init__()
            ...         self.w = torch.nn.Parameter(torch.zeros(1))
            ...     def forward(self, observation):
            ...         return (observation[..., 0] * self.w[0] > 0).long()
            >>> c = Collector(CountingEnv(), Policy(), frames_per_batch=10)
            >>> c.set_weights({"w": torch.ones(1)}, version=7)
            >>> c.policy_version, c.weights_module().w.item()
            (7, 1.0)
        """
        self._check_open()
        module = self.weights_module(model_id)
        with self._quiet():
            if state is not None:
                load_weights(module, state)
            self._version = version

    def get_cached_weights(self, model_id: str) -> Any:
        """Cached shared-memory weights of ``model_id``: None here (a single-process collector
        acts with the module itself; torchrl returns None too when it caches nothing)."""
        return None


def module_device(module: torch.nn.Module) -> torch.device | None:
    """The device of the module's first parameter or buffer."""
    for tensor in module.state_dict().values():
        if isinstance(tensor, torch.Tensor):
            return tensor.device
    return None


def place_env(env: Any, device: torch.device | None) -> None:
    """Honour ``env_device``: a TensorDict (torchrl) env is moved there with its ``to()``, as
    torchrl does; our own envs step in numpy on the CPU, so they accept only a CPU device."""
    if device is None:
        return
    from rlcollect.envs.adapter import TensorDictEnvAdapter

    inner = env.env if isinstance(env, TensorDictEnvAdapter) else None
    if inner is not None and callable(getattr(inner, "to", None)):
        if torch.device(getattr(inner, "device", None) or "cpu") != device:
            env.env = inner.to(device) or inner
            env._root = env._root.to(device)
        env.device = device
        return
    if device.type != "cpu":
        raise ValueError(f"env_device={str(device)!r}: {type(env).__name__} steps in numpy on the CPU, so env_device "
                         "can only be 'cpu' for it; a TensorDict (torchrl) env is moved with its to(). To act on "
                         "the GPU, give policy_device instead")
