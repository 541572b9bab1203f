"""reduce_scatter with an input list whose blocks differ in size per member ("uneven").

torch's Gloo backend (torch 2.13, CPU) runs it: block q of every member's list is reduced into
member q's output, whose size is that block's. fastcomm does the same, natively and through the
backend, blocking, async, in a batch and in a plan, over group shapes 2-4 with 0 and odd sizes.
Members must agree pairwise on the sizes they exchange; two that disagree both fail naming each
other. On device tensors uneven blocks are refused (the device path reduces equal blocks)."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import harness
from _helpers import expect
from test_collectives import RING_ENV, shape_groups
from test_uneven_all_gather import uneven_sizes

import fastcomm as fc

R = fc.ReduceOp
CASES = [(torch.float32, R.SUM), (torch.int64, R.MAX), (torch.float64, R.AVG), (torch.int32, R.PRODUCT),
         (torch.float32, R.MIN), (torch.int64, R.BXOR)]


def block(rank, q, n, dtype, salt):
    """Member ``rank``'s block for member ``q``: small integers, so every fold order is exact."""
    v = (torch.arange(n, dtype=torch.int64) * 7 + 13 * rank + 5 * q + salt) % 5 + 1
    return v.to(dtype)


def reference(ranks, me, n, dtype, op, salt):
    blocks = torch.stack([block(r, me, n, torch.float64 if op == R.AVG else torch.int64, salt) for r in ranks])
    if op == R.SUM:
        out = blocks.sum(0)
    elif op == R.AVG:
        out = blocks.sum(0) / len(ranks)
    elif op == R.MAX:
        out = blocks.max(0).values
    elif op == R.MIN:
        out = blocks.min(0).values
    elif op == R.PRODUCT:
        out = blocks.prod(0)
    else:
        out = blocks[0]
        for b in blocks[1:]:
            out = out ^ b
    return out.to(dtype)


def _native_body(rank, world, shape):
    got = shape_groups(shape, rank, world)
    if got is None:
        return None
    g, ranks = got
    k, me = len(ranks), ranks.index(rank)
    checked = 0
    for case in range(8):
        sizes = uneven_sizes(k, case)
        dtype, op = CASES[case % len(CASES)]
        outs = {}
        ins = {}
        form = ("blocking", "async", "batch", "plan")[case % 4]
        for salt in range(2):  # two ops in flight in the batch and plan forms
            ins[salt] = [block(rank, ranks[q], n, dtype, salt) for q, n in enumerate(sizes)]
            outs[salt] = torch.full((sizes[me],), -1, dtype=dtype)
        if form == "blocking":
            for salt in range(2):
                fc.reduce_scatter(outs[salt], ins[salt], op=op, group=g)
        elif form == "async":
            works = [fc.reduce_scatter(outs[s], ins[s], op=op, group=g, async_op=True) for s in range(2)]
            for w in works:
                w.wait()
        elif form == "batch":
            with fc.batch() as b:
                for s in range(2):
                    fc.reduce_scatter(outs[s], ins[s], op=op, group=g)
            b.wait()
        else:
            with fc.plan() as p:
                for s in range(2):
                    fc.reduce_scatter(outs[s], ins[s], op=op, group=g)
            for _ in range(2):
                for s in range(2):
                    outs[s].fill_(-1)
                p.start(async_op=False)
        for salt in range(2):
            ref = reference(ranks, rank, sizes[me], dtype, op, salt)
            assert torch.equal(outs[salt], ref), (rank, ranks, sizes, form, dtype, op, outs[salt], ref)
            checked += 1
    return checked


@pytest.mark.parametrize("shape", ["pair", "triple", "world"])
def test_uneven_reduce_scatter_natively(shape):
    results = harness.run(_native_body, 4, shape, timeout=120, env=RING_ENV, init_timeout=10.0)
    assert [r for r in results if r is not None] == [16] * (3 if shape == "triple" else 4), results


def _disagree_body(rank, world):
    """Rank 2 sees blocks 1 and 2 swapped: the header's total agrees, the pairs do not. Ranks 1
    and 2 (and 0 and 2) fail naming the sizes; the group then runs a correct op."""
    g = fc.new_group([0, 1, 2], timeout=10)
    sizes = [1, 2, 3] if rank < 2 else [1, 3, 2]
    ins = [torch.ones(n) for n in sizes]
    msg = expect(dist.DistBackendError, lambda: fc.reduce_scatter(torch.zeros(sizes[rank]), ins, group=g),
                 "disagree on the sizes", f"rank {rank}")
    out = torch.zeros(2)
    fc.reduce_scatter(out, [torch.full((2,), float(rank))] * 3, group=fc.new_group([0, 1, 2]))
    assert out.tolist() == [3.0, 3.0], out
    return msg


def test_members_that_disagree_on_a_block_size_fail_naming_it():
    msgs = harness.run(_disagree_body, 3, timeout=90)
    assert all(m for m in msgs), msgs


def _backend_body(rank, world):
    # Gloo for the reference, the "fastcomm" backend beside it.
    dist.init_process_group("gloo", store=harness.child_store(), rank=rank, world_size=world)
    fc.init()
    fcg = dist.new_group(list(range(world)), backend="fastcomm", use_local_synchronization=True)
    glg = dist.new_group(list(range(world)), backend="gloo")
    for case in range(4):
        sizes = uneven_sizes(world, case)
        for dtype, op in CASES[:4]:
            got = []
            for grp, asy in ((glg, False), (fcg, False), (fcg, True)):
                out = torch.full((sizes[rank],), -1, dtype=dtype)
                ins = [block(rank, q, n, dtype, case) for q, n in enumerate(sizes)]
                w = dist.reduce_scatter(out, ins, op=getattr(dist.ReduceOp, str(op).split(".")[-1]), group=grp,
                                        async_op=asy)
                if asy:
                    w.wait()
                got.append(out)
            assert torch.equal(got[0], reference(list(range(world)), rank, sizes[rank], dtype, op, case)), got
            assert torch.equal(got[1], got[0]) and torch.equal(got[2], got[0]), (sizes, dtype, op, got)
    fc.shutdown()
    dist.destroy_process_group()
    return True


def test_uneven_reduce_scatter_through_the_backend_matches_gloo():
    assert harness.run(_backend_body, 3, init=False, timeout=120) == [True] * 3


def _device_body(rank, world):
    g = fc.new_group([0, 1])
    msg = expect(ValueError, lambda: fc.reduce_scatter(torch.zeros(1 + rank), [torch.ones(1), torch.ones(2)], group=g),
                 f"rank {rank}", "uneven blocks run on CPU tensors")
    out = torch.zeros(3)
    fc.reduce_scatter(out, [torch.full((3,), float(rank + 1))] * 2, group=g)  # the pair is still in step
    fc._state._engine.device_synchronize("cpu")
    assert out.tolist() == [3.0] * 3, out
    return msg


def test_uneven_blocks_are_refused_on_device_tensors():
    # (The fake device runtime routes CPU tensors through the device path.)
    msgs = harness.run(_device_body, 2, timeout=60, env={"FASTCOMM_FAKE_DEVICE": "1"})
    assert all(msgs), msgs
