"""Per-group timeouts: a group made with its own timeout fails its stalled ops after that
timeout, not init's. Through fastcomm's API (new_group / new_groups) and through the
torch.distributed backend (dist.new_group(timeout=...)). The message names the member the
op was waiting for.

In every run init's timeout is long (60 s) and the group's short (1 s); a member that never
issues its side makes the other's op fail with "timed out after 1000 ms" well before init's
timeout could fire. The staller stays alive (a death would be reported as such, not as a
timeout) until the waiter has seen its error, told through the run's store."""
from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import harness

import fastcomm as fc

INIT_TIMEOUT = 60.0
WELL_BEFORE = 30.0  # seconds: an op failing later than this was not timed by its group


def expect_timeout(fn, *needles):
    t0 = time.monotonic()
    with pytest.raises(dist.DistBackendError) as ei:
        fn()
    waited = time.monotonic() - t0
    msg = str(ei.value)
    # "the group's timeout": the message names which timeout ran out (and has the word
    # "timeout", which torch's own suite matches).
    for n in ("timed out after 1000 ms, the group's timeout",) + needles:
        assert n in msg, f"{n!r} not in {msg!r}"
    assert waited < WELL_BEFORE, f"failed after {waited:.1f}s: timed by init's timeout? {msg}"
    return waited


def wait_for(store, key):
    store.wait([key], timedelta(seconds=120))


def _api_body(rank, world):
    store = harness.child_store()
    g = fc.new_group([0, 1], timeout=1)
    (h,) = fc.new_groups([[0, 1]], timeout=timedelta(seconds=1))
    t = torch.full((4,), float(rank + 1))
    fc.barrier()  # (init's timeout) so that a rank slow to reach the store cannot time out the next op
    fc.all_reduce(t, group=g)  # both there once
    assert torch.equal(t, torch.full((4,), 3.0))
    if rank == 0:
        expect_timeout(lambda: fc.all_reduce(torch.ones(4), group=g), "rank 0", "group [0, 1]",
                       "(it was waiting for rank 1)")
        expect_timeout(lambda: fc.all_reduce(torch.ones(4), group=h), "rank 0", "waiting for rank 1")
        # A send/recv channel times out as its group does.
        expect_timeout(lambda: fc.recv(torch.ones(4), src=1, group=g), "rank 0", "waiting for rank 1")
        # A barrier's own timeout, shorter or longer than the group's (as torch's barrier takes).
        with pytest.raises(dist.DistBackendError, match="timed out after 300 ms, the call's own timeout"):
            fc.barrier(group=g, timeout=timedelta(milliseconds=300))
        with pytest.raises(dist.DistBackendError, match="timed out after 1500 ms, the call's own timeout"):
            fc.barrier(group=g, timeout=1.5)
        with fc.plan() as p:  # a plan keeps a barrier's own timeout
            fc.barrier(group=g, timeout=0.3)
        with pytest.raises(dist.DistBackendError, match="timed out after 300 ms, the call's own timeout"):
            p.start(async_op=False)
        store.set("timed_out", "1")
    else:
        wait_for(store, "timed_out")
    # The world group (init's timeout) is unaffected.
    u = torch.full((3,), float(rank))
    fc.all_reduce(u)
    assert torch.equal(u, torch.full((3,), 1.0))
    # Bad timeouts are refused before anything is made.
    for bad in (0, -1, timedelta(0)):
        with pytest.raises(ValueError, match="argument 'timeout' must be positive"):
            fc.new_group([0, 1], timeout=bad)
        with pytest.raises(ValueError, match="argument 'timeout' must be positive"):
            fc.barrier(group=g, timeout=bad)
    fc.barrier(timeout=timedelta(seconds=30), device_ids=[0])  # both there: passes
    return True


def test_group_timeout_through_fastcomm_api():
    harness.run(_api_body, 2, timeout=180, init_timeout=INIT_TIMEOUT)


def _named_body(rank, world):
    """A group of 4 in another order than the world's; rank 3 never issues: the others' timeouts
    name it as the member their op was waiting for (small ops, large ones, a broadcast from it)."""
    store = harness.child_store()
    g = fc.new_group([3, 0, 2, 1], timeout=1)
    fc.barrier()
    msgs = []
    if rank != 3:
        for n in (5, 1 << 18):
            msgs.append(expect_timeout(lambda: fc.all_reduce(torch.ones(n), group=g), "waiting for rank 3"))
        msgs.append(expect_timeout(lambda: fc.broadcast(torch.ones(7), src=3, group=g), "waiting for rank 3"))
        store.add("timed_out", 1)
    # Every rank stays until all three saw their timeouts (an exit would fail the others' ops
    # as a death instead).
    while store.add("timed_out", 0) < 3:
        time.sleep(0.01)
    return len(msgs)


def test_a_timeout_names_the_member_the_op_waited_for():
    assert harness.run(_named_body, 4, timeout=180, init_timeout=INIT_TIMEOUT) == [3, 3, 3, 0]


def _backend_body(rank, world):
    store = harness.child_store()
    dist.init_process_group("fastcomm", store=harness.child_store(), rank=rank, world_size=world,
                            timeout=timedelta(seconds=INIT_TIMEOUT))
    g = dist.new_group([0, 1], backend="fastcomm", timeout=timedelta(seconds=1),
                       use_local_synchronization=True)
    t = torch.full((4,), float(rank + 1))
    dist.all_reduce(t, group=g)
    assert torch.equal(t, torch.full((4,), 3.0))
    if rank == 0:
        expect_timeout(lambda: dist.all_reduce(torch.ones(4), group=g), "rank 0", "group [0, 1]")
        store.set("timed_out", "1")
    else:
        wait_for(store, "timed_out")
    u = torch.full((3,), float(rank))
    dist.all_reduce(u)
    assert torch.equal(u, torch.full((3,), 1.0))
    dist.destroy_process_group()
    return True


def test_group_timeout_through_backend():
    harness.run(_backend_body, 2, init=False, timeout=180)
