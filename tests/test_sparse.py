"""all_reduce of sparse COO tensors (SUM, CPU), as torch's Gloo backend does it: through
``dist.all_reduce`` on a fastcomm process group and through ``fc.all_reduce`` (blocking, async,
in a batch, in a plan), against the sum of every member's tensor computed locally; DDP over an
``nn.Embedding(sparse=True)`` trains as one process would; sums round as Gloo's; mismatched shapes fail on every member
and leave the group usable; sparse and dense ops of different groups issued in opposite orders
complete; groups across (simulated) hosts go through Gloo. Ranks are processes (harness.run,
hard timeout each)."""
from __future__ import annotations

import functools
import operator
import warnings
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import _cross_host
import harness
from _helpers import expect

import fastcomm as fc

warnings.filterwarnings("ignore", message="Sparse invariant checks")

# (sparse sizes, dense sizes): 1-3 sparse dimensions, 0-2 dense ones, empty ones.
SHAPES = [((9,), ()), ((5, 4), ()), ((3, 4, 5), ()), ((7,), (3,)), ((4, 6), (2, 3)), ((1000,), (16,)),
          ((5, 0), ()), ((6,), (0,))]
# No complex dtype through the backend: torch's dist.all_reduce hands a backend
# view_as_real(tensor), which for a sparse tensor is a copy, so the caller's tensor keeps its
# values whatever the backend (Gloo's too). fc.all_reduce takes complex tensors as they are.
DTYPES = [torch.float32, torch.float64, torch.int64, torch.bfloat16]


def sparse_input(rank, case, sparse, dense, dtype):
    """Global rank ``rank``'s tensor for ``case``: nnz from 0 (every fourth rank) up, with
    duplicate indices (uncoalesced), small integer values (sums exact in every dtype)."""
    g = torch.Generator().manual_seed(7919 * rank + 104_729 * case + 17)
    nnz = 0 if rank % 4 == 3 or 0 in sparse else int(torch.randint(1, 3 * max(sparse) + 2, (1,), generator=g))
    idx = torch.stack([torch.randint(0, s, (nnz,), generator=g) for s in sparse]) if nnz else \
        torch.zeros(len(sparse), 0, dtype=torch.long)
    vals = torch.randint(-4, 5, (nnz, *dense), generator=g).to(dtype)
    return torch.sparse_coo_tensor(idx, vals, (*sparse, *dense))


def reference(members, case, sparse, dense, dtype):
    return functools.reduce(operator.add, [sparse_input(r, case, sparse, dense, dtype)
                                           for r in members]).coalesce()


def check(out, ref, what):
    assert out.is_sparse and out.is_coalesced(), f"{what}: not a coalesced sparse tensor"
    assert out.shape == ref.shape and out.dtype == ref.dtype, (what, out.shape, out.dtype)
    assert torch.equal(out.indices(), ref.indices()), f"{what}: indices differ"
    assert torch.equal(out.values(), ref.values()), f"{what}: values differ"


