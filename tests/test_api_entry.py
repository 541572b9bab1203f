"""fastcomm.all_reduce is a native entry (no Python frame) that hands every case but the plain
one to the Python wrapper: each spelling of the arguments, inside a batch and a plan, before
init and after shutdown, and wrong arguments must behave exactly as the wrapper does."""
from __future__ import annotations

import torch
from torch.distributed import ReduceOp

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


def test_before_init():
    expect(RuntimeError, lambda: fc.all_reduce(torch.ones(1)), "fastcomm.all_reduce", "not initialized")
