"""Grouped TensorDict envs: action, reward and done entries under groups (multi-agent envs such
as torchrl's ``MultiAgentCountingEnv`` or ``VmasEnv``, nested and multi-key envs).

Such an env is not stepped through the array interface (one action, one reward and one done
flag per row): :class:`GroupedEnv` keeps the env's own TensorDict API, and
``rlcollect/rollout_grouped.py`` steps it as torchrl's collectors do (``step_and_maybe_reset``,
which resets only the rows, groups or agents whose ``_reset`` the env asks for), writing every
leaf the env's ``fake_tensordict()`` has into the batch.  Duck typing only: torchrl is imported
only to add torchrl's own ``StepCounter`` to a torchrl env for ``max_frames_per_traj``.

The env this wraps has ``batch_size``, ``reset(td=None)``, ``step_and_maybe_reset(td)``,
``rand_action(td)``, ``fake_tensordict()``, ``action_keys``, ``reward_keys``, ``done_keys`` and
``set_seed``; rlcollect's own PettingZoo and VMAS adapters (``envs/pettingzoo.py``,
``envs/vmas.py``) have them too.

Agents of different shapes (torchrl's ``HeterogeneousCountingEnv``): a group that the env gives
as a ``LazyStackedTensorDict`` (one TensorDict per agent, each its own shapes) has no single
shape per key, while a batch is one dense tensor per field. Each agent's entries are then fields
of their own, keyed with the agent's place in the stack (``("lazy", "#0", "camera")``,
``("lazy", "#1", "camera")``, ...: :func:`agent_part`), the layout records the stack
(``BatchLayout.lazy``: the group, its agents and its stack dim) and the delivered batch lazily
stacks the agents' views again (``data.BatchBuffer.td``), so it has torchrl's structure.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from rlcollect.envs.base import ArraySpec, EnvBase, NestedKey, numpy_dtype

if TYPE_CHECKING:
    from tensordict import TensorDictBase

_ROOT = {"action_keys": {"action"}, "reward_keys": {"reward"}, "done_keys": {"done", "terminated", "truncated"}}


def _parts(key: NestedKey) -> tuple[str, ...]:
    return (key,) if isinstance(key, str) else tuple(key)


def _key(parts: tuple[str, ...]) -> NestedKey:
    return parts[0] if len(parts) == 1 else parts


def is_grouped(env: Any) -> bool:
    """Whether ``env`` (a TensorDict env) has an action, reward or done entry that is not the
    root one (``"action"``, ``"reward"``, ``"done"``/``"terminated"``/``"truncated"``)."""
    for name, accepted in _ROOT.items():
        try:
            keys = list(getattr(env, name))
        except Exception:  # noqa: BLE001  (not a torchrl-style env: the plain adapter checks it)
            return False
        if any(k not in accepted for k in keys):
            return True
    return False


def end_of_trajectory(td: TensorDictBase, done_fields: list[NestedKey], batch_dims: int,
                      stack_dims: dict | None = None) -> torch.Tensor:
    """Which env rows ended a trajectory this step: any ``done`` entry under ``"next"`` (the
    ``done`` beside each done key, as torchrl's collectors read it: ``GroupedEnv.done_fields``)
    set anywhere in the row, whatever the group or agent (a lazy group's agents one by one:
    :func:`resolve`)."""
    ended = None
    for key in done_fields:
        flag = resolve(td, key, stack_dims or {})
        if flag is None:
            continue
        flag = flag.reshape(*flag.shape[:batch_dims], -1).any(-1)
        ended = flag if ended is None else ended | flag
    if ended is None:
        return torch.zeros(td.batch_size, dtype=torch.bool)
    return ended


def _private(key: NestedKey) -> bool:
    return any(p.startswith("_") for p in _parts(key))


def agent_part(index: int) -> str:
    """The key part of a lazily stacked group's agent ``index`` in a batch layout (``"#0"``)."""
    return f"#{index}"


def agent_index(part: str) -> int | None:
    """The agent a key part names (``"#1"`` -> 1: :func:`agent_part`), None for any other part."""
    return int(part[1:]) if part[:1] == "#" and part[1:].isdigit() else None


def is_lazy_stack(value: Any) -> bool:
    """Whether ``value`` is a lazily stacked group (a ``LazyStackedTensorDict``: one TensorDict
    per agent, duck-typed so that tensordict is not imported here)."""
    return not isinstance(value, torch.Tensor) and hasattr(value, "tensordicts") and hasattr(value, "stack_dim")


def stack_agents(td: Any, lazy: tuple, dims: int) -> None:
    """Replace each lazy group's agents ``(*key, "#i")`` in ``td`` (batch dims ``dims``) by their
    lazy stack (innermost groups first), as the env gave them: torchrl's batch structure.
    ``lazy``: ``((key, agents, stack dim past dims),)``."""
    from tensordict import LazyStackedTensorDict

    for key, agents, stack in sorted(lazy, key=lambda entry: -len(_parts(entry[0]))):
        parts = _parts(key)
        group = td.get(parts)
        members = [group.get(agent_part(i)) for i in range(agents)]
        td.del_(parts)
        td.set(parts, LazyStackedTensorDict(*members, stack_dim=dims + stack))


def logical(key: NestedKey) -> NestedKey:
    """``key`` without its agent parts: ``("lazy", "#1", "camera")`` -> ``("lazy", "camera")``."""
    parts = tuple(p for p in _parts(key) if agent_index(p) is None)
    return _key(parts)


def resolve(td: Any, key: NestedKey, stack_dims: dict) -> Any:
    """The entry ``key`` of ``td``, where an agent part (``"#i"``) picks agent ``i`` of a lazily
    stacked group (its own TensorDict; a group that comes dense is unbound along the stack dim
    ``stack_dims[group]``, counted past the env's batch dims). None when an entry is missing."""
    parts = _parts(key)
    current = td
    for depth, part in enumerate(parts):
        index = agent_index(part)
        if index is None:
            current = current.get(part, None)
        elif hasattr(current, "tensordicts"):
            current = current.tensordicts[index] if index < len(current.tensordicts) else None
        else:  # (a lazy group this step gave dense)
            current = current.unbind(stack_dims[parts[:depth]])[index]
        if current is None:
            return None
    return current


def assign(td: Any, key: NestedKey, value: torch.Tensor, stack_dims: dict) -> None:
    """Set ``key`` of ``td`` to ``value`` (agent parts as in :func:`resolve`)."""
    parts = _parts(key)
    if not any(agent_index(p) is not None for p in parts):
        td.set(key, value)
        return
    parent = resolve(td, _key(parts[:-1]), stack_dims)
    parent.set(parts[-1], value)


def walk(td: Any, batch_dims: int):
    """What one step (or ``fake_tensordict()``) holds, a lazily stacked group's agents apart:
    ``(leaves, group_dims, lazy)``: ``{key: tensor}`` of every leaf (agent parts in the keys of a
    lazy group's entries), ``{key: dims}`` of every sub-TensorDict with batch dims of its own past
    ``batch_dims`` (an agent dim; a lazy group's agents included, not the group itself), and
    ``{key: (agents, stack dim past batch_dims)}`` of every lazy group."""
    leaves: dict[NestedKey, torch.Tensor] = {}
    group_dims: dict[NestedKey, tuple[int, ...]] = {}
    lazy: dict[NestedKey, tuple[int, int]] = {}

    def visit(sub: Any, prefix: tuple[str, ...], ordered: bool = False) -> None:
        # (a lazy group's agents in sorted key order: torchrl's consolidate_spec orders them by a
        # set, which differs between processes, and every worker or node must carve its batch
        # into the same fields in the same order as the main process's view of it)
        for name in sorted(sub.keys()) if ordered else sub.keys():
            value = sub.get(name)
            parts = (*prefix, name)
            if isinstance(value, torch.Tensor):
                leaves[_key(parts)] = value
            elif is_lazy_stack(value):
                lazy[_key(parts)] = (len(value.tensordicts), value.stack_dim - batch_dims)
                for i, agent in enumerate(value.tensordicts):
                    agent_parts = (*parts, agent_part(i))
                    if len(agent.batch_size) > batch_dims:
                        group_dims[_key(agent_parts)] = tuple(agent.batch_size[batch_dims:])
                    visit(agent, agent_parts, True)
            else:
                if len(value.batch_size) > batch_dims:
                    group_dims[_key(parts)] = tuple(value.batch_size[batch_dims:])
                visit(value, parts, ordered)

    visit(td, ())
    return leaves, group_dims, lazy


class GroupedEnv(EnvBase):
    """Wraps a TensorDict env whose action, reward or done entries lie under groups.

    ``obs_layout``: the root entries of one step other than actions and done flags;
    ``fields``: every leaf of ``fake_tensordict()`` (root and ``"next"``), per env row, which is
    what a batch of this env holds besides the policy's outputs; ``group_dims``: the extra
    batch dims of each sub-TensorDict (an agent dim), so that the batch's sub-TensorDicts have
    torchrl's batch sizes; ``lazy``: ``{group: (agents, stack dim)}`` of the lazily stacked
    groups (agents of different shapes), whose agents' entries are fields of their own
    (``("lazy", "#0", "camera")``: the module docstring); ``done_fields``: the fields, agent
    parts included, of the ``done`` flags under ``"next"`` that end a trajectory.

    """

    grouped = True

    def __init__(self, env: Any):
        for attr in ("reset", "step_and_maybe_reset", "fake_tensordict", "batch_size", "action_keys"):
            if not hasattr(env, attr):
                raise TypeError(f"env {type(env).__name__} lacks {attr!r}: not a grouped TensorDict env")
        self.env = env
        self.batch_size = torch.Size(env.batch_size)
        self.device = torch.device(getattr(env, "device", None) or "cpu")
        self._read_keys()
        self._root: TensorDictBase | None = None

    def _read_keys(self) -> None:
        env = self.env
        self.action_keys = list(env.action_keys)
        self.reward_keys = list(env.reward_keys)
        self.done_keys = list(env.done_keys)
        nb = len(self.batch_size)
        leaves, group_dims, lazy = walk(env.fake_tensordict(), nb)
        for key, (_, stack) in lazy.items():
            if stack < 0:
                raise TypeError(
                    f"env {type(env).__name__}: its entry {key!r} is a TensorDict lazily stacked along the env's "
                    f"batch dim {stack + nb} (batch size {list(self.batch_size)}): rlcollect collects lazy stacks "
                    "along an agent dim only; give the collector envs whose rows have one layout")
        self.lazy = lazy
        self.stack_dims = {_parts(k): nb + stack for k, (_, stack) in lazy.items()}
        self.fields = {k: ArraySpec(tuple(v.shape[nb:]), numpy_dtype(v.dtype)) for k, v in leaves.items()
                       if not _private(k)}
        self.group_dims = group_dims
        not_obs = set(self.action_keys) | set(self.done_keys) | set(self.reward_keys)
        self.obs_layout = {k: spec for k, spec in self.fields.items()
                           if _parts(k)[0] != "next" and logical(k) not in not_obs}
        first = self.action_keys[0]
        self.action_layout = self.fields.get(first, ArraySpec((), np.dtype(np.float32)))
        ends = {("next", *_parts(k)[:-1], "done") for k in self.done_keys}
        self.done_fields = [k for k in self.fields if _parts(logical(k)) in ends]
        self.has_truncated = any(_parts(k)[-1] == "truncated" for k in self.done_keys)

    # -- the TensorDict interface the grouped rollout uses -----------------------------------
    def reset(self, td: TensorDictBase | None = None) -> TensorDictBase:
        return self.env.reset() if td is None else self.env.reset(td)

    def step(self, td: TensorDictBase) -> TensorDictBase:
        return self.env.step(td)

    def step_and_maybe_reset(self, td: TensorDictBase) -> tuple[TensorDictBase, TensorDictBase]:
        return self.env.step_and_maybe_reset(td)

    def rand_action(self, td: TensorDictBase | None = None) -> TensorDictBase:
        return self.env.rand_action(td)

    def fake_tensordict(self) -> TensorDictBase:
        return self.env.fake_tensordict()

    def limit_steps(self, max_steps: int) -> None:
        """Truncate trajectories after ``max_steps`` steps (``max_frames_per_traj``): for a
        torchrl env, with torchrl's ``StepCounter`` appended as torchrl's collectors append it
        (its ``step_count`` entries join the batch); else the env's own ``limit_steps``."""
        if type(self.env).__module__.startswith("torchrl."):  # (before getattr: a SerialEnv's recurses)
            from torchrl.envs import StepCounter, TransformedEnv

            # StepCounter resets a step count beside each group's "done": without a root "done"
            # (torchrl's MultiAgentCountingEnv has "env_done") it fails at the first reset, in
            # torchrl's collector too; say so here instead
            parents = {_parts(k)[:-1] for k in self.done_keys}
            lacking = sorted(p for p in parents if (*p, "done") not in {_parts(k) for k in self.done_keys})
            if lacking:
                raise ValueError(
                    f"max_frames_per_traj={max_steps}: env {self!r} has no 'done' entry under {lacking} (its done keys "
                    f"are {self.done_keys}); torchrl's StepCounter, which counts the steps (as in torchrl's collector, "
                    "which fails on this env too), needs one beside each group's done flags")

            self.env = TransformedEnv(self.env, StepCounter(max_steps=max_steps))
        elif hasattr(self.env, "limit_steps"):
            self.env.limit_steps(max_steps)
        else:
            raise TypeError(f"max_frames_per_traj: env {type(self.env).__name__} is neither a torchrl env nor has "
                            "a limit_steps(max_steps) method")
        self._read_keys()

    # -- the array interface is not this env's ---------------------------------------------
    def reset_rows(self, rows, obs_out) -> None:
        raise TypeError(f"{self!r} is a grouped env: it is stepped by rlcollect's grouped rollout, "
                        "not through the array interface")

    step_rows = sample_actions = reset_rows

    def _seed(self, seed: int) -> None:
        self.env.set_seed(seed)

    def set_seed(self, seed: int, static_seed: bool = False) -> int:
        out = self.env.set_seed(seed, static_seed=static_seed)
        return int(seed) + self.num_rows if out is None else int(out)

    def state_dict(self) -> dict:
        fn = getattr(self.env, "state_dict", None)
        return dict(fn()) if fn is not None else {}

    def load_state_dict(self, state: dict) -> None:
        fn = getattr(self.env, "load_state_dict", None)
        if fn is not None:
            fn(state)
        elif state:
            raise ValueError(f"env {type(self.env).__name__} has no load_state_dict")

    def move_to(self, device: torch.device) -> None:
        """Move the wrapped env to ``device`` (``env_device``)."""
        if torch.device(getattr(self.env, "device", None) or "cpu") != device:
            self.env = self.env.to(device) or self.env
        self.device = device

    def close(self) -> None:
        close = getattr(self.env, "close", None)
        if close is not None and not getattr(self.env, "is_closed", False):
            close()

    def __repr__(self) -> str:
        name = getattr(self.env, "name", None) if type(self.env).__module__.startswith("rlcollect.") else None
        label = f"{name}, " if isinstance(name, str) else ""
        return f"{type(self.env).__name__}({label}batch_size={list(self.batch_size)})"
