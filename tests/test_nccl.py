"""The NCCL path (CUDA tensors) on a real GPU. Skipped where there is no CUDA device or fastcomm
was built without NCCL (the device engine's logic runs everywhere on the fake runtime).

Every rank shares the one GPU: each sets its own NCCL_HOSTID before any NCCL use, so NCCL sees
the ranks as separate hosts (it refuses two ranks of one host on one GPU) and connects them
with its network transport over loopback. CUDA is never initialized in the pytest process:
ranks are forked (harness.run) and each child initializes CUDA itself; the availability probe
runs in a subprocess. A user-set NCCL_DEBUG is left alone (ranks inherit it).

Results are compared with references computed locally from deterministic inputs of every
member (_helpers.gen / fold), as in the CPU suites. scripts/gpu_check.sh runs this file on the
GPU machine."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest
import torch
import torch.distributed as dist

import harness
from _helpers import expect, fold, gen, wait_dead

import fastcomm as fc


def _probe():
    """(CUDA device present, fastcomm built with NCCL, what went wrong), asked of a fresh
    interpreter that imports the same fastcomm as this one: CUDA must stay uninitialized here
    (ranks fork)."""
    code = ("import torch, fastcomm; "
            "print(int(torch.cuda.is_available() and torch.cuda.device_count() > 0), "
            "int(bool(getattr(fastcomm._C, 'has_nccl', False))))")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env,
                             cwd=os.path.dirname(os.path.dirname(os.path.abspath(fc.__file__))))
        cuda, nccl = (int(x) for x in out.stdout.split())
        return bool(cuda), bool(nccl), ""
    except Exception as e:  # noqa: BLE001 - reported below
        detail = getattr(locals().get("out"), "stderr", "") or repr(e)
        return False, False, detail.strip()[-2000:]


_CUDA, _NCCL, _WHY = _probe()
# scripts/gpu_check.sh sets FASTCOMM_REQUIRE_GPU=1: there a skip would hide a broken setup.
if os.environ.get("FASTCOMM_REQUIRE_GPU") == "1" and not (_CUDA and _NCCL):
    raise RuntimeError(f"FASTCOMM_REQUIRE_GPU=1 but CUDA available: {_CUDA}, fastcomm has NCCL: {_NCCL}"
                       + (f"; probe failed: {_WHY}" if _WHY else ""))
pytestmark = [
    pytest.mark.skipif(not _CUDA, reason="no CUDA device (torch.cuda unavailable): NCCL path not testable here"),
    pytest.mark.skipif(_CUDA and not _NCCL, reason="fastcomm was built without NCCL (CPU torch or no NCCL found)"),
]

# One GPU, many "hosts" (see the module docstring); NCCL_DEBUG is the user's.
ENV = {"NCCL_SOCKET_IFNAME": "lo", "NCCL_IB_DISABLE": "1"}
# Hard bound of one run (all its ranks): CUDA and NCCL start-up take seconds per rank.
# FASTCOMM_NCCL_TEST_TIMEOUT lowers it where device time is short (scripts/gpu_check.sh).
TIMEOUT = float(os.environ.get("FASTCOMM_NCCL_TEST_TIMEOUT", "150"))
OP_TIMEOUT = 60.0  # fc.init's timeout, which is also the op timeout
OPS = {"SUM": fc.ReduceOp.SUM, "AVG": fc.ReduceOp.AVG, "MIN": fc.ReduceOp.MIN, "MAX": fc.ReduceOp.MAX}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int64": torch.int64}
SIZES = [0, 1, 1001, 1 << 18]  # 1 << 18 float32: 1 MiB


def _setup(rank):
    # Before any NCCL use: NCCL reads the host id once per process.
    os.environ["NCCL_HOSTID"] = f"fastcomm-host{rank}"
    torch.cuda.set_device(0)


def _input(rank, seed, dt, n, op):
    """Rank `rank`'s CPU input: small integers (exact in every dtype); for MIN and MAX on a
    floating dtype one NaN per rank, at a position that depends on the rank, so that every
    member's NaN must come through."""
    x = gen(rank, seed, dt, n, op)
    if op in ("MIN", "MAX") and x.is_floating_point() and n > 0:
        x[(seed + 3 * rank) % n] = float("nan")
    return x


