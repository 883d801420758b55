"""torchrl's argument values and the methods torchrl's collectors have, shared by every
rlcollect collector.

torchrl spells "no limit" several ways (``total_frames=None`` or any negative number,
``max_frames_per_traj=-1``/``None``/``0``, ``init_random_frames=-1``/``None``); the helpers here
map each to rlcollect's one spelling, and reject everything else with a message naming the
argument. ``RL_WARNINGS=0`` (torchrl's environment variable) silences the warnings collectors
give about batch arithmetic, as it does in torchrl.

Example:
    >>> from rlcollect.torchrl_args import endless_total_frames, traj_limit
    >>> endless_total_frames(None), endless_total_frames(-5), endless_total_frames(100)
    (-1, -1, 100)
    >>> traj_limit(-1), traj_limit(0), traj_limit(None), traj_limit(20)
    (None, None, None, 20)
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch


_FALSE = {"0", "false", "f", "no", "n", "off"}


def rl_warnings() -> bool:
    """False when the environment variable ``RL_WARNINGS`` says no (``0``/``False``/``no``/``off``)."""
    return os.environ.get("RL_WARNINGS", "1").strip().lower() not in _FALSE


def warn(message: str, stacklevel: int = 2) -> None:
    """``warnings.warn`` unless ``RL_WARNINGS`` is off."""
    if rl_warnings():
        warnings.warn(message + " (set RL_WARNINGS=0 to silence this message)", stacklevel=stacklevel + 1)


def warn_overshoot(total_frames: int, frames_per_batch: int, stacklevel: int = 2) -> None:
    """Warn when ``total_frames`` is not a multiple of ``frames_per_batch`` (the last batch
    overshoots)."""
    if total_frames > 0 and total_frames % frames_per_batch:
        warn(f"total_frames={total_frames} is less than frames_per_batch={frames_per_batch}: the only batch has "
             f"{frames_per_batch} frames" if total_frames < frames_per_batch else
             f"total_frames={total_frames} is not a multiple of frames_per_batch={frames_per_batch}: the last "
             "batch overshoots to a whole batch", stacklevel=stacklevel + 1)


def _int(name: str, value: Any, accepted: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be {accepted}; got {value!r}")
    return value


def endless_total_frames(value: Any) -> int:
    """``total_frames``: a positive int, or ``None`` / any negative int for an endless collector
    (returned as -1). 0 is refused: it would collect nothing."""
    if value is None:
        return -1
    value = _int("total_frames", value, "a positive int, or None / a negative int (-1) for an endless collector")
    if value == 0:
        raise ValueError("total_frames must be a positive int, or None / a negative int (-1) for an endless "
                         "collector; got 0 (which would collect nothing)")
    return -1 if value < 0 else value


def traj_limit(value: Any) -> int | None:
    """``max_frames_per_traj``: a positive int, or ``None`` / ``-1`` / ``0`` for no limit (None)."""
    if value is None:
        return None
    value = _int("max_frames_per_traj", value, "a positive int, or None / -1 / 0 for no limit")
    if value in (0, -1):
        return None
    if value < 0:
        raise ValueError(f"max_frames_per_traj must be a positive int, or None / -1 / 0 for no limit; got {value!r}")
    return value


def random_frames(value: Any) -> int:
    """``init_random_frames``: an int >= 0, or ``None`` / ``-1`` for none (0)."""
    if value is None:
        return 0
    value = _int("init_random_frames", value, "an int >= 0, or None / -1 for no random frames")
    if value == -1:
        return 0
    if value < 0:
        raise ValueError(f"init_random_frames must be an int >= 0, or None / -1 for no random frames; got {value!r}")
    return value


def version_tracker(value: Any) -> tuple[bool, Any]:
    """``track_policy_version``: a bool, or a torchrl ``PolicyVersion``-like object (anything with
    ``increment_version()``). Returns (track, the object or None)."""
    if isinstance(value, bool):
        return value, None
    if callable(getattr(value, "increment_version", None)):
        return True, value
    raise TypeError("track_policy_version must be a bool or a torchrl PolicyVersion (an object with "
                    f"increment_version()), got {type(value).__name__}")


def check_close_env(close_env: Any, owner: str) -> None:
    if close_env is not True:
        raise ValueError(
            f"{owner}.shutdown(close_env={close_env!r}): a collector owns its envs and always closes them when it "
            "shuts down (torchrl's multi-process collectors refuse close_env=False too); to keep using an env, "
            "keep collecting, or build a new env after shutdown"
        )


def check_hook(name: str, value: Any) -> Any:
    """``pre_collect_hook`` / ``post_collect_hook``: a callable or None."""
    if value is not None and not callable(value):
        raise TypeError(f"{name} must be a callable or None, got {type(value).__name__}")
    return value


def check_reset_when_done(value: Any) -> None:
    """``reset_when_done``: True is what rlcollect always does; False is refused."""
    if value is True:
        return
    raise ValueError(
        f"reset_when_done={value!r} is not supported: rlcollect resets an env in the very step it ends "
        "(same-step autoreset, the ending step's observation is kept under 'next'), so every batch row is a "
        "valid transition; torchrl's reset_when_done=False leaves ended envs for you to reset. To start "
        "every batch fresh use reset_at_each_iter=True; to reset by hand use collector.reset()"
    )


def check_trust_policy(value: Any) -> bool | None:
    if value is None or isinstance(value, bool):
        return value
    raise TypeError(f"trust_policy must be None, True or False, got {value!r}")


def check_local_init_rb(value: Any) -> bool | None:
    """``local_init_rb``: accepted; the buffer's storage is always set up in the main process."""
    if value is None or isinstance(value, bool):
        return value
    raise TypeError(f"local_init_rb must be None, True or False, got {value!r}")


def check_timeout(timeout: Any, default: float) -> float:
    """``shutdown(timeout=None)`` means the collector's default."""
    if timeout is None:
        return default
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout < 0:
        raise ValueError(f"shutdown timeout must be None or a number of seconds >= 0, got {timeout!r}")
    return float(timeout)


def selects_all(index: Any, rows: int) -> bool:
    """Whether torchrl's ``reset(index=...)`` names every row of the env."""
    if isinstance(index, slice):
        return len(range(*index.indices(rows))) == rows
    flat = torch.as_tensor(index).reshape(-1)
    if flat.dtype == torch.bool:
        return flat.numel() == rows and bool(flat.all())
    return set(flat.tolist()) >= set(range(rows)) if rows > 1 else flat.numel() >= 1


def chosen_workers(reset_idx: Any, n: int) -> list[int]:
    """torchrl's ``reset(reset_idx=...)``: None is every worker, else one bool per worker."""
    if reset_idx is None:
        return list(range(n))
    flags = reset_idx.reshape(-1).tolist() if isinstance(reset_idx, torch.Tensor) else list(reset_idx)
    if len(flags) != n or not all(isinstance(f, bool) for f in flags):
        raise ValueError(f"reset_idx must be None or {n} bools (one per worker), got {reset_idx!r}")
    return [i for i, f in enumerate(flags) if f]

