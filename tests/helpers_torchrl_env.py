"""A small torchrl-style TensorDict env for the collector tests (no torchrl import: duck typing).

``DuckCountingEnv`` has only the interface SPEC section 2 asks of a foreign env: ``batch_size``,
``device``, ``reset(td=None)`` (a boolean ``"_reset"`` entry resets only the flagged rows),
``step(td)`` writing ``"next"``, ``rand_action(td)``, ``set_seed(seed, static_seed=False)`` and
``close()``.

Dynamics per row ``i``: the observation (float32, shape ``(1,)``) is the number of steps since
that row's reset; row ``i`` terminates after ``max_steps + i`` steps, so the rows of a batched
env end at different times and the collector must reset them one by one.  The action is a
``Discrete(2)`` int64 index that does not change the dynamics; the reward is ``1.0``.
``with_truncated=False`` leaves the ``"truncated"`` entry out everywhere.
"""

from __future__ import annotations

import torch
from tensordict import TensorDict


class DuckCountingEnv:
    def __init__(self, batch_size=(), max_steps: int = 3, *, with_truncated: bool = True):
        self.batch_size = torch.Size(batch_size)
        self.device = torch.device("cpu")
        self.with_truncated = with_truncated
        rows = self.batch_size.numel()
        self.limits = (max_steps + torch.arange(rows)).reshape(self.batch_size)
        self.count = torch.zeros(self.batch_size, dtype=torch.int64)
        self.generator = torch.Generator().manual_seed(0)
        self.reset_masks: list[torch.Tensor | None] = []
        self.seeds: list[int] = []
        self.closed = 0

    def _done_entries(self, terminated: torch.Tensor) -> dict:
        shape = (*self.batch_size, 1)
        out = {"done": terminated.reshape(shape).clone(), "terminated": terminated.reshape(shape).clone()}
        if self.with_truncated:
            out["truncated"] = torch.zeros(shape, dtype=torch.bool)
        return out

    def _observation(self) -> torch.Tensor:
        return self.count.to(torch.float32).unsqueeze(-1)

    def reset(self, td: TensorDict | None = None) -> TensorDict:
        mask = None
        if td is not None and "_reset" in td.keys():
            mask = td.get("_reset").reshape(self.batch_size)
        self.reset_masks.append(None if mask is None else mask.clone())
        if mask is None:
            self.count.zero_()
        else:
            self.count[mask] = 0
        entries = {"observation": self._observation()}
        entries.update(self._done_entries(torch.zeros(self.batch_size, dtype=torch.bool)))
        return TensorDict(entries, batch_size=self.batch_size)

    def step(self, td: TensorDict) -> TensorDict:
        action = td.get("action")
        if action.shape != self.batch_size or action.dtype != torch.int64:
            raise ValueError(f"DuckCountingEnv: bad action {action.dtype} {tuple(action.shape)}")
        self.count += 1
        terminated = self.count >= self.limits
        entries = {"observation": self._observation(), "reward": torch.ones(*self.batch_size, 1)}
        entries.update(self._done_entries(terminated))
        td.set("next", TensorDict(entries, batch_size=self.batch_size))
        return td

    def rand_action(self, td: TensorDict | None = None) -> TensorDict:
        if td is None:
            td = TensorDict({}, batch_size=self.batch_size)
        td.set("action", torch.randint(0, 2, self.batch_size, generator=self.generator))
        return td

    def set_seed(self, seed: int, static_seed: bool = False) -> int:
        self.seeds.append(seed)
        self.generator.manual_seed(seed)
        return seed if static_seed else seed + 1

    def close(self) -> None:
        self.closed += 1
