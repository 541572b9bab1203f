"""fc.empty and the all_reduce that reads members' shared tensors in place
(csrc/algorithms/direct.cpp): results equal to the ordinary path's reference bit for bit, on
every group shape, dtype, op and size (odd, several chunks); members whose tensors are not all
shared, groups across hosts and the setting turned off fall back to the ordinary algorithm;
views, freed and reallocated buffers, plans, a dead member. The transport's counters
(shm.spans_imported, shm.buffers_mapped) tell which path ran."""
from __future__ import annotations

import os

import pytest
import torch
from torch.distributed import ReduceOp

import harness
from _helpers import all_reduce_ref, digest, expect, gen, wait_dead

import fastcomm as fc

# From 4 KiB on, so small cases take the in-place path too and the sweep stays quick.
DIRECT_ENV = {"FASTCOMM_SHM_DIRECT_BYTES": "4096"}
OPS = {"SUM": ReduceOp.SUM, "AVG": ReduceOp.AVG, "MIN": ReduceOp.MIN, "MAX": ReduceOp.MAX,
       "PRODUCT": ReduceOp.PRODUCT}
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
          "float64": torch.float64, "int32": torch.int32, "int64": torch.int64}
# 1 and 7 stay below the setting (ordinary path on shared tensors); 1,001 and 300,001 take the
# in-place path, the last in several 256 KiB chunks per member, split unevenly.
SIZES = [0, 1, 7, 1001, 300_001]


def _imports():
    return fc._state._engine.counters().get("shm.spans_imported", 0)


def _shared_copy(x):
    return fc.empty(x.shape, dtype=x.dtype).copy_(x)


def _group(rank, world, shape):
    if shape == "pairs":
        return fc.new_group([0, 1] if rank < 2 else [2, 3])
    if shape == "triple":
        return None if rank == 0 else fc.new_group([1, 2, 3])
    return fc.new_group(range(world))


def _sweep_body(rank, world, shape):
    g = _group(rank, world, shape)
    if g is None:
        return None
    failures, digests, case = [], {}, 0
    for n in SIZES:
        for op in OPS:
            for dt, dtype in DTYPES.items():
                if op == "AVG" and not dtype.is_floating_point:
                    continue
                for kind in (["int", "randn"] if dtype.is_floating_point and n > 1 else ["int"]):
                    case += 1
                    t = _shared_copy(gen(rank, case, dt, n, op, kind))
                    before = _imports()
                    fc.all_reduce(t, op=OPS[op], group=g)
                    direct = n * dtype.itemsize >= 4096
                    imported = _imports() - before
                    ref = all_reduce_ref([gen(r, case, dt, n, op, kind) for r in g.ranks], g.ranks, op)
                    what = f"rank {rank}, group {g.ranks}, {op} {dt} numel={n} {kind}"
                    if imported != (g.size() - 1 if direct else 0):
                        failures.append(f"{what}: {imported} spans imported")
                    exact = op != "AVG" and kind == "int"
                    try:
                        if exact:
                            torch.testing.assert_close(t, ref, rtol=0, atol=0)
                        else:
                            torch.testing.assert_close(t, ref)
                    except AssertionError as e:
                        failures.append(f"{what}: {str(e)[:300]}")
                    # The in-place path folds in group-rank order as the ordinary one does: the
                    # same bits as the same op on an ordinary tensor, not just close.
                    plain = gen(rank, case, dt, n, op, kind)
                    fc.all_reduce(plain, op=OPS[op], group=g)
                    if not torch.equal(plain, t):
                        failures.append(f"{what}: differs from the ordinary path's result")
                    digests[case] = digest(t)
    return g.ranks, digests, failures


@pytest.mark.parametrize("shape", ["pairs", "triple", "world"])
def test_in_place_all_reduce_matches_the_reference(shape):
    results = harness.run(_sweep_body, 4, shape, timeout=180, env=DIRECT_ENV)
    failures = [f for r in results if r is not None for f in r[2]]
    assert not failures, f"{len(failures)} failures:\n" + "\n".join(failures[:20])
    by_group = {}
    for r in results:
        if r is not None:
            by_group.setdefault(tuple(r[0]), []).append(r[1])
    for ranks, members in by_group.items():
        assert len(members) == len(ranks)
        assert all(m == members[0] for m in members), f"members of {ranks} got different bits"


def _mixed_body(rank, world, plain_rank, n):
    # One member passes an ordinary tensor: nobody reads anybody in place, all get the result.
    g = fc.new_group(range(world))
    x = torch.arange(n, dtype=torch.float32) * (rank + 1)
    t = x.clone() if rank == plain_rank else _shared_copy(x)
    before = _imports()
    fc.all_reduce(t, group=g)
    expected = torch.arange(n, dtype=torch.float32) * sum(range(1, world + 1))
    return torch.equal(t, expected), _imports() - before


@pytest.mark.parametrize("world,plain_rank", [(2, 0), (2, 1), (3, 2)])
def test_members_without_shared_tensors_fall_back(world, plain_rank):
    res = harness.run(_mixed_body, world, plain_rank, 100_001, timeout=60)
    assert res == [(True, 0)] * world


