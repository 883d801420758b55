"""The main-process hops of one distributed batch (docs/architecture.md's row, made by
``python -m bench.hops --collector distributed``): the files the trainer's thread passes through
for one sync batch of two local nodes stay these. The hop count varies with the polls a batch
waits through (97-102 measured; 100 with Members; 94-96 with the face off the batch path, 2026-12-07), so the
files are pinned, and the count is bounded."""

from __future__ import annotations

import pytest

from bench.hops import count_hops
from rlcollect import DistributedCollector

pytestmark = pytest.mark.timeout(120)

#: The package files of one sync batch (docs/architecture.md's distributed row: 14 files).
FILES = {
    "base.py", "data.py", "metrics.py", "members.py",
    "distributed/collector.py", "distributed/gather.py", "distributed/pool.py", "distributed/nodes.py",
    "distributed/node_weights.py",
    "distributed/control/channel.py", "distributed/control/messages.py", "distributed/control/wire.py",
    "distributed/control/auth.py", "distributed/control/transport.py",
}

#: Passed only when the batch waits long enough for the pool's periodic liveness check of the
#: nodes (their processes, their beats) to run in the trainer's thread: on a loaded machine
#: (the loaded `make test` of 2026-12-07, load ~7-17) the same batch passes these two more.
LIVENESS = {"distributed/launch/launchers.py", "distributed/control/heartbeat.py"}


def test_one_distributed_batch_passes_these_files_in_the_main_process():
    walk: list[tuple[str, bool]] = []
    sequence = count_hops(DistributedCollector, returns=walk)
    assert FILES <= set(sequence) <= FILES | LIVENESS, " > ".join(sequence)
    assert sequence[0] == "base.py" and sequence[-3:] == ["base.py", "data.py", "base.py"]  # delivered by the base
    assert len(sequence) - 1 <= 120, " > ".join(sequence)  # 97-102 measured (2026-12-07)
    assert [name for name, _ in walk][0] == "base.py" and len(walk) >= len(sequence)
