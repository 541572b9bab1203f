"""fastcomm.all_reduce, broadcast, reduce, gather and scatter are native entries (no Python
frame) that hand every case but the plain one to their Python wrappers: each spelling of the
arguments, inside a batch and a plan, before init and after shutdown, and wrong arguments must
behave exactly as the wrapper does."""
from __future__ import annotations

from datetime import timedelta

import torch
from torch.distributed import DistBackendError, ReduceOp

import harness
from _helpers import expect

import fastcomm as fc
from fastcomm import collectives


def _spellings_body(rank, world):
    g = fc.new_group([0, 1])
    out = []
    for call in (
        lambda t: fc.all_reduce(t),
        lambda t: fc.all_reduce(t, ReduceOp.MAX),
        lambda t: fc.all_reduce(t, ReduceOp.SUM, g),
        lambda t: fc.all_reduce(t, ReduceOp.SUM, g, False),
        lambda t: fc.all_reduce(tensor=t, group=g),
        lambda t: fc.all_reduce(t, group=g, op=ReduceOp.MIN),
        lambda t: fc.all_reduce(t, op=None, group=None),
        lambda t: fc.all_reduce(t, async_op=True, group=g).wait(),
        lambda t: collectives._all_reduce_py(t, group=g),
    ):
        t = torch.full((3,), float(rank + 1))
        call(t)
        out.append(t[0].item())
    w = fc.all_reduce(torch.ones(2), group=g, async_op=True)
    assert isinstance(w, fc.Work) and w.wait() is True
    # Inside a batch the op joins the batch (and returns None) instead of running at once.
    t = torch.full((2,), float(rank + 1))
    with fc.batch() as b:
        assert fc.all_reduce(t, group=g) is None
        assert t[0].item() == rank + 1
    b.wait()
    out.append(t[0].item())
    # Recorded by a plan, run by its start.
    with fc.plan() as p:
        fc.all_reduce(t, group=g)
    t.fill_(rank + 10)
    p.start(async_op=False)
    out.append(t[0].item())
    return out


def test_every_spelling_gives_the_same_result():
    res = harness.run(_spellings_body, 2)
    assert res[0] == res[1] == [3.0, 2.0, 3.0, 3.0, 3.0, 1.0, 3.0, 3.0, 3.0, 3.0, 21.0]


def _errors_body(rank, world):
    g = fc.new_group([0, 1])
    t = torch.ones(2)
    expect(TypeError, lambda: fc.all_reduce(t, group=object()), "group", "fastcomm.Group")
    expect(TypeError, lambda: fc.all_reduce(t, bogus=1), "bogus")
    expect(TypeError, lambda: fc.all_reduce(t, ReduceOp.SUM, op=ReduceOp.SUM), "op")
    expect(TypeError, lambda: fc.all_reduce(), "tensor")
    expect(TypeError, lambda: fc.all_reduce([1.0], group=g), "tensor")
    expect(TypeError, lambda: fc.all_reduce(t, op="sum", group=g), "op", "ReduceOp")
    fc.shutdown()
    expect(RuntimeError, lambda: fc.all_reduce(t, group=g), "all_reduce", "not initialized")
    harness.init_child(rank, world)
    # A group of the earlier session.
    expect(ValueError, lambda: fc.all_reduce(t, group=g), "before fastcomm.shutdown()")
    return True


def test_errors_are_the_wrappers():
    assert harness.run(_errors_body, 2) == [True, True]


def _work_handle_body(rank, world):
    """fastcomm.Work, a native type: every method and spelling torch's Work has, and re-wrapping."""
    g = fc.new_group([0, 1])
    t = torch.full((3,), float(rank + 1))
    w = fc.all_reduce(t, group=g, async_op=True)
    assert type(w) is fc.Work and fc.Work.__module__ == "fastcomm"
    assert repr(w) in ("fastcomm.Work(pending)", "fastcomm.Work(completed)")
    assert w.wait(timedelta(seconds=60)) is True
    assert w.wait(timeout=60.0) is True and w.wait(None) is True and w.wait() is True
    assert w.is_completed() and w.is_success() and w.exception() is None
    assert repr(w) == "fastcomm.Work(completed)"
    assert torch.equal(t, torch.full((3,), 3.0))
    assert [torch.equal(x, t) for x in w.result()] == [True]
    assert [torch.equal(x, t) for x in w.get_future().wait()] == [True]
    w.synchronize()
    again = fc.Work(w)
    assert again is not w and again.is_completed() and again.wait() is True
    expect(RuntimeError, w.source_rank)
    expect(TypeError, lambda: w.wait(1.0, 2.0), "at most 1 argument")
    expect(TypeError, lambda: w.wait(seconds=1.0), "unexpected keyword")
    expect(TypeError, lambda: fc.Work(object()))
    # fastcomm.batch is native too: no arguments, and one object can record again once posted.
    expect(TypeError, lambda: fc.batch(1), "no arguments")
    b = fc.batch()
    for i in range(2):
        x = torch.full((2,), float(rank + i))
        with b:
            fc.all_reduce(x, group=g)
            assert len(b) == 1
        assert b.wait(timeout=60) is True and b.is_success() and b.exception() is None
        assert len(b) == 0 and torch.equal(x, torch.full((2,), float(1 + 2 * i)))
    # A failed op: its error as the exception object a raising wait gives.
    slow = fc.new_group([0, 1], timeout=timedelta(milliseconds=300))
    if rank == 0:
        bad = fc.all_reduce(torch.ones(1), group=slow, async_op=True)
        expect(DistBackendError, bad.wait, "timed out")
        assert bad.is_completed() and not bad.is_success()
        e = bad.exception()
        assert isinstance(e, DistBackendError) and "timed out" in str(e), repr(e)
    fc.barrier()
    # An irecv's Work maps its sender to a global rank through the group it was posted on.
    h = fc.new_group([0, 1])
    if rank == 0:
        fc.send(torch.ones(2), 1, group=h)
        return True
    r = fc.irecv(torch.zeros(2), group=h)
    r.wait()
    return r.source_rank() == 0 and fc.Work(r).source_rank() == 0


