"""Policies: how the rollout calls what the user gave (nothing, a TensorDictModule, an
``nn.Module`` or a plain callable) on the current observations.

Every policy is turned into a *runner*: ``runner(obs) -> {key: tensor}`` where ``obs`` maps the
env's observation keys to tensors of shape ``(*batch_size, *feature)`` and the result maps
``"action"`` (and whatever else the policy writes, e.g. ``"logits"``) to tensors of the same
leading shape.  The runner is discovered once, at construction, by a dry run on the first
observation.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
from collections.abc import Callable
from typing import Any

import torch

from rlcollect.envs.base import NestedKey

# tensordict's InteractionType values; kept as strings so that configs travel to workers
# without importing tensordict there.
_EXPLORATION_VALUES = ("mode", "median", "mean", "random", "deterministic")


def __getattr__(name: str) -> Any:
    if name == "ExplorationType":  # the public alias of tensordict.nn.InteractionType
        from tensordict.nn import InteractionType

        return InteractionType
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def as_exploration_type(value: Any) -> str:
    """Validate ``exploration_type`` (an ``ExplorationType`` or its name) and return its value."""
    if isinstance(value, str):
        if value.lower() in _EXPLORATION_VALUES:
            return value.lower()
    elif type(value).__name__ == "InteractionType" and getattr(value, "value", None) in _EXPLORATION_VALUES:
        return value.value
    accepted = ", ".join(v.upper() for v in _EXPLORATION_VALUES)
    raise ValueError(f"exploration_type must be an ExplorationType ({accepted}) or its name, got {value!r}")


def exploration_scope(value: str, thread_local: bool = False):
    """The context a rollout runs in. Exploration settings only matter to tensordict modules,
    so without tensordict loaded in this process there is nothing to set. ``thread_local``:
    for this thread only (a thread beside the trainer's), where tensordict can (0.15 and
    later; before, the setting is the process's)."""
    if "tensordict.nn" not in sys.modules:
        return contextlib.nullcontext()
    from tensordict.nn import InteractionType, set_interaction_type

    if thread_local:
        try:
            return set_interaction_type(InteractionType(value), thread_local=True)
        except TypeError:
            pass
    return set_interaction_type(InteractionType(value))


def _is_tensordict_module(policy: Any) -> bool:
    if "tensordict.nn" not in sys.modules:
        return False
    from tensordict.nn import TensorDictModuleBase

    return isinstance(policy, TensorDictModuleBase)


def takes_tensordict(policy: Any) -> bool:
    """Whether a plain module's (or callable's) forward takes one tensordict, as torchrl uses such
    policies unwrapped: its only argument is named ``tensordict`` or annotated ``TensorDictBase``
    (or ``TensorDict``)."""
    params = _forward_params(policy)
    if not params or len(params) != 1:
        return False
    param = params[0]
    if param.name == "tensordict":
        return True
    note = param.annotation
    if note is param.empty:
        return False
    if isinstance(note, str):
        return note.split(".")[-1].strip("'\"") in ("TensorDictBase", "TensorDict")
    return isinstance(note, type) and any(c.__name__ in ("TensorDictBase", "TensorDict") for c in note.__mro__)


def _key_name(key: NestedKey) -> str:
    return key if isinstance(key, str) else ".".join(key)


class RandomRunner:
    """Marker runner: the rollout samples ``env``'s action space directly (no tensors)."""

    is_random = True
    module = None
    reports_version = False


class ModuleRunner:
    """Calls a plain ``nn.Module`` or callable with the observations its forward asks for."""

    is_random = False
    #: Whether each answer says which policy version computed it (a runner whose policy acts in
    #: another process, whose version may move between two steps); the rollout then records it.
    reports_version = False

    def __init__(self, fn: Callable, in_keys: list[NestedKey], device: torch.device | None):
        self.fn = fn
        self.module = fn if isinstance(fn, torch.nn.Module) else None
        self.in_keys = in_keys
        self.device = device
        self.out_keys: list[NestedKey] = ["action"]

    def __call__(self, obs: dict[NestedKey, torch.Tensor]) -> dict[NestedKey, torch.Tensor]:
        if self.device is None:
            out = self.fn(*[obs[k] for k in self.in_keys])
        else:
            out = self.fn(*[obs[k].to(self.device, non_blocking=True) for k in self.in_keys])
        if isinstance(out, torch.Tensor):
            return {"action": out}
        if isinstance(out, dict) and "action" in out:
            if len(out) != len(self.out_keys):  # (learnt on the first call: every key it returns is written)
                self.out_keys = list(out)
            return out
        raise TypeError(
            f"policy {_describe(self.fn)} returned {type(out).__name__}; a plain module or callable must "
            "return the action tensor (or a dict with an 'action' entry)"
        )


class TensorDictRunner:
    """Calls a ``TensorDictModuleBase`` on a TensorDict holding the observations."""

    is_random = False
    reports_version = False
    require_action = True  # False for a grouped env's policy (central inference's server sets it)

    def __init__(self, module: Any, batch_size: torch.Size, device: torch.device | None):
        from tensordict import TensorDict

        self.fn = module
        self.module = module
        self.batch_size = batch_size
        self.device = device
        self.out_keys: list[NestedKey] = []
        #: ``[(key, dims)]``: sub-TensorDicts given batch dims of their own past the rows (a grouped
        #: env's agent dims), so that the policy sees the sub-TensorDicts the env gives
        self.groups: list[tuple[NestedKey, tuple[int, ...]]] = []
        #: ``[(key, agents, stack dim past the rows)]``: a grouped env's lazily stacked groups
        #: (agents of different shapes, envs/grouped.py), whose agents arrive as entries of their
        #: own (``(*key, "#i", ...)``) and are stacked lazily again for the policy (central
        #: inference's server sets it)
        self.lazy: list[tuple[tuple[str, ...], int, int]] = []
        # One TensorDict reused for every step: only its entries are replaced.
        self._td = TensorDict({}, batch_size=batch_size, device=device)

    def __call__(self, obs: dict[NestedKey, torch.Tensor]) -> dict[NestedKey, torch.Tensor]:
        td = self._td
        if self.lazy:  # (a fresh one: the lazy stacks replace the agents' entries)
            td = self._td = self._td.empty()
        for key, value in obs.items():
            td.set(key, value if self.device is None else value.to(self.device, non_blocking=True))
        for key, dims in self.groups:
            sub = td.get(key, None)
            if sub is not None and tuple(sub.batch_size) != (*self.batch_size, *dims):
                sub.batch_size = (*self.batch_size, *dims)
        if self.lazy:
            return self._call_lazy(td, obs)
        out = self.fn(td)
        if out is None:
            out = td
        if not self.out_keys:
            self._discover(out.keys(include_nested=True, leaves_only=True), obs)
        return {k: out.get(k) for k in self.out_keys}

    def _discover(self, written: Any, obs: dict[NestedKey, torch.Tensor]) -> None:
        self.out_keys = [k for k in written
                         if k not in obs and not any(p.startswith("_") for p in ((k,) if isinstance(k, str) else k))]
        if self.require_action and "action" not in self.out_keys:
            raise TypeError(
                f"policy {_describe(self.fn)} did not write 'action'; it wrote {self.out_keys} "
                f"from the keys {list(obs)}"
            )

    def _call_lazy(self, td: Any, obs: dict[NestedKey, torch.Tensor]) -> dict[NestedKey, torch.Tensor]:
        """The policy on ``td`` with its lazy groups' agents stacked lazily again; what it
        writes is read back agent by agent (the entries ``(*key, "#i", ...)``)."""
        from rlcollect.envs.grouped import resolve, stack_agents, walk

        rows = len(self.batch_size)
        # (the env's groups under "next" are not in a step's observations)
        stack_agents(td, tuple(entry for entry in self.lazy if td.get(entry[0], None) is not None), rows)
        out = self.fn(td)
        if out is None:
            out = td
        if not self.out_keys:
            self._discover(walk(out, rows)[0], obs)
        stack_dims = {tuple(key): rows + stack for key, _, stack in self.lazy}
        return {k: resolve(out, k, stack_dims) for k in self.out_keys}


def _describe(fn: Any) -> str:
    return type(fn).__name__ if isinstance(fn, torch.nn.Module) else getattr(fn, "__name__", repr(fn))


def _forward_params(fn: Callable) -> list[inspect.Parameter] | None:
    target = fn.forward if isinstance(fn, torch.nn.Module) else fn
    try:
        sig = inspect.signature(target)
    except (TypeError, ValueError):
        return None
    return [
        p
        for p in sig.parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty
    ]


def match_in_keys(fn: Callable, obs_keys: list[NestedKey]) -> list[NestedKey]:
    """Which observation keys a plain module's forward takes, in the order of its parameters."""
    available = {_key_name(k): k for k in obs_keys}
    params = _forward_params(fn)
    where = f"policy {_describe(fn)}"
    if params is None:
        raise TypeError(f"{where}: cannot read its forward signature; wrap it in a TensorDictModule")
    if not params:
        raise TypeError(f"{where}: its forward takes no observation argument; available keys: {sorted(available)}")
    if len(params) == 1:
        name = params[0].name
        if name in available:
            return [available[name]]
        if "observation" in available:
            return ["observation"]
        if len(available) == 1:
            return list(available.values())
        raise TypeError(
            f"{where}: cannot tell which observation its forward argument {name!r} is; "
            f"available keys: {sorted(available)} (name the argument after one, or use a TensorDictModule)"
        )
    unknown = [p.name for p in params if p.name not in available]
    if unknown:
        raise TypeError(
            f"{where}: forward arguments {unknown} match no observation key; available keys: {sorted(available)}"
        )
    return [available[p.name] for p in params]


def make_runner(
    policy: Any,
    obs_keys: list[NestedKey],
    batch_size: torch.Size,
    device: torch.device | None,
    compile_policy: bool | dict | None = None,
    cudagraph_policy: bool | dict | None = None,
    trust_policy: bool | None = None,
):
    """Build the runner for what the user gave as ``policy``.  ``trust_policy=True`` (torchrl's):
    the policy is called with a TensorDict as it is, whatever its type or signature."""
    if policy is None:
        return RandomRunner()
    if compile_policy:
        kwargs = compile_policy if isinstance(compile_policy, dict) else {}
        policy_fn = torch.compile(policy, **kwargs)
    else:
        policy_fn = policy
    if cudagraph_policy:
        from tensordict.nn import CudaGraphModule

        if not torch.cuda.is_available():
            raise RuntimeError("cudagraph_policy needs a CUDA device; none is available")
        kwargs = cudagraph_policy if isinstance(cudagraph_policy, dict) else {}
        policy_fn = CudaGraphModule(policy_fn, **kwargs)
    if _is_tensordict_module(policy) or (callable(policy) and (trust_policy or takes_tensordict(policy))):
        runner = TensorDictRunner(policy_fn, batch_size, device)
        runner.module = policy if isinstance(policy, torch.nn.Module) else None
        return runner
    if callable(policy):
        runner = ModuleRunner(policy_fn, match_in_keys(policy, obs_keys), device)
        runner.module = policy if isinstance(policy, torch.nn.Module) else None
        return runner
    raise TypeError(
        f"policy must be None, a TensorDictModule, an nn.Module or a callable, got {type(policy).__name__}"
    )


def has_weights(module: Any) -> bool:
    return isinstance(module, torch.nn.Module) and any(True for _ in module.state_dict().values())


def _check_fits(module: torch.nn.Module, own: dict[str, Any], flat: dict[str, Any], partial: bool) -> None:
    """Raise before copying anything if ``flat`` ({dotted name: tensor}) does not fit ``own``
    (the module's entries): torch's ``load_state_dict`` and ``update_`` copy the entries that
    fit before they fail, which would leave the policy half-updated."""
    unknown = sorted(set(flat) - set(own))
    missing = [] if partial else sorted(set(own) - set(flat))
    mismatched = [
        f"{k}: got {tuple(flat[k].shape)}, the policy has {tuple(own[k].shape)}"
        for k in flat
        if k in own and hasattr(flat[k], "shape") and tuple(flat[k].shape) != tuple(own[k].shape)
    ]
    if unknown or missing or mismatched:
        raise RuntimeError(
            f"weights do not fit the policy {type(module).__name__} (nothing was loaded): "
            f"unexpected keys {unknown}, missing keys {missing}, size mismatch for {mismatched}"
        )


def load_weights(module: torch.nn.Module, weights: Any) -> None:
    """Copy ``weights`` (an ``nn.Module``, a TensorDict of parameters or a state dict) into
    ``module`` in place, parameters and buffers alike; all or nothing."""
    with torch.no_grad():
        if isinstance(weights, torch.nn.Module):
            if weights is not module:
                state = weights.state_dict()
                _check_fits(module, module.state_dict(), state, partial=False)
                module.load_state_dict(state)
        elif hasattr(weights, "to_module"):  # a TensorDict of parameters
            from tensordict import TensorDict

            own = TensorDict.from_module(module)
            _check_fits(module, dict(own.flatten_keys(".").items()), dict(weights.flatten_keys(".").items()),
                        partial=True)
            own.update_(weights)
        elif isinstance(weights, dict):
            _check_fits(module, module.state_dict(), weights, partial=False)
            module.load_state_dict(weights)
        else:
            raise TypeError(
                "weights must be None, an nn.Module, a TensorDict of parameters or a state dict, "
                f"got {type(weights).__name__}"
            )
