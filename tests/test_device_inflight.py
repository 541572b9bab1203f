"""What a device op keeps in flight and what its launch costs, on the fake device runtime.

H7: communicator kernels in flight, bounded (FASTCOMM_DEVICE_MAX_KERNELS), on the fake device
runtime, whose debug("resident_limit", n) lets only n communicator kernels run at once: one past
them moves nothing until a resident one ends, as on a GPU whose SMs are full.

Three ranks in a ring each issue an async op with the next rank, then one with the previous
rank whose input waits behind a held kernel on the caller's stream. With one resident kernel
per device and no bound, every rank's first kernel is resident and spins for its peer's second,
which can never become resident: the ring deadlocks until the ops' deadline. With the bound at
the residency, the follower of a pair commits only once it holds a slot and the leader launches
only after that commit, so every launched kernel meets a peer kernel that runs (docs/design.md,
"Kernels in flight"), and the ring completes.

Group communicators (large ops of groups of 3+) take slots too: a group's large op beside a
pair's, each waiting behind the other's kernel on the next rank, hangs without the bound and
completes with it; so does a mix of every pair and group of three of four ranks; a refused
group op gives its members' slots back.

Host cost: a pair channel's NCCL communicator is in NCCL's blocking mode
(FASTCOMM_DEVICE_PAIR_BLOCKING, default 1), so a launch starts no thread; the fake starts one
per launch on a non-blocking communicator, as ncclGroupEnd does (debug "launch_threads").
"""
from __future__ import annotations

import random
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import harness
from _helpers import expect

import fastcomm as fc

FAKE = {"FASTCOMM_FAKE_DEVICE": "1", "FASTCOMM_DEVICE_IPC": "0"}


def dbg(what, arg=0):
    return fc._state._engine.device_debug("cpu", what, arg)


def _ring_body(rank, world, bounded):
    pairs = [[0, 1], [1, 2], [0, 2]]
    # Unbounded, the ring hangs until this deadline; bounded, it only bounds a hang.
    groups = fc.new_groups(pairs + [list(range(world))], timeout=timedelta(seconds=30 if bounded else 4))
    cpu = groups[-1]
    by_pair = {tuple(p): g for p, g in zip(pairs, groups)}
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    right = by_pair[tuple(sorted((rank, nxt)))]
    left = by_pair[tuple(sorted((rank, prv)))]
    dbg("resident_limit", 1)
    a = torch.full((6,), float(rank + 1))
    b = torch.full((6,), float(10 * (rank + 1)))
    issued = time.monotonic()  # (one clock for the job's processes: CLOCK_MONOTONIC)
    wa = fc.all_reduce(a, group=right, async_op=True)  # its input is ready
    dbg("hold")  # b's transfers wait behind this kernel on the caller's stream
    wb = fc.all_reduce(b, group=left, async_op=True)
    # Unbounded, the first op's kernel becomes resident on every rank (before the release: a
    # rank whose second kernel got in first would let the ring complete), or the op times out;
    # bounded, a rank may hold its slot for the second op's kernel instead (not resident while
    # held back), so the wait is short.
    end = time.monotonic() + (2.0 if bounded else 60.0)
    while dbg("resident") < 1 and not wa.is_completed() and time.monotonic() < end:
        time.sleep(0.005)
    fc.barrier(group=cpu)  # a host op: no rank releases before every rank's kernels are in
    dbg("release")
    if not bounded:
        # The first rank past its deadline aborts its channels, which frees its residency: a
        # rank whose kernels then all get in completes (after that deadline, never before).
        try:
            wa.get_future().wait()
            wb.get_future().wait()
            outcome = "completed"
        except dist.DistBackendError as e:
            outcome = str(e)
        return outcome, issued, time.monotonic()
    wa.get_future().wait()
    wb.get_future().wait()
    return a.tolist(), b.tolist(), dbg("kernels"), dbg("resident_waits")


