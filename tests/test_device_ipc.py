"""Same-host device channels over IPC (csrc/device/ipc_link.h), on the fake device runtime:
FASTCOMM_DEVICE_IPC=1 makes every pair channel between ranks of one host an IPC link (a staging
ring per direction in a /dev/shm segment the sender owns and the receiver maps, ordered by flags
on the streams) instead of a fake NCCL communicator.

- results against local references (sizes incl. 0 and odd, dtypes, pairs, a triple, the world;
  batches; messages many times the ring, in odd chunks), any issue order, several threads, the
  host running ahead through 1,000 pipelined ops (plans hold host ops only: not on this path);
- the fake enforces the order: a receive that waits for nothing reads fresh (poisoned) ring
  memory or an older message, so skipping the wait fails the results;
- a peer killed with ops in flight, or one that stalls, fails only its ops, naming it, within the
  timeout; a timed-out channel goes on over a new link; idle links are released and made again; a
  peer that shuts down takes its link with it; scratch outlives a stream whose waits an abort
  released; a ring is never freed under a late opener's mapping; links are released, and
  /dev/shm is left as it was (the autouse fixture);
- FASTCOMM_DEVICE_IPC=0 keeps the channels on NCCL; a simulated second host does too; an engine
  made while a user captures a graph in the global mode still takes links (its probe runs
  relaxed) and leaves the capture intact.
"""
from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

import harness
import test_device_recovery as tdr
import test_device_streams as tds
import test_fake_device as tfd
from _helpers import expect, fold, gen, seed_of

import fastcomm as fc

IPC = {"FASTCOMM_FAKE_DEVICE": "1", "FASTCOMM_DEVICE_IPC": "1"}
# A 4 KiB ring (four 1 KiB slots): most messages below take many turns of it.
SMALL_RING = dict(IPC, FASTCOMM_DEVICE_IPC_RING_BYTES="4096")


def dbg(what, arg=0):
    return fc._state._engine.device_debug("cpu", what, arg)


def _until(pred, what, limit=30.0):
    end = time.monotonic() + limit
    while not pred():
        if time.monotonic() > end:
            raise AssertionError(f"never happened: {what}")
        time.sleep(0.01)


# ---------------------------------------------------------------------------------------------
# Results


@pytest.mark.parametrize("world,env", [(2, IPC), (3, SMALL_RING)])
def test_collectives_match_the_reference(world, env):
    sizes, dtypes = [0, 1, 7, 1000], ["float32", "bfloat16", "int64", "int16", "uint8"]
    ops = ["SUM", "AVG", "MAX", "MIN", "PRODUCT"]
    res = harness.run(_links_after(tfd._collectives_body), world, sizes, dtypes, ops, timeout=240, env=env)
    for checked, links, ring in res:
        assert checked > 0
        assert links == world - 1 and ring > 0, (links, ring)  # every channel went over IPC


def _links_after(body):
    def run(rank, world, *args):
        r = body(rank, world, *args)
        return r, dbg("ipc_links"), dbg("ipc_ring_bytes")
    run.__name__ = body.__name__
    return run


def _large_body(rank, world, numels):
    g = fc.new_group([0, 1])
    out = []
    for numel in numels:
        for dt in ("float32", "float64", "float16", "int32"):
            t = gen(rank, numel, dt, numel, "SUM")
            fc.all_reduce(t, group=g)
            tfd.assert_close(t, fold([gen(r, numel, dt, numel, "SUM") for r in (0, 1)], "SUM"), rtol=0, atol=0)
        # one direction at a time: broadcast, then send/recv
        b = gen(rank, numel + 1, "float32", numel)
        fc.broadcast(b, src=1, group=g)
        tfd.assert_close(b, gen(1, numel + 1, "float32", numel), rtol=0, atol=0)
        if rank == 0:
            fc.send(gen(0, numel + 2, "float32", numel), 1)
            tfd.dsync()  # its copies have run before the process may exit
        else:
            got = torch.empty(numel)
            fc.recv(got, 0)
            tfd.assert_close(got, gen(0, numel + 2, "float32", numel), rtol=0, atol=0)
        out.append(numel)
    return out, dbg("ipc_links")


def test_messages_many_times_the_ring():
    """A 4 KiB ring carries messages of up to 100x its size, in odd-sized last chunks, both
    directions at once (all_reduce) and one (broadcast, send/recv)."""
    numels = [255, 256, 257, 1023, 100_003]
    for out, links in harness.run(_large_body, 2, numels, timeout=120, env=SMALL_RING):
        assert out == numels and links == 1


