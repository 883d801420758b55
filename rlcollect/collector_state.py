"""Checking and restoring a ``Collector.state_dict()``: everything that can fail is checked, or
undone, before the collector changes.

Example:
    >>> check_state({"frames": 1, "iter": 1, "rollout": {}, "env": {}, "policy": None,
    ...              "policy_version": 0, "torch_rng": None})
    (1, 1, 0, None)
"""

from __future__ import annotations

from typing import Any

import torch

from rlcollect.policy import has_weights, load_weights

STATE_KEYS = ("frames", "iter", "rollout", "env", "policy", "policy_version", "torch_rng")


def check_state(state: Any, check_rollout: Any = None) -> tuple[int, int, int, torch.Tensor | None]:
    """``(frames, iter, policy_version, torch_rng)`` of a ``Collector.state_dict()``; raises
    TypeError / KeyError / ValueError naming what is wrong (``check_rollout(state["rollout"])``
    is called once the keys are known to be there)."""
    if not isinstance(state, dict):
        raise TypeError(f"load_state_dict expects the dict state_dict() returned, got {type(state).__name__}")
    missing = [k for k in STATE_KEYS if k not in state]
    if missing:
        raise KeyError(f"Collector.load_state_dict: missing keys {missing}; expected {list(STATE_KEYS)}")
    if check_rollout is not None:
        check_rollout(state["rollout"])
    try:
        frames, iters, version = (int(state[k]) for k in ("frames", "iter", "policy_version"))
    except (TypeError, ValueError) as err:
        raise ValueError(
            "Collector.load_state_dict: frames, iter and policy_version must be ints, got "
            f"{state['frames']!r}, {state['iter']!r}, {state['policy_version']!r}"
        ) from err
    torch_rng = state["torch_rng"]
    if torch_rng is not None and not (isinstance(torch_rng, torch.Tensor) and torch_rng.dtype == torch.uint8):
        raise TypeError("Collector.load_state_dict: torch_rng must be None or a torch RNG state (uint8 tensor), "
                        f"got {torch_rng!r}")
    return frames, iters, version, torch_rng


def load_all_or_nothing(module: torch.nn.Module | None, env: Any, policy_state: Any, env_state: Any) -> None:
    """Load the policy's weights and the env's state, or (if either fails) neither."""
    # Cloned: module.state_dict() aliases the live tensors, and a load that fails half-way
    # (a size mismatch) has already copied the entries that fitted.
    backup = {k: v.clone() for k, v in module.state_dict().items()} if has_weights(module) else None
    env_backup = env.state_dict()
    try:
        if policy_state is not None:
            if module is None:
                raise ValueError("the state holds policy weights but this collector's policy has none")
            load_weights(module, policy_state)
        env.load_state_dict(env_state)
    except Exception:
        if backup is not None:
            load_weights(module, backup)
        env.load_state_dict(env_backup)
        raise