def _check(got, want, op, what):
    got = got.cpu()
    assert got.dtype == want.dtype and got.shape == want.shape, (what, got.dtype, got.shape)
    if op == "AVG":
        torch.testing.assert_close(got, want, equal_nan=True, msg=lambda m: f"{what}: {m}")
    else:
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True, msg=lambda m: f"{what}: {m}")


def _lists(world):
    # Every rank walks the same list in the same order (the ordering rule for groups that
    # share members); non-members skip.
    return [[0, 1], [2, 3], [0, 1, 2], [1, 3], [0, 1, 2, 3]][: 5 if world >= 4 else 1]


# ---------------------------------------------------------------------------------------------
# all_reduce


def _all_reduce_body(rank, world):
    _setup(rank)
    lists = _lists(world)
    groups = fc.new_groups(lists)
    case = 0
    for dt, dtype in DTYPES.items():
        for op in OPS:
            if op == "AVG" and not dtype.is_floating_point:
                continue
            for n in SIZES:
                case += 1
                for gi, (ranks, g) in enumerate(zip(lists, groups)):
                    if rank not in ranks:
                        continue
                    seed = 100 * case + gi
                    t = _input(rank, seed, dt, n, op).cuda()
                    fc.all_reduce(t, op=OPS[op], group=g)
                    want = fold([_input(r, seed, dt, n, op) for r in ranks], op)
                    _check(t, want, op, f"all_reduce {op} {dt} n={n} on {ranks}")
    torch.cuda.synchronize()
    return case


def test_all_reduce_pairs_triples_and_quads():
    # Pairs [0, 1], [2, 3], [1, 3]; the triple [0, 1, 2]; the world [0, 1, 2, 3]. Every
    # size (0, 1, odd, 1 MiB), float32 / bfloat16 / int64, SUM / AVG / MIN / MAX (NaN in).
    harness.run(_all_reduce_body, 4, timeout=TIMEOUT, env=ENV, init_timeout=OP_TIMEOUT)


# ---------------------------------------------------------------------------------------------
# broadcast, all_gather, reduce_scatter, send/recv


def _collectives_body(rank, world):
    _setup(rank)
    lists = _lists(world)
    groups = fc.new_groups(lists)
    for gi, (ranks, g) in enumerate(zip(lists, groups)):
        if rank not in ranks:
            continue
        n = len(ranks)
        me = ranks.index(rank)
        for numel in [0, 1, 1001, 1 << 16]:
            for dt, dtype in DTYPES.items():
                key = 1000 * gi + numel % 997
                what = f"{dt} n={numel} on {ranks}"
                for src in ranks:
                    t = gen(rank, key + src, dt, numel).cuda()
                    fc.broadcast(t, src=src, group=g)
                    _check(t, gen(src, key + src, dt, numel), "SUM", f"broadcast from {src} {what}")
                inp = gen(rank, key + 1, dt, numel).cuda()
                outs = [torch.empty(numel, dtype=dtype, device="cuda") for _ in range(n)]
                fc.all_gather(outs, inp, group=g)
                for i, r in enumerate(ranks):
                    _check(outs[i], gen(r, key + 1, dt, numel), "SUM", f"all_gather[{i}] {what}")
                flat = torch.empty(n * numel, dtype=dtype, device="cuda")
                fc.all_gather_into_tensor(flat, inp, group=g)
                _check(flat, torch.cat([gen(r, key + 1, dt, numel) for r in ranks]), "SUM",
                       f"all_gather_into_tensor {what}")
                big = gen(rank, key + 2, dt, n * numel).cuda()
                want = fold([gen(r, key + 2, dt, n * numel) for r in ranks], "SUM")[me * numel:(me + 1) * numel]
                out = torch.empty(numel, dtype=dtype, device="cuda")
                fc.reduce_scatter_tensor(out, big, group=g)
                _check(out, want, "SUM", f"reduce_scatter_tensor {what}")
                out2 = torch.empty(numel, dtype=dtype, device="cuda")
                fc.reduce_scatter(out2, list(big.split(numel)) if numel else [big[:0]] * n, op=fc.ReduceOp.SUM,
                                  group=g)
                _check(out2, want, "SUM", f"reduce_scatter {what}")
                if dtype.is_floating_point:
                    # AVG too: at 1 << 16 float32 a triple or quad runs on its own communicator,
                    # where NCCL sums and the runtime divides once, as the fold does.
                    out3 = torch.empty(numel, dtype=dtype, device="cuda")
                    fc.reduce_scatter_tensor(out3, big, op=fc.ReduceOp.AVG, group=g)
                    avg = fold([gen(r, key + 2, dt, n * numel) for r in ranks], "AVG")[me * numel:(me + 1) * numel]
                    _check(out3, avg, "AVG", f"reduce_scatter_tensor AVG {what}")
    torch.cuda.synchronize()
    return True


