"""The device path's contract, run on the fake device runtime (FASTCOMM_FAKE_DEVICE=1 sends the
device path's ops on CPU tensors through csrc/device/engine.cpp over csrc/device/fake_runtime.cpp,
which keeps NCCL's semantics: a communicator's work runs in issue order, a send completes only
when its matching receive runs, connection at first contact, abort, asynchronous errors).

Results are compared with a reference computed locally; faults must raise DistBackendError
naming the peer within the group's timeout, never hang; the harness timeout bounds every run."""
from __future__ import annotations

import os
import random
import threading
import time

import pytest
import torch
import torch.distributed as dist

import harness
from _helpers import expect, fold, gen, seed_of

import fastcomm as fc

FAKE = {"FASTCOMM_FAKE_DEVICE": "1"}


def dsync():
    """What reading a CUDA tensor on the host does first: wait for the caller's stream. The
    fake's runs asynchronously, as a GPU's does, so a result is read only after this."""
    fc._state._engine.device_synchronize("cpu")


def assert_close(*args, **kwargs):
    dsync()
    torch.testing.assert_close(*args, **kwargs)


def equal(a, b):
    dsync()
    return torch.equal(a, b)


def _groups_of(world, rank):
    """Pairs, a triple and the world, every rank making them in the same order."""
    lists = [[a, b] for a in range(world) for b in range(a + 1, world)]
    if world >= 3:
        lists.append([0, 1, 2])
    lists.append(list(range(world)))
    return lists, fc.new_groups(lists)


# ---------------------------------------------------------------------------------------------
# Results


def _collectives_body(rank, world, sizes, dtypes, ops):
    lists, groups = _groups_of(world, rank)
    checked = 0
    for ranks, g in zip(lists, groups):
        if rank not in ranks:
            continue
        n, me = len(ranks), ranks.index(rank)
        for numel in sizes:
            for dt in dtypes:
                for op in ops:
                    if op == "AVG" and "int" in dt:  # AVG is for floating dtypes
                        continue
                    seed = seed_of(tuple(ranks), numel, dt, op, mod=100_000)
                    t = gen(rank, seed, dt, numel, op)
                    fc.all_reduce(t, op=getattr(dist.ReduceOp, op), group=g)
                    ref = fold([gen(r, seed, dt, numel, op) for r in ranks], op)
                    assert_close(t, ref, rtol=0, atol=0)
                    checked += 1
                # broadcast from the last member
                seed = numel * 7 + 1
                t = gen(rank, seed, dt, numel)
                fc.broadcast(t, src=ranks[-1], group=g)
                assert_close(t, gen(ranks[-1], seed, dt, numel), rtol=0, atol=0)
                # all_gather, list and flat
                outs = [torch.empty(numel, dtype=t.dtype) for _ in ranks]
                fc.all_gather(outs, gen(rank, seed, dt, numel), group=g)
                for r, o in zip(ranks, outs):
                    assert_close(o, gen(r, seed, dt, numel), rtol=0, atol=0)
                flat = torch.empty(n * numel, dtype=t.dtype)
                fc.all_gather_into_tensor(flat, gen(rank, seed, dt, numel), group=g)
                assert_close(flat, torch.cat([gen(r, seed, dt, numel) for r in ranks]), rtol=0, atol=0)
                # reduce_scatter, flat and list
                out = torch.empty(numel, dtype=t.dtype)
                fc.reduce_scatter_tensor(out, gen(rank, seed, dt, n * numel), group=g)
                ref = fold([gen(r, seed, dt, n * numel) for r in ranks], "SUM")[me * numel:(me + 1) * numel]
                assert_close(out, ref, rtol=0, atol=0)
                ins = list(gen(rank, seed + 1, dt, n * numel).chunk(n)) if numel else [
                    torch.empty(0, dtype=t.dtype) for _ in ranks]
                fc.reduce_scatter(out, ins, group=g)
                ref = fold([gen(r, seed + 1, dt, n * numel) for r in ranks], "SUM")[me * numel:(me + 1) * numel]
                assert_close(out, ref, rtol=0, atol=0)
                checked += 5
    # send/recv around the world ring
    for numel in sizes:
        t = gen(rank, 99, "float32", numel)
        got = torch.empty(numel)
        src, dst = (rank - 1) % world, (rank + 1) % world
        if rank % 2 == 0:
            fc.send(t, dst)
            fc.recv(got, src)
        else:
            fc.recv(got, src)
            fc.send(t, dst)
        assert_close(got, gen(src, 99, "float32", numel), rtol=0, atol=0)
    return checked


