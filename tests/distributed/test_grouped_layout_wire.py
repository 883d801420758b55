"""A grouped env's batch layout through the distributed protocol: its sub-TensorDict batch dims
(an agent dim) reach rank 0, which builds the batch with torchrl's sub-TensorDict batch sizes.
(The same with real nodes and torchrl's envs: tests/torchrl/test_torchrl_marl.py.)"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from rlcollect.data import BatchBuffer, BatchLayout
from rlcollect.distributed.control import protocol as P
from rlcollect.envs.base import ArraySpec

AGENT = ArraySpec((3, 2), np.dtype(np.float32))


def grouped_layout() -> BatchLayout:
    fields = {("agents", "observation"): AGENT, ("next", "agents", "observation"): AGENT,
              "done": ArraySpec((1,), np.dtype(np.bool_))}
    return BatchLayout(fields, torch.Size([2]), 5, ((("agents",), (3,)), (("next", "agents"), (3,))))


def test_the_group_dims_of_a_layout_travel_to_rank_0():
    back = P.layout_from_json(json.loads(json.dumps(P.layout_to_json(grouped_layout()))))
    assert back == grouped_layout()
    td = BatchBuffer(back).td
    assert td["agents"].batch_size == td["next", "agents"].batch_size == (2, 5, 3)


def test_a_layout_without_groups_still_reads():
    data = P.layout_to_json(grouped_layout())
    del data["groups"]
    assert P.layout_from_json(data).groups == ()


@pytest.mark.parametrize("groups", [[["agents", [-3]]], [[7, [3]]], [["agents"]], "agents"])
def test_malformed_groups_are_a_protocol_error(groups):
    with pytest.raises(P.ProtocolError):
        P.layout_from_json({**P.layout_to_json(grouped_layout()), "groups": groups})


def lazy_layout() -> BatchLayout:
    """Two agents of different shapes, lazily stacked along the agent dim (torchrl's
    ``HeterogeneousCountingEnv``): each agent's entries are fields of their own."""
    fields = {("lazy", "#0", "vector"): ArraySpec((3,), np.dtype(np.float32)),
              ("lazy", "#1", "vector"): ArraySpec((2,), np.dtype(np.float32)),
              "done": ArraySpec((1,), np.dtype(np.bool_))}
    return BatchLayout(fields, torch.Size([2]), 5, (), ((("lazy",), 2, 0),))


def test_the_lazy_stacks_of_a_layout_travel_to_rank_0():
    back = P.layout_from_json(json.loads(json.dumps(P.layout_to_json(lazy_layout()))))
    assert back == lazy_layout()
    lazy = BatchBuffer(back).td["lazy"]
    assert type(lazy).__name__ == "LazyStackedTensorDict"
    assert (lazy.batch_size, lazy.stack_dim) == ((2, 5, 2), 2)
    assert [agent["vector"].shape for agent in lazy.tensordicts] == [(2, 5, 3), (2, 5, 2)]


@pytest.mark.parametrize("lazy", [[[["lazy"], 0, 0]], [[["lazy"], 2, -1]], [[["lazy"], 2]], [[7, 2, 0]], "lazy"])
def test_malformed_lazy_stacks_are_a_protocol_error(lazy):
    with pytest.raises(P.ProtocolError):
        P.layout_from_json({**P.layout_to_json(lazy_layout()), "lazy": lazy})
