"""fastcomm as a torch.distributed backend, driven through torch's own API only.

Nothing here calls fastcomm besides ``import fastcomm`` (which registers the backend): every
rank calls ``dist.init_process_group("fastcomm", store=...)`` itself (harness.run with
init=False; the store is a client of the run's TCPStore), and every op is a plain
``torch.distributed`` call. Results are compared with references computed locally from
deterministic inputs of every member; each run has a hard timeout (harness.run)."""
from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

import harness
from _helpers import all_reduce_ref, expect

import fastcomm  # noqa: F401  (registers the backend)

TIMEOUT = timedelta(seconds=30)
SIZES = [0, 1, 7, 1001, 70_001]  # 70_001 float32 = 280 KB: many ring-sized pieces per op
BIG = 300_001  # all_reduce only: 1.2 MB float32, more than a whole shared-memory ring
DTYPES = [torch.float32, torch.int64, torch.bfloat16]

# torch 2.13 renamed all_gather_into_tensor / reduce_scatter_tensor (the old names still work,
# with a FutureWarning); both spellings are tested where the new one exists.
all_gather_single = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
reduce_scatter_single = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


def init(rank, world, backend="fastcomm"):
    dist.init_process_group(backend, store=harness.child_store(), rank=rank, world_size=world,
                            timeout=TIMEOUT)


def value(rank, n, dtype, salt=0, small=False):
    """Deterministic input of global ``rank``: small integers, exact in every dtype used here
    (sums of four stay below 256; with ``small``, products of four are at most 3**4)."""
    i = torch.arange(n)
    v = (i + rank + salt) % 3 + 1 if small else (i * 5 + rank * 3 + salt) % 11 + rank
    return v.to(dtype)


def fold(xs, op):
    acc = xs[0].clone()
    for x in xs[1:]:
        if op in (ReduceOp.SUM, ReduceOp.AVG):
            acc = acc + x
        elif op == ReduceOp.PRODUCT:
            acc = acc * x
        elif op == ReduceOp.MIN:
            acc = torch.minimum(acc, x)
        else:
            acc = torch.maximum(acc, x)
    return acc / len(xs) if op == ReduceOp.AVG else acc


def same(out, ref, what, exact=True):
    """Exact for the integer-valued data used here, except where rounding may differ (AVG's
    division, 16-bit floats)."""
    assert out.dtype == ref.dtype and out.shape == ref.shape, (what, out.dtype, out.shape, ref.shape)
    if exact and out.dtype not in (torch.float16, torch.bfloat16):
        torch.testing.assert_close(out, ref, rtol=0, atol=0, msg=lambda m: f"{what}: {m}")
    else:
        torch.testing.assert_close(out, ref, msg=lambda m: f"{what}: {m}")


