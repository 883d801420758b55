"""VMAS (batched, torch-native multi-agent simulators) as a grouped TensorDict env
(``envs/grouped.py``), without torchrl.

A VMAS env steps ``num_envs`` instances in one call and returns one tensor per agent, batched
over the instances, on its device. This adapter keeps them tensors end to end: each step stacks
the agents' observations and rewards (one copy each: ``torch.stack``), hands the policy's
``("agents", "action")`` to VMAS as per-agent views (``unbind``: no copy), and the grouped
rollout copies each leaf once into the batch. No numpy, no loop over instances; instances that
end are reset with one ``reset_at`` each (VMAS resets one instance per call), all of them with
one ``reset()``.

Layout, batch ``(num_envs,)``: ``("agents", "observation")`` ``(n_agents, *obs)``,
``("agents", "action")`` ``(n_agents, *action)``, ``("next", "agents", "reward")``
``(n_agents, 1)`` and the instance's ``"done"``, ``"terminated"``, ``"truncated"`` ``(1,)``.
"""

from __future__ import annotations

from typing import Any

import torch

AGENTS = "agents"
_FLAGS = ("done", "terminated", "truncated")


class VmasEnv:
    """A VMAS env (``vmas.make_env(...)``, or made here from ``scenario``) as a grouped env any
    rlcollect collector takes.

    Args:
        env: a VMAS ``Environment``; None to make one from ``scenario``.
        scenario: a VMAS scenario name (``"navigation"``) or object, with ``env=None``.
        num_envs: instances stepped per call (with ``scenario``).
        device: where VMAS simulates (with ``scenario``); the batch is written on the
            collector's storing device.
        **kwargs: more ``vmas.make_env`` arguments (``continuous_actions``, ``max_steps``,
            ``seed``, scenario arguments such as ``n_agents``).

    Example:
        >>> from rlcollect import Collector
        >>> env = VmasEnv(scenario="navigation", num_envs=64, max_steps=10, seed=0)
        >>> c = Collector(env, frames_per_batch=640)
        >>> batch = next(iter(c))
        >>> batch["agents", "observation"].shape, batch["next", "done"].sum().item()
        (torch.Size([64, 10, 4, 18]), 64)
        >>> c.shutdown()
    """

    action_keys = [(AGENTS, "action")]
    reward_keys = [(AGENTS, "reward")]
    done_keys = list(_FLAGS)

    def __init__(self, env: Any = None, *, scenario: Any = None, num_envs: int = 32, device: Any = "cpu", **kwargs):
        if env is None:
            if scenario is None:
                raise TypeError("VmasEnv needs a VMAS env or a scenario, got neither")
            import vmas

            env = vmas.make_env(scenario, num_envs=num_envs, device=device, terminated_truncated=True, **kwargs)
        elif scenario is not None or kwargs:
            raise TypeError("VmasEnv takes a VMAS env or a scenario with its arguments, not both")
        self.env = env
        self.n_agents = int(env.n_agents)
        self.batch_size = torch.Size([int(env.num_envs)])
        self.device = torch.device(env.device)
        self.name = type(getattr(env, "scenario", env)).__module__.rsplit(".", 1)[-1]
        obs_spaces = {repr(s) for s in env.observation_space.spaces}
        act_spaces = {repr(s) for s in env.action_space.spaces}
        if len(obs_spaces) > 1 or len(act_spaces) > 1:
            raise TypeError(f"env {self.name}: its agents have different observation or action spaces; VmasEnv "
                            "stacks them in one group and needs them equal")
        obs, act = env.observation_space.spaces[0], env.action_space.spaces[0]
        self._obs_shape = tuple(obs.shape)
        self._discrete = hasattr(act, "n")
        self._action_shape = () if self._discrete else tuple(act.shape)
        self._act_space = act
        self._split_flags = bool(getattr(env, "terminated_truncated", False))
        self._seed: int | None = None
        self._max_steps: int | None = None
        self._steps = torch.zeros(self.batch_size, dtype=torch.int64, device=self.device)

    def set_seed(self, seed: int, static_seed: bool = False) -> int:
        """The next reset seeds VMAS with ``seed``; returns ``seed + 1``."""
        self._seed = int(seed)
        return int(seed) if static_seed else int(seed) + 1

    def limit_steps(self, max_steps: int) -> None:
        """Truncate each instance's episode after ``max_steps`` steps (``max_frames_per_traj``)."""
        self._max_steps = int(max_steps)

    # -- TensorDicts --------------------------------------------------------------------------
    def _root(self, observation: torch.Tensor):
        from tensordict import TensorDict

        n = self.batch_size[0]
        group = TensorDict({"observation": observation}, batch_size=[n, self.n_agents], device=self.device)
        td = TensorDict({AGENTS: group}, batch_size=self.batch_size, device=self.device)
        for key in _FLAGS:
            td.set(key, torch.zeros(n, 1, dtype=torch.bool, device=self.device))
        return td

    def fake_tensordict(self):
        """Zeros in the layout of one step (root and ``"next"``)."""
        n = self.batch_size[0]
        zeros = torch.zeros(n, self.n_agents, *self._obs_shape, device=self.device)
        td = self._root(zeros)
        dtype = torch.int64 if self._discrete else torch.float32
        td.set((AGENTS, "action"), torch.zeros(n, self.n_agents, *self._action_shape, dtype=dtype, device=self.device))
        nxt = self._root(zeros.clone())
        nxt.set((AGENTS, "reward"), torch.zeros(n, self.n_agents, 1, device=self.device))
        td.set("next", nxt)
        return td

    def reset(self, td: Any = None):
        obs = self.env.reset(seed=self._seed)
        self._seed = None
        self._steps.zero_()
        return self._root(torch.stack(obs, 1))

    def rand_action(self, td: Any = None):
        """Uniform random actions for every instance and agent, from torch's random stream."""
        td = self.reset() if td is None else td
        n = self.batch_size[0]
        if self._discrete:
            action = torch.randint(0, int(self._act_space.n), (n, self.n_agents), device=self.device)
        else:
            low = torch.as_tensor(self._act_space.low, dtype=torch.float32, device=self.device)
            high = torch.as_tensor(self._act_space.high, dtype=torch.float32, device=self.device)
            action = low + (high - low) * torch.rand(n, self.n_agents, *self._action_shape, device=self.device)
        td.set((AGENTS, "action"), action)
        return td

    def step(self, td: Any):
        action = td.get((AGENTS, "action"))
        out = self.env.step(list(action.unbind(1)))
        if self._split_flags:
            obs, rewards, terminated, truncated, _ = out
        else:
            obs, rewards, terminated, _ = out
            truncated = torch.zeros_like(terminated)
        self._steps += 1
        if self._max_steps is not None:
            truncated = truncated | (self._steps >= self._max_steps)
        nxt = self._root(torch.stack(obs, 1))
        nxt.set((AGENTS, "reward"), torch.stack(rewards, 1).unsqueeze(-1))
        nxt.set("terminated", terminated.reshape(-1, 1))
        nxt.set("truncated", truncated.reshape(-1, 1))
        nxt.set("done", (terminated | truncated).reshape(-1, 1))
        td.set("next", nxt)
        return td

    def step_and_maybe_reset(self, td: Any):
        td = self.step(td)
        nxt = td.get("next")
        done = nxt.get("done").reshape(-1)
        root = self._root(nxt.get((AGENTS, "observation")))
        if bool(done.all()):
            return td, self.reset()
        if bool(done.any()):
            rows = done.nonzero().reshape(-1).tolist()
            for i in rows:  # VMAS resets one instance per call
                obs = self.env.reset_at(i)
            observation = root.get((AGENTS, "observation")).clone()
            observation[rows] = torch.stack(obs, 1)[rows]
            root.set((AGENTS, "observation"), observation)
            self._steps[rows] = 0
        return td, root

    def close(self) -> None:
        """VMAS holds nothing to release."""

    def __repr__(self) -> str:
        return f"VmasEnv({self.name})"
