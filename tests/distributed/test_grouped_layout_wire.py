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