def test_broadcast_all_gather_reduce_scatter():
    harness.run(_collectives_body, 4, timeout=TIMEOUT, env=ENV, init_timeout=OP_TIMEOUT)


def _send_recv_body(rank, world):
    _setup(rank)
    g01, g23 = fc.new_groups([[0, 1], [2, 3]])
    g = g01 if rank < 2 else g23
    peer = rank ^ 1
    for numel in [0, 1, 1001, 1 << 18]:
        for dt, dtype in DTYPES.items():
            mine = gen(rank, numel, dt, numel).cuda()
            got = torch.empty(numel, dtype=dtype, device="cuda")
            # Blocking, in matching order.
            if rank % 2 == 0:
                fc.send(mine, dst=peer, group=g)
                fc.recv(got, src=peer, group=g)
            else:
                fc.recv(got, src=peer, group=g)
                fc.send(mine, dst=peer, group=g)
            _check(got, gen(peer, numel, dt, numel), "SUM", f"send/recv {dt} n={numel}")
            # Both directions at once inside a batch: a send and a receive to the same peer do
            # not wait on each other.
            got2 = torch.empty(numel, dtype=dtype, device="cuda")
            with fc.batch() as b:
                fc.isend(mine, dst=peer, group=g)
                fc.irecv(got2, src=peer, group=g)
            b.wait()
            _check(got2, gen(peer, numel, dt, numel), "SUM", f"batched isend/irecv {dt} n={numel}")
    torch.cuda.synchronize()
    return True


def test_send_recv():
    harness.run(_send_recv_body, 4, timeout=TIMEOUT, env=ENV, init_timeout=OP_TIMEOUT)


# ---------------------------------------------------------------------------------------------
# Batches over many groups, issue orders, threads


def _batch_body(rank, world):
    _setup(rank)
    # Every pair of the 4 ranks, three times over: 18 groups, 9 of them this rank's, over its
    # 3 peers (several groups per peer channel).
    lists = [[a, b] for _ in range(3) for a in range(world) for b in range(a + 1, world)]
    groups = fc.new_groups(lists)
    mine = [(i, ranks, g) for i, (ranks, g) in enumerate(zip(lists, groups)) if rank in ranks]
    for numel in [0, 3, 1001, 1 << 16]:
        for dt in ("float32", "bfloat16"):
            ts = [_input(rank, numel + i, dt, numel, "SUM").cuda() for i, _, _ in mine]
            with fc.batch() as b:
                for (_, _, g), t in zip(mine, ts):
                    fc.all_reduce(t, group=g)
            b.wait()
            for (i, ranks, _), t in zip(mine, ts):
                _check(t, fold([_input(r, numel + i, dt, numel, "SUM") for r in ranks], "SUM"), "SUM",
                       f"batch SUM {dt} n={numel} on {ranks}")
            ts = [_input(rank, 7 * numel + i, dt, numel, "MAX").cuda() for i, _, _ in mine]
            fc.all_reduce_many(ts, [g for _, _, g in mine], op=fc.ReduceOp.MAX)
            for (i, ranks, _), t in zip(mine, ts):
                _check(t, fold([_input(r, 7 * numel + i, dt, numel, "MAX") for r in ranks], "MAX"), "MAX",
                       f"all_reduce_many MAX {dt} n={numel} on {ranks}")
    torch.cuda.synchronize()
    return len(mine)


