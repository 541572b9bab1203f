"""Correctness of fc.all_reduce: every op x dtype x size on every group shape, async handles,
and issue orders that must not deadlock (overlapping groups, threads, same-list groups).

Every result is compared with a reference computed locally from the same deterministic
inputs: each rank regenerates the inputs of every member of its group and folds them left to
right in group-rank order (the order the engine promises), in the tensor's own dtype. Members
also return a digest of their result bytes, and the parent checks that every member of a group
got bit-identical results."""
from __future__ import annotations

import platform
import threading
import time

import pytest
import torch
from torch.distributed import ReduceOp

import harness
from _helpers import all_reduce_ref, digest, fold, gen

import fastcomm as fc

RING_ENV = {"FASTCOMM_SHM_RING_BYTES": "65536"}  # a 64 KiB ring: "larger than the ring" is cheap
# The default 1 MiB ring, whose pieces are large enough for non-temporal copies, forced on.
STREAM_ENV = {"FASTCOMM_SHM_STREAM_STORES": "1"}
LARGE = 300_000  # elements: 0.6-2.4 MB, many times the ring in every dtype

OPS = {"SUM": ReduceOp.SUM, "AVG": ReduceOp.AVG, "MIN": ReduceOp.MIN, "MAX": ReduceOp.MAX,
       "PRODUCT": ReduceOp.PRODUCT}
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
          "float64": torch.float64, "int32": torch.int32, "int64": torch.int64}
SIZES = [0, 1, 7, 1000, LARGE]


def sweep_cases():
    """(op, dtype, numel, kind) for the whole sweep. kind "int": small integer values (results
    exact in every dtype); kind "randn": normal floats, where rounding order shows."""
    cases = []
    for n in SIZES:
        for op in OPS:
            for dt in DTYPES:
                if op == "AVG" and not DTYPES[dt].is_floating_point:
                    continue
                cases.append((op, dt, n, "int"))
                if DTYPES[dt].is_floating_point and n in (7, 1000, LARGE):
                    cases.append((op, dt, n, "randn"))
    return cases


def check_result(out, ref, op, kind, what):
    """Returns None or a failure description."""
    try:
        assert out.dtype == ref.dtype and out.shape == ref.shape
        if op != "AVG" and kind == "int":  # integer-valued data: every dtype computes it exactly
            torch.testing.assert_close(out, ref, rtol=0, atol=0)
        else:
            torch.testing.assert_close(out, ref)  # dtype-appropriate default tolerances
    except AssertionError as e:
        return f"{what}: {str(e)[:400]}"
    return None


def sweep_body(rank, world, shape):
    """Runs the whole sweep on this rank's group; returns (group ranks, {case: digest}, failures)."""
    if shape == "pairs":
        g = fc.new_group([0, 1] if rank < 2 else [2, 3])
        ranks = g.ranks
    elif shape == "triple":
        if rank == 0:
            return None  # not a member: the triple [1, 2, 3] runs without it
        g = fc.new_group([3, 1, 2])  # given unsorted; group rank order is sorted
        ranks = g.ranks
        assert ranks == [1, 2, 3] and g.rank() == rank - 1
    elif shape == "world":
        g = fc.new_group(range(world))
        ranks = g.ranks
    elif shape == "default":
        g = None
        ranks = list(range(world))
    elif shape == "single":
        g = fc.new_group([rank])
        ranks = [rank]
        assert g.size() == 1 and g.rank() == 0
    else:
        raise AssertionError(shape)
    digests, failures = {}, []
    for i, (op, dt, n, kind) in enumerate(sweep_cases()):
        t = gen(rank, i, dt, n, op, kind)
        fc.all_reduce(t, op=OPS[op], group=g)
        ref = all_reduce_ref([gen(r, i, dt, n, op, kind) for r in ranks], ranks, op)
        what = f"rank {rank}, group {ranks}, case #{i} {op} {dt} numel={n} {kind}"
        err = check_result(t, ref, op, kind, what)
        if err:
            failures.append(err)
        digests[i] = digest(t)
    return ranks, digests, failures


