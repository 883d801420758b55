"""The main-process hops of one multi-process batch (docs/architecture.md's count, made by
``bench/hops.py``): the files the thread that yields a batch passes through stay few, and the
figure in the docs stays true."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from bench.hops import count_hops
from rlcollect import MultiSyncCollector

pytestmark = pytest.mark.timeout(120)

ARCHITECTURE = Path(__file__).resolve().parents[2] / "docs" / "architecture.md"

#: The count docs/architecture.md gives (its table's "now" column); a change of the sequence
#: must update it there. (An async batch's count varies with the polls it waits through.)
SYNC_HOPS = 9


def test_one_multisync_batch_passes_nine_files_in_the_main_process():
    returns: list[tuple[str, bool]] = []
    sequence = count_hops(MultiSyncCollector, returns=returns)
    assert len(sequence) - 1 == SYNC_HOPS, " > ".join(sequence)
    # the data path of the main process, in order: the members (the face's _collect_next is
    # Members.next_batch), the gather, the slots (picked: the batch is a view of the slot the
    # workers write) and pool, the gather again (its report goes back with the batch), the
    # members (MemberStats counts it), delivery
    assert sequence == [
        "base.py", "members.py", "multiprocess/gather.py", "multiprocess/slots.py", "multiprocess/pool.py",
        "multiprocess/gather.py", "members.py", "base.py", "data.py", "base.py"]
    # with every return counted (a file returned to that makes no call before the next hop, which
    # the sequence does not see): the same files
    assert {name for name, _ in returns} == set(sequence)


def test_the_architecture_doc_gives_the_measured_counts():
    text = ARCHITECTURE.read_text()
    sync_row = next(line for line in text.splitlines() if line.startswith("| `MultiSyncCollector` (default"))
    assert re.search(rf"/ {SYNC_HOPS} \|\s*$", sync_row), sync_row