def test_batch_over_many_pair_groups():
    res = harness.run(_batch_body, 4, timeout=TIMEOUT, env=ENV, init_timeout=OP_TIMEOUT)
    assert res == [9, 9, 9, 9]


def _cyclic_body(rank, world, rounds):
    # Rank i issues async on (i, i+1 mod 3), then on (i-1 mod 3, i), then waits for both: every
    # rank's first op waits on a peer whose first op waits on the next. Must complete (round 0
    # is the first contact of every peer channel), never deadlock.
    _setup(rank)
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    pairs = [[0, 1], [1, 2], [0, 2]]  # new_groups wants the same list on every caller
    groups = fc.new_groups(pairs)
    i_next, i_prev = pairs.index(sorted([rank, nxt])), pairs.index(sorted([prv, rank]))

    def value(r, gi, rnd):  # what global rank r gives group pairs[gi] in round rnd
        return float((r + 1) * 10 ** gi + rnd)

    for rnd in range(rounds):
        n = (1, 1001, 1 << 18)[rnd % 3]
        a = torch.full((n,), value(rank, i_next, rnd), device="cuda")
        b = torch.full((n,), value(rank, i_prev, rnd), device="cuda")
        wa = fc.all_reduce(a, group=groups[i_next], async_op=True)
        wb = fc.all_reduce(b, group=groups[i_prev], async_op=True)
        wa.wait()
        wb.wait()
        torch.cuda.synchronize()
        assert torch.all(a == value(rank, i_next, rnd) + value(nxt, i_next, rnd)).item(), (rnd, a[:3])
        assert torch.all(b == value(rank, i_prev, rnd) + value(prv, i_prev, rnd)).item(), (rnd, b[:3])
    return rounds


def test_cyclic_order_three_ranks():
    harness.run(_cyclic_body, 3, 6, timeout=TIMEOUT, env=ENV, init_timeout=OP_TIMEOUT)


def _threads_body(rank, world, iters):
    # Rank 0 drives [0, 1] and [0, 2] from two Python threads at once, async and blocking;
    # ranks 1 and 2 drive their one group from the main thread.
    _setup(rank)
    g01, g02 = fc.new_groups([[0, 1], [0, 2]])
    errors = []

    def loop(g, peer, salt):
        try:
            torch.cuda.set_device(0)
            for it in range(iters):
                n = (7, 1001, 1 << 16)[it % 3]
                t = torch.full((n,), float(salt + it + rank), device="cuda")
                if it % 2:
                    fc.all_reduce(t, group=g, async_op=True).wait()
                else:
                    fc.all_reduce(t, group=g)
                torch.cuda.current_stream().synchronize()
                exp = float(salt + it + rank) + float(salt + it + peer)
                assert torch.all(t == exp).item(), f"{g.ranks} iter {it}: {t[:3]}"
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(f"{g.ranks}: {type(e).__name__}: {e}")

    if rank == 0:
        ths = [threading.Thread(target=loop, args=(g01, 1, 100)), threading.Thread(target=loop, args=(g02, 2, 200))]
        for th in ths:
            th.start()
        for th in ths:
            th.join(timeout=TIMEOUT - 30)
        assert not any(th.is_alive() for th in ths), "a thread hung"
    elif rank == 1:
        loop(g01, 0, 100)
    else:
        loop(g02, 0, 200)
    assert not errors, errors
    return True


def test_async_ops_from_two_threads():
    harness.run(_threads_body, 3, 30, timeout=TIMEOUT, env=ENV, init_timeout=OP_TIMEOUT)


# ---------------------------------------------------------------------------------------------
# Streams, futures; CUDA graph capture refused