def pair_group(rank):
    """(lo, group): this rank's pair [lo, lo + 1] ([0, 1] or [2, 3]), made by its members only."""
    lo = 2 * (rank // 2)
    return lo, dist.new_group([lo, lo + 1], backend="fastcomm", use_local_synchronization=True)


def make_groups(rank, world):
    """(name, group, sorted global members) for this rank: the default group, its pair (made
    by the pair's members only) and, for ranks 1..3, the triple [1, 2, 3] (made by its members
    only, given unsorted)."""
    lo, pair = pair_group(rank)
    groups = [("world", None, list(range(world))), ("pair", pair, [lo, lo + 1])]
    if rank >= 1:
        triple = dist.new_group([3, 1, 2], backend="fastcomm", use_local_synchronization=True)
        groups.append(("triple", triple, [1, 2, 3]))
    return groups


# ---------------------------------------------------------------------------------------------
# Collectives

def collectives_body(rank, world):
    init(rank, world)
    assert dist.get_backend() == "fastcomm"
    checked = 0
    for name, g, members in make_groups(rank, world):
        k = len(members)
        me = members.index(rank)
        assert dist.get_rank(g) == me and dist.get_world_size(g) == k
        for dtype in DTYPES:
            for n in SIZES + ([BIG] if dtype == torch.float32 else []):
                what = f"{name} {dtype} n={n}"
                # all_reduce, every op
                ops = [ReduceOp.SUM, ReduceOp.MAX, ReduceOp.MIN, ReduceOp.PRODUCT]
                ops += [ReduceOp.AVG] if dtype.is_floating_point else []
                for op in ops:
                    small = op == ReduceOp.PRODUCT
                    t = value(rank, n, dtype, small=small)
                    dist.all_reduce(t, op=op, group=g)
                    same(t, all_reduce_ref([value(r, n, dtype, small=small) for r in members], members, op, fold),
                         f"all_reduce {op} {what}", exact=op != ReduceOp.AVG)
                    checked += 1
                if n == BIG:
                    continue
                # broadcast from every member, by global rank and by group rank
                for root in range(k):
                    t = value(rank, n, dtype, salt=root)
                    if root % 2:
                        dist.broadcast(t, group_src=root, group=g)
                    else:
                        dist.broadcast(t, src=members[root], group=g)
                    same(t, value(members[root], n, dtype, salt=root), f"broadcast root {root} {what}")
                # all_gather (list), all_gather_into_tensor (flat and stacked)
                outs = [torch.full((n,), -1).to(dtype) for _ in range(k)]
                dist.all_gather(outs, value(rank, n, dtype), group=g)
                for i, r in enumerate(members):
                    same(outs[i], value(r, n, dtype), f"all_gather [{i}] {what}")
                ref = torch.cat([value(r, n, dtype) for r in members])
                flat = torch.empty(k * n, dtype=dtype)
                dist.all_gather_into_tensor(flat, value(rank, n, dtype), group=g)
                same(flat, ref, f"all_gather_into_tensor flat {what}")
                stacked = torch.empty(k, n, dtype=dtype)  # through torch 2.13's new name
                all_gather_single(stacked, value(rank, n, dtype), group=g)
                same(stacked, ref.view(k, n), f"all_gather_into_tensor stacked {what}")
                # reduce_scatter (list) and reduce_scatter_tensor: member j gets the reduction
                # of every member's j-th piece
                for op in (ReduceOp.SUM, ReduceOp.MAX):
                    out = torch.full((n,), -1).to(dtype)
                    dist.reduce_scatter(out, [value(rank, n, dtype, salt=j) for j in range(k)],
                                        op=op, group=g)
                    same(out, fold([value(r, n, dtype, salt=me) for r in members], op),
                         f"reduce_scatter {op} {what}")
                out = torch.full((n,), -1).to(dtype)
                inp = torch.cat([value(rank, n, dtype, salt=j) for j in range(k)])
                dist.reduce_scatter_tensor(out, inp, group=g)
                same(out, fold([value(r, n, dtype, salt=me) for r in members], ReduceOp.SUM),
                     f"reduce_scatter_tensor {what}")
                out = torch.full((n,), -1).to(dtype)
                reduce_scatter_single(out, inp.view(k, n), group=g)
                same(out, fold([value(r, n, dtype, salt=me) for r in members], ReduceOp.SUM),
                     f"reduce_scatter_tensor stacked {what}")
                checked += 2 * k + 6
        assert dist.barrier(group=g) is None
        checked += 1
    dist.destroy_process_group()
    return checked


def test_collectives_world_pairs_and_triple():
    counts = harness.run(collectives_body, 4, init=False, timeout=240)
    assert all(c > 100 for c in counts), counts


# ---------------------------------------------------------------------------------------------
# Async ops: Work.wait(), is_completed(), get_future()

def async_body(rank, world):
    init(rank, world)
    lo, pair = pair_group(rank)
    members = [lo, lo + 1]

    # Several ops in flight on two groups, waited in the reverse order of issue.
    a = value(rank, 1001, torch.float32)
    b = value(rank, 7, torch.int64)
    outs = [torch.empty(5, dtype=torch.float32) for _ in range(2)]
    w1 = dist.all_reduce(a, group=pair, async_op=True)
    w2 = dist.all_reduce(b, op=ReduceOp.MAX, async_op=True)  # default group
    w3 = dist.all_gather(outs, torch.full((5,), float(rank)), group=pair, async_op=True)
    w4 = dist.barrier(async_op=True)
    for w in (w1, w2, w3, w4):
        assert isinstance(w, dist.Work), type(w)
    fut3 = w3.get_future()
    assert w4.wait() is True
    vals = fut3.wait()  # the future's value: the op's output tensors themselves
    assert [v.data_ptr() for v in vals] == [o.data_ptr() for o in outs]
    assert [o[0].item() for o in outs] == [float(r) for r in members]
    doubled = w2.get_future().then(lambda f: f.value()[0] * 2)
    assert w2.wait() is True
    same(b, all_reduce_ref([value(r, 7, torch.int64) for r in range(world)], list(range(world)), ReduceOp.MAX, fold), "async all_reduce MAX")
    same(doubled.wait(), b * 2, "future.then")
    assert w1.wait() is True and w1.is_completed()
    if _torch_work_exception_bound():
        assert w1.exception() is None
    same(a, all_reduce_ref([value(r, 1001, torch.float32) for r in members], members, ReduceOp.SUM, fold), "async all_reduce")

    # A callback attached while the op is still pending (the partner issues it 0.3 s late)
    # runs when the op completes, on whichever thread completes it.
    t = torch.full((3,), float(rank + 1))
    if rank % 2 == 0:
        time.sleep(0.3)
    w = dist.all_reduce(t, group=pair, async_op=True)
    seen = []
    fut = w.get_future().then(lambda f: seen.append(f.value()[0].sum().item()))
    fut.wait()
    assert seen == [3.0 * (2 * lo + 3)], seen

    # Async reduce_scatter_tensor, all_gather_into_tensor, broadcast
    out = torch.empty(4)
    w5 = dist.reduce_scatter_tensor(out, torch.arange(8.0) + rank, group=pair, async_op=True)
    cat = torch.empty(6)
    w6 = dist.all_gather_into_tensor(cat, torch.full((3,), float(rank)), group=pair, async_op=True)
    bc = torch.full((2,), float(rank))
    w7 = dist.broadcast(bc, src=lo + 1, group=pair, async_op=True)
    for w in (w7, w6, w5):
        w.wait()
    me = rank - lo
    same(out, 2 * torch.arange(4.0 * me, 4.0 * me + 4) + 2 * lo + 1, "async reduce_scatter_tensor")
    same(cat, torch.tensor([float(lo)] * 3 + [float(lo + 1)] * 3), "async all_gather_into_tensor")
    same(bc, torch.full((2,), float(lo + 1)), "async broadcast")
    dist.destroy_process_group()
    return True


def _torch_work_exception_bound():
    """Whether this torch's Python binding of Work.exception() returns at all: torch 2.11's
    cannot convert its result (it raises TypeError for Gloo's Work too)."""
    try:
        dist.distributed_c10d.Work().exception()
    except TypeError:
        return False
    return True


def test_async_work_and_futures():
    harness.run(async_body, 4, init=False, timeout=90)


# ---------------------------------------------------------------------------------------------
# Point to point

def p2p_body(rank, world):
    init(rank, world)
    lo, pair = pair_group(rank)
    peer = lo + 1 - (rank - lo)
    for dtype in (torch.float32, torch.int64):
        for n in (0, 1, 7, 70_001):
            # blocking send/recv in the pair, by global rank (dst/src) and by group rank
            if rank == lo:
                dist.send(value(rank, n, dtype), dst=peer, group=pair)
                t = torch.zeros(n, dtype=dtype)
                assert dist.recv(t, group_src=1, group=pair) == peer
            else:
                t = torch.zeros(n, dtype=dtype)
                assert dist.recv(t, src=peer, group=pair) == peer
                dist.send(value(rank, n, dtype), group_dst=0, group=pair)
            same(t, value(peer, n, dtype), f"send/recv pair {dtype} n={n}")
            # a ring over the default group with isend/irecv, recv posted first
            nxt, prv = (rank + 1) % world, (rank - 1) % world
            r = torch.zeros(n, dtype=dtype)
            rw = dist.irecv(r, src=prv)
            sw = dist.isend(value(rank, n, dtype, salt=1), dst=nxt)
            sw.wait()
            rw.wait()
            same(r, value(prv, n, dtype, salt=1), f"isend/irecv ring {dtype} n={n}")
    # Tags: messages on different tags match by tag, not by arrival order
    if rank == lo:
        dist.send(torch.tensor([1.0]), dst=peer, group=pair, tag=7)
        dist.send(torch.tensor([2.0]), dst=peer, group=pair, tag=3)
    else:
        a, b = torch.zeros(1), torch.zeros(1)
        wb = dist.irecv(b, src=peer, group=pair, tag=3)
        wa = dist.irecv(a, src=peer, group=pair, tag=7)
        wb.wait()
        wa.wait()
        assert (a.item(), b.item()) == (1.0, 2.0)
    # batch_isend_irecv: a two-way exchange in the pair
    mine, theirs = torch.full((4,), float(rank)), torch.zeros(4)
    reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, mine, peer, pair),
                                   dist.P2POp(dist.irecv, theirs, peer, pair)])
    for req in reqs:
        req.wait()
    same(theirs, torch.full((4,), float(peer)), "batch_isend_irecv")

    # A blocking recv on a thread must not hold the GIL: while it waits, the main thread runs
    # an all_reduce in the same pair, which the sender needs to finish before it sends.
    if rank == lo:
        got = torch.zeros(3)
        th = threading.Thread(target=dist.recv, args=(got,), kwargs={"src": peer, "group": pair, "tag": 9})
        th.start()
        t = torch.ones(2)
        dist.all_reduce(t, group=pair)
        th.join(timeout=20)
        assert not th.is_alive(), "recv thread hung"
        same(got, torch.full((3,), 5.0), "threaded recv")
    else:
        t = torch.ones(2)
        dist.all_reduce(t, group=pair)
        dist.send(torch.full((3,), 5.0), dst=peer, group=pair, tag=9)
    same(t, torch.full((2,), 2.0), "all_reduce beside a blocked recv")
    # The same the other way round: a blocking all_reduce (which waits inside the backend call)
    # on a thread, while the main thread sends what the partner needs before it joins in.
    if rank == lo:
        x = torch.ones(2)
        th = threading.Thread(target=dist.all_reduce, args=(x,), kwargs={"group": pair})
        th.start()
        dist.send(torch.full((3,), 6.0), dst=peer, group=pair, tag=10)
        th.join(timeout=20)
        assert not th.is_alive(), "all_reduce thread hung"
    else:
        got = torch.zeros(3)
        dist.recv(got, src=peer, group=pair, tag=10)
        same(got, torch.full((3,), 6.0), "recv beside a blocked all_reduce")
        x = torch.ones(2)
        dist.all_reduce(x, group=pair)
    same(x, torch.full((2,), 2.0), "threaded all_reduce")
    dist.destroy_process_group()
    return True