@pytest.mark.parametrize("shape,world,env", [("pairs", 4, RING_ENV), ("triple", 4, RING_ENV), ("world", 4, RING_ENV),
                                             ("default", 4, RING_ENV), ("single", 2, RING_ENV),
                                             ("pairs", 4, STREAM_ENV), ("world", 4, STREAM_ENV)],
                         ids=["pairs", "triple", "world", "default", "single", "pairs-stream", "world-stream"])
def test_all_reduce_sweep(shape, world, env):
    results = harness.run(sweep_body, world, shape, timeout=120, env=env)
    failures = [f for res in results if res is not None for f in res[2]]
    assert not failures, f"{len(failures)} wrong results:\n" + "\n".join(failures[:20])
    # Bit-identical on every member of a group.
    by_group = {}
    for rank, res in enumerate(results):
        if res is None:
            continue
        ranks, digests, _ = res
        assert len(digests) == len(sweep_cases())
        by_group.setdefault(tuple(ranks), []).append((rank, digests))
    assert by_group, "no member ran the sweep"
    for ranks, members in by_group.items():
        assert [r for r, _ in members] == list(ranks) or len(ranks) == 1
        r0, d0 = members[0]
        for r, d in members[1:]:
            diff = [sweep_cases()[i] for i in d0 if d0[i] != d[i]]
            assert not diff, f"group {list(ranks)}: ranks {r0} and {r} differ in {diff[:10]}"


# ---------------------------------------------------------------------------------------------
# Async work handles


def _work_api_body(rank, world):
    g = fc.new_group([0, 1])
    out = []
    for n in (7, LARGE):
        t = torch.arange(n, dtype=torch.float32) * (rank + 1)
        ptr = t.data_ptr()
        w = fc.all_reduce(t, op=ReduceOp.SUM, group=g, async_op=True)
        assert isinstance(w, fc.Work)
        fut = w.get_future()  # taken before completion: must complete by itself
        assert w.wait() is True
        assert w.is_completed() is True
        assert w.is_success() is True
        assert w.exception() is None
        value = fut.wait()
        assert isinstance(value, list) and len(value) == 1
        assert value[0].data_ptr() == ptr  # the very tensor, reduced in place
        fut2 = w.get_future()  # taken after completion: already done
        assert fut2.done()
        assert fut2.wait()[0].data_ptr() == ptr
        expected = torch.arange(n, dtype=torch.float32) * 3
        torch.testing.assert_close(t, expected, rtol=0, atol=0)
        out.append(digest(t))
    # get_future().wait() alone (no Work.wait) completes the op.
    t = torch.full((100,), float(rank + 1))
    w = fc.all_reduce(t, op=ReduceOp.MAX, group=g, async_op=True)
    res = w.get_future().wait()
    torch.testing.assert_close(res[0], torch.full((100,), 2.0), rtol=0, atol=0)
    assert w.is_completed() and w.exception() is None
    # is_completed() polling alone (no wait at all) completes the op.
    t = torch.full((10,), float(rank + 1), dtype=torch.float64)
    w = fc.all_reduce(t, op=ReduceOp.PRODUCT, group=g, async_op=True)
    deadline = time.monotonic() + 60
    while not w.is_completed() and time.monotonic() < deadline:
        pass
    assert w.is_completed(), "is_completed() never became true within 60 s"
    torch.testing.assert_close(t, torch.full((10,), 2.0, dtype=torch.float64), rtol=0, atol=0)
    # blocking form returns None
    assert fc.all_reduce(torch.ones(3), group=g) is None
    return out


def _future_after_polling_body(rank, world):
    g = fc.new_group([0, 1])
    for i in range(100):
        t = torch.full((1000,), float(rank + i))
        w = fc.all_reduce(t, group=g, async_op=True)
        fut = w.get_future()
        while not w.is_completed():  # the op may finish inside is_completed(), GIL held
            pass
        res = fut.wait()  # its Future is then completed by another thread
        assert torch.equal(res[0], torch.full((1000,), float(1 + 2 * i))), i
    return True


