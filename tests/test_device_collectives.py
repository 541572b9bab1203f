"""The whole collective set on the device path, run on the fake device runtime
(FASTCOMM_FAKE_DEVICE=1 sends CPU tensors through csrc/device/ as CUDA tensors go): reduce,
gather, scatter, all_to_all and all_to_all_single (even and uneven splits), the flat
all_gather/reduce_scatter and the coalesced forms, natively and through the torch backend,
blocking, async, inside fc.batch() and fc.plan(); per-pair size mismatches of all_to_all; a
dead member; recv from any source in a pair; and ops issued under CUDA graph capture, which are
refused with the plan route (p.capture(), tests/test_device_graphs.py) named.

Every result is compared with a reference computed locally (_helpers.gen/fold) over sizes 0, 1
and odd, several dtypes, group shapes 2 to 5 and overlapping groups. Each test is one launch of
its ranks that loops over its cases, to keep the suite's time down."""
from __future__ import annotations

from datetime import timedelta

import os

import pytest
import torch
import torch.distributed as dist

import harness
from _device import DEV, ENV, ON_GPU, channels, dsync, fake_only, setup
from _helpers import _DTYPES, expect, fold, gen, seed_of

import fastcomm as fc

# FASTCOMM_DEVICE_TEST=cuda (scripts/gpu_check.sh) runs the same cases on CUDA tensors, several
# ranks sharing GPU 0; by default they run on the fake.
SIZES = [0, 1, 7]
DTYPES = ["float32", "bfloat16", "int64"]


def D(t):
    """A tensor on the device under test."""
    return t.to(DEV)


def full(shape, v, **kw):
    return torch.full(shape, v, device=DEV, **kw)


def empty(*shape, **kw):
    return torch.empty(*shape, device=DEV, **kw)


def dbg(what, arg=0):
    return fc._state._engine.device_debug("cpu", what, arg)


def same(got, ref, what):
    got = got.cpu()
    assert torch.equal(got, ref), f"{what}: got {got.tolist()}, expected {ref.tolist()}"


# Group shapes 2 to 5, overlapping, made by every rank in the same order.
LISTS5 = [[0, 1], [1, 2], [3, 4], [0, 1, 2], [1, 2, 3, 4], [0, 1, 2, 3, 4]]


def a2a_count(src, dst, numel, seed):
    """Elements group rank `src` sends to group rank `dst` in the uneven all_to_all: some zero."""
    return (3 * src + 5 * dst + numel + seed) % 4


# ---------------------------------------------------------------------------------------------
# Results, natively: blocking, each kind over every group shape, size and dtype