def test_send_recv_isend_irecv():
    harness.run(p2p_body, 4, init=False, timeout=120)


# ---------------------------------------------------------------------------------------------
# Coalesced forms (dist.all_reduce_coalesced, the coalescing manager's fast path)

def coalesced_body(rank, world):
    init(rank, world)
    lo, pair = pair_group(rank)
    members = [lo, lo + 1]
    ts = [value(rank, n, torch.float32) for n in (0, 3, 1001)]
    dist.all_reduce_coalesced(ts, group=pair)
    for t, n in zip(ts, (0, 3, 1001)):
        same(t, fold([value(r, n, torch.float32) for r in members], ReduceOp.SUM), "all_reduce_coalesced")
    from torch.distributed.distributed_c10d import _coalescing_manager

    xs = [value(rank, n, torch.int64) for n in (5, 7)]
    with _coalescing_manager(group=pair, async_ops=True) as cm:
        for x in xs:
            dist.all_reduce(x, group=pair)
    cm.wait()
    for x, n in zip(xs, (5, 7)):
        same(x, fold([value(r, n, torch.int64) for r in members], ReduceOp.SUM), "coalesced all_reduce")
    outs = [torch.empty(2 * n) for n in (3, 4)]
    with _coalescing_manager(group=pair):
        for o, n in zip(outs, (3, 4)):
            dist.all_gather_into_tensor(o, value(rank, n, torch.float32), group=pair)
    for o, n in zip(outs, (3, 4)):
        same(o, torch.cat([value(r, n, torch.float32) for r in members]), "coalesced all_gather_into_tensor")
    outs = [torch.empty(n) for n in (3, 4)]
    with _coalescing_manager(group=pair):
        for o, n in zip(outs, (3, 4)):
            dist.reduce_scatter_tensor(o, torch.arange(2.0 * n) + rank, group=pair)
    me = rank - lo
    for o, n in zip(outs, (3, 4)):
        same(o, 2 * torch.arange(float(me * n), float(me * n + n)) + 2 * lo + 1,
             "coalesced reduce_scatter_tensor")
    dist.destroy_process_group()
    return True


