"""Large ops of groups of 3+ whose members share a host, over the IPC pair links (no NCCL group
communicator), on the fake device runtime with FASTCOMM_DEVICE_IPC=1 (docs/design.md, "Groups
of 3+ over the links"):

- an all_reduce of at least FASTCOMM_RSAG_THRESHOLD bytes runs as reduce-scatter + all-gather
  (two ops of the group); reduce_scatter, all_gather and broadcast as their pair parts; results
  against local references for group shapes 3 to 5, overlapping groups, sizes 0, 1, below the
  group size and odd, several dtypes, every ReduceOp;
  blocking, async in each rank's own order, inside fc.batch() and fc.plan();
- no group communicator is made for them, while FASTCOMM_DEVICE_IPC=0 and groups past
  FASTCOMM_DEVICE_IPC_GROUP_MAX make one (large groups stay on NCCL);
- a member that lowers the op differently (a smaller tensor) fails it on every member, naming
  the mismatch, within no timeout, and the group goes on.
"""
from __future__ import annotations

import random

import pytest
import torch
import torch.distributed as dist

import harness
import test_fake_device as tfd
from _helpers import expect, fold, gen, seed_of

import fastcomm as fc

# 256 bytes: tensors from 64 float32 elements take the links' reduce-scatter + all-gather.
IPC = {"FASTCOMM_FAKE_DEVICE": "1", "FASTCOMM_DEVICE_IPC": "1", "FASTCOMM_RSAG_THRESHOLD": "256",
       "FASTCOMM_DEVICE_IPC_RING_BYTES": "4096"}
OPS = ["SUM", "AVG", "PRODUCT", "MIN", "MAX"]


def dbg(what, arg=0):
    return fc._state._engine.device_debug("cpu", what, arg)


def _lists(world):
    """Overlapping groups of 3 up to the world, the same on every rank."""
    lists = [list(range(world))]
    for a in range(world):
        lists.append(sorted({a, (a + 1) % world, (a + 2) % world}))
    out = []
    for ranks in lists:
        if ranks not in out:
            out.append(ranks)
    return out


def _check(t, ref, what):
    tfd.dsync()
    assert torch.equal(t, ref), f"{what}: got {t[:8].tolist()}..., expected {ref[:8].tolist()}..."


def _cases(ranks, sizes, dtypes):
    for numel in sizes:
        for dt in dtypes:
            for op in OPS:
                if op == "AVG" and dt in ("int64", "int32"):
                    continue
                yield numel, dt, op


def _blocking_body(rank, world, sizes, dtypes):
    lists = _lists(world)
    groups = fc.new_groups(lists)
    checked = 0
    for ranks, g in zip(lists, groups):
        if rank not in ranks:
            continue
        n, me = len(ranks), ranks.index(rank)
        for numel, dt, op in _cases(ranks, sizes, dtypes):
            seed = seed_of(tuple(ranks), numel, dt, op, mod=100_000)
            t = gen(rank, seed, dt, numel, op)
            fc.all_reduce(t, op=getattr(dist.ReduceOp, op), group=g)
            _check(t, fold([gen(r, seed, dt, numel, op) for r in ranks], op), f"all_reduce {ranks} {numel} {dt} {op}")
            checked += 1
        for numel in sizes:
            seed = numel * 13 + n
            # reduce_scatter and all_gather (flat), broadcast from the last member: their pair parts
            out = torch.empty(numel)
            fc.reduce_scatter_tensor(out, gen(rank, seed, "float32", n * numel), group=g)
            ref = fold([gen(r, seed, "float32", n * numel) for r in ranks], "SUM")[me * numel:(me + 1) * numel]
            _check(out, ref, f"reduce_scatter_tensor {ranks} {numel}")
            flat = torch.empty(n * numel)
            fc.all_gather_into_tensor(flat, gen(rank, seed + 1, "float32", numel), group=g)
            _check(flat, torch.cat([gen(r, seed + 1, "float32", numel) for r in ranks]), f"all_gather {ranks} {numel}")
            b = gen(rank, seed + 2, "float32", numel)
            fc.broadcast(b, src=ranks[-1], group=g)
            _check(b, gen(ranks[-1], seed + 2, "float32", numel), f"broadcast {ranks} {numel}")
            checked += 3
    return checked, dbg("group_comms"), dbg("ipc_links_made"), dbg("ipc_links")


