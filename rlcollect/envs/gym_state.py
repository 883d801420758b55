"""A gymnasium env's state as plain data, where the env allows it (no pickle, no code on load).

``plain_state(env)`` walks the wrapper chain (``env``, ``env.env``, ... ``env.unwrapped``) and
records, for each layer, its class (``module.qualname``, checked on load) and its instance
attributes that are plain data: ``None``, ``bool``, ``int``, ``float``, ``str``, numpy arrays
(numeric or bool dtype) and numpy scalars, and tuples, lists and dicts (str keys) of those. A
numpy ``Generator`` attribute (``np_random``) is recorded as its ``bit_generator.state`` dict,
and a gymnasium space attribute as the generator states of the space and its subspaces (the
space itself is rebuilt with the env: ``GymEnv`` seeds ``action_space``, an env may sample from
it). What the freshly built env of the same id rebuilds is left out: the inner ``env``, ``spec``,
``render_mode``, ``metadata``, the wrappers' saved constructor kwargs and functions, and the
render caches (``screen``, ``clock``, ``surf``). If any other attribute of any layer is
something else, ``plain_state`` returns ``None`` and the caller keeps a pickle of that env
(behaviour is never lost).

``load_plain_state(env, state)`` sets those attributes on a freshly built env of the same
wrapper chain (same classes, layer by layer, else ``ValueError`` naming the layer); it checks
that every value is plain data and every name an ordinary attribute name, so a state from a
checkpoint or the network sets data only and runs no code of its own.

Example:
    >>> import gymnasium as gym
    >>> env = gym.make("CartPole-v1"); _ = env.reset(seed=0)
    >>> state = plain_state(env)
    >>> [layer["class"].rsplit(".", 1)[1] for layer in state["layers"]]
    ['TimeLimit', 'OrderEnforcing', 'PassiveEnvChecker', 'CartPoleEnv']
    >>> fresh = gym.make("CartPole-v1"); load_plain_state(fresh, state)
    >>> bool((fresh.unwrapped.state == env.unwrapped.state).all())
    True
"""

from __future__ import annotations

import copy
from typing import Any

import gymnasium as gym
import numpy as np

#: The attributes a freshly built env of the same id has already (left out of the plain state).
#: (``func``: the function of gymnasium's Transform* wrappers, a constructor argument; ``screen``,
#: ``clock``, ``surf``: pygame render caches, made again by ``render``.)
REBUILT = frozenset({"env", "spec", "_cached_spec", "render_mode", "metadata", "_metadata", "_saved_kwargs",
                     "func", "screen", "clock", "surf"})
_BIT_GENERATORS = {"PCG64", "PCG64DXSM", "MT19937", "Philox", "SFC64"}
_SCALARS = (type(None), bool, int, float, str)


def _is_plain(value: Any) -> bool:
    if type(value) in _SCALARS:
        return True
    if type(value) is np.ndarray or isinstance(value, np.generic):
        return np.asarray(value).dtype.kind in "biufc"
    if type(value) in (list, tuple):
        return all(_is_plain(v) for v in value)
    if type(value) is dict:  # ("envs" never a key: that key marks pickled env state, see control/env_state.py)
        return all(type(k) is str and k != "envs" and _is_plain(v) for k, v in value.items())
    return False


_LEAF_SPACES = (gym.spaces.Box, gym.spaces.Discrete, gym.spaces.MultiDiscrete, gym.spaces.MultiBinary,
                gym.spaces.Text)


def _space_rngs(space: gym.spaces.Space) -> list | None:
    """The generator states of ``space`` and its subspaces, depth first (``None`` in it: not made
    yet); ``None`` for a space of another kind (Sequence, Graph, ...: its subspaces are not walked)."""
    if not isinstance(space, (*_LEAF_SPACES, gym.spaces.Dict, gym.spaces.Tuple)):
        return None
    rng = space._np_random
    out = [None if rng is None else rng.bit_generator.state]
    subspaces = (space.spaces.values() if isinstance(space, gym.spaces.Dict)
                 else space.spaces if isinstance(space, gym.spaces.Tuple) else ())
    for sub in subspaces:
        states = _space_rngs(sub)
        if states is None:
            return None
        out += states
    return out


def _layers(env: gym.Env) -> list:
    layers = [env]
    while isinstance(layers[-1], gym.Wrapper):
        layers.append(layers[-1].env)
    return layers