def _polling_walk_body(rank, world):
    """Every rank walks the same random sequence of small groups, skipping those it is not in,
    and completes each async op by looping on is_completed() alone: with more ranks than cores
    (5 here on 2) a poll that finds nothing to do must let the peers run."""
    import random

    rng = random.Random(7)
    lists = [sorted(rng.sample(range(world), rng.choice((2, 3)))) for _ in range(120)]
    groups = fc.new_groups(lists)
    done = 0
    for i, (members, g) in enumerate(zip(lists, groups)):
        if rank not in members:
            continue
        t = torch.full((16,), float(rank + i))
        w = fc.all_reduce(t, group=g, async_op=True)
        while not w.is_completed():
            pass
        assert torch.equal(t, torch.full((16,), float(sum(members) + len(members) * i))), (i, members)
        done += 1
    return done


def test_is_completed_polling_with_more_ranks_than_cores():
    res = harness.run(_polling_walk_body, 5, timeout=120)
    assert sum(res) > 0 and all(n > 0 for n in res)


def test_future_of_an_op_finished_by_is_completed():
    assert harness.run(_future_after_polling_body, 2, timeout=60, env=RING_ENV) == [True, True]


def test_async_work_api():
    res = harness.run(_work_api_body, 2, timeout=60, env=RING_ENV)
    assert res[0] == res[1]


def _many_async_body(rank, world, k):
    g = fc.new_group([0, 1])
    works, tensors = [], []
    for i in range(k):
        n = LARGE if i % 4 == 1 else 5 + i
        t = torch.full((n,), float(rank + 1 + i), dtype=torch.float64)
        works.append(fc.all_reduce(t, group=g, async_op=True))
        tensors.append(t)
    works[-1].wait()
    for i in reversed(range(k)):  # waited on in reverse order
        w, t = works[i], tensors[i]
        w.wait()
        assert w.is_completed() and w.exception() is None
        expected = float((1 + i) + (2 + i))
        assert torch.equal(t, torch.full_like(t, expected)), f"op {i}: {t[:4]}"
    return True


def test_many_async_ops_on_one_group():
    harness.run(_many_async_body, 2, 16, timeout=60, env=RING_ENV)


def _issue_order_body(rank, world, flag_dir):
    """Ops 0 and 1 of the group become ready together (the peer issues them in one batch);
    op 0's future callback then holds the thread that completed it until op 2 completes (at
    most 2 s). Completion in issue order means op 2 cannot be complete while op 1 is not."""
    import os
    import time

    g = fc.new_group([0, 1])
    ts = [torch.full((n,), float(rank + 1)) for n in (4, 4, 200_000, 200_000)]
    if rank == 1:
        for _ in range(3000):
            if os.path.exists(os.path.join(flag_dir, "go")):
                break
            time.sleep(0.001)
        with fc.batch() as b:
            fc.all_reduce(ts[0], group=g)
            fc.all_reduce(ts[1], group=g)
        ws = [fc.all_reduce(t, group=g, async_op=True) for t in ts[2:]]
        b.wait()
        for w in ws:
            w.wait()
        return None
    ws = [fc.all_reduce(t, group=g, async_op=True) for t in ts]
    futs = [w.get_future() for w in ws]
    seen = {}

    def on_op0(_fut):
        for _ in range(2000):
            if futs[2].done():
                break
            time.sleep(0.001)
        seen["op2_done"] = futs[2].done()
        seen["op1_done"] = futs[1].done()
        seen["op1_is_completed"] = ws[1].is_completed()

    # The callback may run on the engine's background thread, so it can still be running
    # after every Work is done (Works settle before their Futures complete): wait for it.
    cb = futs[0].then(on_op0)
    open(os.path.join(flag_dir, "go"), "w").close()
    for _ in range(100_000_000):  # drive by polling, so that the engine's thread drives too
        if ws[-1].is_completed():
            break
    for w in ws:
        w.wait()
    cb.wait()
    for t in ts:
        assert torch.equal(t, torch.full_like(t, 3.0))
    assert seen, "op 0's callback never ran"
    assert not (seen["op2_done"] and not seen["op1_done"]), (
        f"op 2 of the group completed while op 1 (issued before it) had not: {seen}")
    return seen