@pytest.mark.parametrize("world,threshold,sizes", [
    (3, "256", [0, 1, 64, 67, 1001, 30_001]),  # odd, many times the ring
    (4, "256", [0, 2, 67, 4099]),
    (5, "256", [0, 1, 67, 1001]),
    (5, "1", [1, 2, 3, 4, 7]),  # reduce-scatter + all-gather of fewer elements than members
])
def test_large_ops_of_linked_groups_match_the_reference(world, threshold, sizes):
    dtypes = ["float32", "bfloat16", "int64", "int32"]
    # No idle release (FASTCOMM_DEVICE_IDLE_MS), which would end an epoch and make a second link
    # to the same peer when a starved rank leaves a channel idle that long.
    env = dict(IPC, FASTCOMM_RSAG_THRESHOLD=threshold, FASTCOMM_DEVICE_IDLE_MS="3600000")
    res = harness.run(_blocking_body, world, sizes, dtypes, timeout=300, env=env, init_timeout=30)
    for checked, group_comms, made, links in res:
        assert checked > 0
        assert group_comms == 0, group_comms  # none made: the large ops ran over the links
        # Every rank is in the world group, whose large ops go over a link to every other member:
        # one link per peer, made at the pair's first op.
        assert made == world - 1, made
        # Held now: fewer where a member that finished first has shut down: this side then ends
        # its idle link to it (check_health) and frees it once that member unmapped it, at a time
        # no rank controls, so only the bound is exact.
        assert 0 <= links <= made, (links, made)


def _mixed_body(rank, world, rounds):
    """Async ops of overlapping groups in each rank's own order, a batch, and a plan started
    several times, every one large enough for the links' reduce-scatter + all-gather."""
    lists = _lists(world)
    groups = fc.new_groups(lists)
    mine = [(ranks, g) for ranks, g in zip(lists, groups) if rank in ranks]
    rng = random.Random(rank * 7 + 1)
    bad = []
    for it in range(rounds):
        order = list(range(len(mine)))
        rng.shuffle(order)  # groups only need their own members' order
        pending = []
        for i in order:
            ranks, g = mine[i]
            for k, (numel, op) in enumerate([(100 + 31 * it, "SUM"), (257, "MAX"), (5, "AVG")]):
                seed = seed_of(tuple(ranks), it, k, mod=100_000)
                t = gen(rank, seed, "float32", numel, op)
                w = fc.all_reduce(t, op=getattr(dist.ReduceOp, op), group=g, async_op=True)
                pending.append((w, t, fold([gen(r, seed, "float32", numel, op) for r in ranks], op), ranks))
        for w, t, ref, ranks in pending:
            w.wait()
            tfd.dsync()
            if not torch.equal(t, ref):
                bad.append(("async", it, ranks))
    # one batch over every group of this rank
    ts = []
    with fc.batch() as b:
        for ranks, g in mine:
            seed = seed_of(tuple(ranks), "batch", mod=100_000)
            t = gen(rank, seed, "int64", 999)
            fc.all_reduce(t, group=g)
            ts.append((t, fold([gen(r, seed, "int64", 999) for r in ranks], "SUM"), ranks))
    b.wait()
    tfd.dsync()
    bad += [("batch", ranks) for t, ref, ranks in ts if not torch.equal(t, ref)]
    # a plan: two all_reduces and a reduce_scatter per group, started with refilled inputs
    bufs = []
    with fc.plan() as p:
        for ranks, g in mine:
            x, y = torch.empty(700), torch.empty(333, dtype=torch.bfloat16)
            rs_in, rs_out = torch.empty(len(ranks) * 80), torch.empty(80)
            fc.all_reduce(x, group=g)
            fc.all_reduce(y, op=dist.ReduceOp.MIN, group=g)
            fc.reduce_scatter_tensor(rs_out, rs_in, group=g)
            bufs.append((ranks, x, y, rs_in, rs_out))
    for it in range(3):
        for ranks, x, y, rs_in, rs_out in bufs:
            s = seed_of(tuple(ranks), "plan", it, mod=100_000)
            x.copy_(gen(rank, s, "float32", 700))
            y.copy_(gen(rank, s + 1, "bfloat16", 333))
            rs_in.copy_(gen(rank, s + 2, "float32", rs_in.numel()))
        p.start().wait()
        tfd.dsync()
        for ranks, x, y, rs_in, rs_out in bufs:
            s = seed_of(tuple(ranks), "plan", it, mod=100_000)
            me = ranks.index(rank)
            ok = torch.equal(x, fold([gen(r, s, "float32", 700) for r in ranks], "SUM"))
            ok = ok and torch.equal(y, fold([gen(r, s + 1, "bfloat16", 333) for r in ranks], "MIN"))
            ref = fold([gen(r, s + 2, "float32", rs_in.numel()) for r in ranks], "SUM")[me * 80:(me + 1) * 80]
            if not (ok and torch.equal(rs_out, ref)):
                bad.append(("plan", it, ranks))
    return bad, dbg("group_comms")


