"""torchrl 0.14's ``auto_register_policy_transforms``: the env transforms a torchrl policy needs
(an ``InitTracker`` writing ``"is_init"``, the ``TensorDictPrimer`` of each recurrent module),
appended to the torchrl env that lacks them, where that env is made.

torchrl is imported only when the option is True and the policy is a module.
"""

from __future__ import annotations

from typing import Any

import torch

from rlcollect.torchrl_args import optional_flag

#: The key torchrl's recurrent modules read to know an episode began.
INIT_KEY = "is_init"


def check_flag(value: Any) -> bool | None:
    """``auto_register_policy_transforms``: None (torchrl 0.14's default: nothing is added),
    False or True."""
    return optional_flag("auto_register_policy_transforms", value)


class PolicyTransforms:
    """The transforms a policy needs of its env (found from the policy: ``needed_by``), added to
    an env that lacks them (``apply``). A transform is added when the env's observation and state
    specs do not hold what it writes already (so adding twice changes nothing)."""

    def __init__(self, transforms: list) -> None:
        self.transforms = transforms

    @classmethod
    def needed_by(cls, policy: Any, flag: bool | None) -> PolicyTransforms | None:
        """What ``policy`` needs when ``flag`` is True (None otherwise, or for a policy that is
        not a module: a random policy, a function). As torchrl: an ``InitTracker`` for any module,
        and the primer of each recurrent submodule (``make_tensordict_primer()``)."""
        if check_flag(flag) is not True or not isinstance(policy, torch.nn.Module):
            return None
        try:
            from torchrl.envs.transforms import Compose, InitTracker
            from torchrl.modules.utils import get_primers_from_module
        except ImportError as err:
            raise ValueError("auto_register_policy_transforms=True adds torchrl's InitTracker and "
                             f"TensorDictPrimer transforms to a torchrl env, but torchrl cannot be imported ({err})"
                             ) from err
        primer = get_primers_from_module(policy, warn=False, strict=False)
        primers = [] if primer is None else list(primer) if isinstance(primer, Compose) else [primer]
        return cls([InitTracker(init_key=INIT_KEY), *primers])

    def apply(self, env: Any) -> Any:
        """``env`` (what ``create_env_fn`` made) with the transforms it lacks appended; a fresh
        copy of each, so that every env made gets its own."""
        from torchrl.envs import EnvBase
        from torchrl.envs.transforms import InitTracker

        if not isinstance(env, EnvBase):
            raise ValueError(
                "auto_register_policy_transforms=True appends torchrl transforms (InitTracker, the recurrent "
                f"modules' TensorDictPrimer) to a torchrl env, but create_env_fn made a {type(env).__name__}: "
                "wrap it in a torchrl env (torchrl.envs.GymWrapper, say) or pass auto_register_policy_transforms="
                "False")
        keys = set()
        for spec in (env.full_observation_spec, env.full_state_spec):
            keys.update(spec.keys(True, True))
        leaves = {key if isinstance(key, str) else key[-1] for key in keys}
        for transform in self.transforms:
            if isinstance(transform, InitTracker):
                if INIT_KEY in leaves:
                    continue
            elif set(transform.primers.keys(True, True)) <= keys:
                continue
            env = env.append_transform(transform.clone())
        return env
