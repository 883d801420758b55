"""PettingZoo's parallel API as a grouped TensorDict env (``envs/grouped.py``), without torchrl.

Every agent of ``possible_agents`` has a slot of the group ``"agents"`` (they must share one
observation space and one action space), so the batch's shapes never change:

- root: ``("agents", "observation")`` ``(n_agents, *obs)``, ``("agents", "mask")`` ``(n_agents,)``
  (True: the agent is in the episode and acts at this step), ``("agents", "action_mask")``
  ``(n_agents, n_actions)`` when the env gives action masks (a ``Dict`` observation with an
  ``"action_mask"``, or ``infos[agent]["action_mask"]``), the done flags ``"done"``,
  ``"terminated"``, ``"truncated"`` ``(1,)``;
- ``("agents", "action")``: ``(n_agents,)`` int64 for a ``Discrete`` space, ``(n_agents, d)``
  float32 for a ``Box`` (the actions of agents not in the episode are not sent to the env);
- ``"next"``: the observations, ``("agents", "reward")`` ``(n_agents, 1)``, each agent's
  ``"terminated"``, ``"truncated"`` and ``"done"`` ``(n_agents, 1)``, ``("agents", "mask")``
  (True: the agent acted at this step, so its next entries are real), and the episode's done
  flags ``(1,)``.

An agent that leaves early (terminated or truncated while others go on) has its real last step,
then zeros and ``mask`` False until the episode ends, which is when no agent is left (PettingZoo's
``env.agents`` empty). The episode's done flags are the env's only done keys, so a trajectory
id covers a whole episode; the agents' flags are data.
"""

from __future__ import annotations

import inspect
from typing import Any

import numpy as np
import torch

from rlcollect.envs.base import numpy_dtype, torch_dtype

AGENTS = "agents"
_FLAGS = ("done", "terminated", "truncated")


def is_parallel_env(env: Any) -> bool:
    """Whether ``env`` looks like a PettingZoo ``ParallelEnv`` (duck typing: PettingZoo is
    imported only where one is used). Attributes are looked up statically (the instance's and
    its class's, as ``inspect.getattr_static`` does): a ``__getattr__`` is never run, e.g.
    torchrl's ``SerialEnv``, whose ``__getattr__`` recurses without end before it has started."""
    def has(name: str) -> bool:
        return inspect.getattr_static(env, name, None) is not None

    return has("possible_agents") and has("observation_space") and has("step") and not has("agent_selection")


def is_aec_env(env: Any) -> bool:
    """Whether ``env`` looks like a PettingZoo ``AECEnv`` (agents acting by turns), looked up
    statically as ``is_parallel_env`` does."""
    def has(name: str) -> bool:
        return inspect.getattr_static(env, name, None) is not None

    # (an AEC wrapper passes possible_agents and agent_selection on through its __getattr__:
    # only AECEnv's own methods are found statically)
    return has("observe") and has("last") and has("agent_iter") and has("step")