def _streams_body(rank, world):
    _setup(rank)
    g = fc.new_group([0, 1])
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        # The input is produced on the side stream (the caller's current one): the op sees it.
        t = torch.full((1 << 20,), float(rank + 1), device="cuda")
        w = fc.all_reduce(t, group=g, async_op=True)
        w.wait()  # orders the current (side) stream after the op
        u = t * 2
    side.synchronize()
    assert torch.all(u == 6.0).item()
    fut = fc.all_reduce(t, group=g, async_op=True).get_future()
    assert torch.all(fut.wait()[0] == 6.0).item()
    # Tensors the caller drops stay alive until their op is done.
    ws = [fc.all_reduce(torch.ones(4096, device="cuda"), group=g, async_op=True) for _ in range(20)]
    for x in ws:
        x.wait()
    torch.cuda.synchronize()
    # CUDA graph capture is refused (the transfers are scheduled by the host, so a replay could
    # not rerun them): a clear error before anything is enqueued, and the group still works.
    x = torch.ones(256, device="cuda")
    fc.all_reduce(x, group=g)
    torch.cuda.synchronize()

    def capture():
        graph = torch.cuda.CUDAGraph()
        cap = torch.cuda.Stream()
        with torch.cuda.stream(cap):
            with torch.cuda.graph(graph, stream=cap):
                fc.all_reduce(x, group=g)

    expect(RuntimeError, capture, f"rank {rank}", "CUDA graph")
    torch.cuda.synchronize()
    x.fill_(1.0)
    fc.all_reduce(x, group=g)
    torch.cuda.synchronize()
    assert torch.all(x == 2.0).item(), x[:4]
    return True


def test_streams_futures_and_graph_capture_refused():
    harness.run(_streams_body, 2, timeout=TIMEOUT, env=ENV, init_timeout=OP_TIMEOUT)


def _bad_args_body(rank, world):
    _setup(rank)
    g = fc.new_group([0, 1])
    other = fc.new_groups([[0], [1]])[1 - rank]  # the other rank's group of one
    t = torch.ones(8, device="cuda")
    expect(ValueError, lambda: fc.all_reduce(t, group=other), f"rank {rank}", f"[{1 - rank}]", "'group'")
    expect(ValueError, lambda: fc.all_reduce(torch.ones(4, 4, device="cuda").t(), group=g), "contiguous")
    expect(ValueError, lambda: fc.all_reduce(torch.ones(4, dtype=torch.int32, device="cuda"),
                                             op=fc.ReduceOp.AVG, group=g), "AVG")
    fc.all_reduce(t, group=g)  # the group still works after the refusals
    torch.cuda.synchronize()
    assert torch.all(t == 2.0).item()
    return True


def test_bad_arguments_raise_before_anything_is_sent():
    harness.run(_bad_args_body, 2, timeout=TIMEOUT, env=ENV, init_timeout=OP_TIMEOUT)


# ---------------------------------------------------------------------------------------------
# A dead peer


DEATH_TIMEOUT = 20.0




def _death_body(rank, world, flag_dir):
    # World 3: rank 2 exits after init and a first op on each of its groups. Ranks 0 and 1:
    # an op on their group with rank 2 raises DistBackendError naming it within the timeout;
    # ops on [0, 1] keep working, before and after.
    _setup(rank)
    g01, g02, g12 = fc.new_groups([[0, 1], [0, 2], [1, 2]])
    mine = [g for g in (g01, g02, g12) if rank in g.ranks]
    for g in mine:
        t = torch.ones(16, device="cuda")
        fc.all_reduce(t, group=g)
        torch.cuda.synchronize()
        assert torch.all(t == 2.0).item()
    pid_file = os.path.join(flag_dir, "pid")
    if rank == 2:
        with open(pid_file + ".tmp", "w") as f:
            f.write(str(os.getpid()))
        os.rename(pid_file + ".tmp", pid_file)
        os._exit(0)
    wait_dead(pid_file)
    dead = g02 if rank == 0 else g12
    start = time.monotonic()
    w = fc.all_reduce(torch.ones(1 << 16, device="cuda"), group=dead, async_op=True)
    # Meanwhile the healthy group works.
    t = torch.full((1001,), float(rank + 1), device="cuda")
    fc.all_reduce(t, group=g01)
    torch.cuda.synchronize()
    assert torch.all(t == 3.0).item()
    def finish(work):  # wait() only orders the stream; synchronize() host-waits and raises
        work.wait()
        work.synchronize()

    msg = expect(dist.DistBackendError, lambda: finish(w), "rank 2",
                 nothing="the op on the dead peer's group succeeded")
    elapsed = time.monotonic() - start
    # Later ops on the dead group fail too; the healthy group still works.
    expect(dist.DistBackendError, lambda: finish(fc.all_reduce(torch.ones(3, device="cuda"), group=dead,
                                                               async_op=True)), "rank 2")
    t.fill_(float(rank + 1))
    fc.all_reduce(t, group=g01)
    torch.cuda.synchronize()
    assert torch.all(t == 3.0).item()
    return elapsed, msg