def test_async_ops_complete_in_issue_order(tmp_path):
    harness.run(_issue_order_body, 2, str(tmp_path), timeout=60, env=RING_ENV)


def _future_without_wait_body(rank, world):
    g = fc.new_group([0, 1])
    # A stretch of async ops each waited for at once (the same count on both ranks): the
    # background thread's ticks find nothing to drive and slow down.
    for _ in range(5000):
        fc.all_reduce(torch.ones(4), group=g, async_op=True).wait()
    done = threading.Event()
    t = torch.full((4,), float(rank + 1))
    w = fc.all_reduce(t, group=g, async_op=True)
    w.get_future().then(lambda _f: done.set())
    # Nobody waits on or polls the Work: only the background thread drives the op and runs the
    # callback (asking for the Future hurries it).
    assert done.wait(60), f"rank {rank}: the Future's callback never ran"
    assert torch.equal(t, torch.full((4,), 3.0))
    return True


def test_future_completes_without_a_wait():
    assert harness.run(_future_without_wait_body, 2, timeout=90) == [True, True]


# ---------------------------------------------------------------------------------------------
# Issue orders that must not deadlock


def _shutdown_in_callback_body(rank, world):
    """fc.shutdown() from a Future callback on the background thread (nobody waits on the op):
    before, the engine was destroyed on that thread, inside the pass that ran the callback, which
    then used the freed engine (with glibc's free() filling freed memory, every run ended in
    std::terminate). After it, fc.init() gives a working engine again."""
    import ctypes
    import threading
    import time

    ctypes.CDLL(None).mallopt(-6, 165)  # M_PERTURB: freed memory is overwritten, so a use shows
    g = fc.new_group([0, 1])
    ended = threading.Event()
    if rank == 1:
        time.sleep(0.3)  # rank 0's op is then completed by its background thread

    def cb(_fut):
        fc.shutdown()
        ended.set()

    fc.all_reduce(torch.ones(4), group=g, async_op=True).get_future().then(cb)
    assert ended.wait(30), "fc.shutdown() from the callback did not return"
    time.sleep(0.2)  # the background thread's way out, where the freed engine was used
    harness.init_child(rank, world)
    t = torch.full((3,), float(rank + 1))
    fc.all_reduce(t, group=fc.new_group([0, 1]))
    return t.tolist()


def test_shutdown_from_a_callback_on_the_background_thread():
    assert harness.run(_shutdown_in_callback_body, 2, timeout=60) == [[3.0] * 3] * 2


def _ring_body(rank, world, iters):
    left = fc.new_group([(rank - 1) % world, rank])
    right = fc.new_group([rank, (rank + 1) % world])
    sizes = [7, 1000, 100_000]  # 100k float32 = 400 KB, several times the 64 KiB ring
    for it in range(iters):
        n = sizes[it % len(sizes)]

        def val(r, side):  # global rank r's contribution to its left/right group
            return float(1 + r + 10 * (side == "right") + it % 5)

        tl = torch.full((n,), val(rank, "left"))
        tr = torch.full((n,), val(rank, "right"))
        if rank % 2 == 0:  # even ranks: right first
            wr = fc.all_reduce(tr, group=right, async_op=True)
            wl = fc.all_reduce(tl, group=left, async_op=True)
        else:
            wl = fc.all_reduce(tl, group=left, async_op=True)
            wr = fc.all_reduce(tr, group=right, async_op=True)
        if it % 2:
            wl.wait(); wr.wait()  # noqa: E702
        else:
            wr.wait(); wl.wait()  # noqa: E702
        # left group (rank-1, rank): rank-1 contributes its "right" value, rank its "left" one.
        exp_l = val((rank - 1) % world, "right") + val(rank, "left")
        exp_r = val(rank, "right") + val((rank + 1) % world, "left")
        assert torch.equal(tl, torch.full((n,), exp_l)), f"iter {it} left: {tl[:3]} != {exp_l}"
        assert torch.equal(tr, torch.full((n,), exp_r)), f"iter {it} right: {tr[:3]} != {exp_r}"
    return True