def test_coalesced_forms():
    harness.run(coalesced_body, 4, init=False, timeout=90)


# ---------------------------------------------------------------------------------------------
# Errors: unsupported ops, bad arguments, mismatched members

def errors_body(rank, world):
    init(rank, world)
    pair = dist.new_group([0, 1], backend="fastcomm", use_local_synchronization=True)
    t = torch.ones(4)
    # (reduce, gather, scatter and all_to_all are tested in test_more_collectives.py, recv
    # without src in test_any_source.py)

    # Arguments the engine rejects, before anything is sent (so the group stays in step)
    with pytest.raises(ValueError, match="exactly one tensor"):
        pair.allreduce([torch.ones(2), torch.ones(2)]).wait()
    with pytest.raises(ValueError, match="contiguous"):
        dist.all_reduce(torch.ones(4, 4).t(), group=pair)
    with pytest.raises(ValueError, match="BAND"):
        dist.all_reduce(torch.ones(4), op=ReduceOp.BAND, group=pair)
    with pytest.raises(ValueError, match="expected 2"):
        dist.all_gather([torch.zeros(4)], t, group=pair)

    # Members that disagree: both get torch's DistBackendError from the Work
    with pytest.raises(dist.DistBackendError, match="mismatched"):
        dist.all_reduce(torch.ones(3 + rank), group=pair)
    x = torch.full((2,), float(rank))
    dist.all_reduce(x, group=pair)  # the group still works
    same(x, torch.ones(2), "all_reduce after errors")
    dist.destroy_process_group()
    return True