def _native_body(rank, world):
    setup(rank)
    groups = fc.new_groups(LISTS5)
    checked = 0
    for ranks, g in zip(LISTS5, groups):
        if rank not in ranks:
            continue
        n, me = len(ranks), ranks.index(rank)
        for numel in SIZES:
            for dt in DTYPES:
                seed = seed_of(tuple(ranks), numel, dt, mod=100_000)
                dtype = _DTYPES[dt]
                # reduce to the last member
                for op in ("SUM", "MAX", "MIN", "PRODUCT", "AVG"):
                    if op == "AVG" and dt == "int64":
                        continue
                    t = D(gen(rank, seed, dt, numel, op))
                    fc.reduce(t, dst=ranks[-1], op=getattr(dist.ReduceOp, op), group=g)
                    dsync()
                    if me == n - 1:
                        same(t, fold([gen(r, seed, dt, numel, op) for r in ranks], op), f"reduce {op} {ranks}")
                    else:
                        same(t, gen(rank, seed, dt, numel, op), "reduce leaves a non-root's tensor")
                # gather to the second member, scatter from the first
                root = ranks[1 % n]
                outs = [full((numel,), -1, dtype=dtype) for _ in ranks] if rank == root else None
                fc.gather(D(gen(rank, seed, dt, numel)), outs, dst=root, group=g)
                dsync()
                if rank == root:
                    for r, o in zip(ranks, outs):
                        same(o, gen(r, seed, dt, numel), f"gather from {r}")
                ins = [D(gen(ranks[0], seed + j, dt, numel)) for j in range(n)] if me == 0 else None
                t = full((numel,), -1, dtype=dtype)
                fc.scatter(t, ins, src=ranks[0], group=g)
                dsync()
                same(t, gen(ranks[0], seed + me, dt, numel), "scatter")
                # all_to_all, even then uneven (some pairs move nothing one way or both)
                for even in (True, False):
                    cnt = (lambda s, d: numel) if even else (lambda s, d: a2a_count(s, d, numel, seed))
                    ins = [D(gen(rank, seed + 10 * j, dt, cnt(me, j))) for j in range(n)]
                    outs = [full((cnt(j, me),), -1, dtype=dtype) for j in range(n)]
                    fc.all_to_all(outs, ins, group=g)
                    dsync()
                    for j, r in enumerate(ranks):
                        same(outs[j], gen(r, seed + 10 * me, dt, cnt(j, me)), f"all_to_all from {r}")
                    # all_to_all_single, rows of 3 elements
                    send = [cnt(me, j) for j in range(n)]
                    recv = [cnt(j, me) for j in range(n)]
                    x = D(gen(rank, seed + 1, dt, 3 * sum(send)).reshape(-1, 3))
                    y = full((sum(recv), 3), -1, dtype=dtype)
                    if even:
                        fc.all_to_all_single(y, x, group=g)
                    else:
                        fc.all_to_all_single(y, x, recv, send, group=g)
                    dsync()
                    for j, r in enumerate(ranks):
                        theirs = [cnt(j, k) for k in range(n)]
                        blk = gen(r, seed + 1, dt, 3 * sum(theirs)).reshape(-1, 3)
                        lo = sum(theirs[:me])
                        at = sum(recv[:j])
                        same(y[at:at + recv[j]], blk[lo:lo + theirs[me]], f"all_to_all_single from {r}")
                # the flat forms
                flat = empty(n * numel, dtype=dtype)
                fc.all_gather_into_tensor(flat, D(gen(rank, seed, dt, numel)), group=g)
                o = empty(numel, dtype=dtype)
                fc.reduce_scatter_tensor(o, D(gen(rank, seed, dt, n * numel)), group=g)
                dsync()
                same(flat, torch.cat([gen(r, seed, dt, numel) for r in ranks]), "all_gather_into_tensor")
                ref = fold([gen(r, seed, dt, n * numel) for r in ranks], "SUM")[me * numel:(me + 1) * numel]
                same(o, ref, "reduce_scatter_tensor")
                checked += 1
    return checked


@channels
def test_each_collective_matches_the_reference_on_every_group_shape(channel):
    # An op's timeout counts from its issue, so a member's first op of a group waits there for
    # the members with more groups before it: rank 0's first op of the world group waits for the
    # whole of [1, 2, 3, 4]'s ops, about half of the body's time (18.5 s of 38 s measured on a
    # starved machine, where 20 s timed out). Half the run's limit: an op times out only in a run
    # that would have run out of time anyway.
    res = harness.run(_native_body, 5, timeout=300, env={**ENV, **channel}, init_timeout=150)
    assert all(r > 0 for r in res), res


# ---------------------------------------------------------------------------------------------
# Async, fc.batch(), fc.plan()