class PettingZooEnv:
    """A PettingZoo parallel env, as a grouped TensorDict env any rlcollect collector takes
    (a raw ``ParallelEnv`` given to a collector is wrapped in this).

    Args:
        env: a PettingZoo ``ParallelEnv`` whose agents share one observation and one action
            space (``Discrete`` or ``Box`` actions).

    Example:
        >>> from mpe2 import simple_spread_v3
        >>> from rlcollect import Collector
        >>> env = PettingZooEnv(simple_spread_v3.parallel_env(N=3, max_cycles=5))
        >>> c = Collector(env, frames_per_batch=8)
        >>> batch = next(iter(c))
        >>> batch["next", "agents", "reward"].shape, batch["agents", "action"].dtype
        (torch.Size([8, 3, 1]), torch.int64)
        >>> c.shutdown()
    """

    batch_size = torch.Size([])
    device = torch.device("cpu")
    action_keys = [(AGENTS, "action")]
    reward_keys = [(AGENTS, "reward")]
    done_keys = list(_FLAGS)

    by_turns = False  # PettingZooAECEnv's: the agents act in turn

    def __init__(self, env: Any):
        if self.by_turns and not is_aec_env(env):
            raise TypeError(f"PettingZooAECEnv takes a PettingZoo AECEnv (possible_agents, agent_selection, observe, "
                            f"step), got {type(env).__name__}")
        if not self.by_turns and not is_parallel_env(env):
            raise TypeError(f"PettingZooEnv takes a PettingZoo ParallelEnv (possible_agents, observation_space(agent), "
                            f"step), got {type(env).__name__}"
                            + ("; an AECEnv (agents by turns) goes in PettingZooAECEnv" if is_aec_env(env) else ""))
        self.env = env
        self.agents = list(env.possible_agents)
        self.name = getattr(getattr(env, "metadata", None) or {}, "get", lambda *_: None)("name") or type(env).__name__
        spaces = {(repr(env.observation_space(a)), repr(env.action_space(a))) for a in self.agents}
        if len(spaces) > 1:
            raise TypeError(f"env {self.name}: its agents {self.agents} have different observation or action spaces; "
                            "PettingZooEnv stacks them in one group and needs them equal (pad them in a wrapper)")
        obs_space, act_space = env.observation_space(self.agents[0]), env.action_space(self.agents[0])
        self._masked = hasattr(obs_space, "spaces") and "action_mask" in obs_space.spaces
        if self._masked:
            obs_space = obs_space.spaces["observation"]
        self._obs_shape, self._obs_dtype = tuple(obs_space.shape), torch_dtype(np.dtype(obs_space.dtype))
        self._discrete = hasattr(act_space, "n")
        self._n_actions = int(act_space.n) if self._discrete else None
        self._action = ((), torch.int64) if self._discrete else (tuple(act_space.shape), torch.float32)
        self._info_masks = False  # learnt at the first reset: infos carry action masks
        self._max_steps: int | None = None
        self._steps = 0
        self._seed: int | None = None
        self._live = torch.zeros(len(self.agents), dtype=torch.bool)
        self._probed = False

    # -- the grouped-env interface -------------------------------------------------------------
    def set_seed(self, seed: int, static_seed: bool = False) -> int:
        """The next reset uses ``seed`` (PettingZoo seeds at reset); returns ``seed + 1``."""
        self._seed = int(seed)
        return int(seed) if static_seed else int(seed) + 1

    def limit_steps(self, max_steps: int) -> None:
        """Truncate every episode after ``max_steps`` steps (``max_frames_per_traj``)."""
        self._max_steps = int(max_steps)

    def fake_tensordict(self):
        """Zeros in the layout of one step (root and ``"next"``). The first call of an env with
        discrete actions resets it, to learn whether its infos carry action masks."""
        if self._discrete and not self._masked and not self._probed:
            self.reset()
        td = self._root(self._zeros_obs(), torch.zeros(len(self.agents), dtype=torch.bool), None)
        td.set(self.action_keys[0], torch.zeros(len(self.agents), *self._action[0], dtype=self._action[1]))
        td.set("next", self._next(self._zeros_obs(), torch.zeros(len(self.agents), 1), *(
            torch.zeros(len(self.agents), 1, dtype=torch.bool) for _ in range(2)), self._live.clone(), False, False,
            None))
        return td

    def reset(self, td: Any = None):
        kwargs = {} if self._seed is None else {"seed": self._seed}
        self._seed = None
        obs, infos = self.env.reset(**kwargs)
        self._steps = 0
        observation, masks = self._read(obs, infos, first=True)
        self._live = torch.tensor([a in obs for a in self.agents])
        return self._root(observation, self._live.clone(), masks)

    def rand_action(self, td: Any = None):
        """A uniformly random action per agent (within its action mask), drawn from torch's
        random stream."""
        if td is None:
            td = self.reset()
        n = len(self.agents)
        if self._discrete:
            mask = td.get((AGENTS, "action_mask"), None)
            if mask is None:
                action = torch.randint(self._n_actions, (n,))
            else:
                weights = mask.float()
                weights[weights.sum(-1) == 0] = 1.0  # (an agent out of the episode, or with nothing allowed)
                action = torch.multinomial(weights, 1).squeeze(-1)
        else:
            space = self.env.action_space(self.agents[0])
            low = torch.as_tensor(space.low, dtype=torch.float32)
            high = torch.as_tensor(space.high, dtype=torch.float32)
            action = low + (high - low) * torch.rand(n, *self._action[0])
        td.set(self.action_keys[0], action)
        return td

    def step(self, td: Any):
        # (flags in numpy, one tensor each at the end: a torch call per agent and flag cost more
        # than the env's own step, ~400 us on simple_spread)
        action = td.get(self.action_keys[0])
        acting = self._live.numpy().copy()
        values = action.tolist() if self._discrete else action.detach().cpu().numpy()
        sent = {a: values[i] for i, a in enumerate(self.agents) if acting[i]}
        obs, rewards, terms, truncs, infos = self.env.step(sent)
        self._steps += 1
        observation, masks = self._read(obs, infos, first=False)
        agents, current = self.agents, getattr(self.env, "agents", obs)
        reward = np.array([rewards.get(a, 0.0) for a in agents], dtype=np.float32)
        term = np.array([bool(terms.get(a, False)) for a in agents]) & acting
        trunc = np.array([bool(truncs.get(a, False)) for a in agents]) & acting
        live = np.array([a in current for a in agents]) & acting
        limit = self._max_steps is not None and self._steps >= self._max_steps and bool(live.any())
        if limit:  # max_frames_per_traj: every agent still in the episode is truncated
            trunc |= live
            live[:] = False
        episode_over = not live.any()
        all_terminated = episode_over and not limit and bool(term[acting].all())
        self._live = torch.from_numpy(live)
        nxt = self._next(observation, torch.from_numpy(reward[:, None]), torch.from_numpy(term[:, None]),
                         torch.from_numpy(trunc[:, None]), torch.from_numpy(acting), all_terminated,
                         episode_over and not all_terminated, masks)
        td.set("next", nxt)
        return td

    def step_and_maybe_reset(self, td: Any):
        td = self.step(td)
        nxt = td.get("next")
        if bool(nxt.get("done").any()):
            return td, self.reset()
        group = nxt.get(AGENTS)
        observation = group.get("observation")
        # (out of the episode: by turns, the agents the env dropped; else those that did not act)
        if self.by_turns:
            current = self.env.agents
            gone = torch.tensor([a not in current for a in self.agents])
        else:
            gone = ~self._live
        if bool(gone.any()):  # (an agent that left has its real last observation under "next" only)
            observation = observation.masked_fill(gone.reshape(-1, *([1] * len(self._obs_shape))), 0)
        return td, self._root(observation, self._live.clone(), group.get("action_mask", None))

    def close(self) -> None:
        self.env.close()

    def __repr__(self) -> str:
        return f"PettingZooEnv({self.name})"

    # -- building TensorDicts --------------------------------------------------------------------
    def _zeros_obs(self) -> torch.Tensor:
        return torch.zeros(len(self.agents), *self._obs_shape, dtype=self._obs_dtype)

    def _has_masks(self) -> bool:
        return self._masked or self._info_masks

    def _root(self, observation: torch.Tensor, mask: torch.Tensor, masks: torch.Tensor | None, **entries):
        """The root TensorDict of a step (``entries``: more of the group's, for ``"next"``)."""
        from tensordict import TensorDict

        group = {"observation": observation, "mask": mask}
        if self._has_masks():
            group["action_mask"] = masks if masks is not None else torch.zeros(len(self.agents), self._n_actions,
                                                                               dtype=torch.bool)
        group.update(entries)
        return TensorDict({AGENTS: TensorDict(group, batch_size=[len(self.agents)]),
                           **{key: torch.zeros(1, dtype=torch.bool) for key in _FLAGS}}, batch_size=[])

    def _next(self, observation, reward, term, trunc, acting, terminated: bool, truncated: bool, masks):
        td = self._root(observation, acting, masks, reward=reward, terminated=term, truncated=trunc, done=term | trunc)
        if terminated or truncated:
            td.set("terminated", torch.tensor([terminated]))
            td.set("truncated", torch.tensor([truncated]))
            td.set("done", torch.tensor([True]))
        return td

    def _read(self, obs: dict, infos: dict, first: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The stacked observations (zeros for agents not in ``obs``) and action masks."""
        out = np.zeros((len(self.agents), *self._obs_shape), dtype=numpy_dtype(self._obs_dtype))
        if first and not self._masked and self._discrete and not self._probed:
            self._probed = True
            self._info_masks = any(isinstance(i, dict) and "action_mask" in i for i in (infos or {}).values())
        masks = np.zeros((len(self.agents), self._n_actions), dtype=np.bool_) if self._has_masks() else None
        for i, agent in enumerate(self.agents):
            if agent not in obs:
                continue
            value = obs[agent]
            mask = None
            if self._masked:
                value, mask = value["observation"], value.get("action_mask")
            elif self._info_masks:
                mask = (infos.get(agent) or {}).get("action_mask")
            if masks is not None and mask is None and agent in getattr(self.env, "agents", obs):
                raise ValueError(
                    f"env {self.name}: agent {agent!r} has no action mask at step {self._steps} of the episode, but "
                    "the env gave action masks at its reset; a masked env must give one for every agent still in "
                    "the episode")
            array = np.asarray(value)
            if array.shape != self._obs_shape:
                raise ValueError(f"env {self.name}: agent {agent!r}'s observation has shape {array.shape} at step "
                                 f"{self._steps}, its space says {self._obs_shape}")
            out[i] = array
            if mask is not None:
                masks[i] = np.asarray(mask, dtype=np.bool_)
        return torch.from_numpy(out), None if masks is None else torch.from_numpy(masks)

    def _to_env(self, action: torch.Tensor) -> Any:
        return int(action) if self._discrete else action.detach().cpu().numpy()


class PettingZooAECEnv(PettingZooEnv):
    """A PettingZoo AEC env (agents acting by turns, e.g. PettingZoo's classic board games) in
    the same grouped layout as :class:`PettingZooEnv`, one frame per turn (a raw ``AECEnv``
    given to a collector is wrapped in this).

    At each frame ``("agents", "mask")`` is True for the one agent whose turn it is (the env's
    ``agent_selection``): only its action is sent. Every agent's observation is the env's
    ``observe(agent)`` (zeros once it left), its action mask the observation's
    ``"action_mask"``. Under ``"next"``, each agent's reward, terminated and truncated are the
    env's after the turn (``rewards``, ``terminations``, ``truncations``: an agent that did not
    act may get a reward, as the loser of a board game does), and ``("next", "agents",
    "mask")`` is True for the agents in the episode before the turn, whose entries are real.
    Turns the env gives to agents already done (AEC's ``step(None)``) are taken here, not
    collected; the episode ends when no agent is left.

    Example:
        >>> from pettingzoo.classic import tictactoe_v3
        >>> from rlcollect import Collector
        >>> c = Collector(PettingZooAECEnv(tictactoe_v3.env()), frames_per_batch=9)
        >>> batch = next(iter(c))
        >>> batch["agents", "mask"].sum(-1).tolist() == [1] * 9  # one agent acts per frame
        True
        >>> c.shutdown()
    """

    by_turns = True

    def _turn(self) -> torch.Tensor:
        """One-hot: whose turn it is (none once the episode is over)."""
        env = self.env
        turn = torch.zeros(len(self.agents), dtype=torch.bool)
        if env.agents:
            turn[self.agents.index(env.agent_selection)] = True
        return turn

    def _skip_done_turns(self) -> None:
        env = self.env
        while env.agents and (env.terminations.get(env.agent_selection) or env.truncations.get(env.agent_selection)):
            env.step(None)

    def _observe(self, first: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        env = self.env
        return self._read({a: env.observe(a) for a in env.agents}, dict(env.infos), first=first)

    def reset(self, td: Any = None):
        kwargs = {} if self._seed is None else {"seed": self._seed}
        self._seed = None
        self.env.reset(**kwargs)
        self._steps = 0
        self._skip_done_turns()
        observation, masks = self._observe(first=True)
        self._live = self._turn()
        return self._root(observation, self._live.clone(), masks)

    def step(self, td: Any):
        env = self.env
        action = td.get(self.action_keys[0])
        turn = self._live.clone()
        present = torch.tensor([a in env.agents for a in self.agents])
        env.step(self._to_env(action[int(turn.nonzero()[0, 0])]))
        self._steps += 1
        reward = torch.tensor([[float(env.rewards.get(a, 0.0))] for a in self.agents], dtype=torch.float32)
        term = torch.tensor([[bool(env.terminations.get(a, False))] for a in self.agents]) & present[:, None]
        trunc = torch.tensor([[bool(env.truncations.get(a, False))] for a in self.agents]) & present[:, None]
        observation, masks = self._observe(first=False)  # (before the done agents' turns remove them)
        self._skip_done_turns()
        limit = self._max_steps is not None and self._steps >= self._max_steps and bool(env.agents)
        if limit:  # max_frames_per_traj: every agent still in the episode is truncated
            still = torch.tensor([a in env.agents for a in self.agents])
            trunc |= still[:, None]
        episode_over = limit or not env.agents
        all_terminated = episode_over and not limit and bool(term[present].all())
        self._live = torch.zeros_like(turn) if episode_over else self._turn()
        td.set("next", self._next(observation, reward, term, trunc, present, all_terminated,
                                  episode_over and not all_terminated, masks))
        return td