def test_overlapping_ring_groups_async_any_order():
    harness.run(_ring_body, 4, 30, timeout=90, env=RING_ENV)


def _threads_body(rank, world, iters):
    # world 3: rank 0 drives groups [0, 1] and [0, 2] from two Python threads at once;
    # ranks 1 and 2 each drive their one group from the main thread.
    g01, g02 = fc.new_groups([[0, 1], [0, 2]])  # the non-member entry stays unused
    errors = []

    def loop(g, peer, salt):
        try:
            for it in range(iters):
                n = (7, 1000, 50_000)[it % 3]
                mine = torch.full((n,), float(salt + it + rank))
                fc.all_reduce(mine, group=g)
                exp = float(salt + it + rank) + float(salt + it + peer)
                assert torch.equal(mine, torch.full((n,), exp)), f"{g.ranks} iter {it}"
                if it % 4 == 0:
                    t = torch.full((n,), float(rank + 2))
                    fc.all_reduce(t, op=ReduceOp.MAX, group=g, async_op=True).wait()
                    assert torch.equal(t, torch.full((n,), float(max(rank, peer) + 2)))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(f"{g.ranks}: {type(e).__name__}: {e}")

    if rank == 0:
        ths = [threading.Thread(target=loop, args=(g01, 1, 100)),
               threading.Thread(target=loop, args=(g02, 2, 200))]
        for th in ths:
            th.start()
        for th in ths:
            th.join(timeout=60)
        assert not any(th.is_alive() for th in ths), "a thread hung"
    elif rank == 1:
        loop(g01, 0, 100)
    else:
        loop(g02, 0, 200)
    assert not errors, errors
    return True


def test_two_threads_on_one_rank_different_groups():
    harness.run(_threads_body, 3, 60, timeout=90, env=RING_ENV)


def _threads_both_body(rank, world, iters):
    # world 2: two groups over the same list [0, 1]; both ranks run one thread per group.
    ga = fc.new_group([0, 1])
    gb = fc.new_group([0, 1])
    errors = []

    def loop(g, salt):
        try:
            for it in range(iters):
                n = (3, 2000, 40_000)[it % 3]
                t = torch.full((n,), float(salt * (rank + 1) + it))
                fc.all_reduce(t, group=g)
                exp = float(salt * 1 + it) + float(salt * 2 + it)
                assert torch.equal(t, torch.full((n,), exp)), f"salt {salt} iter {it}: {t[:3]}"
        except BaseException as e:  # noqa: BLE001
            errors.append(f"salt {salt}: {type(e).__name__}: {e}")

    ths = [threading.Thread(target=loop, args=(ga, 10)), threading.Thread(target=loop, args=(gb, 1000))]
    for th in ths:
        th.start()
    for th in ths:
        th.join(timeout=60)
    assert not any(th.is_alive() for th in ths), "a thread hung"
    assert not errors, errors
    return True


def test_threads_on_both_ranks_same_list_groups():
    harness.run(_threads_both_body, 2, 60, timeout=90, env=RING_ENV)


def _blocking_among_queued_body(rank, world, iters):
    """A blocking op usually runs before anything is queued for it; it must still go behind an
    async op of its own group, and other groups' messages it reads past (here an async op's on
    `ga`, sent before the blocking op's on `gb`) must reach their ops."""
    ga = fc.new_group([0, 1])
    gb = fc.new_group([0, 1])
    for it in range(iters):
        n = (1, 64, 5000)[it % 3]
        a = torch.full((n,), float(rank + 1))       # ga, first op: 3
        b = torch.full((n,), float(10 * (rank + 1)))  # gb: 30
        c = torch.full((n,), float(100 * (rank + 1)))  # ga, second op: 300
        if rank == 0:
            wa = fc.all_reduce(a, group=ga, async_op=True)
            fc.all_reduce(b, group=gb)
            fc.all_reduce(c, group=ga)  # behind `a` whenever `a` is still queued
            wa.wait()
        else:
            if it % 2:  # gb's op before or after ga's async one
                fc.all_reduce(b, group=gb)
            wa = fc.all_reduce(a, group=ga, async_op=True)
            if it % 2 == 0:
                fc.all_reduce(b, group=gb)
            fc.all_reduce(c, group=ga)
            wa.wait()
        for t, v, name in ((a, 3.0, "a"), (b, 30.0, "b"), (c, 300.0, "c")):
            assert torch.equal(t, torch.full((n,), v)), f"rank {rank} iter {it} {name}: {t[:3]}"
    return True


