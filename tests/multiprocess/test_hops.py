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
SYNC_HOPS = 15


def test_one_multisync_batch_passes_fifteen_files_in_the_main_process():
    sequence = count_hops(MultiSyncCollector)
    assert len(sequence) - 1 == SYNC_HOPS, " > ".join(sequence)
    # the data path of the main process, in order: the face, the gather, the slots and pool,
    # the slot's batch, the statistics (the gather reports the batch, stats.py counts it), delivery
    assert sequence == [
        "base.py", "multiprocess/collector.py", "multiprocess/gather.py", "multiprocess/slots.py",
        "multiprocess/pool.py", "multiprocess/gather.py", "multiprocess/slots.py", "multiprocess/gather.py",
        "multiprocess/stats.py", "metrics.py", "multiprocess/stats.py", "multiprocess/gather.py",
        "multiprocess/collector.py", "base.py", "data.py", "base.py"]


def test_the_architecture_doc_gives_the_measured_counts():
    text = ARCHITECTURE.read_text()
    sync_row = next(line for line in text.splitlines() if line.startswith("| `MultiSyncCollector` (default"))
    assert re.search(rf"/ {SYNC_HOPS} \|\s*$", sync_row), sync_row
