"""fc.monitored_barrier: a barrier whose rank 0 names the members that did not reach it.

Covered: every member arriving (the default group, a triple whose rank 0 is global rank 1, a
pair, a group of one; timeout as seconds, as a timedelta and the group's default; repeated
calls); a member that never arrives (rank 0 names it, the others are told, the late member
learns it was reported once it arrives, and the group's next monitored_barrier passes);
wait_all_ranks (every missing member named, not only the first); rank 0 never answering; a
member that exited; simulated hosts; bad arguments; torch's own dist.monitored_barrier, which
refuses every backend but Gloo. No assertion is on how long anything took."""
from __future__ import annotations

import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import harness
from _helpers import expect

import fastcomm as fc

SHORT = dict(init_timeout=30.0)


def _all_arrive_body(rank, world):
    triple = fc.new_group([1, 2, 3]) if rank >= 1 else None
    pair = fc.new_group([2 * (rank // 2), 2 * (rank // 2) + 1])
    alone = fc.new_group([rank])
    for i in range(3):
        fc.monitored_barrier(timeout=20)
        fc.monitored_barrier(timeout=timedelta(seconds=20), wait_all_ranks=True)
        if triple is not None:
            fc.monitored_barrier(group=triple)  # the group's timeout
        fc.monitored_barrier(group=pair, timeout=20, wait_all_ranks=bool(i % 2))
        fc.monitored_barrier(group=alone, timeout=1)
    # The group still runs ordinary ops, and user messages never meet the barrier's.
    t = torch.full((3,), float(rank))
    fc.all_reduce(t)
    return t.tolist()


def test_every_member_arrives():
    res = harness.run(_all_arrive_body, 4, timeout=120, **SHORT)
    assert all(r == [6.0, 6.0, 6.0] for r in res), res


def _missing_body(rank, world, absent, wait_all):
    """Ranks in ``absent`` stay away (blocked in a recv from rank 0) until rank 0's barrier has
    failed; then they call it too, late."""
    out = {}
    release = torch.zeros(1)
    if rank in absent:
        fc.recv(release, src=0, tag=77)
        out["late"] = expect(dist.DistBackendError, lambda: fc.monitored_barrier(timeout=20),
                             f"rank {rank}", "rank 0", "reports")
    else:
        # The present members start together: the 0.5 s is then only the absent ones' to miss.
        fc.barrier(group=fc.new_group([r for r in range(world) if r not in absent]))
        out["error"] = expect(dist.DistBackendError,
                              lambda: fc.monitored_barrier(timeout=0.5, wait_all_ranks=wait_all),
                              f"rank {rank}", "group [0, 1, 2, 3]", "failed to pass monitored_barrier")
        if rank == 0:
            for r in absent:
                fc.send(release, dst=r, tag=77)
    # Everyone in step again: the next one passes on every rank.
    fc.monitored_barrier(timeout=20)
    return out


@pytest.mark.parametrize("wait_all", [False, True])
def test_a_member_that_never_arrives_is_named(wait_all):
    res = harness.run(_missing_body, 4, (3,), wait_all, timeout=90, **SHORT)
    for rank in (0, 1, 2):
        assert "rank 3 failed to pass" in res[rank]["error"], res[rank]
    assert "rank 0 (the group's rank 0) reports rank 3" in res[1]["error"]
    assert "rank 3 failed to pass" in res[3]["late"]


def test_wait_all_ranks_names_every_missing_member():
    res = harness.run(_missing_body, 4, (2, 3), True, timeout=90, **SHORT)
    for rank in (0, 1):
        assert "ranks 2, 3 failed to pass" in res[rank]["error"], res[rank]
    for rank in (2, 3):
        assert "ranks 2, 3 failed to pass" in res[rank]["late"], res[rank]


def test_without_wait_all_ranks_only_the_first_missing_member_is_named():
    res = harness.run(_missing_body, 4, (2, 3), False, timeout=90, **SHORT)
    for rank in (0, 1):
        assert "rank 2 failed to pass" in res[rank]["error"] and "rank 3" not in res[rank]["error"], res[rank]
    for rank in (2, 3):  # late, both are told what rank 0 reported
        assert "rank 2 failed to pass" in res[rank]["late"], res[rank]


def _no_answer_body(rank, world):
    """Rank 0 of the triple [1, 2, 3] (global rank 1) stays away until the others gave up."""
    g = fc.new_group([1, 2, 3]) if rank >= 1 else None
    out = None
    if rank in (2, 3):
        out = expect(dist.DistBackendError, lambda: fc.monitored_barrier(group=g, timeout=0.3),
                     f"rank {rank}", "group [1, 2, 3]", "no answer from rank 1")
    fc.barrier()
    if rank == 1:  # late: the others' reports are there, so it passes (and answers them)
        fc.monitored_barrier(group=g, timeout=20)
    if g is not None:  # the next one, all together
        fc.monitored_barrier(group=g, timeout=20)
    return out


def test_members_raise_when_rank_0_does_not_answer():
    res = harness.run(_no_answer_body, 4, timeout=60, **SHORT)
    assert res[2] and res[3]


def _exited_body(rank, world):
    if rank == 2:
        os._exit(0)
    return expect(dist.DistBackendError, lambda: fc.monitored_barrier(timeout=20),
                  f"rank {rank}", "rank 2 failed to pass")


def test_a_member_that_exited_is_named():
    res = harness.run(_exited_body, 3, timeout=60, allow_fail=(2,), **SHORT)
    assert "exited" in res[0], res[0]


def _on_hosts(rank, world):
    os.environ["FASTCOMM_HOST_ID"] = f"host-{'AB'[rank % 2]}"
    harness.init_child(rank, world, timeout=30.0)
    try:
        ok = _all_arrive_body(rank, world)
        return ok, _missing_body(rank, world, (3,), True)
    finally:
        fc.shutdown()


def test_across_hosts():
    res = harness.run(_on_hosts, 4, init=False, timeout=180)
    assert all(ok == [6.0, 6.0, 6.0] for ok, _ in res)
    assert "rank 3 failed to pass" in res[0][1]["error"] and "rank 3 failed to pass" in res[3][1]["late"]


def _args_body(rank, world):
    where = f"rank {rank}"
    expect(ValueError, lambda: fc.monitored_barrier(timeout=0), where, "'timeout'", "positive")
    expect(ValueError, lambda: fc.monitored_barrier(timeout=timedelta(seconds=-1)), "'timeout'")
    with fc.batch():
        expect(RuntimeError, fc.monitored_barrier, where, "batch")
    others = fc.new_groups([[0, 1], [2, 3]])
    theirs = others[1 - rank // 2]
    expect(ValueError, lambda: fc.monitored_barrier(group=theirs), where, "not a member")
    fc.monitored_barrier(timeout=20)  # nothing above sent anything
    return True


def test_bad_arguments():
    assert harness.run(_args_body, 4, timeout=60, **SHORT) == [True] * 4


def _torch_body(rank, world):
    dist.init_process_group("fastcomm", store=harness.child_store(), rank=rank, world_size=world,
                            timeout=timedelta(seconds=30))
    try:
        # torch's Python layer refuses any backend but Gloo before the backend is reached.
        expect(ValueError, lambda: dist.monitored_barrier(timeout=timedelta(seconds=5)), "GLOO")
        fc.monitored_barrier(timeout=20)  # fastcomm's own works on the backend's engine
    finally:
        dist.destroy_process_group()
    return True


def test_torch_monitored_barrier_refuses_the_backend():
    assert harness.run(_torch_body, 2, init=False, timeout=60) == [True, True]
