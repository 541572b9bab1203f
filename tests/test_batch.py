"""``with fc.batch() as b:`` and ``fc.all_reduce_many``: many collectives over many (overlapping)
groups issued as one fused step, checked against references computed locally (the inputs and
references come from test_collectives: every rank regenerates every member's input from
(rank, seed)); the batch's Work API; discarding a batch; errors confined to the bad group."""
from __future__ import annotations

import pytest
import torch
from torch.distributed import DistBackendError, ReduceOp

import harness
from test_collectives import BIG, DTYPES, RING_ENV, all_reduce_ref, digest, fold, gen, issue, same

import fastcomm as fc

RING_PAIRS = [[i, (i + 1) % 4] for i in range(4)]          # (i, i+1) neighbour pairs, world 4
TRIPLES = [[i, (i + 1) % 4, (i + 2) % 4] for i in range(4)]  # every triple, world 4


def _mixed_ops(rank, world, groups, lists, it, dt, n):
    """Issues, for every group this rank is in, a mix of collectives; returns the Issued list.
    Each group's ops are issued in the same order on every member; the order across groups
    depends on the rank (reversed on odd ranks), as does nothing else."""
    mine = [(gi, g) for gi, g in enumerate(groups) if g.rank() >= 0]
    if rank % 2:
        mine = mine[::-1]
    issued = []
    for gi, g in mine:
        ranks = g.ranks  # sorted: group rank order
        seed = 10_000 * it + 100 * gi
        kinds = [("all_reduce", "SUM"), ("broadcast", None), ("all_gather_list", None),
                 ("reduce_scatter", "MAX"), ("all_reduce", "MIN"),
                 ("all_gather_into_tensor", None), ("reduce_scatter_tensor", "SUM")]
        if len(ranks) == 2:
            kinds = kinds[:4]
        for j, (kind, op) in enumerate(kinds):
            issued.append(issue(kind, g, ranks, rank, seed + j, dt, n, op, "int", False, variant=it + j))
    return issued


def _p2p_ring(rank, world, it, dt, n):
    """send to rank+1 and recv from rank-1 (all ranks the same way round: fine in a batch)."""
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    mine = gen(rank, 777 + it, dt, n)
    got = torch.full((n,), -5, dtype=DTYPES[dt])
    assert fc.send(mine, nxt, tag=it) is None
    assert fc.recv(got, prv, tag=it) == prv
    return got, gen(prv, 777 + it, dt, n)


def _mix_body(rank, world, rounds):
    lists = RING_PAIRS + TRIPLES + [[0, 1, 2, 3]]
    groups = fc.new_groups(lists)
    failures = []
    for it, (dt, n) in enumerate(rounds):
        with fc.batch() as b:
            issued = _mixed_ops(rank, world, groups, lists, it, dt, n)
            got, exp = _p2p_ring(rank, world, it, dt, n)
            # async_op=True inside a batch still returns None: the batch is the Work.
            extra = torch.full((n,), float(rank + 1), dtype=torch.float64)
            assert fc.all_reduce(extra, group=groups[-1], async_op=True) is None
            with pytest.raises(RuntimeError, match="not been issued"):
                b.wait()
            assert len(b) == len(issued) + 3  # queued so far (after the block, the
            # queue has been handed to the engine)
        if it % 3 == 0:
            assert b.wait() is True
        elif it % 3 == 1:
            fut = b.get_future()
            fut.wait()
        else:
            for _ in range(20_000_000):
                if b.is_completed():
                    break
        assert b.is_completed() and b.exception() is None and b.is_success()
        assert b.get_future().done()
        for x in issued:
            err, d = x.check()
            if err:
                failures.append(err)
        if not torch.equal(got, exp):
            failures.append(f"rank {rank} round {it}: recv in batch got {got[:4]}, expected {exp[:4]}")
        if not torch.equal(extra, torch.full((n,), 10.0, dtype=torch.float64)):
            failures.append(f"rank {rank} round {it}: world all_reduce in batch got {extra[:4]}")
    return failures


def test_batch_mixed_collectives_overlapping_groups():
    rounds = [("float32", 1), ("int64", 7), ("bfloat16", 1001), ("float64", 0),
              ("float32", BIG), ("int32", 100), ("float16", 33)]
    res = harness.run(_mix_body, 4, rounds, timeout=90, env=RING_ENV)
    failures = [f for r in res for f in r]
    assert not failures, f"{len(failures)} wrong results:\n" + "\n".join(failures[:15])


# ---------------------------------------------------------------------------------------------
# all_reduce_many


