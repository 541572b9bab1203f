import os
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(__file__))

import harness  # noqa: E402
from harness import shm_entries  # noqa: E402


@pytest.fixture(autouse=True)
def no_shm_leak():
    """Every test must leave /dev/shm as it found it, crashed ranks included.

    A segment of one of this test's jobs (its name carries the job token) fails at once. Any
    other new fastcomm-* entry fails only if it is still there after a grace period: another
    job on the machine (a concurrent build's tests) may be inside its own init, and its
    segments are gone as soon as its ranks have attached them, or, if one of its ranks died
    during init, once its survivors' init timed out (seconds). Only such foreign entries
    ever wait out the grace period."""
    before = set(shm_entries())
    tokens_before = set(harness.TOKENS_SEEN)
    yield
    ours = harness.TOKENS_SEEN - tokens_before
    leaked = set(shm_entries()) - before
    mine = sorted(n for n in leaked if any(tok in n for tok in ours))
    assert not mine, f"shared-memory segments left behind: {mine}"
    deadline = time.monotonic() + 15.0
    while leaked and time.monotonic() < deadline:
        time.sleep(0.05)
        leaked &= set(shm_entries())
    assert not leaked, f"shared-memory segments left behind: {sorted(leaked)}"