def test_unsupported_ops_and_bad_arguments_raise():
    harness.run(errors_body, 2, init=False, timeout=90)


def barrier_timeout_body(rank, world, case):
    """dist.barrier(timeout=...) is the barrier's own timeout, as in Gloo, shorter or longer than
    the group's (1 s here): "shorter": rank 0's barrier of 0.5 s fails while rank 1 stays away
    (the store says when it may come); rank 1 then passes it (rank 0's arrival was sent) and the
    group goes on. "longer": rank 0's barrier of 60 s waits for rank 1, which comes 2 s after
    rank 0 entered, past the group's timeout. "async": the same as "shorter", through
    barrier(async_op=True).wait()."""
    init(rank, world)
    store = harness.child_store()
    g = dist.new_group([0, 1], timeout=timedelta(seconds=1))
    msg = None
    if case == "longer":
        if rank == 0:
            store.set("entering", "1")
            dist.barrier(group=g, timeout=timedelta(seconds=60))
        else:
            store.wait(["entering"])
            time.sleep(2.0)  # at least twice the group's timeout (only a lower bound matters)
            dist.barrier(group=g)
    elif rank == 0:
        if case == "async":
            call = lambda: dist.barrier(group=g, async_op=True, timeout=timedelta(seconds=0.5)).wait()  # noqa: E731
        else:
            call = lambda: dist.barrier(group=g, timeout=timedelta(seconds=0.5))  # noqa: E731
        msg = expect(dist.DistBackendError, call, "barrier", "rank 0", "timed out after 500 ms, the call's own timeout")
        store.set("barrier_timed_out", "1")
    else:
        store.wait(["barrier_timed_out"])
        dist.barrier(group=g)  # passes: rank 0's arrival came before its barrier timed out
    t = torch.full((3,), float(rank + 1))
    dist.all_reduce(t, group=g)
    same(t, torch.full((3,), 3.0), "all_reduce after the barrier")
    dist.destroy_process_group()
    return msg


@pytest.mark.parametrize("case", ["shorter", "longer", "async"])
def test_a_barrier_timeout_is_the_barriers_own(case):
    res = harness.run(barrier_timeout_body, 2, case, init=False, timeout=120)
    assert (res[0] is not None) == (case != "longer"), res


# ---------------------------------------------------------------------------------------------
# Backend strings, lifecycle