def _async_batch_plan_body(rank, world):
    setup(rank)
    lists = [[0, 1], [1, 2], [0, 1, 2]]
    groups = fc.new_groups(lists)
    n = 3
    tri = groups[2]
    me = rank
    # async: several ops of overlapping groups in flight at once
    works, checks = [], []
    for numel in (0, 5):
        x = D(gen(rank, 11 + numel, "float32", 2 * n * numel).reshape(n * numel, 2) if numel else torch.empty(0, 2))
        y = torch.empty_like(x)
        works.append(fc.all_to_all_single(y, x, group=tri, async_op=True))
        checks.append((y, numel))
        r = D(gen(rank, 21 + numel, "float64", numel))
        works.append(fc.reduce(r, dst=2, group=tri, async_op=True))
        checks.append((r, -numel - 1))
    for ranks, g in zip(lists[:2], groups[:2]):
        if rank in ranks:
            outs = [empty(3, dtype=torch.int64) for _ in ranks]
            works.append(fc.all_to_all(outs, [full((3,), 10 * rank + j) for j in range(2)], group=g,
                                       async_op=True))
            checks.append((outs, ranks))
    for w in works:
        w.wait()
    dsync()
    for got, what in checks:
        if isinstance(what, list):
            for j, r in enumerate(what):
                same(got[j], torch.full((3,), 10 * r + what.index(rank)), "async all_to_all")
        elif what >= 0:
            numel = what
            for j in range(n):
                blk = gen(j, 11 + numel, "float32", 2 * n * numel).reshape(n * numel, 2) if numel else torch.empty(0, 2)
                same(got[j * numel:(j + 1) * numel], blk[me * numel:(me + 1) * numel], "async all_to_all_single")
        else:
            numel = -what - 1
            ref = fold([gen(r, 21 + numel, "float64", numel) for r in range(n)], "SUM") if rank == 2 else \
                gen(rank, 21 + numel, "float64", numel)
            same(got, ref, "async reduce")
    # one batch: a scatter, a gather and an all_to_all over overlapping groups
    sc = empty(4)
    ga = [empty(4) for _ in range(n)] if rank == 1 else None
    a2a = [empty(2) for _ in range(n)]
    with fc.batch() as b:
        fc.scatter(sc, [full((4,), float(j)) for j in range(n)] if rank == 0 else None, src=0, group=tri)
        fc.gather(full((4,), float(rank)), ga, dst=1, group=tri)
        fc.all_to_all(a2a, [full((2,), float(10 * rank + j)) for j in range(n)], group=tri)
    b.wait()
    dsync()
    same(sc, torch.full((4,), float(rank)), "batch scatter")
    if rank == 1:
        for j in range(n):
            same(ga[j], torch.full((4,), float(j)), "batch gather")
    for j in range(n):
        same(a2a[j], torch.full((2,), float(10 * j + rank)), "batch all_to_all")
    # a plan, started several times with refilled inputs
    x = empty(2 * n, 3)
    y = empty(2 * n, 3)
    red = empty(5, dtype=torch.int64)
    with fc.plan() as p:
        fc.all_to_all_single(y, x, group=tri)
        fc.reduce(red, dst=0, op=dist.ReduceOp.MAX, group=tri)
    for it in range(4):
        x.copy_(gen(rank, 100 + it, "float32", 6 * n).reshape(2 * n, 3))
        red.copy_(gen(rank, 200 + it, "int64", 5))
        p.start().wait()
        dsync()
        for j in range(n):
            blk = gen(j, 100 + it, "float32", 6 * n).reshape(2 * n, 3)
            same(y[2 * j:2 * j + 2], blk[2 * me:2 * me + 2], "plan all_to_all_single")
        if rank == 0:
            same(red, fold([gen(r, 200 + it, "int64", 5) for r in range(n)], "MAX"), "plan reduce")
    return len(p)


@channels
def test_async_batched_and_planned_ops(channel):
    assert harness.run(_async_batch_plan_body, 3, timeout=120, env={**ENV, **channel}, init_timeout=20) == [2, 2, 2]


# ---------------------------------------------------------------------------------------------
# all_to_all: sizes are agreed per pair


def _a2a_mismatch_body(rank, world):
    setup(rank)
    g = fc.new_group([0, 1, 2])
    # rank 0 sends 2 elements to rank 1, which expects 3; the pairs with rank 2 agree
    send = {0: [1, 2, 1], 1: [1, 1, 1], 2: [1, 1, 1]}[rank]
    recv = {0: [1, 1, 1], 1: [3, 1, 1], 2: [1, 1, 1]}[rank]
    x = full((sum(send),), 1.0)
    y = empty(sum(recv))
    msg = None
    if rank in (0, 1):
        msg = expect(dist.DistBackendError, lambda: fc.all_to_all_single(y, x, recv, send, group=g),
                     "mismatched op", "all_to_all(")
    else:
        # rank 2's own pairs agree, but its op is one with the failed ones: it may fail or not,
        # never hang; the group goes on below either way
        try:
            fc.all_to_all_single(y, x, recv, send, group=g)
            dsync()
        except dist.DistBackendError:
            pass
    # the group goes on; all_to_all meets all_to_all_single, as on the host path
    out = empty(3)
    if rank == 0:
        outs = [empty(1) for _ in range(3)]
        fc.all_to_all(outs, [full((1,), float(rank)) for _ in range(3)], group=g)
    else:
        fc.all_to_all_single(out, full((3,), float(rank)), group=g)
    dsync()
    if rank == 0:
        out = torch.cat(outs)
    return msg, out.cpu().tolist()


