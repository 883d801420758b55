"""torchrl's weight-update vocabulary: model ids (attribute paths such as ``"policy"`` or
``"policy.module[0]"``), the keyword forms of ``update_policy_weights_`` and ``weight_updater``."""

from __future__ import annotations

import ast
import inspect
import re
from typing import Any

_PART = re.compile(r"^([A-Za-z_]\w*)?((?:\[[^\]]+\])*)$")
_INDEX = re.compile(r"\[([^\]]+)\]")


class UnknownModelError(KeyError, ValueError):
    """A ``model_id`` that names no registered model (a ``KeyError`` as in torchrl, and a
    ``ValueError`` as every bad argument here)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


def resolve_model(context: Any, model_id: str) -> Any:
    """The object at ``model_id``, an attribute path from ``context`` (a collector) as torchrl
    writes it: ``"policy"``, ``"policy.module[0]"``, ``"env.transform[0]"``, ``"a['key']"``.

    Subscripts are integers or quoted strings, read with ``ast.literal_eval`` (nothing is
    evaluated).

    Example:
        >>> import torch
        >>> class C: policy = torch.nn.Sequential(torch.nn.Linear(1, 1))
        >>> type(resolve_model(C(), "policy[0]")).__name__
        'Linear'
    """
    if not isinstance(model_id, str) or not model_id:
        raise ValueError(f"model_id must be a non-empty attribute path like 'policy' or 'policy.module[0]', "
                         f"got {model_id!r}")
    obj = context
    for part in model_id.split("."):
        match = _PART.match(part)
        if match is None or (not match.group(1) and not match.group(2)):
            raise ValueError(f"model_id {model_id!r}: cannot read {part!r} (expected name, name[0] or name['key'])")
        name, subscripts = match.group(1), match.group(2)
        try:
            if name:
                obj = getattr(obj, name)
            for raw in _INDEX.findall(subscripts):
                try:
                    key = ast.literal_eval(raw.strip())
                except (ValueError, SyntaxError) as err:
                    raise ValueError(
                        f"model_id {model_id!r}: subscript [{raw}] must be an int or a quoted string") from err
                obj = obj[key]
        except (AttributeError, KeyError, IndexError, TypeError) as err:
            raise UnknownModelError(f"model_id {model_id!r} names nothing in {type(context).__name__} "
                                    f"({type(err).__name__}: {err})") from err
    return obj


def update_targets(policy_or_weights: Any = None, *, weights: Any = None, policy: Any = None,
                   model_id: str | None = None, weights_dict: dict | None = None) -> dict[str, Any]:
    """``{model_id: weights or None}`` from the forms torchrl's ``update_policy_weights_``
    accepts; the same conflicts rejected as there.

    Example:
        >>> update_targets(weights_dict={"policy": None, "value": None})
        {'policy': None, 'value': None}
        >>> update_targets({"w": 1}, model_id="value")
        {'value': {'w': 1}}
    """
    if weights is not None:
        if policy_or_weights is not None:
            raise ValueError("update_policy_weights_: give the weights positionally or as weights=, not both")
        if policy is not None:
            raise ValueError("update_policy_weights_: give weights= or policy=, not both")
        policy_or_weights = weights
    if policy is not None:
        if policy_or_weights is not None:
            raise ValueError("update_policy_weights_: give the policy positionally or as policy=, not both")
        policy_or_weights = policy
    if weights_dict is not None:
        if model_id is not None:
            raise ValueError("update_policy_weights_: give model_id= or weights_dict=, not both")
        if policy_or_weights is not None:
            raise ValueError("update_policy_weights_: give weights (or policy=) or weights_dict=, not both")
        if not isinstance(weights_dict, dict) or not weights_dict:
            raise ValueError(f"weights_dict must be a non-empty dict {{model_id: weights}}, got {weights_dict!r}")
        bad = [k for k in weights_dict if not isinstance(k, str)]
        if bad:
            raise ValueError(f"weights_dict keys must be model ids (strings), got {bad}")
        return dict(weights_dict)
    return {"policy" if model_id is None else model_id: policy_or_weights}


def make_weight_updater(value: Any, collector: Any) -> Any:
    """What ``weight_updater=`` accepts, as torchrl does: an updater instance (an object with
    ``register_collector``, e.g. a ``WeightUpdaterBase`` subclass), a class or zero-argument
    constructor returning one (called once), or a plain function
    ``fn(policy_or_weights=..., worker_ids=...)`` used as the updater itself."""
    if value is None:
        return None
    if not callable(value):
        raise TypeError(f"weight_updater must be a WeightUpdaterBase instance, a constructor of one, or a function "
                        f"fn(policy_or_weights, worker_ids); got {type(value).__name__}")
    if not hasattr(value, "register_collector") or isinstance(value, type):
        if isinstance(value, type) or not _required_params(value):
            value = value()  # a constructor (torchrl: "WeightUpdaterBase or constructor")
            if not callable(value):
                raise TypeError(f"weight_updater's constructor returned {type(value).__name__}, which is not callable")
        else:
            return value
    register = getattr(value, "register_collector", None)
    if register is not None:
        register(collector)
    return value


def _required_params(fn: Any) -> list:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return ["?"]
    return [p for p in sig.parameters.values()
            if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
