"""torch's stream semantics on the device path, and the hazards of running ahead, on the fake
device runtime (FASTCOMM_FAKE_DEVICE=1). The fake's caller stream runs asynchronously, as a
GPU's does: "hold" queues a kernel that runs until "release", so a check that the host got
control back while the device had not run an op asserts an order, not a duration.

- a blocking call, Work.wait() and Work.block_current_stream() return once the op is
  enqueued, the caller's stream ordered after it; the host runs ahead of a long kernel, through
  1,000 ops of one group (pipelined: each is enqueued while the previous has not run);
  is_completed/synchronize/get_future follow the device, a future completed on the runtime's
  idle stream;
- events are pooled (flat over a long run);
- an error found after a blocking call returned is raised by the group's next op, natively and
  through torch.distributed (whose blocking calls wait() on the Work);
- each collective's future holds what the host path's holds (the output list of all_to_all and
  gather, as torch's NCCL backend gives it);
- H2: a zero-size op is agreed like any other (a mismatch, not a timeout);
- H3: int16 never reaches NCCL's reductions (the fake refuses it, as NCCL does);
- H4: an op's memory outlives every stream that may still write it, after an abort too;
- H5: the engine's event queries do not invalidate a graph the caller captures in the global mode;
(Recovery and release, H1, H6 and H8: tests/test_device_recovery.py.)
"""
from __future__ import annotations

import os
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import harness
from _helpers import expect

import fastcomm as fc

FAKE = {"FASTCOMM_FAKE_DEVICE": "1"}


def dbg(what, arg=0):
    return fc._state._engine.device_debug("cpu", what, arg)


def dsync():
    """What reading a CUDA tensor on the host does first: wait for the caller's stream."""
    fc._state._engine.device_synchronize("cpu")


def _until(pred, what, limit=60.0):
    """Waits for an event another process or thread causes; the limit only bounds a hang."""
    end = time.monotonic() + limit
    while not pred():
        if time.monotonic() > end:
            raise AssertionError(f"never happened: {what}")
        time.sleep(0.005)


# ---------------------------------------------------------------------------------------------
# Run-ahead and pipelining


def _run_ahead_body(rank, world, n):
    g = fc.new_group([0, 1])
    t = torch.full((33,), 2.0 ** -900, dtype=torch.float64)
    dbg("hold")  # a long kernel on the caller's stream: nothing after it runs until "release"
    for _ in range(n):
        fc.all_reduce(t, group=g)  # returns once enqueued, behind the previous op
    w = fc.all_reduce(t, group=g, async_op=True)
    w.wait()  # orders the caller's stream; never waits for the device
    pending = not w.is_completed()
    held = w.get_future()  # completed by the engine's publisher, on the runtime's idle stream
    dbg("release")
    w.synchronize()  # host-blocks until the device has run it
    done = w.is_completed()
    fut = fc.all_reduce(t, group=g, async_op=True).get_future()
    fut.wait()  # completes once the device has run the op
    held.wait()
    dsync()
    return (pending, done, t[0].item() == 2.0 ** (-900 + n + 2), bool(t.eq(t[0]).all()),
            dbg("idle_stream_calls") > 0)


def test_the_host_runs_ahead_of_the_device_through_1000_pipelined_ops():
    for r in harness.run(_run_ahead_body, 2, 1000, timeout=120, env=FAKE, init_timeout=60):
        assert r == (True, True, True, True, True), r


def _ahead_three_body(rank, world):
    """The same with a group of three (its folds on the group's own join stream) and a batch."""
    lists = [[0, 1, 2], [0, 1], [1, 2]]
    groups = fc.new_groups(lists)
    tri = groups[0]
    t = torch.full((7,), float(rank + 1))
    dbg("hold")
    for _ in range(5):
        fc.all_reduce(t, group=tri)
    mine = [(r, g) for r, g in zip(lists[1:], groups[1:]) if rank in r]
    ts = [torch.full((3,), float(rank * 10)) for _ in mine]
    with fc.batch() as b:
        for (ranks, g), x in zip(mine, ts):
            fc.all_reduce(x, group=g)
    b.wait()
    pending = not b.is_completed()
    dbg("release")
    dsync()
    return pending, t.tolist(), [(ranks, x.tolist()) for (ranks, _), x in zip(mine, ts)]


def test_a_group_of_three_and_a_batch_run_ahead():
    for rank, (pending, t, pairs) in enumerate(harness.run(_ahead_three_body, 3, timeout=90, env=FAKE,
                                                            init_timeout=30)):
        assert pending
        assert t == [6.0 * 3 ** 4] * 7
        for ranks, x in pairs:
            assert x == [float(sum(10 * r for r in ranks))] * 3