@pytest.mark.parametrize("world", [2, 4])
def test_collectives_match_the_reference(world):
    sizes, dtypes = [0, 1, 7, 1000], ["float32", "bfloat16", "int64"]
    ops = ["SUM", "AVG", "MAX", "MIN", "PRODUCT"]
    res = harness.run(_collectives_body, world, sizes, dtypes, ops, timeout=240, env=FAKE)
    assert all(r > 0 for r in res)


def _nan_body(rank, world):
    g = fc.new_group([0, 1])
    out = {}
    for op in ("MAX", "MIN"):
        t = torch.tensor([1.0, 2.0, float("nan")]) if rank == 0 else torch.tensor([float("nan"), 5.0, 0.0])
        fc.all_reduce(t, op=getattr(dist.ReduceOp, op), group=g)
        dsync()
        out[op] = t.tolist()
    return out


def test_min_max_propagate_nan():
    for r in harness.run(_nan_body, 2, timeout=60, env=FAKE):
        assert torch.isnan(torch.tensor(r["MAX"][0])) and torch.isnan(torch.tensor(r["MAX"][2]))
        assert r["MAX"][1] == 5.0 and r["MIN"][1] == 2.0
        assert torch.isnan(torch.tensor(r["MIN"][0])) and torch.isnan(torch.tensor(r["MIN"][2]))


# ---------------------------------------------------------------------------------------------
# Any issue order


def _cyclic_body(rank, world):
    """Rank i issues async all_reduce on (i, i+1) and then on (i-1, i): on one stream per rank
    every first op waits for a peer's second one, a cycle."""
    lists = [sorted([i, (i + 1) % world]) for i in range(world)]
    groups = fc.new_groups(lists)
    nxt, prv = groups[rank], groups[(rank - 1) % world]
    a, b = torch.full((5,), float(rank)), torch.full((5,), float(rank) * 10)
    w1 = fc.all_reduce(a, group=nxt, async_op=True)
    w2 = fc.all_reduce(b, group=prv, async_op=True)
    try:
        w1.wait()
        w2.wait()
        # wait() returns once the ops are enqueued; their Futures complete once they have run.
        w1.get_future().wait()
        w2.get_future().wait()
    except (dist.DistBackendError, RuntimeError) as e:
        return ("error", str(e))
    dsync()
    return ("ok", a.tolist(), b.tolist())


def test_cyclic_issue_order_completes():
    world = 3
    for rank, r in enumerate(harness.run(_cyclic_body, world, timeout=60, env=FAKE, init_timeout=10)):
        assert r[0] == "ok", r
        nxt, prv = (rank + 1) % world, (rank - 1) % world
        # On (i, i+1) rank i gives its first tensor (i), rank i+1 its second (10 (i+1)).
        assert r[1] == [float(rank + 10 * nxt)] * 5
        assert r[2] == [float(prv + 10 * rank)] * 5


def test_single_stream_scheme_deadlocks_on_the_fake():
    """The scheme this path replaced (every op on one stream in issue order), run on the fake,
    hangs on the cyclic order as it does on NCCL: the ops time out instead of completing."""
    env = dict(FAKE, FASTCOMM_DEVICE_SCHEME="single-stream")
    res = harness.run(_cyclic_body, 3, timeout=60, env=env, init_timeout=3)
    # Only a timeout (its abort ends the stuck transfers) breaks the cycle; a rank whose ops
    # ran after another's abort may then finish its own.
    timed_out = [r for r in res if r[0] == "error" and "did not finish within the group's timeout" in r[1]]
    assert timed_out, res


