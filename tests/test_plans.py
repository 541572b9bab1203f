"""Persistent plans: ``with fc.plan() as p:`` records ops once, ``p.start()`` runs them again
and again. Every start must give what issuing the same ops anew would give, on the tensors'
contents at that start: the inputs are refilled in place between starts (from (rank, start)),
and the outputs compared with references computed locally. Also: the Work of a start, one
start at a time, plans interleaved with ordinary ops on the same groups, and the errors (a
tensor that moved, a plan after shutdown, recording inside a batch)."""
from __future__ import annotations

import pytest
import torch
from torch.distributed import ReduceOp

import harness
from _helpers import expect
from test_collectives import BIG, RING_ENV

import fastcomm as fc

SIZES = [0, 1, 7, 1001, BIG]  # BIG: several pieces of the 64 KiB test ring
DTYPES = [torch.float32, torch.int64, torch.float64]
STARTS = 6


def _val(rank, start, n, dtype, salt=0):
    """Small integers: exact in every dtype here, whatever order a sum folds them in."""
    return ((torch.arange(n) * 7 + salt) % 97 + 10 * rank + 3 * start).to(dtype)


class _Recorded:
    """The ops of one plan on this rank, with their tensors, their refills and references."""

    def __init__(self, rank, world, groups, n, dtype):
        self.rank, self.items = rank, []
        for gi, g in enumerate(groups):
            if g.rank() < 0:
                continue
            ranks = g.ranks
            k = len(ranks)
            root = ranks[gi % k]
            # The salt names the op (group and kind), the same on every member.
            self.items += [
                ("all_reduce_sum", g, ranks, torch.empty(n, dtype=dtype), None, 10 * gi),
                ("all_reduce_max", g, ranks, torch.empty(n, dtype=dtype), None, 10 * gi + 1),
                ("broadcast", g, ranks, torch.empty(n, dtype=dtype), root, 10 * gi + 2),
                ("all_gather", g, ranks, torch.empty(n, dtype=dtype), torch.empty(k * n, dtype=dtype),
                 10 * gi + 3),
                ("reduce_scatter", g, ranks, torch.empty(k * n, dtype=dtype), torch.empty(n, dtype=dtype),
                 10 * gi + 4),
            ]
        # A ring of sends and receives over the whole world (rank r sends to r + 1).
        self.items.append(("ring", None, list(range(world)), torch.empty(n, dtype=dtype),
                           torch.empty(n, dtype=dtype), 99))

    def issue(self):
        for kind, g, ranks, t, extra, _ in self.items:
            if kind == "all_reduce_sum":
                fc.all_reduce(t, group=g)
            elif kind == "all_reduce_max":
                fc.all_reduce(t, op=ReduceOp.MAX, group=g)
            elif kind == "broadcast":
                fc.broadcast(t, src=extra, group=g)
            elif kind == "all_gather":
                fc.all_gather_into_tensor(extra, t, group=g)
            elif kind == "reduce_scatter":
                fc.reduce_scatter_tensor(extra, t, group=g)
            else:
                world = len(ranks)
                fc.send(t, (self.rank + 1) % world)
                fc.recv(extra, (self.rank - 1) % world)

    def refill(self, s):
        for kind, g, ranks, t, extra, j in self.items:
            t.copy_(_val(self.rank, s, t.numel(), t.dtype, j))
            if extra is not None and isinstance(extra, torch.Tensor):
                extra.fill_(-1)

    def check(self, s):
        bad = []
        for kind, g, ranks, t, extra, j in self.items:
            n, dt = t.numel(), t.dtype
            if kind == "all_reduce_sum":
                got, ref = t, sum(_val(r, s, n, dt, j) for r in ranks)
            elif kind == "all_reduce_max":
                got, ref = t, torch.stack([_val(r, s, n, dt, j) for r in ranks]).amax(0)
            elif kind == "broadcast":
                got, ref = t, _val(extra, s, n, dt, j)
            elif kind == "all_gather":
                got, ref = extra, torch.cat([_val(r, s, n, dt, j) for r in ranks])
            elif kind == "reduce_scatter":
                me = ranks.index(self.rank)
                k = len(ranks)
                full = sum(_val(r, s, n, dt, j) for r in ranks)
                got, ref = extra, full[me * (n // k):(me + 1) * (n // k)]
            else:
                got, ref = extra, _val((self.rank - 1) % len(ranks), s, n, dt, j)
            if not torch.equal(got, ref.to(dt)):
                bad.append(f"rank {self.rank}, start {s}, {kind} on {ranks}, n={n} {dt}")
        return bad


def _sweep_body(rank, world, lists, sizes, dtypes, starts):
    groups = fc.new_groups(lists)
    bad = []
    for n in sizes:
        for dt in dtypes:
            rec = _Recorded(rank, world, groups, n, dt)
            with fc.plan() as p:
                rec.issue()
            assert len(p) == sum(2 if kind == "ring" else 1 for kind, *_ in rec.items)
            outs = []
            for s in range(starts):
                rec.refill(s)
                if s % 2:
                    assert p.start(async_op=False) is None
                else:
                    w = p.start()
                    assert w.wait() is True and w.is_completed() and w.exception() is None
                    outs.append([t.data_ptr() for t in w.result()])
                    outs.append([t.data_ptr() for t in w.get_future().value()])
                bad += rec.check(s)
            # Every start's Work holds the outputs a batch of the same ops holds, in order.
            with fc.batch() as b:
                rec.issue()
            b.wait()
            want = [t.data_ptr() for t in b.get_future().value()]
            bad += [f"rank {rank}, n={n} {dt}: a start's outputs differ from a batch's" for o in outs if o != want]
    return bad


@pytest.mark.parametrize("shape", ["pairs", "triples", "world"])
def test_every_start_gives_the_ops_results_on_current_contents(shape):
    lists = {"pairs": [[0, 1], [2, 3], [1, 2], [3, 0]],
             "triples": [[0, 1, 2], [1, 2, 3], [0, 2, 3]],
             "world": [[0, 1, 2, 3]]}[shape]
    res = harness.run(_sweep_body, 4, lists, SIZES, DTYPES, STARTS, env=RING_ENV, timeout=240)
    bad = [b for r in res for b in r]
    assert not bad, f"{len(bad)} wrong results:\n" + "\n".join(bad[:20])


def _cross_host_body(rank, world, lists, sizes, dtypes, starts):
    import os
    os.environ["FASTCOMM_HOST_ID"] = f"host-{rank % 2}"
    harness.init_child(rank, world)
    try:
        return _sweep_body(rank, world, lists, sizes, dtypes, starts)
    finally:
        fc.shutdown()


def test_plans_across_hosts():
    # Pairs [0, 1] and [2, 3] cross hosts (Gloo), the world group is mixed (hierarchical).
    res = harness.run(_cross_host_body, 4, [[0, 1], [2, 3], [0, 1, 2, 3]], [0, 7, BIG],
                      [torch.float32], 3, env=RING_ENV, init=False, timeout=240)
    bad = [b for r in res for b in r]
    assert not bad, "\n".join(bad[:20])


def _interleaved_body(rank, world):
    # Plan starts and ordinary ops on the same groups, in the same order on every member.
    g = fc.new_group([0, 1])
    t = torch.empty(5)
    with fc.plan() as p:
        fc.all_reduce(t, group=g)
    out = []
    for s in range(20):
        t.fill_(rank + s)
        p.start(async_op=False)
        out.append(t[0].item())
        u = torch.full((3,), float(rank * 10 + s))
        w = fc.all_reduce(u, group=g, async_op=True)
        t.fill_(rank + 2 * s)
        p.start().wait()
        w.wait()
        out += [u[0].item(), t[0].item()]
    return out


def test_plan_starts_and_ordinary_ops_interleave_in_issue_order():
    res = harness.run(_interleaved_body, 2)
    exp = []
    for s in range(20):
        exp += [float(2 * s + 1), float(10 + 2 * s), float(4 * s + 1)]
    assert res == [exp, exp]


def _one_at_a_time_body(rank, world):
    """A start while the last one runs waits for it first, on every member alike however fast
    the peers were, and whatever told the program the last one was done (or nothing did): rank
    0's first start is still pending at its second (rank 1 has not started); rank 1's has run,
    seen only through its future; then starts chained through futures, a blocking op of the
    same group, and starts never waited for in between."""
    store = harness.child_store()
    g = fc.new_group([0, 1])
    t = torch.full((4,), float(rank + 1))
    with fc.plan() as p:
        fc.all_reduce(t, group=g)
    if rank == 1:
        store.wait(["fc-test/second-start-issued"])  # rank 0's first start stays pending until now
    w = p.start()
    if rank == 0:
        store.set("fc-test/second-start-issued", "1")  # (its second start below waits for rank 1)
    else:
        w.get_future().wait()
    p.start().get_future().then(lambda f: f.value()).wait()  # 3 -> 6 -> 12
    p.start()
    u = torch.full((2,), float(rank))
    fc.all_reduce(u, group=g)
    p.start()
    p.start().wait()  # 12 -> 24 -> 48
    return t.tolist(), u.tolist()


def test_a_plan_runs_one_start_at_a_time():
    assert harness.run(_one_at_a_time_body, 2) == [([48.0] * 4, [1.0] * 2)] * 2


def _errors_body(rank, world):
    g = fc.new_group([0, 1])
    # Recording inside a batch, or starting before the block ends, is refused.
    with fc.batch():
        expect(RuntimeError, lambda: fc.plan().__enter__(), "inside a batch")
    p = fc.plan()
    expect(RuntimeError, p.start, "before the plan was recorded")
    # An exception inside the block records nothing.
    q = fc.plan()
    with pytest.raises(KeyError):
        with q:
            fc.all_reduce(torch.ones(2), group=g)
            raise KeyError("user code failed")
    expect(RuntimeError, q.start, "with-block raised", "record it again")
    # An empty plan completes at once.
    with fc.plan() as empty:
        pass
    assert len(empty) == 0 and empty.start().is_completed()
    # A tensor moved or laid out anew after recording: every start refuses it (the plan's ops
    # point into the memory and layout it had).
    def recorded(t):
        with fc.plan() as q:
            fc.all_reduce(t, group=g)
        return q

    t = torch.ones(8)
    moved = recorded(t)
    t.set_(torch.zeros(16))
    expect(ValueError, moved.start, "was moved", "rank", "group [0, 1]")
    base = torch.ones(8)
    u = base[:4]
    offset = recorded(u)
    u.set_(base.untyped_storage(), 4, (4,))  # the same storage, another offset
    expect(ValueError, offset.start, "was moved")
    m = torch.ones(2, 3)
    transposed = recorded(m)
    m.t_()
    expect(ValueError, transposed.start, "laid out anew")
    s = torch.ones(8)
    smaller = recorded(s)
    s.resize_(4)
    expect(ValueError, smaller.start, "laid out anew")
    for x in (torch.ones(4), torch.sparse_coo_tensor([[0, 2]], [1.0, 2.0], (4,))):
        retyped = recorded(x)
        x.data = x.data.double()  # the same tensor object, another dtype (sparse: its size may change)
        expect(ValueError, retyped.start, "another dtype")
    # A plan outlives the session it was recorded in, but cannot run there.
    with fc.plan() as old:
        fc.all_reduce(torch.ones(2), group=g)
    fc.barrier(group=g)
    fc.shutdown()
    harness.init_child(rank, world)
    expect(RuntimeError, old.start, "shutdown")
    return True


def test_plan_errors():
    assert harness.run(_errors_body, 2) == [True, True]