def test_a_ring_of_kernels_past_the_residency_completes_under_the_bound():
    env = dict(FAKE, FASTCOMM_DEVICE_MAX_KERNELS="1")
    res = harness.run(_ring_body, 3, True, timeout=90, env=env, init_timeout=30)
    for rank, (a, b, kernels, waits) in enumerate(res):
        nxt, prv = (rank + 1) % 3, (rank - 1) % 3
        # The pair with the next rank sums this rank's `a` and the next's `b`.
        assert a == [float(rank + 1 + 10 * (nxt + 1))] * 6, (rank, a)
        assert b == [float(prv + 1 + 10 * (rank + 1))] * 6, (rank, b)
        assert kernels == 0  # every slot given back once harvested


def test_the_same_ring_deadlocks_on_the_fake_without_the_bound():
    """The fake's residency is faithful: unbounded, the ring hangs until the deadline. Nothing
    ends before the first rank's deadline (4 s after its issue), and some rank times out."""
    env = dict(FAKE, FASTCOMM_DEVICE_MAX_KERNELS="0")
    res = harness.run(_ring_body, 3, False, timeout=90, env=env, init_timeout=30)
    _hung_until_the_first_deadline(res)


def _hung_until_the_first_deadline(res, timeout_s=4.0):
    """Every rank's (outcome, issued, ended): some rank timed out, and nothing ended before the
    first rank's deadline (its issue plus the group's timeout)."""
    assert any("timeout" in outcome for outcome, _, _ in res), res
    first_deadline = min(issued for _, issued, _ in res) + timeout_s
    for rank, (outcome, issued, ended) in enumerate(res):
        assert ended >= first_deadline, (rank, outcome, ended - first_deadline)


def _many_body(rank, world):
    """Every rank runs async ops with every other at once, 4 rounds, each rank issuing the groups
    of a round in an order of its own, under a bound of 2 kernels
    and a residency of 2: launches past the bound wait for a harvest, none is lost. Their inputs
    wait behind a held kernel, so no slot is given back before the release: rank 3, the follower
    of its 3 channels, must queue one."""
    lists = [[i, j] for i in range(world) for j in range(i + 1, world)]
    groups = fc.new_groups(lists)
    return _rounds_in_own_orders(rank, lists, groups, rounds=4, numel=lambda ranks: 3, wait_s=2.0)


def _rounds_in_own_orders(rank, lists, groups, rounds, numel, wait_s):
    """The rounds of _many_body and _groups_and_pairs_body: under a residency of 2, each rank
    issues a round's all_reduces over its groups in an order of its own, their inputs behind a
    held kernel; the release comes once a launch waited for a slot (or after wait_s). Returns
    (ranks, round, result) per op, the kernel waits and the slots still held."""
    dbg("resident_limit", 2)
    mine = [(r, g) for r, g in zip(lists, groups) if rank in r]
    ts, works = [], []
    dbg("hold")
    for it in range(rounds):
        random.Random(rank * 10 + it).shuffle(mine)  # each rank its own order of groups
        for ranks, g in mine:
            t = torch.full((numel(ranks),), float(rank + it))
            ts.append((ranks, it, t))
            works.append(fc.all_reduce(t, group=g, async_op=True))
    end = time.monotonic() + wait_s
    while dbg("kernel_waits") < 1 and time.monotonic() < end:
        time.sleep(0.005)
    waits = dbg("kernel_waits")
    dbg("release")
    for w in works:
        w.get_future().wait()
    return [(ranks, it, t.tolist()) for ranks, it, t in ts], waits, dbg("kernels")


def test_many_channels_under_a_small_bound():
    env = dict(FAKE, FASTCOMM_DEVICE_MAX_KERNELS="2")
    res = harness.run(_many_body, 4, timeout=120, env=env, init_timeout=30)
    for got, waits, kernels in res:
        assert kernels == 0
        for ranks, it, t in got:
            assert t == [float(sum(ranks) + 2 * it)] * 3, (ranks, it, t)
    assert res[3][1] >= 1  # the bound held a launch back