def _random_order_body(rank, world, seed, rounds):
    """Every rank walks the same ops per group, interleaving the groups in its own random order;
    every op async, all waited at the end."""
    lists, groups = _groups_of(world, rank)
    mine = [(ranks, g) for ranks, g in zip(lists, groups) if rank in ranks]
    queues = {tuple(ranks): [(k, torch.full((3 + k,), float(rank + 1) * (k + 1))) for k in range(rounds)]
              for ranks, _ in mine}
    rng = random.Random(seed * 1000 + rank)
    order = [i for i, (ranks, _) in enumerate(mine) for _ in range(rounds)]
    rng.shuffle(order)
    issued = []
    for i in order:
        ranks, g = mine[i]
        k, t = queues[tuple(ranks)].pop(0)
        issued.append((ranks, k, t, fc.all_reduce(t, group=g, async_op=True)))
    for ranks, k, t, w in issued:
        w.wait()
        assert equal(t, torch.full((3 + k,), float(sum(r + 1 for r in ranks)) * (k + 1))), (ranks, k, t)
    return len(issued)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_random_issue_orders_over_overlapping_groups(seed):
    res = harness.run(_random_order_body, 4, seed, 3, timeout=120, env=FAKE, init_timeout=20)
    assert all(r > 0 for r in res)


def _pipelined_body(rank, world):
    """Async ops of one group back to back on one tensor: each must see the previous one's
    result (its fold), including after the previous op is over and forgotten by the engine."""
    pair, triple = fc.new_groups([[0, 1], [0, 1, 2]])
    out = []
    for g, n in ((pair, 2), (triple, 3)):
        if rank >= n:
            continue
        t = torch.ones(5)
        works = [fc.all_reduce(t, group=g, async_op=True) for _ in range(6)]
        for w in works:
            w.wait()
        dsync()
        out.append((n, t[0].item()))
        time.sleep(0.05)
        fc.all_reduce(t, group=g, async_op=True).wait()
        dsync()
        out.append((n, t[0].item()))
    return out


def test_async_ops_of_one_group_see_each_others_results():
    for rank, r in enumerate(harness.run(_pipelined_body, 3, timeout=60, env=FAKE, init_timeout=20)):
        expect_ = [(2, 2.0 ** 6), (2, 2.0 ** 7), (3, 3.0 ** 6), (3, 3.0 ** 7)]
        assert r == (expect_ if rank < 2 else expect_[2:]), r


def _future_body(rank, world):
    g = fc.new_group([0, 1])
    a, b = torch.ones(3), torch.ones(3)

    def then(fut):
        # A callback that waits for another device op (DDP comm hooks such as PowerSGD do).
        fc.all_reduce(b, group=g, async_op=True).get_future().wait()
        return b.clone()

    out = fc.all_reduce(a, group=g, async_op=True).get_future().then(then).wait()
    dsync()
    return a.tolist(), out.tolist()


def test_a_future_callback_may_wait_for_another_op():
    for r in harness.run(_future_body, 2, timeout=60, env=FAKE, init_timeout=10):
        assert r == ([2.0] * 3, [2.0] * 3)