@pytest.mark.parametrize("world", [3, 5])
def test_async_batched_and_planned_ops_of_overlapping_groups(world):
    for bad, group_comms in harness.run(_mixed_body, world, 4, timeout=300, env=IPC, init_timeout=30):
        assert bad == [] and group_comms == 0, (bad, group_comms)


def _where_body(rank, world):
    lists = [list(range(world)), [0, 1, 2]]
    groups = fc.new_groups(lists)
    for ranks, g in zip(lists, groups):
        if rank in ranks:
            seed = len(ranks)
            t = gen(rank, seed, "float32", 1001)
            fc.all_reduce(t, group=g)
            _check(t, fold([gen(r, seed, "float32", 1001) for r in ranks], "SUM"), f"all_reduce {ranks}")
    return dbg("group_comms")


@pytest.mark.parametrize("env,comms", [
    ({}, [0, 0, 0, 0]),  # every group linked
    ({"FASTCOMM_DEVICE_IPC_GROUP_MAX": "3"}, [1, 1, 1, 1]),  # the world of 4 is large: NCCL
    ({"FASTCOMM_DEVICE_IPC": "0"}, [2, 2, 2, 1]),  # no links: both on group communicators
])
def test_large_groups_and_unlinked_ones_stay_on_nccl(env, comms):
    assert harness.run(_where_body, 4, timeout=120, env={**IPC, **env}, init_timeout=30) == comms


def _lowered_differently_body(rank, world):
    g = fc.new_group([0, 1, 2])
    # rank 0's tensor is large (reduce-scatter + all-gather), the others' small (one exchange)
    t = torch.ones(1000 if rank == 0 else 10)
    msg = expect(dist.DistBackendError, lambda: (fc.all_reduce(t, group=g), tfd.dsync()), "mismatched op")
    ok = torch.full((500,), float(rank + 1))
    fc.all_reduce(ok, group=g)
    _check(ok, torch.full((500,), 6.0), "the op after the mismatch")
    return msg


def test_a_member_that_lowers_differently_fails_the_op_on_all_and_the_group_goes_on():
    res = harness.run(_lowered_differently_body, 3, timeout=60, env=IPC, init_timeout=20)
    assert "reduce-scatter over the pair links" in res[1] + res[2], res