def _threads_body(rank, world, ops):
    g = fc.new_group([0, 1])
    t = torch.ones(8)
    fc.all_reduce(t, group=g)  # the channel is made and connected
    dbg("hold")  # every launch below is enqueued before any has run
    before = dbg("launch_threads")
    works = [fc.all_reduce(t, group=g, async_op=True) for _ in range(ops)]
    for w in works:
        w.wait()  # enqueued
    launched = dbg("launch_threads") - before
    dbg("release")
    works[-1].get_future().wait()
    return launched, t[0].item()


def test_pair_launches_start_no_thread():
    res = harness.run(_threads_body, 2, 40, timeout=90, env=FAKE, init_timeout=30)
    for launched, v in res:
        assert launched == 0
        assert v == 2.0 ** 41


def test_a_non_blocking_pair_communicator_starts_a_thread_per_launch():
    """The cost the blocking mode avoids: NCCL's non-blocking ncclGroupEnd starts a thread."""
    env = dict(FAKE, FASTCOMM_DEVICE_PAIR_BLOCKING="0")
    res = harness.run(_threads_body, 2, 40, timeout=90, env=env, init_timeout=30)
    for launched, v in res:
        assert launched >= 1
        assert v == 2.0 ** 41


# Large ops of a group of 3+ run on the group's own NCCL communicator: its kernels take slots
# under the same bound (docs/design.md, "Kernels in flight": the members take theirs one after
# another, highest rank first, the group's rank 0 last, before its go).
GROUP_ENV = dict(FAKE, FASTCOMM_RSAG_THRESHOLD="64")  # 32 floats per member go on the group's communicator


def _group_mix_body(rank, world, bounded):
    """A group of three's large all_reduce beside an all_reduce of the pair [1, 2], one kernel
    resident per device. Rank 1 issues the pair's op before a held kernel on its caller's stream
    and the group's after it, rank 2 the other way round: without a slot for the group's kernels,
    rank 1's pair kernel and rank 2's group kernel are resident first, each spinning for a peer
    kernel that waits behind the other, and both ops hang until the deadline."""
    pair, trio = fc.new_groups([[1, 2], [0, 1, 2]], timeout=timedelta(seconds=30 if bounded else 4))
    dbg("resident_limit", 1)
    g = torch.full((32,), float(rank + 1))
    p = torch.full((6,), float(10 * (rank + 1)))
    works = []
    issued = time.monotonic()
    if rank == 1:
        works.append(fc.all_reduce(p, group=pair, async_op=True))  # its input is ready
    if rank != 1:
        works.append(fc.all_reduce(g, group=trio, async_op=True))
    dbg("hold")  # what is issued below waits behind this kernel on the caller's stream
    if rank == 1:
        works.append(fc.all_reduce(g, group=trio, async_op=True))
    if rank == 2:
        works.append(fc.all_reduce(p, group=pair, async_op=True))
    # Rank 2 wants a slot for both (bounded: one queues, deterministically, since neither can end
    # before the release); unbounded, each rank's first kernel becomes resident (before the
    # release, or the mix could complete) unless its op ends first. Bounded, a rank may hold its
    # slot for a kernel still held back.
    end = time.monotonic() + (10.0 if rank == 2 or not bounded else 2.0)
    while time.monotonic() < end and not works[0].is_completed():
        if (dbg("kernel_waits") >= 1) if (rank == 2 and bounded) else (dbg("resident") >= 1):
            break
        time.sleep(0.005)
    fc.barrier(group=trio)  # a host op: no rank releases before every rank's kernels are in
    dbg("release")
    if not bounded:
        # As in the ring: the first rank past its deadline frees its residency, after which
        # another rank's ops may complete (never before).
        try:
            for w in works:
                w.get_future().wait()
            outcome = "completed"
        except dist.DistBackendError as e:
            outcome = str(e)
        return outcome, issued, time.monotonic()
    for w in works:
        w.get_future().wait()
    return g.tolist(), p.tolist(), dbg("kernels"), dbg("kernel_waits")


