"""Recovery and release on the device path, on the fake device runtime (FASTCOMM_FAKE_DEVICE=1;
tests/test_device_streams.py has the stream semantics and the other hazards):

- H1: a channel whose op timed out goes on in a new epoch, its peer's side cancelled, not timed
  out; a group op awaiting its go is refused when a member's channel resets;
- H6: an abort that blocks holds up no other channel;
- H8: idle pair and group communicators are released, join streams reused; a member swaps a
  released group communicator before its next op;
- a device engine that failed on its own thread shuts down cleanly.
"""
from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import harness
from _helpers import expect
from _device import channels
from test_device_streams import FAKE, _until, dbg, dsync

import fastcomm as fc


def _recovery_body(rank, world):
    """H1: an op that times out resets its channel; the peer is told (its side of the op fails
    as cancelled, without a timeout of its own), and the pair goes on, that group included."""
    from datetime import timedelta
    g1 = fc.new_group([0, 1], timeout=timedelta(seconds=2))
    g2, cpu = fc.new_groups([[0, 1], [0, 1]])  # the init timeout (30 s)
    first = None
    if rank == 0:
        first = expect(dist.DistBackendError, lambda: fc.all_reduce(torch.ones(3), group=g1), "timeout", "rank 1")
    fc.barrier(group=cpu)  # a host op: rank 1 issues g1's first op only after rank 0's failed
    if rank == 1:
        first = expect(dist.DistBackendError, lambda: fc.all_reduce(torch.ones(3), group=g1), "cancelled", "rank 0")
    a = torch.full((4,), float(rank + 1))
    fc.all_reduce(a, group=g2)
    b = torch.full((4,), float(rank + 10))
    fc.all_reduce(b, group=g1)  # the group's next op runs in the channel's new epoch
    dsync()
    return first, a.tolist(), b.tolist()


def test_a_timed_out_channel_recovers():
    # g1 times out in 2 s; rank 1 would need a timeout of its own to fail without the reset.
    for first, a, b in harness.run(_recovery_body, 2, timeout=60, env=FAKE, init_timeout=30):
        assert a == [3.0] * 4 and b == [21.0] * 4, (first, a, b)


def _undecided_body(rank, world, kernels):
    """A large op of the group {0, 1, 2} on its group communicator: rank 2 has committed rank 0's
    proposal and awaits the go, rank 1 has not issued it yet, when rank 0's channel with rank 2
    is reset (a pair op of theirs times out; rank 2 never issues it). Rank 2 dropped its side in
    the reset, so rank 0 must not send a go: the op is refused on every member (before, ranks 0
    and 1 launched it and waited out the group's timeout, and the group's communicator failed for
    good), and the group's next op runs."""
    G = fc.new_group([0, 1, 2], timeout=timedelta(seconds=6))
    W = fc.new_group([0, 1, 2])  # host barriers
    P = fc.new_group([0, 2], timeout=timedelta(seconds=1)) if rank != 1 else None
    t = torch.full((2048,), float(rank + 1))  # 8 KB: past the threshold, on the group communicator
    w = fc.all_reduce(t, group=G, async_op=True) if rank != 1 else None
    if rank == 2:
        _until(lambda: dbg("awaiting_decision") == 1, "rank 2 committed G's op, awaiting rank 0's go")
    fc.barrier(group=W)
    pair = None
    if rank == 0:  # rank 2 never issues it: it times out and resets the channel 0-2
        pair = expect(dist.DistBackendError, lambda: fc.all_reduce(torch.ones(2), group=P), "rank 2")
    fc.barrier(group=W)
    if rank == 1:
        w = fc.all_reduce(t, group=G, async_op=True)
    first = expect(dist.DistBackendError, w.wait, "group [0, 1, 2]")
    fc.barrier(group=W)
    t2 = torch.full((2048,), float(rank + 1))
    fc.all_reduce(t2, group=G)
    dsync()
    return pair, first, t2[0].item()