def _class_name(obj: Any) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def plain_state(env: gym.Env) -> dict | None:
    """``env``'s state as plain data, or ``None`` where an attribute is not representable."""
    layers = []
    for layer in _layers(env):
        attrs, rngs, spaces = {}, {}, {}
        for name, value in vars(layer).items():
            if name in REBUILT:
                continue
            if isinstance(value, np.random.Generator):
                rngs[name] = value.bit_generator.state
            elif isinstance(value, gym.spaces.Space):
                spaces[name] = _space_rngs(value)
                if spaces[name] is None:
                    return None
            elif _is_plain(value) and name != "envs":  # ("envs" marks pickled env state: control/env_state.py)
                attrs[name] = copy.deepcopy(value)
            else:
                return None
        layers.append({"class": _class_name(layer), "attrs": attrs, "rngs": rngs, "spaces": spaces})
    return {"layers": layers}


def _generator(state: Any, where: str) -> np.random.Generator | None:
    if state is None:
        return None
    if not (type(state) is dict and state.get("bit_generator") in _BIT_GENERATORS and _is_plain(state)):
        raise ValueError(f"{where}: not a numpy bit generator state: {state!r:.200}")
    rng = np.random.Generator(getattr(np.random, state["bit_generator"])())
    try:
        rng.bit_generator.state = state
    except (TypeError, ValueError, KeyError, OverflowError) as err:
        raise ValueError(f"{where}: not a numpy bit generator state: {err}") from None
    return rng


def _set_space_rngs(space: gym.spaces.Space, states: list, where: str, apply: bool) -> list:
    """Set (``apply``) or only check the generator states of ``space`` and its subspaces."""
    if not states:
        raise ValueError(f"{where}: fewer generator states than (sub)spaces")
    rng = _generator(states[0], where)
    if apply:
        space._np_random = rng
    rest = states[1:]
    subspaces = (space.spaces.values() if isinstance(space, gym.spaces.Dict)
                 else space.spaces if isinstance(space, gym.spaces.Tuple) else ())
    for sub in subspaces:
        rest = _set_space_rngs(sub, rest, where, apply)
    return rest


def _name(name: Any, where: str) -> str:
    if not (type(name) is str and name.isidentifier() and not name.startswith("__") and name not in REBUILT):
        raise ValueError(f"{where}: {name!r} is not an attribute a plain env state may set")
    return name


def load_plain_state(env: gym.Env, state: Any, where: str = "load_plain_state", apply: bool = True) -> None:
    """Set ``plain_state``'s ``state`` on ``env`` (a freshly built env of the same wrapper chain);
    ``apply=False`` only checks it (``ValueError`` if it does not fit ``env``)."""
    if not (isinstance(state, dict) and isinstance(state.get("layers"), (list, tuple))
            and all(isinstance(layer, dict) for layer in state["layers"])):
        raise ValueError(f"{where}: a plain env state is a dict with a list of layers, got {state!r:.200}")
    layers = _layers(env)
    saved = [layer.get("class") for layer in state["layers"]]
    here = [_class_name(layer) for layer in layers]
    if saved != here:
        bad = next((i for i, (a, b) in enumerate(zip(saved, here)) if a != b), min(len(saved), len(here)))
        raise ValueError(
            f"{where}: the saved env's wrapper chain differs from this env's at layer {bad}: saved "
            f"{saved[bad] if bad < len(saved) else 'nothing'}, here {here[bad] if bad < len(here) else 'nothing'} "
            f"(saved chain {saved}, this chain {here})")
    # check everything before setting anything: a refused state leaves the env as it was
    updates = []
    for i, (layer, data) in enumerate(zip(layers, state["layers"])):
        at = f"{where}: layer {i} ({here[i]})"
        attrs, rngs, spaces = data.get("attrs", {}), data.get("rngs", {}), data.get("spaces", {})
        if not all(type(part) is dict for part in (attrs, rngs, spaces)):
            raise ValueError(f"{at}: attrs, rngs and spaces must be dicts")
        for name, value in attrs.items():
            if not _is_plain(value):
                raise ValueError(f"{at}: attribute {name!r} is not plain data ({type(value).__name__})")
            updates.append((layer, _name(name, at), copy.deepcopy(value)))
        for name, value in rngs.items():
            updates.append((layer, _name(name, at), _generator(value, f"{at}: {name}")))
        for name, value in spaces.items():
            space = getattr(layer, _name(name, at), None)
            if not (isinstance(space, gym.spaces.Space) and type(value) in (list, tuple)):
                raise ValueError(f"{at}: {name!r} is not a space of this env, or its state not a list")
            if _set_space_rngs(space, list(value), f"{at}: {name}", apply=False):
                raise ValueError(f"{at}: {name}: more generator states than (sub)spaces")
            updates.append((space, None, list(value)))
    if not apply:
        return
    for target, name, value in updates:
        if name is None:
            _set_space_rngs(target, value, where, apply=True)
        else:
            setattr(target, name, value)