def _batch_body(rank, world, count):
    lists = [[a, b] for _ in range(count // 6 + 1) for a in range(world) for b in range(a + 1, world)][:count]
    groups = fc.new_groups(lists)
    ts = {}
    with fc.batch() as b:
        for i, (ranks, g) in enumerate(zip(lists, groups)):
            if rank in ranks:
                ts[i] = torch.full((4,), float(rank * 1000 + i))
                fc.all_reduce(ts[i], group=g)
    b.wait()
    for i, t in ts.items():
        assert equal(t, torch.full((4,), float(sum(r * 1000 + i for r in lists[i])))), i
    return len(ts)


def test_a_batch_of_hundreds_of_groups():
    res = harness.run(_batch_body, 4, 300, timeout=120, env=FAKE, init_timeout=20)
    assert sum(res) == 600


def _threads_body(rank, world):
    lists, groups = _groups_of(world, rank)
    mine = [(ranks, g) for ranks, g in zip(lists, groups) if rank in ranks]
    errors = []

    def worker(part):
        try:
            for k in range(20):
                for ranks, g in part:
                    t = torch.full((6,), float(rank + k))
                    fc.all_reduce(t, group=g)
                    assert equal(t, torch.full((6,), float(sum(r + k for r in ranks))))
        except BaseException as e:  # noqa: BLE001
            errors.append(repr(e))

    # Each group is used by one thread (ops of a group are ordered by issue), the two threads
    # interleave freely.
    threads = [threading.Thread(target=worker, args=(mine[i::2],)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    return errors


def test_several_threads():
    for errors in harness.run(_threads_body, 3, timeout=120, env=FAKE, init_timeout=20):
        assert errors == []


# ---------------------------------------------------------------------------------------------
# Mismatches and faults


def _mismatch_body(rank, world):
    g = fc.new_group([0, 1])
    t = torch.ones(10 if rank == 0 else 12)
    msg = expect(dist.DistBackendError, lambda: fc.all_reduce(t, group=g), "mismatched op", "rank")
    kind = torch.ones(4)
    if rank == 0:
        msg2 = expect(dist.DistBackendError, lambda: fc.all_reduce(kind, group=g), "mismatched op")
    else:
        msg2 = expect(dist.DistBackendError, lambda: fc.broadcast(kind, src=0, group=g), "mismatched op")
    # The pair goes on working after a mismatch.
    ok = torch.full((3,), float(rank + 1))
    fc.all_reduce(ok, group=g)
    dsync()
    return msg, msg2, ok.tolist()


def test_mismatched_calls_raise_on_every_member():
    res = harness.run(_mismatch_body, 2, timeout=60, env=FAKE, init_timeout=10)
    for rank, (msg, msg2, ok) in enumerate(res):
        assert f"rank {1 - rank} issued" in msg, msg
        assert "broadcast" in msg2 and "all_reduce" in msg2, msg2
        assert ok == [3.0, 3.0, 3.0]


def _dead_peer_body(rank, world, when):
    pairs = fc.new_groups([[0, 1], [0, 2], [1, 2]])
    g01, g02, g12 = pairs
    if when == "after" and rank in (0, 2):
        t = torch.ones(4)
        fc.all_reduce(t, group=g02)  # first contact made
    if rank == 2:
        os._exit(0)
    t0 = time.monotonic()
    peer_group = g02 if rank == 0 else g12
    msg = expect(dist.DistBackendError, lambda: fc.all_reduce(torch.ones(4), group=peer_group), "rank 2")
    took = time.monotonic() - t0
    ok = torch.full((2,), float(rank + 1))
    fc.all_reduce(ok, group=g01)
    dsync()
    return msg, took, ok.tolist()


@pytest.mark.parametrize("when", ["before", "after"])
def test_a_dead_peer_fails_only_its_groups(when):
    """A peer dead before or after first contact fails the ops that need it, naming it, within
    the timeout; a group without it keeps working."""
    res = harness.run(_dead_peer_body, 3, when, timeout=90, env=FAKE, init_timeout=5, allow_fail=(2,))
    for r in res[:2]:
        msg, took, ok = r
        # Found dead (the host engine's liveness check), not left to the 5 s timeout.
        assert "exited" in msg and "timeout" not in msg, (took, msg)
        assert ok == [3.0, 3.0]


def _stalled_peer_body(rank, world):
    g01, g02 = fc.new_groups([[0, 1], [0, 2]])
    if rank == 2:
        time.sleep(8)  # never issues its op: a stall, not a death
        return None
    stalled = fc.all_reduce(torch.ones(3), group=g02, async_op=True) if rank == 0 else None
    # Rank 0 goes on working with rank 1 while its op with rank 2 waits.
    ok = torch.full((2,), float(rank + 1))
    fc.all_reduce(ok, group=g01)
    # The message says where the op stood: rank 2 (the follower) never committed rank 0's proposal.
    msg = expect(dist.DistBackendError, stalled.wait, "timeout", "rank 2",
                 "proposed, not committed by the peer yet") if rank == 0 else ""
    dsync()
    return msg, ok.tolist()


def test_a_stalled_peer_times_out_and_others_go_on():
    res = harness.run(_stalled_peer_body, 3, timeout=90, env=FAKE, init_timeout=3)
    assert res[0][1] == [3.0, 3.0] and res[1][1] == [3.0, 3.0]


def _shutdown_inflight_body(rank, world, flag_dir):
    g = fc.new_group([0, 1])
    done = os.path.join(flag_dir, "done")
    if rank == 1:
        # Issues nothing, and stays alive until rank 0 is through: its op stays in flight and
        # fails for the shutdown, not for a peer that exited.
        for _ in range(6000):
            if os.path.exists(done):
                return None
            time.sleep(0.01)
        raise AssertionError("rank 0 never finished")
    try:
        w = fc.all_reduce(torch.ones(8), group=g, async_op=True)
        time.sleep(0.2)
        t0 = time.monotonic()
        fc.shutdown()
        took = time.monotonic() - t0
        msg = expect(dist.DistBackendError, w.wait, "shut down")
        return took, msg
    finally:
        open(done, "w").close()


def test_shutdown_with_ops_in_flight_does_not_hang(tmp_path):
    res = harness.run(_shutdown_inflight_body, 2, str(tmp_path), timeout=60, env=FAKE, init_timeout=30)
    took, _ = res[0]
    assert took < 5, took


def _reinit_body(rank, world):
    g = fc.new_group([0, 1])
    if rank == 1:
        time.sleep(4)  # rank 0's op times out and its channel is aborted
    else:
        expect(dist.DistBackendError, lambda: fc.all_reduce(torch.ones(2), group=g), "rank 1")
    fc.shutdown()
    harness.init_child(rank, world, timeout=10)
    g = fc.new_group([0, 1])
    t = torch.full((4,), float(rank + 1))
    fc.all_reduce(t, group=g)
    dsync()
    return t.tolist()


def test_reinit_after_an_abort():
    res = harness.run(_reinit_body, 2, timeout=90, env=FAKE, init_timeout=2)
    assert res == [[3.0] * 4, [3.0] * 4]


# ---------------------------------------------------------------------------------------------
# The torch backend on the device path


def _backend_body(rank, world):
    from datetime import timedelta
    dist.init_process_group("fastcomm", store=harness.child_store(), rank=rank, world_size=world,
                            timeout=timedelta(seconds=20))
    try:
        t = torch.full((5,), float(rank + 1))
        dist.all_reduce(t)
        pair = dist.new_group([0, 1])
        outs = [torch.empty(3) for _ in range(world)]
        w = dist.all_gather(outs, torch.full((3,), float(rank)), async_op=True)
        w.wait()
        fut_t = torch.full((2,), float(rank))
        fut = dist.all_reduce(fut_t, op=dist.ReduceOp.MAX, async_op=True).get_future()
        dsync()
        fut_val = fut.wait()[0].tolist()
        p = torch.full((4,), float(rank * 10))
        if rank in (0, 1):
            dist.all_reduce(p, group=pair)
        b = torch.full((2,), float(rank))
        dist.broadcast(b, src=world - 1)
        dsync()
        return t.tolist(), [o.tolist() for o in outs], fut_val, p.tolist(), b.tolist()
    finally:
        dist.destroy_process_group()


def test_the_torch_backend_runs_on_the_device_path():
    world = 3
    res = harness.run(_backend_body, world, timeout=90, env=FAKE, init=False)
    for rank, (t, outs, fut_val, p, b) in enumerate(res):
        assert t == [6.0] * 5
        assert outs == [[float(r)] * 3 for r in range(world)]
        assert fut_val == [2.0, 2.0]
        assert p == ([10.0] * 4 if rank in (0, 1) else [rank * 10.0] * 4)
        assert b == [2.0, 2.0]


# ---------------------------------------------------------------------------------------------
# Large ops of groups of 3+: one collective on the group's own communicator


def _group_comm_body(rank, world, numel):
    lists, groups = _groups_of(world, rank)
    out = []
    for ranks, g in zip(lists, groups):
        if rank not in ranks or len(ranks) < 3:
            continue
        n, me = len(ranks), ranks.index(rank)
        for dt in ("float32", "bfloat16", "int64"):
            for op in ("SUM", "AVG", "PRODUCT"):
                if op == "AVG" and dt == "int64":
                    continue
                seed = seed_of(tuple(ranks), dt, op, mod=10_000)
                t = gen(rank, seed, dt, numel, op)
                fc.all_reduce(t, op=getattr(dist.ReduceOp, op), group=g)
                ref = fold([gen(r, seed, dt, numel, op) for r in ranks], op)
                assert_close(t, ref, rtol=0, atol=0)
            flat = torch.empty(n * numel, dtype=t.dtype)
            fc.all_gather_into_tensor(flat, gen(rank, 5, dt, numel), group=g)
            assert_close(flat, torch.cat([gen(r, 5, dt, numel) for r in ranks]), rtol=0, atol=0)
            o = torch.empty(numel, dtype=t.dtype)
            fc.reduce_scatter_tensor(o, gen(rank, 6, dt, n * numel), group=g)
            ref = fold([gen(r, 6, dt, n * numel) for r in ranks], "SUM")[me * numel:(me + 1) * numel]
            assert_close(o, ref, rtol=0, atol=0)
            if dt != "int64":
                fc.reduce_scatter_tensor(o, gen(rank, 6, dt, n * numel), op=dist.ReduceOp.AVG, group=g)
                ref = fold([gen(r, 6, dt, n * numel) for r in ranks], "AVG")[me * numel:(me + 1) * numel]
                assert_close(o, ref, rtol=0, atol=0)
            b = gen(rank, 7, dt, numel)
            fc.broadcast(b, src=ranks[1], group=g)
            assert_close(b, gen(ranks[1], 7, dt, numel), rtol=0, atol=0)
            out.append(len(ranks))
    return out


def test_large_ops_of_larger_groups_run_on_the_group_communicator():
    # A threshold of 4 KB sends the 4096-element ops of the triple and the world of 4 through
    # the group communicator; the pairs keep their channels.
    env = dict(FAKE, FASTCOMM_RSAG_THRESHOLD="4096")
    res = harness.run(_group_comm_body, 4, 4096 + 3, timeout=120, env=env, init_timeout=20)
    assert all(len(r) > 0 for r in res)


def _group_mismatch_body(rank, world):
    g = fc.new_group([0, 1, 2])
    numel = 2048 if rank != 2 else 2050  # rank 2 disagrees with the group's rank 0
    msg = expect(dist.DistBackendError, lambda: fc.all_reduce(torch.ones(numel), group=g), "rank")
    ok = torch.full((2048,), float(rank + 1))
    fc.all_reduce(ok, group=g)
    dsync()
    return msg, ok[0].item()


def test_a_mismatch_in_a_group_communicator_op_raises_on_every_member():
    env = dict(FAKE, FASTCOMM_RSAG_THRESHOLD="4096")
    res = harness.run(_group_mismatch_body, 3, timeout=60, env=env, init_timeout=10)
    assert "refused" in res[1][0], res[1][0]
    assert "mismatched op" in res[0][0] and "mismatched op" in res[2][0]
    assert [r[1] for r in res] == [6.0, 6.0, 6.0]
