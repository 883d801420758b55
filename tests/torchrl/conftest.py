"""What every torchrl side-by-side test shares: torchrl's objects may hold multiprocessing locks
until collected, so each test ends with a garbage collection."""

import gc

import pytest


@pytest.fixture(autouse=True)
def _collect_torchrl_objects():
    yield
    gc.collect()