def _block_body(rank, world, via):
    """Work.block_current_stream() (torch's, and fastcomm.Work's and a batch's): returns with the
    op not yet run on the device, the caller's stream ordered after it."""
    if via == "backend":
        dist.init_process_group("fastcomm", store=harness.child_store(), rank=rank, world_size=world,
                                timeout=timedelta(seconds=30))
        ar = lambda t: dist.all_reduce(t, async_op=True)  # noqa: E731
    else:
        g = fc.new_group([0, 1])
        ar = lambda t: fc.all_reduce(t, group=g, async_op=True)  # noqa: E731
    try:
        t = torch.full((5,), float(rank + 1))
        u = torch.full((3,), float(rank + 1))
        dbg("hold")  # the op waits for the caller's stream, which runs nothing until "release"
        w = ar(t)
        w.block_current_stream()
        pending = [not w.is_completed()]
        if via == "native":
            with fc.batch() as b:
                fc.all_reduce(u, group=g)
            b.block_current_stream()
            pending.append(not b.is_completed())
        dbg("release")
        dsync()
        return pending, t.tolist(), u.tolist() if via == "native" else None
    finally:
        if via == "backend":
            dist.destroy_process_group()


@pytest.mark.parametrize("via", ["native", "backend"])
def test_block_current_stream_orders_the_stream_without_waiting_for_the_device(via):
    for pending, t, u in harness.run(_block_body, 2, via, timeout=90, env=FAKE, init=(via == "native")):
        assert all(pending) and t == [3.0] * 5, (pending, t)
        assert via == "backend" or u == [3.0] * 3, u


def _pool_body(rank, world):
    g = fc.new_group([0, 1])
    t = torch.ones(10)

    def step():
        fc.all_reduce(t, group=g, async_op=True).get_future().wait()

    for _ in range(20):
        step()
    c1 = dbg("events_created")
    for _ in range(300):
        step()
    return c1, dbg("events_created")


def test_events_are_pooled():
    for c1, c2 in harness.run(_pool_body, 2, timeout=90, env=FAKE, init_timeout=30):
        assert c2 - c1 <= 10, (c1, c2)


def _late_error_body(rank, world):
    g = fc.new_group([0, 1])
    if rank == 1:
        dbg("hold")  # its side of the op never runs
        w = fc.all_reduce(torch.ones(4), group=g, async_op=True)
        w.wait()  # enqueued on both sides
        os._exit(0)
    fc.all_reduce(torch.ones(4), group=g)  # returns once enqueued
    msg = expect(dist.DistBackendError, lambda: fc.all_reduce(torch.ones(4), group=g), "rank 1")
    return msg


def test_an_error_after_a_blocking_call_returned_is_raised_by_the_next_op():
    res = harness.run(_late_error_body, 2, timeout=60, env=FAKE, init_timeout=5, allow_fail=(1,))
    assert "rank 1" in res[0]


def _late_error_backend_body(rank, world, via):
    """Rank 0's stream is held, so a blocking all_reduce of a pair with a 2 s timeout returns
    (enqueued) and then fails on both sides; the group's next op raises it, through
    torch.distributed as natively (torch's wait() on a blocking call's Work is that call)."""
    if via == "backend":
        dist.init_process_group("fastcomm", store=harness.child_store(), rank=rank, world_size=world,
                                timeout=timedelta(seconds=30))
        g = dist.new_group([0, 1], timeout=timedelta(seconds=2))
        ar = lambda t: dist.all_reduce(t, group=g)  # noqa: E731
        bar = dist.barrier
    else:
        g = fc.new_group([0, 1], timeout=timedelta(seconds=2))
        host = fc.new_group([0, 1])
        ar = lambda t: fc.all_reduce(t, group=g)  # noqa: E731
        bar = lambda: fc.barrier(group=host)  # noqa: E731
    try:
        if rank == 0:
            dbg("hold")
        ar(torch.ones(4))  # returns once enqueued; rank 0's side runs only after the release
        if rank == 0:
            _until(lambda: dbg("channel_failed", 1) == 1, "the channel to rank 1 failed (timeout)")
            dbg("release")
            _until(lambda: dbg("deferred_errors") == 1, "the op's error kept for the group's next op")
        bar()
        b = torch.full((3,), float(rank + 1))
        # Rank 0's own op timed out after its call returned (deferred to this one); rank 1's
        # may be that too, or this op cancelled by rank 0's reset of the channel.
        msg = expect(dist.DistBackendError, lambda: ar(b), "group [0, 1]")
        bar()
        return msg
    finally:
        if via == "backend":
            dist.destroy_process_group()


@pytest.mark.parametrize("via", ["native", "backend"])
def test_a_late_error_of_a_blocking_call_reaches_the_next_op_through_either_api(via):
    res = harness.run(_late_error_backend_body, 2, via, timeout=90, env=FAKE, init=(via == "native"))
    assert "failed after its blocking call returned" in res[0], res


