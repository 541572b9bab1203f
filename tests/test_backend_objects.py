"""torch's object collectives and DistributedDataParallel over the fastcomm backend (CPU).

Everything goes through torch's own API: the object collectives pickle into byte tensors and
run all_gather / broadcast / scatter / gather on the group's backend, and DDP broadcasts the
model from rank 0 (_broadcast_coalesced), checks the parameters' shapes across ranks (an
all_gather) and all-reduces gradient buckets. Results are compared with the Python objects
every rank can compute, and DDP's training with a single-process reference."""
from __future__ import annotations

import warnings
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import harness

import fastcomm  # noqa: F401  (registers the backend)

TIMEOUT = timedelta(seconds=60)


def init(rank, world):
    dist.init_process_group("fastcomm", store=harness.child_store(), rank=rank, world_size=world,
                            timeout=TIMEOUT)


def obj(rank, salt=0):
    """Objects of different types and pickled sizes per rank (rank 0's is the smallest)."""
    if rank % 3 == 2:
        return None if salt else ("t", rank, salt)
    return {"rank": rank, "salt": salt, "xs": list(range(rank * 50 + salt)), "s": "x" * (100 * rank),
            "t": torch.arange(rank + 3)}


def same_obj(a, b):
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same_obj(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    return a == b


def check(got, want, what):
    assert len(got) == len(want) and all(same_obj(g, w) for g, w in zip(got, want)), f"{what}: {got} != {want}"


def object_collectives(group, ranks, rank, salt):
    """Every object collective on ``group`` (global ``ranks``), each root in turn."""
    n = len(ranks)
    out = [None] * n
    dist.all_gather_object(out, obj(rank, salt), group=group)
    check(out, [obj(r, salt) for r in ranks], "all_gather_object")
    for src in ranks:
        lst = [obj(src, salt + i) for i in range(3)] if rank == src else [None] * 3
        dist.broadcast_object_list(lst, src=src, group=group)
        check(lst, [obj(src, salt + i) for i in range(3)], f"broadcast_object_list from {src}")
    for src in ranks:
        out = [None]
        inputs = [obj(r, salt + src) for r in ranks] if rank == src else None
        dist.scatter_object_list(out, inputs, src=src, group=group)
        check(out, [obj(rank, salt + src)], f"scatter_object_list from {src}")
    for dst in ranks:
        out = [None] * n if rank == dst else None
        dist.gather_object(obj(rank, salt + dst), out, dst=dst, group=group)
        if rank == dst:
            check(out, [obj(r, salt + dst) for r in ranks], f"gather_object to {dst}")


def all_gather_coalesced(group, ranks, rank):
    """torch's (deprecated) all_gather_coalesced: the backend's allgather_coalesced."""
    shapes = [(3,), (2, 4), (0,), (5,)]
    ins = [torch.full(s, float(10 * rank + i)) for i, s in enumerate(shapes)]
    outs = [[torch.empty(s) for s in shapes] for _ in ranks]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        dist.all_gather_coalesced(outs, ins, group=group)
    for m, r in enumerate(ranks):
        for i, s in enumerate(shapes):
            assert torch.equal(outs[m][i], torch.full(s, float(10 * r + i))), (m, i, outs[m][i])


def objects_body(rank, world):
    init(rank, world)
    object_collectives(None, list(range(world)), rank, 0)
    all_gather_coalesced(None, list(range(world)), rank)
    # A fastcomm subgroup of the last two ranks (made by its members only).
    sub = [world - 2, world - 1]
    if rank in sub:
        g = dist.new_group(sub, backend="fastcomm", use_local_synchronization=True)
        object_collectives(g, sub, rank, 1)
        all_gather_coalesced(g, sub, rank)
    dist.barrier()
    dist.destroy_process_group()
    return True


@pytest.mark.parametrize("world", [2, 3])
def test_object_collectives(world):
    harness.run(objects_body, world, init=False, timeout=180)


# ---------------------------------------------------------------------------------------------
# DDP

STEPS, BATCH, LR = 4, 5, 0.1


def make_model(seed):
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))
    m.register_buffer("marker", torch.full((2,), float(seed)))  # synced from rank 0 by DDP
    return m


def batch(step, rank):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(BATCH, 6, generator=g), torch.randn(BATCH, 3, generator=g)


def reference(world):
    """One process training on every rank's batch at once: DDP averages the ranks' gradients of
    equal-sized batches, which is the gradient of the mean loss over their concatenation."""
    m = make_model(0)
    opt = torch.optim.SGD(m.parameters(), lr=LR)
    for step in range(STEPS):
        xs, ys = zip(*(batch(step, r) for r in range(world)))
        opt.zero_grad()
        nn.functional.mse_loss(m(torch.cat(xs)), torch.cat(ys)).backward()
        opt.step()
    return [p.detach() for p in m.parameters()]


def ddp_body(rank, world, subgroup):
    init(rank, world)
    if subgroup:
        # DDP over a fastcomm subgroup made with dist.new_group (every rank in it here).
        pg = dist.new_group(list(range(world)), backend="fastcomm")
    else:
        pg = None
    assert type(dist.group.WORLD._get_backend(torch.device("cpu"))).__name__ == "FastcommBackend"
    # Ranks start from different weights: DDP's construction broadcasts rank 0's.
    model = nn.parallel.DistributedDataParallel(make_model(rank), process_group=pg, bucket_cap_mb=0.001)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        x, y = batch(step, rank)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    assert torch.equal(model.module.marker, torch.zeros(2)), model.module.marker
    params = [p.detach().clone() for p in model.parameters()]
    everyone = [None] * world
    dist.all_gather_object(everyone, params, group=pg)
    for r, ps in enumerate(everyone):
        assert all(torch.equal(a, b) for a, b in zip(ps, params)), f"rank {r}'s parameters differ from rank {rank}'s"
    for i, (p, want) in enumerate(zip(params, reference(world))):
        assert torch.allclose(p, want, rtol=1e-5, atol=1e-6), f"parameter {i}: {(p - want).abs().max()}"
    dist.destroy_process_group()
    return True


@pytest.mark.parametrize("world,subgroup", [(2, False), (3, False), (2, True)])
def test_ddp_matches_single_process(world, subgroup):
    harness.run(ddp_body, world, subgroup, init=False, timeout=180)