def _many_body(rank, world):
    lists = RING_PAIRS + TRIPLES
    groups = fc.new_groups(lists)
    mine = [(gi, g) for gi, g in enumerate(groups) if g.rank() >= 0]
    out = {}
    for it, (dt, n, op) in enumerate([("float32", 100, "SUM"), ("int64", 1001, "MAX"),
                                       ("float64", BIG, "PRODUCT"), ("bfloat16", 0, "AVG")]):
        for async_op in (False, True):
            seed = 100 * it + 50 * async_op
            ts = [gen(rank, seed + gi, dt, n, op) for gi, _ in mine]
            res = fc.all_reduce_many(ts, [g for _, g in mine], op=getattr(ReduceOp, op),
                                     async_op=async_op)
            if async_op:
                assert res is not None
                assert res.wait() is True and res.is_completed() and res.exception() is None
            else:
                assert res is None
            for (gi, g), t in zip(mine, ts):
                ref = all_reduce_ref([gen(r, seed + gi, dt, n, op) for r in sorted(lists[gi])], sorted(lists[gi]), op)
                err = same(t, ref, f"rank {rank} all_reduce_many {dt} {n} {op} group {lists[gi]}")
                assert err is None, err
                out[(gi, it, async_op)] = digest(t)
    # Mismatched lengths are refused before anything is sent.
    with pytest.raises(ValueError):
        fc.all_reduce_many([torch.ones(1)], [g for _, g in mine])
    # A bad tensor after a good one discards the whole blocking batch on every rank: nothing
    # was sent, the thread records nothing more, and the groups' next ops match.
    with pytest.raises(ValueError, match="contiguous"):
        fc.all_reduce_many([torch.full((4,), 1000.0), torch.ones(4, 2).t()], [None, None])
    assert not fc._C.recording()
    t = torch.full((4,), float(rank + 1))
    fc.all_reduce(t)
    assert torch.equal(t, torch.full((4,), float(sum(range(1, world + 1))))), t
    assert fc.all_reduce_many([], []) is None
    return out


def test_all_reduce_many_sync_and_async():
    res = harness.run(_many_body, 4, timeout=60, env=RING_ENV)
    # bit-identical on every member of each group
    for gi, lst in enumerate(RING_PAIRS + TRIPLES):
        ds = [{k: v for k, v in res[r].items() if k[0] == gi} for r in lst]
        assert ds[0] and all(d == ds[0] for d in ds), f"group {lst} members differ"


# ---------------------------------------------------------------------------------------------
# Discarded batches, empty batches, nesting


def _discard_body(rank, world):
    g = fc.new_group([0, 1])
    other = fc.new_group([0, 1])
    results = []
    # 1. Rank 0 raises inside the block after queuing ops on g (and a send to rank 1): nothing
    #    may have been sent, so rank 1's next all_reduce/recv match rank 0's next ones.
    if rank == 0:
        with pytest.raises(KeyError):
            with fc.batch() as b:
                fc.all_reduce(torch.full((8,), 1000.0), group=g)
                fc.broadcast(torch.full((3,), 1000.0), 0, group=other)
                fc.send(torch.full((2,), 1000.0), 1)
                raise KeyError("boom")
        with pytest.raises(RuntimeError, match="with-block raised, so its ops were discarded"):
            b.wait()
    t = torch.full((8,), float(rank + 1))
    # The thread's batch is gone: this is a normal op again (async returns a Work).
    w = fc.all_reduce(t, group=g, async_op=True)
    assert isinstance(w, fc.Work)
    w.wait()
    results.append(t.tolist())
    u = torch.full((3,), float(rank + 10))
    fc.broadcast(u, 1, group=other)
    results.append(u.tolist())
    v = torch.full((2,), -1.0)
    if rank == 0:
        fc.send(torch.full((2,), 5.0), 1)
    else:
        fc.recv(v, 0)
    results.append(v.tolist())
    # 2. An argument error raised at issue time inside the block discards the whole batch
    #    too: on both ranks, after a valid op was queued.
    with pytest.raises(ValueError):
        with fc.batch():
            fc.all_reduce(torch.full((4,), 1000.0), group=g)
            fc.all_reduce(torch.ones(4, 2).t(), group=g)  # non-contiguous: refused
    t = torch.full((4,), float(rank + 1))
    fc.all_reduce(t, group=g)
    results.append(t.tolist())
    # 3. Batches do not nest; the outer one still works.
    with fc.batch() as outer:
        x = torch.full((5,), float(rank))
        fc.all_reduce(x, group=g)
        with pytest.raises(RuntimeError, match="nest"):
            with fc.batch():
                pass
    outer.wait()
    results.append(x.tolist())
    # 4. Empty batches complete at once, in every form.
    with fc.batch() as e:
        pass
    assert len(e) == 0
    assert e.wait() is True and e.is_completed() and e.exception() is None
    assert e.get_future().wait() == []
    with fc.batch() as e2:
        pass
    assert e2.get_future().wait() == [] and e2.is_completed()
    m = fc.all_reduce_many([], [], async_op=True)
    assert m.wait() is True and m.is_completed()
    return results