def _wait_timeout_body(rank, world):
    """Work.wait(timeout) on the device path raises once the timeout passes, saying what it
    waited for: its members' agreement (rank 1 has not issued the op), then, once enqueued, the
    device (rank 0's stream held); the op goes on and ends normally afterwards."""
    g, host = fc.new_groups([[0, 1], [0, 1]])
    t = torch.full((4,), float(rank + 1))
    msgs = []
    if rank == 0:
        dbg("hold")
        w = fc.all_reduce(t, group=g, async_op=True)
        msgs.append(expect(dist.DistBackendError, lambda: w.wait(timeout=0.2), "rank 0", "not yet agreed by its members",
                           "Work.wait timed out"))
    fc.barrier(group=host)
    if rank == 1:
        w = fc.all_reduce(t, group=g, async_op=True)
    fc.barrier(group=host)
    if rank == 0:
        w.wait()  # enqueued: orders the caller's stream, which is still held
        msgs.append(expect(dist.DistBackendError, lambda: w.wait(timeout=0.2), "not finished on the device"))
        dbg("release")
    w.wait()
    dsync()
    return msgs, t.tolist()


def test_a_device_wait_with_a_timeout_says_what_it_waited_for():
    res = harness.run(_wait_timeout_body, 2, timeout=60, env=FAKE, init_timeout=30)
    assert len(res[0][0]) == 2 and res[0][1] == res[1][1] == [3.0] * 4, res


def _future_values_body(rank, world):
    """Each collective's future holds what the host path's holds (torch's NCCL backend: the
    outputs), for async ops and a plan's start."""
    g = fc.new_group([0, 1, 2])

    def value(w):
        return [None if x is None else x.tolist() for x in w.get_future().wait()]

    out = {}
    outs = [torch.zeros(2) for _ in range(3)]
    out["all_to_all"] = value(fc.all_to_all(outs, [torch.full((2,), float(rank * 3 + j)) for j in range(3)], group=g,
                                            async_op=True))
    gl = [torch.zeros(3) for _ in range(3)] if rank == 0 else None
    out["gather"] = value(fc.gather(torch.full((3,), float(rank)), gl, dst=0, group=g, async_op=True))
    al = [torch.zeros(4) for _ in range(3)]
    out["all_gather"] = value(fc.all_gather(al, torch.full((4,), float(rank)), group=g, async_op=True))
    out["scatter"] = value(fc.scatter(torch.zeros(5), [torch.full((5,), float(j)) for j in range(3)] if rank == 0 else None,
                                      src=0, group=g, async_op=True))
    out["reduce_scatter"] = value(fc.reduce_scatter(torch.zeros(2), [torch.full((2,), float(rank + j)) for j in range(3)],
                                                    group=g, async_op=True))
    out["all_to_all_single"] = value(fc.all_to_all_single(torch.zeros(3), torch.arange(3.0) + 10 * rank, group=g,
                                                          async_op=True))
    pouts = [torch.zeros(1) for _ in range(3)]
    with fc.plan() as p:
        fc.all_to_all(pouts, [torch.full((1,), float(rank))] * 3, group=g)
    out["plan all_to_all"] = value(p.start())
    return out


def test_futures_hold_what_the_host_path_holds():
    device = harness.run(_future_values_body, 3, timeout=90, env=FAKE, init_timeout=30)
    host = harness.run(_future_values_body, 3, timeout=90, init_timeout=30)
    assert device == host, (device, host)
    assert host[0]["all_to_all"] == [[0.0, 0.0], [3.0, 3.0], [6.0, 6.0]] and host[1]["gather"] == [], host


# ---------------------------------------------------------------------------------------------
# Hazards


def _zero_body(rank, world):
    g = fc.new_group([0, 1])
    t = torch.ones(0 if rank == 0 else 4)
    msg = expect(dist.DistBackendError, lambda: fc.all_reduce(t, group=g), "mismatched op")
    z = torch.ones(0)
    fc.all_reduce(z, group=g)  # empty on both: agreed, nothing moves
    outs = [torch.empty(0) for _ in range(2)]
    fc.all_gather(outs, torch.empty(0), group=g)
    ok = torch.full((3,), float(rank + 1))
    fc.all_reduce(ok, group=g)
    dsync()
    return msg, ok.tolist()


def test_a_zero_size_op_against_a_non_empty_one_is_a_mismatch():
    # The group's timeout (60 s) is past the harness's: a timeout instead of the mismatch fails.
    for msg, ok in harness.run(_zero_body, 2, timeout=40, env=FAKE, init_timeout=60):
        assert "0 bytes" in msg, msg
        assert ok == [3.0] * 3