@pytest.mark.parametrize("kernels", ["0", "8"], ids=["unbounded", "kernel-bound"])
def test_a_group_op_awaiting_its_go_is_refused_when_a_members_channel_resets(kernels):
    env = dict(FAKE, FASTCOMM_DEVICE_IPC="0", FASTCOMM_RSAG_THRESHOLD="4096", FASTCOMM_DEVICE_MAX_KERNELS=kernels)
    res = harness.run(_undecided_body, 3, kernels, timeout=90, env=env, init_timeout=30)
    for pair, first, after in res:
        assert "(6000 ms)" not in first, res  # nobody waited out G's timeout
        assert after == 6.0, res
    assert "cancelled before the go" in res[0][1], res


def _release_body(rank, world):
    """H8: an idle pair's communicator is released on both sides, and the pair's next op makes a
    new one; join streams of groups of 3 that are over are reused, not made anew."""
    pair = fc.new_group([0, 1]) if rank < 2 else None
    out = []
    if pair is not None:
        t = torch.full((3,), float(rank + 1))
        fc.all_reduce(t, group=pair)
        dsync()
        out.append(t.tolist())
        _until(lambda: dbg("ended_comms") >= 1, "the idle communicator released")
        released = dbg("live_comms") == 0 or rank == 1  # rank 1 may already hold the next one
        fc.all_reduce(t, group=pair)  # a new epoch, a new communicator
        dsync()
        out.append(t.tolist() if released else "not released")
    triples = fc.new_groups([[0, 1, 2]] * 30)
    for g in triples:
        x = torch.ones(5)
        fc.all_reduce(x, group=g, async_op=True).get_future().wait()
        out.append(x[0].item())
    out.append(dbg("join_streams"))
    return out


def test_idle_channels_are_released_and_join_streams_reused():
    env = dict(FAKE, FASTCOMM_DEVICE_IDLE_MS="100")
    res = harness.run(_release_body, 3, timeout=90, env=env, init_timeout=30)
    for rank, r in enumerate(res):
        if rank < 2:
            assert r[:2] == [[3.0] * 3, [6.0] * 3], r
            r = r[2:]
        assert r[:30] == [3.0] * 30, r
        assert r[30] <= 3, r  # join streams made, of 30 groups used one after another


def _slow_abort_body(rank, world):
    """H6: an abort that blocks (NCCL's can, for seconds) holds up no other channel: while the
    channel to rank 1 is being aborted, rank 0's ops with rank 2 go on."""
    from datetime import timedelta
    g01 = fc.new_group([0, 1], timeout=timedelta(seconds=1)) if rank < 2 else None
    g02, h02 = fc.new_groups([[0, 2], [0, 2]]) if rank != 1 else (None, None)
    everyone = fc.new_group([0, 1, 2])
    out = None
    if rank == 0:
        dbg("abort_hold")  # comm_abort blocks until released
        expect(dist.DistBackendError, lambda: fc.all_reduce(torch.ones(2), group=g01), "timeout", "rank 1")
    if rank != 1:
        fc.barrier(group=h02)  # a host op: rank 2 starts once rank 0's channel to rank 1 is aborting
        t = torch.full((3,), float(rank + 1))
        fc.all_reduce(t, group=g02)
        dsync()
        out = t.tolist()
    if rank == 0:
        dbg("abort_release")
    fc.barrier(group=everyone)  # rank 1 stays until then: its channel's fault is the timeout
    return out


def test_a_blocking_abort_holds_no_other_channel():
    res = harness.run(_slow_abort_body, 3, timeout=60, env=FAKE, init_timeout=30)
    assert res[0] == [4.0] * 3 and res[2] == [4.0] * 3, res


