import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from harness import shm_entries  # noqa: E402


@pytest.fixture(autouse=True)
def no_shm_leak():
    """Every test must leave /dev/shm as it found it, crashed ranks included."""
    before = set(shm_entries())
    yield
    leaked = set(shm_entries()) - before
    assert not leaked, f"shared-memory segments left behind: {sorted(leaked)}"