def _views_body(rank, world):
    # A slice of a larger shared tensor: its offset in the buffer travels; the rest is untouched.
    n = 70_001
    buf = fc.empty(3 * n)
    buf.fill_(-1.0)
    t = buf[n:2 * n]
    t.copy_(torch.arange(n, dtype=torch.float32) + rank)
    before = _imports()
    fc.all_reduce(t, op=ReduceOp.MAX)
    ok = torch.equal(t, torch.arange(n, dtype=torch.float32) + world - 1)
    untouched = bool((buf[:n] == -1).all() and (buf[2 * n:] == -1).all())
    # Complex tensors run as their real view, in place too.
    z = fc.empty(40_000, dtype=torch.complex64)
    z.copy_(torch.full((40_000,), complex(rank, -rank)))
    fc.all_reduce(z)
    s = sum(range(world))
    return ok, untouched, torch.equal(z, torch.full((40_000,), complex(s, -s))), _imports() - before


def test_views_and_complex_tensors():
    assert harness.run(_views_body, 2, timeout=60) == [(True, True, True, 2)] * 2


def _fresh_buffers_body(rank, world, rounds):
    # A new buffer every round, more than a rank keeps mapped: each is mapped once and the
    # oldest are let go; results stay right (a buffer id is never reused).
    g = fc.new_group([0, 1])
    mapped0 = fc._state._engine.counters().get("shm.buffers_mapped", 0)
    ok = True
    for i in range(rounds):
        t = fc.empty(65_537, dtype=torch.float64).fill_(rank + i)
        fc.all_reduce(t, group=g)
        fc.all_reduce(t, group=g)  # the same buffer again: already mapped
        ok &= bool((t == 2 * (1 + 2 * i)).all())
        del t
    return ok, fc._state._engine.counters().get("shm.buffers_mapped", 0) - mapped0


def test_fresh_buffers_every_op():
    assert harness.run(_fresh_buffers_body, 2, 12, timeout=60) == [(True, 12)] * 2


def _plan_body(rank, world):
    g = fc.new_group(range(world))
    a = fc.empty(200_003)
    b = fc.empty(3, 99_999, dtype=torch.bfloat16)
    with fc.plan() as p:
        fc.all_reduce(a, group=g)
        fc.all_reduce(b, op=ReduceOp.MIN, group=g)
    before = _imports()
    ok = True
    for i in range(4):
        a.fill_(rank * i)
        b.fill_(rank - i)
        p.start().wait()
        ok &= bool((a == i * sum(range(world))).all()) and bool((b == -i).all())
    return ok, _imports() - before


def test_plan_starts_read_in_place():
    assert harness.run(_plan_body, 3, timeout=60) == [(True, 2 * 2 * 4)] * 3


def _off_body(rank, world):
    t = fc.empty(100_000).fill_(rank)
    fc.all_reduce(t)
    return bool((t == 1).all()), _imports()


def test_setting_zero_turns_it_off():
    assert harness.run(_off_body, 2, env={"FASTCOMM_SHM_DIRECT_BYTES": "0"}, timeout=60) == [(True, 0)] * 2


def _cross_host_body(rank, world):
    # Ranks 0, 2 on one host, 1, 3 on the other: the pair [0, 1] crosses hosts (no protocol,
    # nothing imported), [0, 2] shares one (read in place), the world group is hierarchical.
    os.environ["FASTCOMM_HOST_ID"] = f"host-{rank % 2}"
    harness.init_child(rank, world)
    try:
        out = []
        for ranks in ([0, 1] if rank < 2 else [2, 3], [0, 2] if rank % 2 == 0 else [1, 3], list(range(world))):
            g = fc.new_group(ranks)
            t = fc.empty(100_000).fill_(rank + 1)
            before = _imports()
            fc.all_reduce(t, group=g)
            out.append((bool((t == sum(r + 1 for r in ranks)).all()), _imports() - before))
        return out
    finally:
        fc.shutdown()


def test_groups_across_hosts():
    res = harness.run(_cross_host_body, 4, init=False, timeout=120)
    assert res == [[(True, 0), (True, 1), (True, 0)]] * 4


def _dead_member_body(rank, world, pid_dir, late):
    # A member exits without taking part: the others fail naming it instead of waiting on it.
    # `late`: rank 2 starts only once rank 0 has failed and exited too, so it finds two members
    # gone, and must still name rank 1.
    g = fc.new_group(range(world))
    fc.barrier()
    if rank == 1:
        os._exit(0)
    if rank == 0:
        with open(os.path.join(pid_dir, "pid.tmp"), "w") as f:
            f.write(str(os.getpid()))
        os.rename(os.path.join(pid_dir, "pid.tmp"), os.path.join(pid_dir, "pid"))
    elif late:
        wait_dead(os.path.join(pid_dir, "pid"))
    t = fc.empty(100_000).fill_(1.0)
    expect(RuntimeError, lambda: fc.all_reduce(t, group=g), "rank 1")
    return True


@pytest.mark.parametrize("late", [False, True], ids=["together", "after_rank_0_exited"])
def test_dead_member_fails_the_others(late, tmp_path):
    res = harness.run(_dead_member_body, 3, str(tmp_path), late, timeout=60, init_timeout=10,
                      allow_fail=(1,))
    assert res == [True, None, True]


def _api_body():
    a = fc.empty(2, 3)
    b = fc.empty((4,), dtype=torch.int64)
    c = fc.empty(torch.Size([0, 5]), dtype=torch.bfloat16)
    a.fill_(1.5)
    ok = a.shape == (2, 3) and a.dtype == torch.get_default_dtype() and a.is_contiguous() and not a.is_cuda
    ok &= b.shape == (4,) and b.dtype == torch.int64 and c.shape == (0, 5) and c.numel() == 0
    ok &= a.data_ptr() != b.data_ptr() != c.data_ptr()
    expect(ValueError, lambda: fc.empty(2, -1), "negative dimension")
    return bool(ok) and float(a.sum()) == 9.0


def test_empty_before_init():
    assert _api_body()