def mixed_string_body(rank, world):
    out = {}
    try:
        init(rank, world, "cpu:fastcomm,cuda:nccl")
        out["nccl"] = "ok"
    except RuntimeError as e:
        # A CPU-only build of torch refuses any NCCL part itself, before the group exists.
        assert not dist.is_nccl_available() and "NCCL built in" in str(e), e
        out["nccl"] = "torch has no NCCL"
        init(rank, world, "cpu:fastcomm,cuda:gloo")  # the same multi-backend path
    except ValueError as e:
        # A CUDA build of torch on a machine without a GPU: its NCCL part refuses to start.
        assert not torch.cuda.is_available() and "no GPUs found" in str(e), e
        out["nccl"] = "no GPU"
        init(rank, world, "cpu:fastcomm,cuda:gloo")
    assert type(dist.group.WORLD._get_backend(torch.device("cpu"))).__name__ == "FastcommBackend"
    t = torch.full((5,), float(rank + 1))
    dist.all_reduce(t)
    same(t, torch.full((5,), float(sum(range(1, world + 1)))), "all_reduce on cpu:fastcomm")
    g = dist.new_group([0, 1], use_local_synchronization=True)  # inherits the backend string
    assert type(g._get_backend(torch.device("cpu"))).__name__ == "FastcommBackend"
    u = torch.full((3,), float(rank))
    dist.broadcast(u, src=1, group=g)
    same(u, torch.ones(3), "broadcast on inherited subgroup")
    dist.destroy_process_group()
    return out


def test_device_backend_string():
    out = harness.run(mixed_string_body, 2, init=False, timeout=90)
    assert len({o["nccl"] for o in out}) == 1, out


def lifecycle_body(rank, world):
    # Default group on Gloo: a fastcomm subgroup has no engine to join (its members alone
    # create it), and says so.
    dist.init_process_group("gloo", store=harness.child_store(), rank=rank, world_size=world,
                            timeout=TIMEOUT)
    with pytest.raises(RuntimeError, match="needs fastcomm's engine"):
        dist.new_group([0, 1], backend="fastcomm", use_local_synchronization=True)
    dist.destroy_process_group()

    # Twice over: init on fastcomm, use, destroy a subgroup alone, destroy everything.
    for round_ in range(2):
        init(rank, world)
        g = dist.new_group([0, 1], backend="fastcomm", use_local_synchronization=True)
        t = torch.full((3,), float(rank + round_))
        dist.all_reduce(t, group=g)
        same(t, torch.full((3,), float(1 + 2 * round_)), f"round {round_}")
        dist.destroy_process_group(g)
        t = torch.ones(2)
        dist.all_reduce(t)
        same(t, torch.full((2,), float(world)), f"round {round_} world after subgroup destroy")
        dist.destroy_process_group()
        assert not dist.is_initialized()
    return True


def test_lifecycle_destroy_and_reinit():
    harness.run(lifecycle_body, 2, init=False, timeout=90)


def debug_detail_body(rank, world):
    # TORCH_DISTRIBUTED_DEBUG=DETAIL: torch wraps every group it makes in its checking wrapper,
    # which needs the backend's sequence numbers (the world group's creation failed without).
    dist.set_debug_level(dist.DebugLevel.DETAIL)
    try:
        init(rank, world)
        pair = dist.new_group([0, 1], backend="fastcomm", use_local_synchronization=True)
        for name, g in (("world", None), ("pair", pair)):
            backend = (g or dist.group.WORLD)._get_backend(torch.device("cpu"))
            seq = backend._get_sequence_number_for_group()
            t = torch.full((3,), float(rank + 1))
            dist.all_reduce(t, group=g)
            same(t, torch.full((3,), 3.0), f"all_reduce on {name} under DETAIL")
            objs = [None] * 2
            dist.all_gather_object(objs, f"r{rank}", group=g)
            assert objs == ["r0", "r1"], objs
            dist.send(torch.ones(1), dst=1 - rank, group=g) if rank == 0 else \
                dist.recv(torch.ones(1), src=0, group=g)
            # all_reduce, then all_gather_object's two all_gathers; send/recv are not counted
            assert backend._get_sequence_number_for_group() == seq + 3, name
        # The wrapper compares the members' next collectives (kind, sequence number, tensors)
        # before running them: a mismatch is an error on both, and the group goes on.
        with pytest.raises(RuntimeError, match="Detected mismatch between collectives"):
            if rank == 0:
                dist.all_reduce(torch.ones(3), group=pair)
            else:
                dist.broadcast(torch.ones(3), src=0, group=pair)
        u = torch.full((2,), float(rank))
        dist.all_reduce(u, group=pair)
        same(u, torch.ones(2), "all_reduce after a detected mismatch")
        dist.destroy_process_group()
    finally:
        dist.set_debug_level(dist.DebugLevel.OFF)
    return True


def test_debug_detail_wrapper_and_sequence_numbers():
    harness.run(debug_detail_body, 2, init=False, timeout=90)