def test_dead_peer_fails_its_groups_only(tmp_path):
    res = harness.run(_death_body, 3, str(tmp_path), timeout=TIMEOUT, env=ENV, init_timeout=DEATH_TIMEOUT,
                      allow_fail=(2,))
    for r in (0, 1):
        elapsed, msg = res[r]
        assert elapsed < DEATH_TIMEOUT + 10.0, f"rank {r}: the error took {elapsed:.1f} s: {msg}"


# ---------------------------------------------------------------------------------------------
# The torch backend


def _backend_body(rank, world):
    _setup(rank)
    dist.init_process_group("cpu:fastcomm,cuda:fastcomm", store=harness.child_store(), rank=rank,
                            world_size=world)
    try:
        t = torch.full((1001,), float(rank + 1), device="cuda")
        dist.all_reduce(t)
        torch.cuda.synchronize()
        assert torch.all(t == 3.0).item(), t[:3]
        c = torch.full((5,), float(rank + 1))
        dist.all_reduce(c)
        assert torch.all(c == 3.0).item(), c
        g = dist.new_group([0, 1], use_local_synchronization=True)
        u = torch.full((1 << 16,), float(rank + 2), device="cuda")
        w = dist.all_reduce(u, op=dist.ReduceOp.MAX, group=g, async_op=True)
        w.wait()
        torch.cuda.synchronize()
        assert torch.all(u == 3.0).item(), u[:3]
    finally:
        dist.destroy_process_group()
    return True


def test_torch_backend_cuda_all_reduce():
    harness.run(_backend_body, 2, timeout=TIMEOUT, env=ENV, init=False)


# ---------------------------------------------------------------------------------------------
# GPU memory per group


MIB = 1 << 20
EXTRA_GROUPS = 64


def _memory_body(rank, world):
    _setup(rank)
    x = torch.ones(1024, device="cuda")
    torch.cuda.synchronize()

    def free_after_barrier():
        # mem_get_info is device-wide and both ranks share the GPU: measure only while both
        # are between the same two steps.
        torch.cuda.synchronize()
        fc.barrier()
        free = torch.cuda.mem_get_info()[0]
        fc.barrier()
        return free

    before = free_after_barrier()
    g0 = fc.new_group([0, 1])
    fc.all_reduce(x, group=g0)  # the pair's channel: its NCCL communicator, made here
    first = free_after_barrier()
    groups = [fc.new_group([0, 1]) for _ in range(EXTRA_GROUPS)]
    for g in groups:
        fc.all_reduce(x, group=g)
    after = free_after_barrier()
    assert torch.all(x == 2.0 ** (EXTRA_GROUPS + 1)).item(), x[:3]
    return before - first, first - after


def test_gpu_memory_per_added_group_is_about_zero():
    res = harness.run(_memory_body, 2, timeout=TIMEOUT, env=ENV, init_timeout=OP_TIMEOUT)
    first, growth = res[0]  # device-wide figures: both ranks see the same ones
    print(f"\nGPU memory (device-wide, both ranks): the pair's first group and op {first / MIB:.1f} MiB; "
          f"{EXTRA_GROUPS} more groups over the same pair, one op each: {growth / MIB:.1f} MiB "
          f"({growth / EXTRA_GROUPS / MIB:.3f} MiB per group)")
    # Well under one communicator: the groups share the pair's channel. (A first figure under
    # 32 MiB means NCCL allocated little up front; the bound then stays 8 MiB.)
    assert growth < max(first / 4, 8 * MIB), (first, growth)