def _batch_body(rank, world, count):
    lists = [[a, b] for a in range(world) for b in range(a + 1, world)] * (count // 6 + 1)
    lists = lists[:count]
    groups = fc.new_groups(lists)
    ts = {}
    with fc.batch() as b:
        for i, (ranks, g) in enumerate(zip(lists, groups)):
            if rank in ranks:
                ts[i] = gen(rank, i, "float32", 1 + i % 13)
                fc.all_reduce(ts[i], group=g)
    b.wait()
    for i, t in ts.items():
        tfd.assert_close(t, fold([gen(r, i, "float32", 1 + i % 13) for r in lists[i]], "SUM"), rtol=0, atol=0)
    return len(ts)


def test_a_batch_over_many_groups():
    res = harness.run(_batch_body, 4, 120, timeout=120, env=SMALL_RING, init_timeout=20)
    assert sum(res) == 2 * 120


def test_random_issue_orders_over_overlapping_groups():
    res = harness.run(tfd._random_order_body, 4, 7, 3, timeout=120, env=SMALL_RING, init_timeout=20)
    assert all(r for r in res)


def test_cyclic_issue_order_completes():
    for r in harness.run(tfd._cyclic_body, 3, timeout=60, env=IPC, init_timeout=10):
        assert r


def test_several_threads():
    for errors in harness.run(tfd._threads_body, 3, timeout=120, env=IPC, init_timeout=20):
        assert not errors


def test_the_host_runs_ahead_of_the_device_through_1000_pipelined_ops():
    for r in harness.run(tds._run_ahead_body, 2, 1000, timeout=120, env=IPC, init_timeout=60):
        assert r == (True,) * 5, r


# ---------------------------------------------------------------------------------------------
# The fake keeps the order the flags give


def _skip_waits_body(rank, world, skip):
    g = fc.new_group([0, 1])
    if skip:
        dbg("ipc_skip_waits", 1)
    bad = 0
    for i in range(4):
        if rank == 0:
            dbg("spin", 200)  # rank 0's copies into its ring come late
        t = torch.full((300,), float(rank + 10 * i))
        fc.all_reduce(t, group=g)
        tfd.dsync()
        bad += int(not torch.equal(t, torch.full((300,), float(1 + 20 * i))))
    return bad


def test_a_receive_that_waits_for_nothing_reads_wrong_data():
    """The engine's wait is what makes the result right: without it, rank 1 reads rank 0's
    ring before rank 0 wrote it (fresh poisoned memory, then an older message)."""
    assert harness.run(_skip_waits_body, 2, False, timeout=60, env=IPC) == [0, 0]
    bad = harness.run(_skip_waits_body, 2, True, timeout=60, env=IPC)
    assert bad[1] > 0, bad


def _early_waits_body(rank, world):
    issued = tfd._random_order_body(rank, world, 5, 3)
    # Messages of several laps of the 4 KiB ring, over every pair at once: sends wait for room.
    pairs = [[a, b] for a in range(world) for b in range(a + 1, world)]
    groups = fc.new_groups(pairs)
    works = []
    for k, (ranks, g) in enumerate(zip(pairs, groups)):
        if rank in ranks:
            t = gen(rank, k, "float32", 5003)
            works.append((ranks, t, k, fc.all_reduce(t, group=g, async_op=True)))
    for ranks, t, k, w in works:
        w.wait()
        tfd.assert_close(t, fold([gen(r, k, "float32", 5003) for r in ranks], "SUM"), rtol=0, atol=0)
    tfd.dsync()
    return issued, dbg("ipc_early_waits")


def test_a_stream_waits_only_on_work_the_peer_has_enqueued():
    """A flag wait goes onto a stream only once the peer's host has enqueued the write it waits
    for: on a GPU, a stream's wait holds the hardware queue it sits in, and with it other
    streams' work behind it (CUDA_DEVICE_MAX_CONNECTIONS), so a wait on a write nobody enqueued
    yet can close a cycle across processes. The fake counts such waits at enqueue time."""
    res = harness.run(_early_waits_body, 4, timeout=120, env=SMALL_RING, init_timeout=20)
    for issued, early in res:
        assert issued > 0
        assert early == 0, res


# ---------------------------------------------------------------------------------------------
# Faults


def _killed_body(rank, world, flag_dir):
    g01, g02, g12 = fc.new_groups([[0, 1], [0, 2], [1, 2]])
    warm = torch.ones(1000)
    if rank in (0, 2):
        fc.all_reduce(warm, group=g02)  # the link is up
    if rank in (1, 2):
        fc.all_reduce(torch.ones(1000), group=g12)
    tfd.dsync()
    if rank == 2:
        dbg("hold")  # its copies never run: ops in flight on both links
        fc.all_reduce(torch.ones(5000), group=g02, async_op=True)
        fc.all_reduce(torch.ones(5000), group=g12, async_op=True)
        open(os.path.join(flag_dir, "issued"), "w").close()
        time.sleep(0.3)
        os._exit(0)
    peer_group = g02 if rank == 0 else g12
    w = fc.all_reduce(torch.ones(5000), group=peer_group, async_op=True)
    t0 = time.monotonic()
    _until(w.is_completed, "the op with the dead peer settled")
    took = time.monotonic() - t0
    msg = str(w.exception())
    assert "rank 2" in msg, msg
    ok = torch.full((1001,), float(rank + 1))
    fc.all_reduce(ok, group=g01)
    tfd.dsync()
    _until(lambda: dbg("ipc_links") == 1, "the dead peer's link released")
    return msg, took, ok[:2].tolist(), dbg("ipc_ring_bytes")


def test_a_peer_killed_mid_run_fails_only_its_ops(tmp_path):
    res = harness.run(_killed_body, 3, str(tmp_path), timeout=90, env=IPC, init_timeout=5, allow_fail=(2,))
    for msg, took, ok, ring in res[:2]:
        # Found dead (the host engine's liveness check), not left to the 5 s timeout.
        assert "exited" in msg and "timeout" not in msg, (took, msg)
        assert ok == [3.0, 3.0]
        assert ring > 0  # the link with the live peer stays


def test_a_stalled_peer_times_out_and_others_go_on():
    res = harness.run(tfd._stalled_peer_body, 3, timeout=90, env=IPC, init_timeout=3)
    assert res[0][1] == [3.0, 3.0] and res[1][1] == [3.0, 3.0]


def test_an_error_after_a_blocking_call_returned_is_raised_by_the_next_op():
    res = harness.run(tds._late_error_body, 2, timeout=60, env=IPC, init_timeout=5, allow_fail=(1,))
    assert "rank 1" in res[0]


def test_memory_outlives_the_streams_that_may_write_it():
    """An aborted link lets its stream run on (its waits released): the receives then write
    garbage into scratch that must still be there."""
    for msg, late in harness.run(tds._late_write_body, 2, timeout=60, env=IPC, init_timeout=2):
        assert late == 0, msg


def test_a_timed_out_channel_recovers_on_a_new_link():
    for first, a, b in harness.run(tdr._recovery_body, 2, timeout=60, env=IPC, init_timeout=30):
        assert a == [3.0] * 4 and b == [21.0] * 4, (first, a, b)


def test_idle_links_are_released_and_made_again():
    env = dict(IPC, FASTCOMM_DEVICE_IDLE_MS="100")
    res = harness.run(tdr._release_body, 3, timeout=90, env=env, init_timeout=30)
    for rank, r in enumerate(res):
        if rank < 2:
            assert r[:2] == [[3.0] * 3, [6.0] * 3], r
            r = r[2:]
        assert r[:30] == [3.0] * 30, r


def test_shutdown_with_ops_in_flight_does_not_hang(tmp_path):
    res = harness.run(tfd._shutdown_inflight_body, 2, str(tmp_path), timeout=60, env=IPC, init_timeout=30)
    assert len(res) == 2


def _linked_pair(rank):
    """The pair [0, 1] with its IPC link up (an op run over it); returns the op's tensor."""
    g = fc.new_group([0, 1])
    t = torch.full((700,), float(rank + 1))
    fc.all_reduce(t, group=g)
    tfd.dsync()
    return t


def _peer_shutdown_body(rank, world, flag_dir):
    t = _linked_pair(rank)
    done = os.path.join(flag_dir, "released")
    if rank == 1:
        fc.shutdown()  # ends its links, waits a little for rank 0 to unmap its ring
        _until(lambda: os.path.exists(done), "rank 0 released its side")
        return t[0].item(), 0
    # Rank 0 is idle: its health check sees the peer's side ended and lets its own go; the
    # peer is alive, so its ring is freed only once the peer unmapped it.
    _until(lambda: dbg("ipc_links") == 0, "the link of a peer that shut down released")
    open(done, "w").close()
    return t[0].item(), dbg("ipc_ring_bytes")


def test_a_peer_that_shuts_down_takes_its_link_with_it(tmp_path):
    assert harness.run(_peer_shutdown_body, 2, str(tmp_path), timeout=60, env=IPC) == [(3.0, 0)] * 2


def _late_opener_body(rank, world):
    """Rank 1 maps rank 0's ring and is held there (its engine thread waits, the data mapped)
    while rank 0's op times out, its link ends and well past two seconds go by: rank 0 must not
    free the ring under rank 1's mapping (undefined on CUDA; the fake counts it), however late
    rank 1 comes back, and frees it once rank 1 has let it go."""
    from datetime import timedelta
    store = harness.child_store()
    g = fc.new_group([0, 1], timeout=timedelta(seconds=1))
    if rank == 1:
        dbg("ipc_open_hold", 1)
    w = fc.all_reduce(torch.ones(8), group=g, async_op=True)
    err = None
    if rank == 0:
        err = expect(dist.DistBackendError, w.wait, "timeout")
        time.sleep(3.0)  # rank 0's link has ended; rank 1 still holds the mapping
        store.set("late-opener/waited", "1")
        _until(lambda: dbg("ipc_links") == 0, "rank 0's ring freed once rank 1 let it go")
    else:
        store.wait(["late-opener/waited"], timedelta(seconds=30))
        dbg("ipc_open_hold", 0)
        try:
            w.wait()
        except dist.DistBackendError as e:
            err = str(e)
    store.set(f"late-opener/done-{rank}", "1")
    store.wait([f"late-opener/done-{r}" for r in range(world)], timedelta(seconds=30))
    return err is not None, dbg("ipc_freed_while_mapped")


def test_a_ring_is_never_freed_under_a_late_openers_mapping():
    assert harness.run(_late_opener_body, 2, timeout=60, env=IPC, init_timeout=30) == [(True, 0), (True, 0)]


def _busy_peer_body(rank, world):
    """Rank 0 shuts down while rank 1's stream has yet to read rank 0's ring (rank 1's side of
    the op is held behind a kernel): rank 0 keeps its ring rather than free it under rank 1's
    mapping (undefined on CUDA; the fake counts it), however long rank 1 takes. Before, the
    ring went 500 ms into rank 0's teardown."""
    from datetime import timedelta
    store = harness.child_store()
    g = fc.new_group([0, 1], timeout=timedelta(seconds=300))
    fc.all_reduce(torch.ones(8), group=g)  # the link made
    tfd.dsync()
    if rank == 1:
        dbg("hold")
    w = fc.all_reduce(torch.ones(8), group=g, async_op=True)
    if rank == 0:
        w.wait()  # enqueued
        fc.shutdown()
        store.set("busy-peer/down", "1")
    else:
        store.wait(["busy-peer/down"], timedelta(seconds=30))
        time.sleep(0.8)  # past the 500 ms rank 0's teardown waits for it
        dbg("release")
        try:
            w.wait(timedelta(seconds=30))
        except dist.DistBackendError:
            pass
        fc.shutdown()
    harness.init_child(rank, world)  # the fake's counters live on in the process
    return dbg("ipc_freed_while_mapped")


def test_a_ring_is_kept_while_a_live_peer_may_still_read_it():
    assert harness.run(_busy_peer_body, 2, timeout=60, env=IPC, init_timeout=30) == [0, 0]


# ---------------------------------------------------------------------------------------------
# Devices without peer access: rings in host memory


def _placement_body(rank, world, peer_access):
    dbg("fake_device", [0, 0, 1][rank])  # ranks 0 and 1 share a device, rank 2 has its own
    dbg("peer_access", int(peer_access))
    lists = [[0, 1], [0, 2], [1, 2], [0, 1, 2]]
    groups = fc.new_groups(lists)
    bad, counts = [], []
    for epoch in range(2):
        for ranks, g in zip(lists, groups):
            if rank not in ranks:
                continue
            for numel in (1, 300, 5000):  # 5,000 floats: many turns of the 4 KiB ring
                seed = seed_of(tuple(ranks), numel, epoch, mod=10_000)
                t = gen(rank, seed, "float32", numel)
                fc.all_reduce(t, group=g)
                tfd.dsync()
                if not torch.equal(t, fold([gen(r, seed, "float32", numel) for r in ranks], "SUM")):
                    bad.append((epoch, ranks, numel))
        counts.append((dbg("ipc_links"), dbg("ipc_host_rings")))
        # idle links are released; the next epoch's are made with the placement found above
        _until(lambda: dbg("ipc_links") == 0, "idle links released")
    return bad, counts


@pytest.mark.parametrize("peer_access,host_rings", [(False, [1, 1, 2]), (True, [0, 0, 0])])
def test_devices_without_peer_access_share_rings_in_host_memory(peer_access, host_rings):
    """Rank 2's fake device cannot read the others' memory (the fake's ipc_open refuses a device
    ring there, as cudaIpcOpenMemHandle would): its links put both rings in host memory, found at
    first contact and kept for later links; ranks 0 and 1 share a device and keep device rings."""
    env = dict(SMALL_RING, FASTCOMM_DEVICE_IDLE_MS="200", FASTCOMM_RSAG_THRESHOLD="1024")
    res = harness.run(_placement_body, 3, peer_access, timeout=120, env=env, init_timeout=20)
    for rank, (bad, counts) in enumerate(res):
        assert bad == [], bad
        assert counts == [(2, host_rings[rank]), (2, 2 * host_rings[rank])], (rank, counts)


# ---------------------------------------------------------------------------------------------
# A pair all_reduce folds straight from the peer's ring


def _ring_fold_body(rank, world, ring_bytes):
    os.environ["FASTCOMM_DEVICE_IPC_RING_BYTES"] = str(ring_bytes[rank])
    harness.init_child(rank, world, timeout=10)
    try:
        g = fc.new_group([0, 1])
        bad = []
        for numel, dt, op in [(100_003, "float32", "SUM"), (5000, "bfloat16", "AVG"), (777, "int64", "MAX"),
                              (0, "float32", "SUM")]:
            t = gen(rank, numel, dt, numel, op)
            fc.all_reduce(t, op=getattr(dist.ReduceOp, op), group=g)
            tfd.dsync()
            if not torch.equal(t, fold([gen(r, numel, dt, numel, op) for r in (0, 1)], op)):
                bad.append((numel, dt, op))
        return bad, dbg("ipc_ring_fold_bytes")
    finally:
        fc.shutdown()


@pytest.mark.parametrize("ring_bytes,folded", [
    ((4096, 4096), 400_012 + 10_000 + 6_216),  # every received byte folded in place, none copied out
    ((4096, 8192), 0),  # rings cut differently: copied out, then folded at the end as before
])
def test_a_pair_all_reduce_folds_straight_from_the_peers_ring(ring_bytes, folded):
    res = harness.run(_ring_fold_body, 2, ring_bytes, timeout=60, env=IPC, init=False)
    assert res == [([], folded)] * 2, res


# ---------------------------------------------------------------------------------------------
# The choice of transport


def _kind_body(rank, world, two_hosts):
    if two_hosts:
        os.environ["FASTCOMM_HOST_ID"] = f"host-{rank}"
    harness.init_child(rank, world, timeout=10)
    g = fc.new_group([0, 1])
    t = torch.full((9,), float(rank + 1))
    fc.all_reduce(t, group=g)
    tfd.dsync()
    try:
        return t.tolist(), dbg("ipc_links"), dbg("live_comms")
    finally:
        fc.shutdown()


@pytest.mark.parametrize("env,two_hosts,links", [
    ({"FASTCOMM_FAKE_DEVICE": "1", "FASTCOMM_DEVICE_IPC": "0"}, False, 0),
    ({"FASTCOMM_FAKE_DEVICE": "1"}, False, 0),  # auto: NCCL on the fake
    (IPC, True, 0),  # another (simulated) host: NCCL
    (IPC, False, 1),
])
def test_ipc_only_between_ranks_of_one_host_and_when_enabled(env, two_hosts, links):
    res = harness.run(_kind_body, 2, two_hosts, timeout=60, env=env, init=False)
    for t, n, comms in res:
        assert t == [3.0] * 9
        assert n == links and comms == 1


def _made_under_capture_body(rank, world):
    fc._C._fake_process_capture(True, True)  # a user's capture in CUDA's global mode, under way
    try:
        dbg("ipc_links")  # this process's device engine is made now, and probes for IPC links
    finally:
        intact = fc._C._fake_process_capture(False)
    g = fc.new_group([0, 1])
    t = torch.full((9,), float(rank + 1))
    fc.all_reduce(t, group=g)
    tfd.dsync()
    return intact, t.tolist(), dbg("ipc_links")


def test_a_device_engine_made_while_a_user_captures_still_takes_ipc_links():
    """The first device op may come while the user captures a graph in the global mode; the
    engine's probe for IPC links (an allocation and a host registration on CUDA, both refused
    then from a thread not in the relaxed mode) must neither fail, which would keep this
    process on NCCL while its peers use links, nor invalidate the user's capture."""
    for intact, t, links in harness.run(_made_under_capture_body, 2, timeout=60, env=IPC):
        assert intact == 1, "the engine's probe invalidated the user's capture"
        assert t == [3.0] * 9
        assert links == 1, "the probe failed under the capture: no IPC link"


# ---------------------------------------------------------------------------------------------
# What a small op puts on the link's stream


def _entries_body(rank, world, n):
    g = fc.new_group([0, 1])
    fc.all_reduce(torch.ones(100), group=g)  # the link is up, slot 0 used once and consumed
    tfd.dsync()
    before = dbg("work_entries")
    dbg("hold")  # nothing runs until every op below is enqueued: no wait is met yet
    ts = [torch.full((100,), float(rank + i)) for i in range(n)]
    for t in ts:
        fc.all_reduce(t, group=g)  # returns once enqueued
    entries = dbg("work_entries") - before
    dbg("release")
    tfd.dsync()
    ok = all(torch.equal(t, torch.full((100,), float(2 * i + 1))) for i, t in enumerate(ts))
    return entries, ok


@pytest.mark.parametrize("fuse_bytes,per_op", [(None, 4), ("0", 6)])  # None: the default
def test_a_small_pair_op_puts_four_entries_on_the_links_stream(fuse_bytes, per_op):
    """A CUDA stream takes only so many entries (copies, kernels, stream memory operations)
    before the host blocks until the GPU catches up, so they bound how far the host runs ahead.
    A small pair all_reduce over a link puts four there: the wait for ring room, one kernel that
    copies the chunk in and sets its flag, the wait for the peer's chunk, one kernel that folds
    it and sets the consumed flag (six with FASTCOMM_DEVICE_IPC_FUSE_BYTES=0: the copy, the fold
    and their flag writes apart). The first op behind the warm-up finds its slot consumed and
    leaves the room wait off (the host sees it met), as do the three before, which use fresh
    slots; so n ops make per_op * n - 4, and give the right sums."""
    n = 20
    env = dict(IPC) if fuse_bytes is None else dict(IPC, FASTCOMM_DEVICE_IPC_FUSE_BYTES=fuse_bytes)
    for entries, ok in harness.run(_entries_body, 2, n, timeout=60, env=env):
        assert ok
        assert entries == per_op * n - 4, (entries, per_op)


def _freed_under_capture_body(rank, world, flag_dir):
    _linked_pair(rank)
    done = os.path.join(flag_dir, "captured")
    if rank == 1:
        _until(lambda: os.path.exists(os.path.join(flag_dir, "capturing")), "rank 0 capturing")
        fc.shutdown()  # ends its links: rank 0's threads let its side go and free its ring
        _until(lambda: os.path.exists(done), "rank 0's capture ended")
        return 0
    # A capture of the user's own in CUDA's global mode (torch.cuda.graph's default) while
    # fastcomm's threads unmap and free the link's memory: calls that invalidate such a capture
    # unless the thread making them is in the relaxed mode.
    dbg("begin_capture", 0)
    open(os.path.join(flag_dir, "capturing"), "w").close()
    try:
        _until(lambda: dbg("ipc_links") == 0 and dbg("ipc_ring_bytes") == 0, "the link released")
    finally:
        graph = dbg("end_capture", 1)
    open(done, "w").close()
    return graph


def test_a_link_freed_while_the_user_captures_leaves_the_capture_valid(tmp_path):
    res = harness.run(_freed_under_capture_body, 2, str(tmp_path), timeout=60, env=IPC)
    assert res[0] > 0, "the user's capture was invalidated (see stderr)"
