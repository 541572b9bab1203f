"""all_reduce of sparse COO tensors (SUM, CPU), as torch's Gloo backend does it: through
``dist.all_reduce`` on a fastcomm process group and through ``fc.all_reduce`` (blocking, async,
in a batch, in a plan), against the sum of every member's tensor computed locally; DDP over an
``nn.Embedding(sparse=True)`` gives Gloo's parameters; mismatched shapes fail on every member
and leave the group usable; sparse and dense ops of different groups issued in opposite orders
complete. Ranks are processes (harness.run, hard timeout each)."""
from __future__ import annotations

import functools
import operator
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist

import harness
from _helpers import expect

import fastcomm as fc

warnings.filterwarnings("ignore", message="Sparse invariant checks")

# (sparse sizes, dense sizes): 1-3 sparse dimensions, 0-2 dense ones.
SHAPES = [((9,), ()), ((5, 4), ()), ((3, 4, 5), ()), ((7,), (3,)), ((4, 6), (2, 3)), ((1000,), (16,))]
# No complex dtype through the backend: torch's dist.all_reduce hands a backend
# view_as_real(tensor), which for a sparse tensor is a copy, so the caller's tensor keeps its
# values whatever the backend (Gloo's too). fc.all_reduce takes complex tensors as they are.
DTYPES = [torch.float32, torch.float64, torch.int64, torch.bfloat16]


def sparse_input(rank, case, sparse, dense, dtype):
    """Global rank ``rank``'s tensor for ``case``: nnz from 0 (every fourth rank) up, with
    duplicate indices (uncoalesced), small integer values (sums exact in every dtype)."""
    g = torch.Generator().manual_seed(7919 * rank + 104_729 * case + 17)
    nnz = 0 if rank % 4 == 3 else int(torch.randint(1, 3 * max(sparse) + 2, (1,), generator=g))
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


def _backend_body(rank, world):
    dist.init_process_group("fastcomm", store=harness.child_store(), rank=rank, world_size=world,
                            timeout=timedelta(seconds=30))
    new = functools.partial(dist.new_group, backend="fastcomm", use_local_synchronization=True)
    checked = 0
    for name, g, members in groups_of(rank, world, new):
        for case, (sparse, dense) in enumerate(SHAPES):
            for dtype in DTYPES:
                what = f"{name} {sparse}+{dense} {dtype}"
                t = sparse_input(rank, case, sparse, dense, dtype)
                ref = reference(members, case, sparse, dense, dtype)
                dist.all_reduce(t, group=g)
                check(t, ref, what)
                t = sparse_input(rank, case, sparse, dense, dtype)
                w = dist.all_reduce(t, group=g, async_op=True)
                w.wait()
                check(t, ref, what + " async")
                check(w.get_future().value()[0], ref, what + " future")
                checked += 2
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
    new = fc.new_group
    for name, g, members in groups_of(rank, world, new):
        for case, (sparse, dense) in enumerate(SHAPES[:4]):
            for dtype in (torch.float32, torch.complex64):
                what = f"{name} {sparse}+{dense} {dtype}"
                ref = reference(members, case, sparse, dense, dtype)
                t = sparse_input(rank, case, sparse, dense, dtype)
                fc.all_reduce(t, group=g)
                check(t, ref, what)
                t = sparse_input(rank, case, sparse, dense, dtype)
                fc.all_reduce(t, group=g, async_op=True).wait()
                check(t, ref, what + " async")
    # In a batch beside dense ops of the same group and of others.
    groups = groups_of(rank, world, new)
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
    return True


def test_sparse_all_reduce_native_async_batch_and_plan():
    harness.run(_native_body, 4, timeout=120)


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


def _ddp_body(rank, world, backend):
    dist.init_process_group(backend, store=harness.child_store(), rank=rank, world_size=world,
                            timeout=timedelta(seconds=30))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(50, 8, sparse=True), torch.nn.Linear(8, 1))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(rank + 1)
    for _ in range(4):
        ids = torch.randint(0, 50, (16,), generator=g)
        opt.zero_grad()
        ddp(ids).pow(2).mean().backward()
        opt.step()
    out = [p.detach().numpy().copy() for p in model.parameters()]  # tensors would travel as shared fds
    dist.destroy_process_group()
    return out


def test_ddp_with_a_sparse_embedding_matches_gloo():
    ours = harness.run(_ddp_body, 2, "fastcomm", init=False, timeout=120)
    gloo = harness.run(_ddp_body, 2, "gloo", init=False, timeout=120)
    for r in range(2):
        for a, b in zip(ours[r], gloo[r]):
            assert (a == b).all(), f"rank {r}: a parameter differs from Gloo's"
    for a, b in zip(ours[0], ours[1]):
        assert (a == b).all(), "the ranks' parameters differ"