def test_blocking_ops_among_queued_ones():
    harness.run(_blocking_among_queued_body, 2, 300, timeout=60, env=RING_ENV)


def _same_list_body(rank, world, iters):
    ga = fc.new_group([0, 1])
    gb = fc.new_group([0, 1])  # a second, distinct group over the same ranks
    for it in range(iters):
        n = (1, 999, LARGE // 2)[it % 3]
        ta = torch.full((n,), float(rank + 1), dtype=torch.float64)  # sum over ga: 3
        tb = torch.full((n,), float(10 * (rank + 1)), dtype=torch.float64)  # sum over gb: 30
        if rank == 0:
            wa = fc.all_reduce(ta, group=ga, async_op=True)
            wb = fc.all_reduce(tb, group=gb, async_op=True)
        else:
            wb = fc.all_reduce(tb, group=gb, async_op=True)
            wa = fc.all_reduce(ta, group=ga, async_op=True)
        (wb if it % 2 else wa).wait()
        (wa if it % 2 else wb).wait()
        assert torch.equal(ta, torch.full((n,), 3.0, dtype=torch.float64)), f"iter {it} ga {ta[:3]}"
        assert torch.equal(tb, torch.full((n,), 30.0, dtype=torch.float64)), f"iter {it} gb {tb[:3]}"
    return True


def test_same_rank_list_groups_opposite_orders():
    harness.run(_same_list_body, 2, 30, timeout=60, env=RING_ENV)


# ---------------------------------------------------------------------------------------------
# Tensor shapes, the other integer dtypes, non-finite values


def _shapes_body(rank, world):
    g = fc.new_group([0, 1, 2])
    out = []
    base = torch.arange(1000, dtype=torch.float32)
    cases = [
        ("0-d", lambda r: torch.tensor(float(r + 1))),
        ("10x10 (the forum's MWE)", lambda r: torch.full((10, 10), float(r + 1))),
        ("3-d", lambda r: (base[:60] + r).reshape(3, 4, 5).clone()),
        ("storage offset", lambda r: (base + r)[100:]),  # contiguous view into a bigger storage
        ("empty 2-d", lambda r: torch.empty(0, 5)),
    ]
    for name, make in cases:
        t = make(rank)
        whole = t._base if t._base is not None else None
        whole_before = whole.clone() if whole is not None else None
        fc.all_reduce(t, group=g)
        ref = fold([make(r) for r in range(3)], "SUM")
        assert t.shape == ref.shape, name
        torch.testing.assert_close(t, ref, rtol=0, atol=0, msg=name)
        if whole is not None:  # nothing outside the view was touched
            assert torch.equal(whole[:100], whole_before[:100]), name
        out.append(digest(t))
    # int8 / uint8 / int16 (supported too), with torch's wrap-around for the integer sum
    for dt in (torch.int8, torch.uint8, torch.int16):
        for op in ("SUM", "MIN", "MAX", "PRODUCT"):
            def make(r, dt=dt, op=op):
                gen = torch.Generator().manual_seed(r * 31 + len(op))
                lo, hi = (0, 100) if dt == torch.uint8 else (-60, 60)
                if op == "PRODUCT":
                    lo, hi = (1, 4) if dt == torch.uint8 else (-3, 4)
                return torch.randint(lo, hi, (257,), generator=gen).to(dt)
            t = make(rank)
            fc.all_reduce(t, op=OPS[op], group=g)
            ref = fold([make(r) for r in range(3)], op)
            torch.testing.assert_close(t, ref, rtol=0, atol=0, msg=f"{dt} {op}")
            out.append(digest(t))
    return out


def test_shapes_offsets_and_small_int_dtypes():
    res = harness.run(_shapes_body, 3, timeout=60)
    assert res[0] == res[1] == res[2]


def _nonfinite_body(rank, world):
    g = fc.new_group([0, 1, 2])
    out = []
    for dt in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        def make(r, dt=dt):
            t = torch.arange(12, dtype=torch.float64) - 6.0 + r
            t[r] = float("nan")  # each rank a NaN in a different place
            t[5 + r] = float("inf") if r != 1 else -float("inf")
            t[11] = float("nan") if r == 2 else 1.0
            return t.to(dt)
        for op in ("SUM", "MIN", "MAX", "PRODUCT", "AVG"):
            t = make(rank)
            fc.all_reduce(t, op=OPS[op], group=g)
            ref = fold([make(r) for r in range(3)], op)
            torch.testing.assert_close(t, ref, equal_nan=True, msg=f"{dt} {op}")
            out.append(digest(t))
    return out


def test_nan_and_inf_propagate_like_torch():
    res = harness.run(_nonfinite_body, 3, timeout=60)
    assert res[0] == res[1] == res[2]


def _wait_timeout_body(rank, world, flag_dir):
    import os
    import time

    g = fc.new_group([0, 1])
    t = torch.full((1000,), float(rank + 1))
    if rank == 0:
        w = fc.all_reduce(t, group=g, async_op=True)
        try:  # rank 1 has not issued it yet: a bounded wait gives up, the op stays pending
            w.wait(timeout=0.2)
            raise AssertionError("wait(timeout) returned before the peer issued the op")
        except RuntimeError as e:
            assert "rank 0" in str(e) and "timed out on ALLREDUCE" in str(e), str(e)
        assert not w.is_completed()
        open(os.path.join(flag_dir, "go"), "w").close()
        assert w.wait() is True  # and completes once the peer comes
    else:
        for _ in range(3000):
            if os.path.exists(os.path.join(flag_dir, "go")):
                break
            time.sleep(0.01)
        fc.all_reduce(t, group=g)
    assert torch.equal(t, torch.full((1000,), 3.0))
    return True


def test_work_wait_with_timeout_leaves_op_pending(tmp_path):
    harness.run(_wait_timeout_body, 2, str(tmp_path), timeout=60)


# ---------------------------------------------------------------------------------------------
# Builds of the reduction loops


def _cpu_has_avx2():
    try:
        with open("/proc/cpuinfo") as f:
            return platform.machine() in ("x86_64", "AMD64") and " avx2" in f.read()
    except OSError:
        return False


def _kernels_sweep_body(rank, world):
    from fastcomm import _C
    return _C.reduce_kernels(), sweep_body(rank, world, "pairs")


def test_baseline_and_default_kernels_agree_bit_for_bit():
    """On x86-64 the reduction loops have an AVX2 build picked at run time; every other test
    runs the build this machine picks. Here the pairs sweep runs once with the baseline build
    forced (FASTCOMM_REDUCE_KERNELS=baseline) and once with the default: both must be right
    and give the same bytes in every case, since each element is computed the same way."""
    runs = {}
    expect = {"baseline": "baseline", "default": "avx2" if _cpu_has_avx2() else "baseline"}
    for name, extra in (("baseline", {"FASTCOMM_REDUCE_KERNELS": "baseline"}), ("default", {})):
        out = harness.run(_kernels_sweep_body, 2, timeout=120, env=dict(RING_ENV, **extra))
        ran = [k for k, _ in out]
        assert ran == [expect[name]] * 2, f"{name}: builds run: {ran}"
        results = [res for _, res in out]
        failures = [f for res in results for f in res[2]]
        assert not failures, f"{name}: {len(failures)} wrong results:\n" + "\n".join(failures[:20])
        assert len(results[0][1]) == len(sweep_cases())
        runs[name] = results[0][1]
    diff = [sweep_cases()[i] for i in runs["baseline"] if runs["baseline"][i] != runs["default"][i]]
    assert not diff, f"the two builds differ in {diff[:10]}"