def groups_of(rank, world, new_group):
    """(name, group, members): the world, this rank's pair, and the triple [1, 2, 3]."""
    lo = 2 * (rank // 2)
    out = [("world", None, list(range(world))), ("pair", new_group([lo, lo + 1]), [lo, lo + 1])]
    if rank >= 1:
        out.append(("triple", new_group([1, 2, 3]), [1, 2, 3]))
    return out


def sweep(groups, rank, shapes, dtypes, all_reduce):
    """``all_reduce`` over every group, shape and dtype, blocking and async (the Work's future
    too), each result against the local reference; returns how many were checked."""
    checked = 0
    for name, g, members in groups:
        for case, (sparse, dense) in enumerate(shapes):
            for dtype in dtypes:
                what = f"{name} {sparse}+{dense} {dtype}"
                ref = reference(members, case, sparse, dense, dtype)
                t = sparse_input(rank, case, sparse, dense, dtype)
                all_reduce(t, group=g)
                check(t, ref, what)
                t = sparse_input(rank, case, sparse, dense, dtype)
                w = all_reduce(t, group=g, async_op=True)
                w.wait()
                check(t, ref, what + " async")
                check(w.get_future().value()[0], ref, what + " future")
                checked += 2
    return checked


def _backend_body(rank, world):
    dist.init_process_group("fastcomm", store=harness.child_store(), rank=rank, world_size=world,
                            timeout=timedelta(seconds=30))
    new = functools.partial(dist.new_group, backend="fastcomm", use_local_synchronization=True)
    checked = sweep(groups_of(rank, world, new), rank, SHAPES, DTYPES, dist.all_reduce)
    # Only SUM, as in Gloo; the refusal sends nothing (the next op of the group still matches).
    t = sparse_input(rank, 0, (9,), (), torch.float32)
    expect(ValueError, lambda: dist.all_reduce(t, op=dist.ReduceOp.MAX), f"rank {rank}", "'op'", "MAX", "sparse")
    dist.all_reduce(t)
    check(t, reference(range(world), 0, (9,), (), torch.float32), "after a refused op")
    dist.destroy_process_group()
    return checked


def test_sparse_all_reduce_through_the_backend():
    res = harness.run(_backend_body, 4, init=False, timeout=120)
    assert all(n > 0 for n in res)


def _native_body(rank, world):
    groups = groups_of(rank, world, fc.new_group)
    assert sweep(groups, rank, SHAPES[:4], (torch.float32, torch.complex64), fc.all_reduce) > 0
    # In a batch beside dense ops of the same group and of others.
    ts = [sparse_input(rank, i, (9,), (2,), torch.float64) for i in range(len(groups))]
    ds = [torch.full((5,), float(rank)) for _ in groups]
    with fc.batch() as b:
        for (_, g, _), t, d in zip(groups, ts, ds):
            fc.all_reduce(t, group=g)
            fc.all_reduce(d, group=g)
    b.wait()
    for i, ((name, _, members), t, d) in enumerate(zip(groups, ts, ds)):
        check(t, reference(members, i, (9,), (2,), torch.float64), f"batch {name}")
        assert torch.equal(d, torch.full((5,), float(sum(members))))
    # A plan reads the tensor at each start: its nnz may change between starts.
    _, pair, members = groups[1]
    t = sparse_input(rank, 0, (5, 4), (), torch.float32)
    with fc.plan() as p:
        fc.all_reduce(t, group=pair)
    for case in range(3):
        t.copy_(sparse_input(rank, case, (5, 4), (), torch.float32))
        p.start().wait()
        check(t, reference(members, case, (5, 4), (), torch.float32), f"plan start {case}")
    # A tensor whose dimension count changed since the recording (an empty sparse tensor's can)
    # fails the start on both members, the one that changed it naming the way out.
    if rank == members[0]:
        t.sparse_resize_and_clear_((5, 4, 2), 3, 0)
    expect(dist.DistBackendError, p.start().wait, "record the plan again" if rank == members[0] else "rank")
    return True


def test_sparse_all_reduce_native_async_batch_and_plan():
    harness.run(_native_body, 4, timeout=120)


def _hosts_body(rank, world):
    return sweep(groups_of(rank, world, fc.new_group), rank, SHAPES, (torch.float32,), fc.all_reduce)


@pytest.mark.parametrize("env", [_cross_host.RING_ENV, _cross_host.BULK_ENV], ids=["frames", "bulk"])
def test_sparse_all_reduce_across_hosts(env):
    """Pairs across hosts (Gloo), triples and the world mixed; Gloo's frames or bulk transfers."""
    _cross_host.run(_hosts_body, 4, env=env)


def rounding_input(rank, case):
    """Float values of very different sizes at overlapping indices (every member's indices
    [0, 40) in some order, some repeated): the order of the additions shows in the bits. Odd
    ranks pass a coalesced tensor (its own, as coalesce() returns it)."""
    g = torch.Generator().manual_seed(31 * rank + 977 * case)
    idx = torch.cat([torch.randperm(40, generator=g), torch.randint(0, 40, (10,), generator=g)])
    vals = torch.randn(50, 3, generator=g, dtype=torch.float64) * 10.0 ** torch.randint(-6, 7, (50, 1), generator=g)
    t = torch.sparse_coo_tensor(idx[None], vals.to(torch.float32 if case % 2 else torch.float64), (40, 3))
    return t.coalesce() if rank % 2 else t


def gloo_sum(inputs):
    """Gloo's sequence: each member's tensor coalesced, rebuilt from its indices and values as
    they arrive (not marked coalesced), added in group-rank order, then coalesced."""
    parts = [x.coalesce() for x in inputs]
    acc = torch.sparse_coo_tensor(parts[0].indices(), parts[0].values(), parts[0].shape)
    for x in parts[1:]:
        acc += torch.sparse_coo_tensor(x.indices(), x.values(), x.shape)
    return acc.coalesce()


def _rounding_body(rank, world, backend):
    dist.init_process_group(backend, store=harness.child_store(), rank=rank, world_size=world,
                            timeout=timedelta(seconds=30))
    triple = dist.new_group([1, 2, 3], backend=backend, use_local_synchronization=True) if rank else None
    out = []
    for case in range(4):
        for g, members in [(None, range(world)), (triple, [1, 2, 3])]:
            if rank not in members:
                continue
            t = rounding_input(rank, case)
            dist.all_reduce(t, group=g)
            check(t, gloo_sum([rounding_input(r, case) for r in members]), f"case {case} members {list(members)}")
            out.append((t.indices().numpy().copy(), t.values().numpy().copy()))
    dist.destroy_process_group()
    return out


def test_sparse_sums_round_as_gloo_does():
    """Members add in group-rank order, as Gloo: the same bits as Gloo's, in groups of 3 and 4."""
    ours = harness.run(_rounding_body, 4, "fastcomm", init=False, timeout=120)
    gloo = harness.run(_rounding_body, 4, "gloo", init=False, timeout=120)
    for r in range(4):
        assert len(ours[r]) == len(gloo[r]) > 0
        for (oi, ov), (gi, gv) in zip(ours[r], gloo[r]):
            assert (oi == gi).all() and ov.tobytes() == gv.tobytes(), f"rank {r}: not Gloo's bits"


def _mismatch_body(rank, world):
    g = fc.new_group([0, 1])
    t = sparse_input(rank, 0, (5, 4) if rank == 0 else (4, 5), (), torch.float32)
    msg = expect(dist.DistBackendError, lambda: fc.all_reduce(t, group=g), f"rank {rank}", "[0, 1]",
                 "different shapes", f"group rank {1 - rank}")
    # A different number of dimensions is a different collective for the headers.
    t = sparse_input(rank, 0, (5, 4) if rank == 0 else (5, 4, 1), (), torch.float32)
    expect(dist.DistBackendError, lambda: fc.all_reduce(t, group=g), f"rank {rank}", "mismatch", "sparse")
    # Against a dense all_reduce.
    t = sparse_input(rank, 0, (4,), (), torch.float32) if rank == 0 else torch.ones(4)
    expect(dist.DistBackendError, lambda: fc.all_reduce(t, group=g), f"rank {rank}", "mismatch")
    t = sparse_input(rank, 1, (6,), (), torch.float32)
    fc.all_reduce(t, group=g)
    check(t, reference([0, 1], 1, (6,), (), torch.float32), "after the mismatches")
    return msg


def test_mismatched_shapes_fail_on_both_members_and_the_group_goes_on():
    harness.run(_mismatch_body, 2, timeout=60, init_timeout=10.0)


def _any_order_body(rank, world):
    a, b = fc.new_group([0, 1]), fc.new_group([0, 1])
    s = sparse_input(rank, 2, (8,), (3,), torch.float32)
    d = torch.full((6,), float(rank + 1))
    if rank == 0:
        ws = [fc.all_reduce(s, group=a, async_op=True), fc.all_reduce(d, group=b, async_op=True)]
    else:
        ws = [fc.all_reduce(d, group=b, async_op=True), fc.all_reduce(s, group=a, async_op=True)]
    for w in ws:
        w.wait()
    check(s, reference([0, 1], 2, (8,), (3,), torch.float32), "sparse")
    assert torch.equal(d, torch.full((6,), 3.0))
    return True


def test_sparse_and_dense_ops_of_two_groups_in_opposite_orders():
    harness.run(_any_order_body, 2, timeout=60)


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(50, 8, sparse=True), torch.nn.Linear(8, 1))