def test_discarded_nested_and_empty_batches():
    res = harness.run(_discard_body, 2, timeout=60)
    for r in res:
        assert r == [[3.0] * 8, [11.0] * 3, r[2], [3.0] * 4, [1.0] * 5]
    assert res[1][2] == [5.0, 5.0]


def _batch_work_body(rank, world):
    """A batch answers the Work API whole: result() lists the ops' outputs in issue order, and
    synchronize() after wait() leaves it completed (on the device path it waits for the device;
    wait() there returns once the ops are enqueued)."""
    g = fc.new_group([0, 1])
    x, y = torch.full((3,), float(rank + 1)), torch.full((2,), float(10 * rank))
    with fc.batch() as b:
        fc.all_reduce(x, group=g)
        fc.broadcast(y, src=1, group=g)
    b.wait()
    b.synchronize()
    return [t.tolist() for t in b.result()], b.is_completed()


@pytest.mark.parametrize("env", [{}, {"FASTCOMM_FAKE_DEVICE": "1"}], ids=["host", "device"])
def test_a_batch_has_result_and_synchronize(env):
    for res, done in harness.run(_batch_work_body, 2, timeout=60, env=env):
        assert res == [[3.0] * 3, [10.0] * 2] and done, res


def _other_thread_body(rank, world):
    """A batch records the ops of the thread that opened it only: another thread's op inside
    the block runs at once (natively entered or through a Python wrapper), and a plan being
    recorded on that other thread is its own."""
    import threading

    g, h = fc.new_group([0, 1]), fc.new_group([0, 1])
    seen = {}

    def other():
        t = torch.full((3,), float(rank + 1))
        assert fc.all_reduce(t, group=h) is None
        u = [torch.zeros(3) for _ in range(2)]
        fc.all_gather(u, t, group=h)
        seen["other"] = (t.tolist(), [x.tolist() for x in u], fc._C.recording())

    x = torch.full((4,), float(rank + 1))
    with fc.batch() as b:
        fc.all_reduce(x, group=g)
        th = threading.Thread(target=other)
        th.start()
        th.join(timeout=30)
        assert not th.is_alive() and "other" in seen
        assert fc._C.recording() and len(b) == 1 and x[0].item() == rank + 1
    assert not fc._C.recording()
    b.wait()
    return x.tolist(), seen["other"]


def test_batch_records_its_own_thread_only():
    res = harness.run(_other_thread_body, 2, timeout=60)
    assert res[0] == res[1] == ([3.0] * 4, ([3.0] * 3, [[3.0] * 3, [3.0] * 3], False))


