"""A torchrl-style TensorDict environment written without torchrl, for duck-typing tests.

``TorchRLLikeEnv`` has exactly the interface SPEC section 2 asks of a foreign env (``batch_size``,
``device``, ``reset(td=None)``, ``step(td)`` writing ``"next"``, ``rand_action(td)``,
``set_seed(seed, static_seed=False)``, ``close()``, ``state_dict()/load_state_dict()``), and is
not an ``rlcollect.EnvBase``, so rlcollect must reach it through ``TensorDictEnvAdapter``.

Dynamics, per row (all deterministic given the seed):
    observation (float32, shape (3,)) = [steps since reset, last action, episode offset]
    where the episode offset is drawn uniformly in [0, 1) at each reset from the seeded generator.
    action: int64 scalar in [0, num_actions) (a Discrete index); it does not change the count.
    reward: float32 ``1.0`` per step (shape ``[*batch, 1]``).
    terminated once the count reaches ``max_steps``; truncated once it reaches ``truncate_at``
    (``done = terminated | truncated``).  ``with_truncated=False`` / ``with_terminated=False``
    leave those keys out entirely (only ``"done"`` is written then).

Partial reset: ``reset(td)`` with a boolean ``"_reset"`` entry (shape ``[*batch]`` or
``[*batch, 1]``) resets only the flagged rows; the other rows keep counting and report their
current observation.  Every call is recorded (``reset_calls``, ``step_calls``, ``reset_masks``,
``seeds``, ``close_calls``) so tests can check what the adapter asked of the env.

Importable from tests in ``tests/envs`` as ``from torchrl_like import TorchRLLikeEnv``; other
test directories can add ``tests/envs`` to ``sys.path``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from tensordict import TensorDict

OBS_DIM = 3


class TorchRLLikeEnv:
    def __init__(
        self,
        batch_size: int | Sequence[int] | torch.Size = (),
        max_steps: int | None = 5,
        num_actions: int = 2,
        *,
        truncate_at: int | None = None,
        with_truncated: bool = True,
        with_terminated: bool = True,
        device: str | torch.device = "cpu",
    ):
        self.batch_size = torch.Size([batch_size] if isinstance(batch_size, int) else batch_size)
        self.device = torch.device(device)
        self.max_steps = max_steps
        self.truncate_at = truncate_at
        self.num_actions = num_actions
        self.with_truncated = with_truncated
        self.with_terminated = with_terminated
        self.generator = torch.Generator().manual_seed(0)
        self.count = torch.zeros(self.batch_size, dtype=torch.int64)
        self.last_action = torch.zeros(self.batch_size, dtype=torch.int64)
        self.offset = torch.zeros(self.batch_size, dtype=torch.float32)
        self.reset_calls = 0
        self.step_calls = 0
        self.close_calls = 0
        self.reset_masks: list[torch.Tensor | None] = []
        self.seeds: list[tuple[int, bool]] = []

    # -- helpers ----------------------------------------------------------------------------
    @property
    def numel(self) -> int:
        return math.prod(self.batch_size)

    def _observation(self) -> torch.Tensor:
        return torch.stack(
            [self.count.to(torch.float32), self.last_action.to(torch.float32), self.offset], dim=-1
        ).to(self.device)

    def _flags(self, terminated: torch.Tensor, truncated: torch.Tensor) -> dict[str, torch.Tensor]:
        shape = (*self.batch_size, 1)
        out = {"done": (terminated | truncated).reshape(shape).to(self.device)}
        if self.with_terminated:
            out["terminated"] = terminated.reshape(shape).to(self.device)
        if self.with_truncated:
            out["truncated"] = truncated.reshape(shape).to(self.device)
        return out

    # -- the torchrl-style interface ----------------------------------------------------------
    def reset(self, td: TensorDict | None = None) -> TensorDict:
        self.reset_calls += 1
        if td is not None and "_reset" in td.keys():
            mask = td.get("_reset").reshape(*self.batch_size, -1).any(-1).cpu()
        else:
            mask = torch.ones(self.batch_size, dtype=torch.bool)
        self.reset_masks.append(None if td is None or "_reset" not in td.keys() else mask.clone())
        self.count[mask] = 0
        self.last_action[mask] = 0
        self.offset[mask] = torch.rand(self.batch_size, generator=self.generator)[mask]
        no = torch.zeros(self.batch_size, dtype=torch.bool)
        return TensorDict(
            {"observation": self._observation(), **self._flags(no, no)},
            batch_size=self.batch_size,
            device=self.device,
        )

    def step(self, td: TensorDict) -> TensorDict:
        self.step_calls += 1
        action = td.get("action").to(torch.int64).cpu().reshape(self.batch_size)
        self.last_action = action.clone()
        self.count += 1
        never = torch.zeros(self.batch_size, dtype=torch.bool)
        terminated = never if self.max_steps is None else self.count >= self.max_steps
        truncated = never if self.truncate_at is None else self.count >= self.truncate_at
        truncated = truncated & ~terminated
        nxt = TensorDict(
            {
                "observation": self._observation(),
                "reward": torch.ones(*self.batch_size, 1, dtype=torch.float32, device=self.device),
                **self._flags(terminated, truncated),
            },
            batch_size=self.batch_size,
            device=self.device,
        )
        td.set("next", nxt)
        return td

    def rand_action(self, td: TensorDict | None = None) -> TensorDict:
        if td is None:
            td = TensorDict({}, batch_size=self.batch_size, device=self.device)
        action = torch.randint(0, self.num_actions, self.batch_size, generator=self.generator)
        td.set("action", action.to(self.device))
        return td

    def set_seed(self, seed: int, static_seed: bool = False) -> int:
        self.seeds.append((int(seed), static_seed))
        self.generator.manual_seed(int(seed))
        return int(seed) if static_seed else int(seed) + self.numel

    def state_dict(self) -> dict:
        return {
            "count": self.count.clone(),
            "last_action": self.last_action.clone(),
            "offset": self.offset.clone(),
            "generator": self.generator.get_state(),
        }

    def load_state_dict(self, state: dict) -> None:
        self.count = state["count"].clone()
        self.last_action = state["last_action"].clone()
        self.offset = state["offset"].clone()
        self.generator.set_state(state["generator"])

    def close(self) -> None:
        self.close_calls += 1