def _engine_failure_body(rank, world):
    """Rank 0's device engine fails on its own thread (the runtime makes no more streams; on a
    GPU a sticky CUDA error does that): the op fails naming it, fc.shutdown() still joins the
    engine thread and ends the plan graph it holds, and dropping the graph afterwards is clean
    (before, the unjoined thread aborted the process)."""
    from datetime import timedelta

    from _plan_cases import pair_plan
    store = harness.child_store()
    tri = fc.new_group([0, 1, 2], timeout=timedelta(seconds=2))
    p01, p02 = fc.new_groups([[0, 1], [0, 2]])
    for g in (p01, p02):  # the pair channels (and their streams) made beforehand
        if g.is_member:
            fc.all_reduce(torch.ones(2), group=g)
    dsync()
    graph = pair_plan(torch.ones(3), p01) if rank < 2 else None
    out = []
    if rank == 0:
        dbg("fail_new_streams", 1000)  # the join stream of the group of three is the next one
    w = fc.all_reduce(torch.ones(5), group=tri, async_op=True)
    if rank == 0:
        out.append(expect(dist.DistBackendError, lambda: w.wait(timedelta(seconds=30)), "device engine failed"))
        fc.shutdown()
        out.append(expect(dist.DistBackendError, graph.replay, "capture the plan again"))
        del graph  # the last reference to the engine: its thread was joined
        store.set("rank0-done", "1")
    else:
        # (Rank 0's data may have gone out before its fold failed: the peers' op may succeed.)
        try:
            w.wait(timedelta(seconds=30))
        except dist.DistBackendError:
            pass
        store.wait(["rank0-done"], timedelta(seconds=60))
    return len(out)


def test_a_device_engine_that_failed_on_its_thread_shuts_down_cleanly():
    assert harness.run(_engine_failure_body, 3, timeout=90, env=FAKE, init_timeout=30) == [2, 0, 0]


def _group_release_body(rank, world):
    """H8 for groups of 3+: a group communicator idle past FASTCOMM_DEVICE_IDLE_MS is released by
    the group's rank 0 on every member, and the group's next large op makes a new one."""
    g = fc.new_group([0, 1, 2])
    t = torch.full((2048,), float(rank + 1))
    fc.all_reduce(t, group=g)  # 8 KB: the group's communicator
    dsync()
    first = t[0].item()
    _until(lambda: dbg("group_comms") == 0, "the idle group communicator released")
    fc.all_reduce(t, group=g)
    dsync()
    return first, t[0].item(), dbg("group_comms")


def test_idle_group_communicators_are_released():
    env = dict(FAKE, FASTCOMM_DEVICE_IDLE_MS="100", FASTCOMM_RSAG_THRESHOLD="4096")
    assert harness.run(_group_release_body, 3, timeout=60, env=env, init_timeout=30) == [(6.0, 18.0, 1)] * 3


def _release_in_flight_body(rank, world):
    """Rank 0 releases an idle group communicator while rank 2's op on it has not run (its caller
    stream is held): rank 2's next op, whose go brings the new communicator, must wait for the
    swap, not go onto the old one, where rank 0 no longer is."""
    from datetime import timedelta
    store = harness.child_store()
    g = fc.new_group([0, 1, 2], timeout=timedelta(seconds=8))
    t = torch.full((2048,), float(rank))  # 8 KB: the group's communicator
    fc.broadcast(t, src=1, group=g)
    dsync()
    if rank == 2:
        dbg("hold")
    a = torch.full((2048,), float(10 + rank))
    wa = fc.broadcast(a, src=1, group=g, async_op=True)  # runs on ranks 0 and 1 only, for now
    if rank == 0:
        _until(lambda: wa.is_completed() and dbg("group_comms") == 0, "the idle communicator released")
        store.set("released", "1")
    else:
        store.wait(["released"], timedelta(seconds=60))
        _until(lambda: dbg("group_releases_heard") >= 1, "the release heard")
    b = torch.full((2048,), float(20 + rank))
    wb = fc.broadcast(b, src=1, group=g, async_op=True)
    if rank == 2:
        _until(lambda: dbg("group_next_ids") >= 2, "the go with the new communicator")
        dbg("release")
    wa.wait()
    wb.wait()
    dsync()
    return t[0].item(), a[0].item(), b[0].item()