def _batches(rank, steps=4):
    g = torch.Generator().manual_seed(rank + 1)
    return [torch.randint(0, 50, (16,), generator=g) for _ in range(steps)]


def _ddp_body(rank, world):
    dist.init_process_group("fastcomm", store=harness.child_store(), rank=rank, world_size=world,
                            timeout=timedelta(seconds=30))
    model = _model()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for ids in _batches(rank):
        opt.zero_grad()
        ddp(ids).pow(2).mean().backward()
        opt.step()
    # What DDP computes, in one process: every rank's gradients averaged, then the step.
    ref = _model()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step_ids in zip(*[_batches(r) for r in range(world)]):
        grads = []
        for ids in step_ids:
            ref.zero_grad()
            ref(ids).pow(2).mean().backward()
            grads.append([p.grad.clone() for p in ref.parameters()])
        for i, p in enumerate(ref.parameters()):
            p.grad = functools.reduce(operator.add, [g[i] for g in grads]) / world
        ref_opt.step()
    assert model[0].weight.grad.is_sparse, "the embedding's gradient was not sparse"
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-6, atol=1e-7)
    out = [p.detach().numpy().copy() for p in model.parameters()]  # tensors would travel as shared fds
    dist.destroy_process_group()
    return out


def test_ddp_with_a_sparse_embedding_trains_as_one_process_would():
    """DDP averages nn.Embedding(sparse=True)'s sparse gradients through the backend's
    allreduce_sparse; every rank ends with the parameters a single process computes from all
    ranks' batches, and the ranks' parameters are the same bits."""
    res = harness.run(_ddp_body, 2, init=False, timeout=120)
    for a, b in zip(res[0], res[1]):
        assert (a == b).all(), "the ranks' parameters differ"