def test_an_all_to_all_size_mismatch_names_both_sides():
    res = harness.run(_a2a_mismatch_body, 3, timeout=60, env=ENV, init_timeout=20)
    for rank in (0, 1):
        msg = res[rank][0]
        # both sides' sizes, each as its rank sees the pair
        assert "sending 8 bytes to and receiving 4 bytes" in msg, msg
        assert "sending 4 bytes to and receiving 12 bytes" in msg, msg
        assert f"rank {1 - rank} issued" in msg, msg
    for rank in range(3):
        assert res[rank][1] == [0.0, 1.0, 2.0]


# ---------------------------------------------------------------------------------------------
# Through the torch backend, the coalesced forms included


def _backend_body(rank, world):
    setup(rank)
    backend = "cpu:fastcomm,cuda:fastcomm" if ON_GPU else "fastcomm"
    dist.init_process_group(backend, store=harness.child_store(), rank=rank, world_size=world,
                            timeout=timedelta(seconds=30))
    try:
        sub = dist.new_group([1, 2, 3])
        out = {}
        # all_to_all_single, uneven: rank r sends r + j + 1 rows of 2 to rank j
        send = [rank + j + 1 for j in range(world)]
        recv = [j + rank + 1 for j in range(world)]
        x = D(torch.arange(2 * sum(send), dtype=torch.float32).reshape(-1, 2) + 1000 * rank)
        y = empty(sum(recv), 2)
        dist.all_to_all_single(y, x, recv, send)
        dist.barrier()
        w = dist.all_to_all_single(y, x, recv, send, async_op=True)
        w.wait()
        dsync()
        out["a2a_single"] = y.tolist()
        outs = [empty(j + 1, dtype=torch.int64) for j in range(world)]
        dist.all_to_all(outs, [full((rank + 1,), 10 * rank + j) for j in range(world)])
        t = full((3,), float(rank + 1))
        dist.reduce(t, dst=2, op=dist.ReduceOp.PRODUCT)
        g = [empty(2) for _ in range(world)] if rank == 1 else None
        dist.gather(full((2,), float(rank)), g, dst=1)
        s = empty(2)
        dist.scatter(s, [full((2,), float(j * j)) for j in range(world)] if rank == 3 else None, src=3)
        dsync()
        out["a2a"] = [o.tolist() for o in outs]
        out["reduce"] = t.tolist()
        out["gather"] = [x.tolist() for x in g] if g else None
        out["scatter"] = s.tolist()
        # the coalesced forms (torch's coalescing manager calls the backend's *_coalesced)
        if rank in (1, 2, 3):
            flats = [empty(3 * k) for k in (1, 2)]
            with dist._coalescing_manager(group=sub, async_ops=True) as cm:
                for k, f in zip((1, 2), flats):
                    dist.all_gather_into_tensor(f, full((k,), float(rank * k)), group=sub)
            cm.wait()
            rs = [empty(k) for k in (1, 3)]
            with dist._coalescing_manager(group=sub, async_ops=False):
                for k, o in zip((1, 3), rs):
                    dist.reduce_scatter_tensor(o, D(torch.arange(3 * k, dtype=torch.float32) * rank), group=sub)
            ar = [full((2,), float(rank)), full((5,), 1.0)]
            with dist._coalescing_manager(group=sub):
                for a in ar:
                    dist.all_reduce(a, group=sub)
            dsync()
            out["coalesced"] = ([f.tolist() for f in flats], [o.tolist() for o in rs], [a.tolist() for a in ar])
        dist.barrier()
        return out
    finally:
        dist.destroy_process_group()


