"""Groups: thousands cost no threads or fds, are made by their members alone, and behave like
torch's (sorted ranks, rank() == -1 off the group)."""
from __future__ import annotations

import itertools
import os
import threading

import pytest
import torch
from torch.distributed import ReduceOp

import harness

import fastcomm as fc

REPEAT = 1000


def _counts():
    return {"threads": threading.active_count(), "tasks": len(os.listdir("/proc/self/task")),
            "fds": len(os.listdir("/proc/self/fd"))}


def _use_all_body(rank, world):
    """6000 groups (all pairs of world 4, 1000 times); then every one of this rank's 3000 is
    used, values checked exactly against the members' contributions."""
    pairs = [list(p) for p in itertools.combinations(range(world), 2)]
    lists = pairs * REPEAT
    before = _counts()
    gs = fc.new_groups(lists)
    after_create = _counts()
    assert after_create == before, f"creating {len(lists)} groups cost {before} -> {after_create}"
    assert len(gs) == len(lists)
    refused = False
    for ranks, g in zip(lists, gs):
        assert g.ranks == ranks and g.size() == 2
        if rank in ranks:
            assert g.is_member and g.rank() == ranks.index(rank)
        else:
            assert not g.is_member and g.rank() == -1
            if not refused:  # one refusal is enough (the error tests cover the message)
                try:
                    fc.all_reduce(torch.ones(1), group=g)
                except ValueError as e:
                    assert f"rank {rank}" in str(e)
                    refused = True
                else:
                    raise AssertionError(f"non-member group {ranks} accepted all_reduce")
    assert refused
    assert sum(g.is_member for g in gs) == 3 * REPEAT
    blocking_upto = 200 * len(pairs)  # list index: first 200 repeats blocking, the rest async

    def contribution(r, idx):  # what global rank r puts into the group at list index idx
        return float(r * 1000 + idx % 997)

    pending = []
    for idx, (ranks, g) in enumerate(zip(lists, gs)):
        if not g.is_member:
            continue
        t = torch.full((5,), contribution(rank, idx))
        exp = sum(contribution(r, idx) for r in ranks)
        if idx < blocking_upto:
            fc.all_reduce(t, group=g)
            assert torch.equal(t, torch.full((5,), exp)), (idx, ranks, t)
        else:
            pending.append((fc.all_reduce(t, group=g, async_op=True), t, exp, idx, ranks))
    after_blocking_created = _counts()  # blocking ops plus issuing the async ones
    for w, t, exp, idx, ranks in pending:
        w.wait()
        assert torch.equal(t, torch.full((5,), exp)), (idx, ranks, t)
    after = _counts()
    # Async ops may start the engine's one progress thread: never one per group.
    assert after["threads"] <= before["threads"] + 1 and after["tasks"] <= before["tasks"] + 1, (before, after)
    assert after["fds"] <= before["fds"] + 2, (before, after)
    return before, after_blocking_created, after, len(pending)


def test_thousands_of_groups_cost_no_threads_or_fds_and_work():
    res = harness.run(_use_all_body, 4, timeout=120)
    for before, mid, after, n_async in res:
        assert n_async == 3 * (REPEAT - 200)


def _members_only_body(rank, world):
    # Only the members of [0, 1] create it; ranks 2 and 3 never hear of it, and make (many)
    # groups of their own in a different number: no world-wide step is involved.
    if rank < 2:
        g = fc.new_group([0, 1])
        for i in range(5):
            t = torch.full((4,), float(rank + i))
            fc.all_reduce(t, group=g)
            assert torch.equal(t, torch.full((4,), float(1 + 2 * i)))
    else:
        gs = [fc.new_group([2, 3]) for _ in range(50)]
        for i, g in enumerate(gs[::7]):
            t = torch.full((4,), float(rank * i))
            fc.all_reduce(t, op=ReduceOp.MAX, group=g)
            assert torch.equal(t, torch.full((4,), float(3 * i)))
    return True


def test_groups_are_made_by_their_members_only():
    harness.run(_members_only_body, 4, timeout=60)


def _torch_like_body(rank, world):
    # Sorted like torch: new_group([1, 0]) has ranks [0, 1] and group rank == index there.
    if rank < 2:
        g = fc.new_group([1, 0] if rank == 0 else [0, 1])  # either spelling names the same group
        assert g.ranks == [0, 1] and g.size() == 2 and g.rank() == rank
        t = torch.tensor([float(rank + 1)])
        fc.all_reduce(t, group=g)
        assert t.item() == 3.0
    # a triple given in three different orders
    g3 = fc.new_group([[2, 0, 1], [1, 2, 0], [0, 1, 2]][rank])
    assert g3.ranks == [0, 1, 2] and g3.rank() == rank
    t = torch.tensor([float(rank + 1)])
    fc.all_reduce(t, op=ReduceOp.PRODUCT, group=g3)
    assert t.item() == 6.0
    # new_groups: same list on every caller; non-members get rank() == -1 and the sorted ranks
    gs = fc.new_groups([[2, 1], [0], [1, 0], [2, 0, 1]])
    assert [x.ranks for x in gs] == [[1, 2], [0], [0, 1], [0, 1, 2]]
    exp_rank = {0: [-1, 0, 0, 0], 1: [0, -1, 1, 1], 2: [1, -1, -1, 2]}[rank]
    assert [x.rank() for x in gs] == exp_rank
    assert [x.is_member for x in gs] == [r >= 0 for r in exp_rank]
    assert f"{gs[0].ranks}" in repr(gs[0])
    # Two groups over the same list are distinct: their ops do not mix.
    a, b = fc.new_group([0, 1, 2]), fc.new_group([2, 1, 0])
    ta = torch.full((3,), float(rank))
    tb = torch.full((3,), float(10 * rank))
    wb = fc.all_reduce(tb, group=b, async_op=True)
    wa = fc.all_reduce(ta, group=a, async_op=True)
    wa.wait()
    wb.wait()
    assert torch.equal(ta, torch.full((3,), 3.0)) and torch.equal(tb, torch.full((3,), 30.0))
    # The world group equals new_group(range(world)) in membership.
    t = torch.full((2,), float(rank))
    fc.all_reduce(t)
    assert torch.equal(t, torch.full((2,), 3.0))
    assert fc.get_rank() == rank and fc.get_world_size() == world
    # With a group, as torch's: this process's group rank and the group's size, -1 for both
    # where it is not a member.
    (pair,) = fc.new_groups([[2, 1]])
    assert fc.get_rank(pair) == {0: -1, 1: 0, 2: 1}[rank]
    assert fc.get_world_size(group=pair) == (-1 if rank == 0 else 2)
    assert fc.get_rank(group=None) == rank and fc.get_world_size(None) == world
    with pytest.raises(TypeError, match="argument 'group' must be a fastcomm.Group"):
        fc.get_rank([0, 1])
    return True


def test_group_ranks_sorted_like_torch():
    harness.run(_torch_like_body, 3, timeout=60)