def test_a_member_swaps_a_released_group_communicator_before_its_next_op():
    env = dict(FAKE, FASTCOMM_DEVICE_IDLE_MS="100", FASTCOMM_RSAG_THRESHOLD="4096")
    res = harness.run(_release_in_flight_body, 3, timeout=90, env=env, init_timeout=30)
    assert res == [(1.0, 11.0, 21.0)] * 3, res


def _shutdown_in_callback_body(rank, world):
    """A Future's callback (on the publisher's thread) calls fc.shutdown(): the teardown it waits
    for no longer joins that very thread (before, both ranks hung there for good)."""
    import threading

    g = fc.new_group([0, 1])
    t = torch.full((7,), float(rank + 1))
    ended = threading.Event()
    seen = {}

    def cb(fut):
        seen["value"] = fut.value()[0].tolist()
        fc.shutdown()
        ended.set()

    fc.all_reduce(t, group=g, async_op=True).get_future().then(cb)
    assert ended.wait(30), "fc.shutdown() from the callback did not return"
    refused = expect(Exception, lambda: fc.all_reduce(torch.ones(2), group=g), "not initialized")
    return seen["value"], refused


def test_shutdown_from_a_future_callback_returns():
    for value, refused in harness.run(_shutdown_in_callback_body, 2, timeout=60, env=FAKE, init=True):
        assert value == [3.0] * 7 and refused, (value, refused)


def _sticky_body(rank, world):
    """Rank 0's device context breaks for good (a sticky CUDA error: every later call fails) while
    an op is in flight. The engine's teardown makes device calls too: they fail as well, and the
    op still fails with DistBackendError naming the engine's failure, fc.shutdown() returns, and
    the process lives on (before, an exception out of teardown ended it in std::terminate)."""
    store = harness.child_store()
    g = fc.new_group([0, 1], timeout=timedelta(seconds=3))
    fc.all_reduce(torch.ones(4), group=g)  # the channel made beforehand
    dsync()
    out = None
    if rank == 0:
        dbg("hold")  # the op's input is never ready: it stays in flight
    w = fc.all_reduce(torch.ones(5), group=g, async_op=True)
    if rank == 0:
        dbg("sticky_error", 1)
        out = expect(dist.DistBackendError, lambda: w.wait(timedelta(seconds=30)), "sticky device error")
        dbg("release")
        fc.shutdown()  # its teardown's device calls fail too
        store.set("rank0-done", "1")
    else:
        try:  # (its peer's engine is gone: a failure or a timeout)
            w.wait(timedelta(seconds=30))
        except dist.DistBackendError:
            pass
        store.wait(["rank0-done"], timedelta(seconds=60))
    return out


@channels
def test_a_sticky_device_error_fails_the_op_and_shutdown_still_returns(channel):
    res = harness.run(_sticky_body, 2, timeout=90, env={**FAKE, **channel}, init_timeout=30)
    assert res[0] and res[1] is None, res


def _peer_shut_down_body(rank, world):
    """Rank 1 shuts fastcomm down (and lives on) while rank 0's op waits for it: the op fails at
    once saying so (the device channel's message said "exited" of a live process)."""
    store = harness.child_store()
    g = fc.new_group([0, 1], timeout=timedelta(seconds=300))
    fc.all_reduce(torch.ones(2), group=g)
    dsync()
    if rank == 1:
        fc.shutdown()
        store.set("down", "1")
        store.wait(["seen"], timedelta(seconds=60))
        return None
    store.wait(["down"], timedelta(seconds=60))
    w = fc.all_reduce(torch.ones(3), group=g, async_op=True)
    msg = expect(dist.DistBackendError, lambda: w.wait(timedelta(seconds=60)), "rank 1", "shut fastcomm down")
    store.set("seen", "1")
    return msg


@channels
def test_a_peer_that_shut_down_fails_device_ops_naming_it(channel):
    res = harness.run(_peer_shut_down_body, 2, timeout=90, env={**FAKE, **channel}, init_timeout=30)
    assert res[0], res