def test_group_communicator_kernels_take_slots_beside_pair_kernels():
    env = dict(GROUP_ENV, FASTCOMM_DEVICE_MAX_KERNELS="1")
    res = harness.run(_group_mix_body, 3, True, timeout=120, env=env, init_timeout=30)
    for rank, (g, p, kernels, waits) in enumerate(res):
        assert g == [6.0] * 32, (rank, g)  # 1 + 2 + 3
        assert p == ([50.0] * 6 if rank else [10.0] * 6), (rank, p)  # 20 + 30; rank 0 not in the pair
        assert kernels == 0, (rank, kernels)  # every slot, the group's too, given back
    assert res[2][3] >= 1  # rank 2's group kernel and pair kernel could not both hold a slot


def test_the_group_and_pair_mix_deadlocks_on_the_fake_without_the_bound():
    env = dict(GROUP_ENV, FASTCOMM_DEVICE_MAX_KERNELS="0")
    res = harness.run(_group_mix_body, 3, False, timeout=90, env=env, init_timeout=30)
    _hung_until_the_first_deadline(res)


def _groups_and_pairs_body(rank, world):
    """Every pair and every group of three of four ranks, 3 rounds, each rank issuing a round's
    groups in an order of its own, the groups' ops large (their communicators), the pairs'
    small, under a bound of 2 kernels and a residency of 2; inputs wait behind a held kernel."""
    lists = [[i, j] for i in range(world) for j in range(i + 1, world)]
    lists += [[i for i in range(world) if i != x] for x in range(world)]
    groups = fc.new_groups(lists, timeout=timedelta(seconds=60))
    res = _rounds_in_own_orders(rank, lists, groups, rounds=3, numel=lambda ranks: 32 if len(ranks) == 3 else 3,
                                wait_s=10.0)
    return res + (dbg("group_comms"),)


def test_groups_of_three_and_pairs_in_any_order_under_a_small_bound():
    env = dict(GROUP_ENV, FASTCOMM_DEVICE_MAX_KERNELS="2")
    res = harness.run(_groups_and_pairs_body, 4, timeout=150, env=env, init_timeout=30)
    for got, waits, kernels, comms in res:
        assert kernels == 0
        assert comms == 3  # each rank is in 3 groups of three: their large ops ran on communicators
        for ranks, it, t in got:
            assert t == [float(sum(ranks) + len(ranks) * it)] * len(t), (ranks, it, t)
    assert res[3][1] >= 1  # the bound held a launch back


def _group_refused_body(rank, world):
    """Rank 2 of four issues a larger all_reduce than the others on the group's communicator,
    one slot per device: rank 0 proposes to rank 3, then to the mismatched rank 2, then to
    rank 1, and refuses the op; the members that committed holding a slot give it back, and the
    group's next op runs."""
    g = fc.new_group(list(range(world)), timeout=timedelta(seconds=30))
    bad = torch.full((64 if rank == 2 else 32,), float(rank + 1))
    want = "mismatched op" if rank in (0, 2) else "refused by the group's rank 0"
    msg = expect(dist.DistBackendError, lambda: fc.all_reduce(bad, group=g), want)
    good = torch.full((32,), float(rank + 1))
    # Its future completes once the engine saw it run (so gave its slot back).
    fc.all_reduce(good, group=g, async_op=True).get_future().wait()
    return msg, good.tolist(), dbg("kernels"), dbg("group_comms")


def test_a_refused_group_op_gives_every_slot_back():
    env = dict(GROUP_ENV, FASTCOMM_DEVICE_MAX_KERNELS="1")
    for msg, good, kernels, comms in harness.run(_group_refused_body, 4, timeout=90, env=env, init_timeout=30):
        assert good == [10.0] * 32, (msg, good)  # 1 + 2 + 3 + 4
        assert kernels == 0, msg
        assert comms == 1  # the second op ran on the group's communicator
