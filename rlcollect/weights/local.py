"""Weights and devices of the single-process ``Collector``: the acting policy and the other
models its ``update_policy_weights_`` / ``get_model`` / ``set_weights`` reach, and
``env_device``."""

from __future__ import annotations

import copy
from typing import Any

import torch

from rlcollect.policy import has_weights, load_weights
from rlcollect.weights.models import UnknownModelError, resolve_model


class LocalWeights:
    """The weights of a single-process ``Collector``: the acting policy and the other models
    of ``weight_sync_schemes``.

    Args:
        acting: the module the policy acts with (None: no module, a random policy say).
        policy: the collector's ``policy`` (what ``get_model("policy")`` gives without ``acting``).
        weight_source: the module ``update_policy_weights_()`` copies from (None: the acting
            module is the user's own, so there is nothing to copy).
        schemes: the validated ``weight_sync_schemes``.
        models: where model ids (``"policy.head"``, ``"env.x"``) are looked up: a weak reference
            to the collector, the root of the user's attribute paths.
    """

    def __init__(self, acting: torch.nn.Module | None, policy: Any, weight_source: Any, schemes: dict, models: Any):
        self.acting, self.policy, self.weight_source, self.schemes, self.models = (
            acting, policy, weight_source, schemes, models)

    def check_models(self) -> None:
        """Every model id of ``weight_sync_schemes`` must name a module with weights, now."""
        for mid in self.schemes:
            if mid != "policy":
                module = self.get_model(mid)
                if not isinstance(module, torch.nn.Module):
                    raise ValueError(f"weight_sync_schemes[{mid!r}] names a {type(module).__name__}, not an nn.Module")

    def plan(self, targets: dict[str, Any], worker_ids: Any) -> list[tuple[torch.nn.Module, Any]]:
        """``[(module, weights or None)]`` for ``targets`` (``{model_id: weights or None}``),
        everything checked before anything is loaded."""
        if worker_ids not in (None, 0, [0], (0,)):
            raise ValueError(f"a single-process Collector has only worker 0; got worker_ids={worker_ids!r}")
        loads = []
        for mid, source in targets.items():
            scheme = self.schemes.get(mid)
            if mid != "policy" and scheme is None:
                raise UnknownModelError(f"model_id {mid!r} is not in weight_sync_schemes; registered: "
                                        f"{sorted(set(self.schemes) | {'policy'})}")
            if scheme is not None and not scheme.delivers:
                continue
            module = self.get_model(mid) if mid != "policy" else self.acting
            if not has_weights(module):
                raise RuntimeError(
                    f"update_policy_weights_: the model {mid!r} ({type(module).__name__}) has no parameters or "
                    "buffers, so there are no weights to update"
                )
            if source is None and mid == "policy":
                source = self.weight_source
            loads.append((module, source))
        return loads

    @staticmethod
    def load(loads: list[tuple[torch.nn.Module, Any]]) -> None:
        for module, source in loads:
            if source is not None:
                load_weights(module, source)

    def get_model(self, model_id: str) -> Any:
        if model_id == "policy":
            return self.acting if self.acting is not None else self.policy
        return resolve_model(self.models(), model_id)

    @property
    def spec(self) -> dict | None:
        if not has_weights(self.acting):
            return None
        return {k: (tuple(v.shape), v.dtype) for k, v in self.acting.state_dict().items()}

    def module(self, model_id: str = "policy") -> torch.nn.Module | None:
        if model_id == "policy":
            return self.acting
        module = resolve_model(self.models(), model_id)
        if not has_weights(module):
            raise ValueError(f"weight_sync_schemes[{model_id!r}] names a {type(module).__name__} without parameters "
                             "or buffers in the worker's collector")
        return module


def acting_policy(policy: Any, policy_factory: Any, device: torch.device | None) -> tuple[Any, Any]:
    """The policy a ``Collector`` acts with, and the module its ``update_policy_weights_()``
    copies from (None: none to copy from): the factory's policy (``policy`` is then the source),
    or ``policy`` itself; a module with weights elsewhere than ``device`` acts as a copy there
    (as torchrl: the user's own module is not moved, the copy takes its weights on update)."""
    acting = policy_factory() if policy_factory is not None else policy
    source = policy if policy_factory is not None else None
    if device is not None and has_weights(acting) and module_device(acting) != device:
        if policy_factory is None:
            source = acting
            acting = copy.deepcopy(acting)
        acting = acting.to(device)
    return acting, source


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
        env.move_to(device)
        return
    if device.type != "cpu":
        raise ValueError(f"env_device={str(device)!r}: {type(env).__name__} steps in numpy on the CPU, so env_device "
                         "can only be 'cpu' for it; a TensorDict (torchrl) env is moved with its to(). To act on "
                         "the GPU, give policy_device instead")