def test_the_torch_backend_runs_every_collective_on_the_device_path():
    world = 4
    res = harness.run(_backend_body, world, timeout=120, env=ENV, init=False)
    for rank, out in enumerate(res):
        rows = []
        for j in range(world):
            theirs = [j + k + 1 for k in range(world)]
            x = torch.arange(2 * sum(theirs), dtype=torch.float32).reshape(-1, 2) + 1000 * j
            lo = sum(theirs[:rank])
            rows += x[lo:lo + theirs[rank]].tolist()
        assert out["a2a_single"] == rows
        assert out["a2a"] == [[10 * j + rank] * (j + 1) for j in range(world)]
        assert out["reduce"] == ([24.0] * 3 if rank == 2 else [float(rank + 1)] * 3)
        assert out["gather"] == ([[float(j)] * 2 for j in range(world)] if rank == 1 else None)
        assert out["scatter"] == [float(rank * rank)] * 2
        if rank in (1, 2, 3):
            flats, rs, ar = out["coalesced"]
            assert flats == [[1.0, 2.0, 3.0], [2.0, 2.0, 4.0, 4.0, 6.0, 6.0]]
            me = rank - 1
            assert rs[0] == [6.0 * me]
            assert rs[1] == [6.0 * (3 * me + i) for i in range(3)]
            assert ar == [[6.0, 6.0], [3.0] * 5]


# ---------------------------------------------------------------------------------------------
# CUDA graph capture: an op issued under capture is refused, naming the plan route


def _capture_body(rank, world):
    from datetime import timedelta as td
    g = fc.new_group([0, 1])
    t = torch.full((4,), float(rank + 1))
    msgs = []
    for mode in (0, 1):  # the global and the thread-local capture modes
        dbg("begin_capture", mode)
        try:
            msgs.append(expect(RuntimeError, lambda: fc.all_reduce(t, group=g), "fastcomm.plan()", "CUDA graph",
                               "group [0, 1]", f"rank {rank}"))
            msgs.append(expect(RuntimeError, lambda: fc.all_to_all_single(torch.empty(2), torch.ones(2), group=g,
                                                                            async_op=True), "fastcomm.plan()"))
        finally:
            valid = dbg("end_capture")
        assert valid == 1  # the refusal touched nothing the capture could record
    # nothing was issued: the group's next op is its first
    fc.all_reduce(t, group=g)
    dsync()
    assert t.tolist() == [3.0] * 4
    # through the torch backend on the same fake
    dist.init_process_group("fastcomm", store=harness.child_store(), rank=rank, world_size=world,
                            timeout=td(seconds=20))
    try:
        x = torch.ones(3)
        dbg("begin_capture", 1)
        try:
            msgs.append(expect(RuntimeError, lambda: dist.all_reduce(x), "fastcomm.plan()", "p.capture()",
                               "CUDA graph"))
        finally:
            dbg("end_capture")
        dist.all_reduce(x)
        # dist.recv without src on a world of two: the other rank
        r = torch.empty(2)
        if rank == 0:
            dist.send(torch.full((2,), 7.0), dst=1)
        else:
            assert dist.recv(r) == 0
            w = dist.irecv(r)
        if rank == 0:
            dist.send(torch.full((2,), 8.0), dst=1)
        else:
            w.wait()
            assert w._source_rank() == 0
        dsync()
        if rank == 1:
            assert r.tolist() == [8.0, 8.0]
        return msgs, x.tolist()
    finally:
        dist.destroy_process_group()


@fake_only
def test_an_op_under_graph_capture_is_refused_naming_the_plan_route():
    res = harness.run(_capture_body, 2, timeout=60, env=ENV, init_timeout=20)
    for msgs, x in res:
        assert x == [2.0] * 3
        assert len(msgs) == 5


def _mixed_batch_body(rank, world):
    """A barrier has no device form: a batch or plan that holds one beside CUDA ops is refused
    on every member, saying so, and nothing of it is sent."""
    setup(rank)
    g = fc.new_group([0, 1])
    t = full((3,), float(rank + 1))

    def batch():
        with fc.batch():
            fc.all_reduce(t, group=g)
            fc.barrier(group=g)

    def plan():
        with fc.plan():
            fc.barrier(group=g)
            fc.all_reduce(t, group=g)

    msgs = [expect(ValueError, batch, "runs on one device", "barrier, which has no device form"),
            expect(ValueError, plan, "runs on one device", "barrier, which has no device form")]
    fc.all_reduce(t, group=g)
    dsync()
    return msgs, t.tolist()