def test_work_handle():
    assert harness.run(_work_handle_body, 2) == [True, True]


def test_before_init():
    expect(RuntimeError, lambda: fc.all_reduce(torch.ones(1)), "fastcomm.all_reduce", "not initialized")


def _rooted_spellings_body(rank, world):
    """broadcast, reduce, gather and scatter in the pair [1, 2] of world 3 (group rank 0 is
    global rank 1, so a group rank taken for a global one gives a wrong root), spelled every
    way torch allows, each against the result computed here."""
    if rank == 0:
        return None
    g = fc.new_group([1, 2])
    me = rank - 1
    out = []

    def val(r):
        return torch.arange(3, dtype=torch.float32) + 10 * r

    for call in (
        lambda t: fc.broadcast(t, 2, g),
        lambda t: fc.broadcast(t, src=2, group=g),
        lambda t: fc.broadcast(t, group=g, group_src=1),
        lambda t: fc.broadcast(t, 2, g, True).wait(),
        lambda t: collectives._broadcast_py(t, 2, g),
    ):
        t = val(rank)
        call(t)
        out.append(torch.equal(t, val(2)))
    for call in (
        lambda t: fc.reduce(t, 1, ReduceOp.SUM, g),
        lambda t: fc.reduce(t, dst=1, group=g),
        lambda t: fc.reduce(t, group=g, group_dst=0),
        lambda t: fc.reduce(t, 1, group=g, async_op=True).wait(),
        lambda t: collectives._reduce_py(t, 1, group=g),
    ):
        t = val(rank)
        call(t)
        out.append(torch.equal(t, val(1) + val(2) if rank == 1 else val(rank)))
    for call in (
        lambda t, lst: fc.gather(t, lst, 2, g),
        lambda t, lst: fc.gather(t, gather_list=lst, dst=2, group=g),
        lambda t, lst: fc.gather(t, lst, group=g, group_dst=1),
        lambda t, lst: fc.gather(t, lst, 2, g, True).wait(),
        lambda t, lst: collectives._gather_py(t, lst, 2, g),
    ):
        lst = [torch.zeros(3) for _ in range(2)] if rank == 2 else None
        call(val(rank), lst)
        out.append(lst is None or (torch.equal(lst[0], val(1)) and torch.equal(lst[1], val(2))))
    for call in (
        lambda t, lst: fc.scatter(t, lst, 1, g),
        lambda t, lst: fc.scatter(t, scatter_list=lst, src=1, group=g),
        lambda t, lst: fc.scatter(t, lst, group=g, group_src=0),
        lambda t, lst: fc.scatter(t, lst, 1, g, async_op=True).wait(),
        lambda t, lst: collectives._scatter_py(t, lst, 1, g),
    ):
        lst = [val(5), val(6)] if rank == 1 else None
        t = torch.zeros(3)
        call(t, lst)
        out.append(torch.equal(t, val(5 + me)))
    # Inside a batch the ops join it (returning None) and run at its end.
    t = val(rank)
    with fc.batch() as b:
        assert fc.broadcast(t, 1, g) is None and fc.reduce(t, 2, group=g) is None
        assert torch.equal(t, val(rank))
    b.wait()
    out.append(torch.equal(t, 2 * val(1) if rank == 2 else val(1)))
    return out


def _world_default_root_body(rank, world):
    """gather and scatter default to global rank 0."""
    lst = [torch.zeros(2) for _ in range(world)] if rank == 0 else None
    fc.gather(torch.full((2,), float(rank)), lst)
    t = torch.zeros(2)
    fc.scatter(t, [torch.full((2,), 7.0 + r) for r in range(world)] if rank == 0 else None)
    return t[0].item(), None if lst is None else [x[0].item() for x in lst]


def test_rooted_ops_every_spelling():
    res = harness.run(_rooted_spellings_body, 3)
    assert res[0] is None and res[1] == res[2] and all(res[1]) and len(res[1]) == 21, res
    assert harness.run(_world_default_root_body, 2) == [(7.0, [0.0, 1.0]), (8.0, None)]


def _rooted_errors_body(rank, world):
    g = fc.new_group([0, 1])
    t = torch.ones(2)
    expect(ValueError, lambda: fc.broadcast(t, group=g), "broadcast", "src")
    expect(ValueError, lambda: fc.reduce(t, 0, group=g, group_dst=0), "reduce", "dst")
    expect(TypeError, lambda: fc.gather(t, bogus=1), "bogus")
    expect(TypeError, lambda: fc.scatter(t, None, 0, object()), "group", "fastcomm.Group")
    expect(TypeError, lambda: fc.reduce(t, 0, "sum", g), "op", "ReduceOp")
    expect(ValueError, lambda: fc.broadcast(t, 5, g), "rank 5")
    expect(TypeError, lambda: fc.gather(), "tensor")
    fc.shutdown()
    expect(RuntimeError, lambda: fc.gather(t), "gather", "not initialized")
    harness.init_child(rank, world)
    return True


def test_rooted_errors_are_the_wrappers():
    assert harness.run(_rooted_errors_body, 2) == [True, True]