def _int16_body(rank, world):
    g = fc.new_group([0, 1, 2])
    t = torch.full((100,), rank + 1, dtype=torch.int16)
    fc.all_reduce(t, group=g)  # 200 bytes, past the threshold, but NCCL has no int16: the fold
    f = torch.full((100,), float(rank + 1))
    fc.all_reduce(f, group=g)  # the group's communicator
    m = torch.full((100,), rank + 1, dtype=torch.int16)
    fc.all_reduce(m, op=dist.ReduceOp.MAX, group=g)
    dsync()
    return t[0].item(), f[0].item(), m[0].item()


def test_int16_never_reaches_nccl_reductions():
    env = dict(FAKE, FASTCOMM_RSAG_THRESHOLD="64")
    assert harness.run(_int16_body, 3, timeout=60, env=env, init_timeout=30) == [(6, 6.0, 3)] * 3


def _late_write_body(rank, world):
    g = fc.new_group([0, 1])
    before = dbg("late_writes")
    if rank == 0:
        dbg("hold")  # its transfers wait behind the caller's stream
    w = fc.all_reduce(torch.ones(256), group=g, async_op=True)
    if rank == 0:
        # Its deadline passes and the channel is aborted while the receive still waits; the
        # peer's data has arrived, so the receive writes when the stream moves on.
        _until(lambda: dbg("channel_failed", 1) == 1, "the channel to rank 1 aborted")
        dbg("release")
    msg = expect(Exception, lambda: w.get_future().wait(), "timeout")
    dsync()
    return msg, dbg("late_writes") - before


def test_memory_outlives_the_streams_that_may_write_it():
    for msg, late in harness.run(_late_write_body, 2, timeout=60, env=FAKE, init_timeout=2):
        assert late == 0, msg


def _batch_end_body(rank, world, reps):
    """A batch of a pair op with work at its end (all_gather's copy of the own block, a pair
    all_reduce's fold) and an op of a group of 3 over the same pair: b.wait() must cover the pair
    op's end work, which goes onto the pair's stream after the other op's part was recorded
    there (a review's fuzz found results read stale, and freed memory written, 16-56 times in
    100). The tensors are kept, so a miss shows as a wrong result, not a crash."""
    g, g3 = fc.new_groups([[0, 1], [0, 1, 2]])
    kept, bad = [], 0
    n = 1 << 18
    for i in range(reps):
        inp = torch.full((n,), float(rank + 1))
        outs = [torch.zeros(n), torch.zeros(n)]
        t = torch.ones(1)
        with fc.batch() as b:
            if rank < 2:
                if i % 2 == 0:
                    fc.all_gather(outs, inp, group=g)
                else:
                    fc.all_reduce(inp, group=g)
            fc.all_reduce(t, group=g3)
        b.wait()
        dsync()
        kept.append((inp, outs, t))
        if rank < 2 and i % 2 == 0:
            bad += not (torch.equal(outs[0], torch.full((n,), 1.0)) and torch.equal(outs[1], torch.full((n,), 2.0)))
        elif rank < 2:
            bad += not torch.equal(inp, torch.full((n,), 3.0))
        bad += not torch.equal(t, torch.full((1,), 3.0))
    return bad


@pytest.mark.parametrize("ipc", ["0", "1"], ids=["nccl", "ipc"])
def test_a_batch_wait_covers_every_ops_end_work(ipc):
    env = dict(FAKE, FASTCOMM_DEVICE_IPC=ipc)
    assert harness.run(_batch_end_body, 3, 40, timeout=120, env=env, init_timeout=30) == [0, 0, 0]


def _capture_body(rank, world):
    pair, cpu = fc.new_groups([[0, 1], [0, 1]])
    t = torch.full((5,), float(rank + 1))
    if rank == 1:
        dbg("hold")  # rank 0's transfer stays in flight: its engine polls the device meanwhile
    w = fc.all_reduce(t, group=pair, async_op=True)
    w.wait()
    valid = None
    if rank == 0:
        dbg("begin_capture", 0)  # the caller captures unrelated work in the global mode
        seen = dbg("events_created")
        _until(lambda: not w.is_completed() and dbg("events_created") >= seen, "the op in flight")
        time.sleep(0.1)  # the engine thread polls its events meanwhile
        valid = dbg("end_capture")
    fc.barrier(group=cpu)  # a host op: rank 1 releases only after rank 0's capture ended
    if rank == 1:
        dbg("release")
    w.synchronize()
    dsync()
    return valid, t.tolist()


def test_the_engine_does_not_invalidate_a_graph_captured_meanwhile():
    res = harness.run(_capture_body, 2, timeout=60, env=FAKE, init_timeout=30)
    assert res[0] == (1, [3.0] * 5), res[0]
    assert res[1][1] == [3.0] * 5