@fake_only
def test_a_batch_of_device_ops_and_a_barrier_is_refused_saying_why():
    for msgs, t in harness.run(_mixed_batch_body, 2, timeout=60, env=ENV, init_timeout=20):
        assert t == [3.0] * 3, (msgs, t)


def _cuda_graph_body(rank, world):
    setup(rank)
    g = fc.new_group([0, 1])
    t = full((4,), float(rank + 1))
    fc.all_reduce(t, group=g)  # the channel exists before the capture
    s = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    msg = None
    with torch.cuda.stream(s):
        try:
            with torch.cuda.graph(graph, stream=s):
                fc.all_reduce(t, group=g)
        except RuntimeError as e:
            msg = str(e)
    fc.all_reduce(t, group=g)
    dsync()
    return msg, t.cpu().tolist()


@pytest.mark.skipif(not ON_GPU, reason="torch.cuda.graph needs a GPU (the fake's capture is tested above)")
def test_torch_cuda_graph_capture_raises_naming_the_plan_route():
    res = harness.run(_cuda_graph_body, 2, timeout=120, env=ENV, init_timeout=60)
    for msg, t in res:
        assert msg is not None and "fastcomm.plan()" in msg and "p.capture()" in msg, msg
        assert t == [6.0] * 4


# ---------------------------------------------------------------------------------------------
# recv from any source: in a pair, the other member (larger groups: tests/test_device_any_source.py)


def _any_source_body(rank, world):
    setup(rank)
    pair, tri = fc.new_groups([[0, 1], [0, 1, 2]])
    got = {}
    if rank in (0, 1):
        other = 1 - rank
        for numel in (0, 5):
            t = D(gen(rank, numel, "float32", numel))
            r = empty(numel)
            if rank == 0:
                fc.send(t, dst=1, group=pair)
                w = fc.irecv(r, group=pair)
                w.wait()
                got[f"irecv{numel}"] = w.source_rank()
            else:
                got[f"recv{numel}"] = fc.recv(r, group=pair)
                fc.send(t, dst=0, group=pair)
            dsync()
            same(r, gen(other, numel, "float32", numel), "any-source recv in a pair")
    return got


def test_a_pair_recv_from_any_source_takes_the_other_member():
    res = harness.run(_any_source_body, 3, timeout=60, env=ENV, init_timeout=20)
    assert res[0]["irecv0"] == 1 and res[0]["irecv5"] == 1, res[0]
    assert res[1]["recv0"] == 0 and res[1]["recv5"] == 0, res[1]
    assert res[2] == {}


# ---------------------------------------------------------------------------------------------
# A dead member fails the new kinds on the others, naming it, never a hang; a group without it
# goes on


def _dead_member_body(rank, world):
    setup(rank)
    tri, pair = fc.new_groups([[0, 1, 2], [0, 1]])
    t = full((4,), float(rank))
    fc.all_to_all_single(empty(3), full((3,), 1.0), group=tri)  # every channel made
    dsync()
    if rank == 2:
        os._exit(0)
    msgs = [expect(dist.DistBackendError, lambda: fc.all_to_all_single(empty(3), full((3,), 1.0), group=tri),
                   "rank 2")]
    if rank == 0:  # the root needs rank 2's block; rank 1 only sends to the root, which takes it
        msgs.append(expect(dist.DistBackendError, lambda: fc.gather(t, [empty(4) for _ in range(3)], dst=0,
                                                                    group=tri), "rank 2"))
    else:
        fc.gather(t, None, dst=0, group=tri)
    ok = full((2,), float(rank + 1))
    fc.reduce(ok, dst=1, group=pair)
    dsync()
    return msgs, ok.cpu().tolist()


@fake_only
def test_a_dead_member_fails_the_new_collectives_naming_it():
    res = harness.run(_dead_member_body, 3, timeout=90, env=ENV, init_timeout=5, allow_fail=(2,))
    assert res[1][1] == [3.0, 3.0]
    assert res[0][1] == [1.0, 1.0]