def _pending_batch_then_op_body(rank, world):
    """A posted batch not yet waited on, then a blocking op on one of its groups: the group's
    ops still run in issue order."""
    lists = RING_PAIRS
    groups = fc.new_groups(lists)
    mine = [(gi, g) for gi, g in enumerate(groups) if g.rank() >= 0]
    ts = [torch.full((50_000,), float(rank + 1)) for _ in mine]
    with fc.batch() as b:
        for t, (_, g) in zip(ts, mine):
            fc.all_reduce(t, group=g)
    gi0 = 2 * (rank // 2)  # [0, 1] for ranks 0, 1; [2, 3] for ranks 2, 3
    g0 = groups[gi0]
    after = torch.full((7,), float(10 * (rank + 1)))
    fc.all_reduce(after, op=ReduceOp.MAX, group=g0)
    b.wait()
    for t, (gi, _) in zip(ts, mine):
        assert torch.equal(t, torch.full_like(t, float(sum(r + 1 for r in lists[gi])))), (gi, t[:3])
    assert torch.equal(after, torch.full((7,), float(10 * (max(lists[gi0]) + 1))))
    return True


def test_pending_batch_then_blocking_op_same_group():
    harness.run(_pending_batch_then_op_body, 4, timeout=60, env=RING_ENV)


# ---------------------------------------------------------------------------------------------
# Errors inside a batch stay with their group


def _bad_group_body(rank, world, n):
    # bad: [0, 1] with mismatched numel; good: [1, 2], [2, 3], [3, 0] (ranks 0 and 1 are in one
    # good group each, in the same batch as the bad op).
    lists = [[0, 1], [1, 2], [2, 3], [3, 0]]
    groups = fc.new_groups(lists)
    mine = [(gi, g) for gi, g in enumerate(groups) if g.rank() >= 0]
    tensors = {}
    with fc.batch() as b:
        for gi, g in mine:
            size = n + (rank if gi == 0 else 0)  # rank 0: n, rank 1: n + 1 in group [0, 1]
            t = torch.full((size,), float(rank + 1))
            tensors[gi] = t
            fc.all_reduce(t, group=g)
            if gi != 0:  # a second op in the good groups, after the bad one
                t2 = torch.full((3,), float(rank + 1))
                tensors[(gi, 2)] = t2
                fc.broadcast(t2, lists[gi][0], group=g)
    err = None
    try:
        b.wait()
    except DistBackendError as e:
        err = str(e)
    assert b.is_completed()
    if rank in (0, 1):
        assert err is not None, f"rank {rank}: bad batch did not raise"
        assert "[0, 1]" in err, f"rank {rank}: error does not name the group: {err}"
        assert b.exception() is not None
        fut = b.get_future()
        with pytest.raises(Exception):
            fut.wait()
    else:
        assert err is None, f"rank {rank}: good batch raised {err}"
    for gi, _ in mine:
        if gi == 0:
            continue
        exp = float(sum(r + 1 for r in lists[gi]))
        assert torch.equal(tensors[gi], torch.full((n,), exp)), f"rank {rank} group {lists[gi]}"
        root = lists[gi][0]
        assert torch.equal(tensors[(gi, 2)], torch.full((3,), float(root + 1)))
    # The bad group stays usable. (Small on purpose: a follow-up all_reduce larger than what
    # the failed op left free in the rings can hang -- see test_group_usable_after_large_mismatch.)
    if rank in (0, 1):
        t = torch.full((7,), float(rank + 1))
        fc.all_reduce(t, group=groups[0])
        assert torch.equal(t, torch.full((7,), 3.0))
        t = torch.full((n,), float(rank + 1))
        fc.all_reduce(t, group=groups[0])
        assert torch.equal(t, torch.full((n,), 3.0))
    return err


@pytest.mark.parametrize("n", [10, 100_001])  # 100001 float32: many pieces of a 64 KiB ring
def test_batch_error_confined_to_bad_group(n):
    res = harness.run(_bad_group_body, 4, n, timeout=60, env=RING_ENV)
    assert res[2] is None and res[3] is None


def _mismatch_body(rank, world):
    g = fc.new_group([0, 1])
    good = fc.new_group([0, 1])
    errors = []
    variants = [
        ("dtype", lambda: fc.all_reduce(torch.ones(6, dtype=torch.float32 if rank == 0 else torch.float64),
                                        group=g)),
        ("op", lambda: fc.all_reduce(torch.ones(6), op=ReduceOp.SUM if rank == 0 else ReduceOp.MAX,
                                     group=g)),
        ("kind", lambda: (fc.all_reduce(torch.ones(6), group=g) if rank == 0
                          else fc.broadcast(torch.ones(6), 0, group=g))),
        ("root", lambda: fc.broadcast(torch.ones(6), rank, group=g)),
        ("numel", lambda: fc.all_gather([torch.ones(6 + rank), torch.ones(6 + rank)], torch.ones(6 + rank),
                                        group=g)),
    ]
    for name, fn in variants:
        ok = torch.full((4,), float(rank + 1))
        with fc.batch() as b:
            fc.all_reduce(ok, group=good)
            fn()
        try:
            b.wait()
            errors.append(None)
        except DistBackendError as e:
            errors.append(str(e))
        assert torch.equal(ok, torch.full((4,), 3.0)), f"{name}: good group result {ok}"
        # The group is still usable after the mismatch.
        t = torch.full((2,), float(rank + 1))
        fc.all_reduce(t, group=g)
        assert torch.equal(t, torch.full((2,), 3.0)), f"{name}: group unusable after: {t}"
    return errors


def test_mismatched_batches_raise_on_every_member():
    res = harness.run(_mismatch_body, 2, timeout=60)
    for rank, errs in enumerate(res):
        for name, e in zip(["dtype", "op", "kind", "root", "numel"], errs):
            assert e is not None, f"rank {rank}: mismatched {name} did not raise"
            assert "[0, 1]" in e and "mismatch" in e, f"rank {rank}: {name}: {e}"


def _big_batch_body(rank, world, k, reps):
    """Many more ops in one batch than the 64 KiB rings hold: k groups over the same pair,
    each used `reps` times in the batch, plus several sends with one tag that must arrive in
    order, and all_reduce_many with a group listed twice."""
    groups = fc.new_groups([[0, 1]] * k)
    ts, sent, got = [], [], []
    with fc.batch() as b:
        for rep in range(reps):
            for i, g in enumerate(groups):
                t = torch.full((10, 10), float((rank + 1) * (i + 1) + rep))
                ts.append((i, rep, t))
                fc.all_reduce(t, group=g)
        for j in range(5):
            if rank == 0:
                x = torch.full((1000,), float(j))
                sent.append(x)
                fc.send(x, 1, tag=9)
            else:
                y = torch.full((1000,), -1.0)
                got.append(y)
                fc.recv(y, 0, tag=9)
    b.wait()
    for i, rep, t in ts:
        exp = float(3 * (i + 1) + 2 * rep)
        assert torch.equal(t, torch.full((10, 10), exp)), (i, rep, t[0, :3])
    for j, y in enumerate(got):
        assert torch.equal(y, torch.full((1000,), float(j))), (j, y[:3])
    a, c = torch.full((3,), float(rank + 1)), torch.full((3,), float(10 * (rank + 1)))
    fc.all_reduce_many([a, c], [groups[0], groups[0]])
    assert torch.equal(a, torch.full((3,), 3.0)) and torch.equal(c, torch.full((3,), 30.0))
    return True


def test_batch_larger_than_the_rings():
    harness.run(_big_batch_body, 2, 64, 4, timeout=60, env=RING_ENV)


def _large_mismatch_then_large_op_body(rank, world, n):
    g = fc.new_group([0, 1])
    try:
        fc.all_reduce(torch.ones(n + rank), group=g, async_op=True).wait()  # numel mismatch
        return "mismatch not detected"
    except DistBackendError:
        pass
    t = torch.full((n,), float(rank + 1))
    try:
        fc.all_reduce(t, group=g)  # matched: the group must still work
    except DistBackendError as e:
        return f"stuck: {str(e)[:160]}"
    return "ok" if torch.equal(t, torch.full((n,), 3.0)) else f"wrong result {t[:3]}"


def test_group_usable_after_large_mismatch():
    """A mismatched all_reduce larger than the ring, then a matched large all_reduce on the
    same pair: repeated over fresh launches (the race needs both members to detect the
    mismatch at once, most likely on their first op), stopping at the first stuck one."""
    n = 100_001  # 400 KB of float32: many pieces of a 64 KiB ring
    for launch in range(120):
        res = harness.run(_large_mismatch_then_large_op_body, 2, n, timeout=60, env=RING_ENV,
                          init_timeout=2)
        assert res == ["ok", "ok"], f"launch {launch}: {res}"


def _interleaved_batches_body(rank, world, rounds, k):
    """Batches over k pair groups, some groups with several ops, each round's group order
    shuffled differently on each rank (a group's own ops in the same order everywhere), and
    rank 1 sometimes a little late: the peer's messages arrive before, during and after a
    pass, are taken in place or set aside, and every result must still be exact."""
    import random
    import time

    groups = fc.new_groups([[0, 1]] * k)
    sizes = [0, 1, 7, 100, 1001]
    dtypes = [torch.float32, torch.int64, torch.float64, torch.int32]
    for it in range(rounds):
        plan_rng = random.Random(1000 + it)  # the same on both ranks: what each op is
        ops = []
        for gi in range(k):
            for j in range(plan_rng.choice([1, 1, 2, 3])):
                n, dt = plan_rng.choice(sizes), plan_rng.choice(dtypes)
                ops.append((gi, j, n, dt))
        order = list(range(k))
        random.Random(7 * it + rank).shuffle(order)  # differs between the ranks
        by_group = {gi: [op for op in ops if op[0] == gi] for gi in range(k)}
        if rank == 1 and it % 3 == 1:
            time.sleep(0.002)
        tensors = {}
        with fc.batch() as b:
            for gi in order:
                for (_, j, n, dt) in by_group[gi]:
                    t = (torch.arange(n) % 13 + 100 * rank + 10 * j + gi).to(dt)
                    tensors[(gi, j)] = t
                    fc.all_reduce(t, group=groups[gi])
        b.wait()
        for (gi, j, n, dt) in ops:
            exp = (2 * (torch.arange(n) % 13) + 100 + 20 * j + 2 * gi).to(dt)
            if not torch.equal(tensors[(gi, j)], exp):
                return f"rank {rank} round {it}: group {gi} op {j} ({n} x {dt}) wrong"
    return "ok"


def test_interleaved_batches_over_many_groups():
    assert harness.run(_interleaved_batches_body, 2, 40, 24, timeout=120) == ["ok", "ok"]
