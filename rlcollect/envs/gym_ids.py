"""``make``: gymnasium's ``make`` for an env id, with the one registration gymnasium leaves to
the user: Atari's ``ALE/...`` ids exist only once ``ale_py`` is imported.

Imports gymnasium and nothing heavier (no torch), so the command line can check an id before
torch is imported.
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym


def make(env_id: str, **kwargs: Any) -> gym.Env:
    """``gymnasium.make(env_id, **kwargs)``; for an ``ALE/`` id that gymnasium does not know yet,
    ``ale_py`` is imported (its import registers the ids) and the call made again.

    Without ale-py installed, the ``NamespaceNotFound`` names the extra that brings it.

    Example:
        >>> from rlcollect.envs.gym_ids import make
        >>> env = make("CartPole-v1")
        >>> env.spec.id
        'CartPole-v1'
        >>> env.close()
    """
    try:
        return gym.make(env_id, **kwargs)
    except gym.error.NamespaceNotFound as err:
        if not env_id.startswith("ALE/"):
            raise
        try:
            import ale_py  # noqa: F401
        except ImportError:
            raise gym.error.NamespaceNotFound(
                f"{env_id!r}: Atari envs need ale-py, which rlcollect does not install by default: "
                f"pip install 'rlcollect[atari]' ({err})") from err
    return gym.make(env_id, **kwargs)
