"""Pickled env state never crosses the network, whatever holds it.

A ``GymEnv`` / ``VectorEnv`` state keeps pickles of its gymnasium envs under ``"envs"`` where
an env's state is not plain data, and its ``load_state_dict`` unpickles each item, which runs
code; ``pickle.loads`` takes any bytes-like object (``bytes``, ``bytearray``, ``memoryview``, a
numpy array...).  The other ``"envs"`` a collector state holds are lists of dicts: an
``EnvGroup``'s (``SerialEnv``) members' states, and the plain-data env states of a ``GymEnv`` /
``VectorEnv`` whose envs allow it (``rlcollect.envs.gym_state``: they cross, and set data only).
So an ``"envs"`` entry that is not a list (or tuple) of dicts is
pickled env state, whatever the container or the byte type; an ``EnvGroup``'s members are
searched in turn.  Rank 0 leaves such entries out of what a node sends (``strip``) and refuses a
state holding one before sending it (``find``); a node refuses one in what it receives, so a
state from a checkpoint or the network never runs code on a node whatever rank 0 let through.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

#: The key of pickled envs in a GymEnv / VectorEnv state (and of an EnvGroup's members' states).
ENVS = "envs"


def _is_group(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and all(isinstance(v, Mapping) for v in value)


def find(state: Any, path: str = "") -> list[str]:
    """The paths in ``state`` (nested dicts, lists and tuples) of pickled env state.

    Example:
        >>> find({"env": {"envs": (b"\\x80...",), "rng": 1}, "frames": 3})
        ["['env']['envs']"]
        >>> find({"env": {"envs": [{"rng": 1}, {"rng": 2}]}})  # a SerialEnv's members
        []
    """
    found: list[str] = []
    if isinstance(state, Mapping):
        for key, value in state.items():
            where = f"{path}[{key!r}]"
            if key == ENVS and not _is_group(value):
                found.append(where)
            else:
                found += find(value, where)
    elif isinstance(state, (list, tuple)):
        for i, value in enumerate(state):
            found += find(value, f"{path}[{i}]")
    return found


def strip(state: Any) -> Any:
    """``state`` without its pickled env state. Only the containers on a path to such an entry
    are rebuilt (mappings as plain dicts, tuples kept); every other value is returned as it is,
    the same object (a TensorDict stays a TensorDict, a torch state dict keeps its metadata).

    Example:
        >>> strip({"env": {"envs": [bytearray(b"\\x80")], "pending_seeds": [None]}, "frames": 3})
        {'env': {'pending_seeds': [None]}, 'frames': 3}
        >>> kept = {"policy": {"w": 1}}
        >>> strip(kept) is kept
        True
    """
    if not find(state):
        return state
    if isinstance(state, Mapping):
        return {key: strip(value) for key, value in state.items() if not (key == ENVS and not _is_group(value))}
    if isinstance(state, (list, tuple)):
        return type(state)(strip(v) for v in state) if type(state) in (list, tuple) else [strip(v) for v in state]
    return state


def refuse(state: Any, where: str) -> None:
    """Raise ``ValueError`` if ``state`` holds pickled env state (``where``: the call, for the
    message)."""
    found = find(state)
    if found:
        raise ValueError(f"{where}: {', '.join(found[:4])} hold pickled env state ('envs' that is not a list of "
                         "env states), which is never sent to a node (unpickling runs code); state_dict() leaves "
                         "it out")
