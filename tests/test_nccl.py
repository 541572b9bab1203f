"""The NCCL path (CUDA tensors). Runs only where CUDA and a fastcomm build with NCCL are present.

All ranks share one GPU: each rank gets its own NCCL_HOSTID, so NCCL sees them as separate
hosts (it refuses two ranks on one GPU of one host) and connects them over loopback sockets.
CUDA is never initialized in the pytest process itself: ranks are forked (harness.run) and
each child initializes CUDA on its own; the availability probe runs in a subprocess."""
import os
import subprocess
import sys

import pytest
import torch

import harness


def _probe():
    code = ("import torch, fastcomm; "
            "print(int(torch.cuda.is_available() and torch.cuda.device_count() > 0), int(fastcomm.has_nccl()))")
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                             cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        cuda, nccl = (int(x) for x in out.stdout.split())
        return bool(cuda), bool(nccl)
    except Exception:
        return False, False


_CUDA, _NCCL = _probe()
pytestmark = [
    pytest.mark.skipif(not _CUDA, reason="no CUDA device (torch.cuda unavailable): NCCL path not testable here"),
    pytest.mark.skipif(_CUDA and not _NCCL, reason="fastcomm was built without NCCL (CPU torch or no NCCL found)"),
]

# One GPU, many "hosts": see the module docstring.
ENV = {"NCCL_SOCKET_IFNAME": "lo", "NCCL_IB_DISABLE": "1", "NCCL_DEBUG": "WARN"}
# Per run. A hung op fails by itself after the init timeout (30 s here: the watchdog aborts the
# communicator), so this only bounds what the watchdog cannot see (NCCL's init and connection
# setup, CUDA graph replays). Lower than before (240 s) so that one run hanging there still
# leaves the other runs time to report within a 10-minute job; several hung runs do not fit.
TIMEOUT = 150.0


def _setup(rank):
    # NCCL computes the host hash once per process, at its first call (the world communicator
    # is made at the first CUDA op), so this must run before any fastcomm CUDA op. Distinct per
    # rank: two ranks on one GPU with one host hash are refused as duplicate GPUs.
    os.environ["NCCL_HOSTID"] = f"fastcomm-test-{os.getpid()}-{rank}"
    torch.cuda.set_device(0)


def _data(case, rank, numel, dtype):
    g = torch.Generator().manual_seed(1000 * case + rank)
    if dtype.is_floating_point:
        t = torch.rand(numel, generator=g, dtype=torch.float64) + 0.5
    else:
        t = torch.randint(1, 4, (numel,), generator=g, dtype=torch.int64)
    return t.to(dtype)


def _fold(vals, op):
    import fastcomm as fc

    acc = vals[0].double()
    for v in vals[1:]:
        v = v.double()
        if op == fc.ReduceOp.SUM or op == fc.ReduceOp.AVG:
            acc = acc + v
        elif op == fc.ReduceOp.PRODUCT:
            acc = acc * v
        elif op == fc.ReduceOp.MIN:
            acc = torch.minimum(acc, v)
        else:
            acc = torch.maximum(acc, v)
    if op == fc.ReduceOp.AVG:
        acc = acc / len(vals)
    return acc


def _check(got, want, dtype):
    tol = {torch.float16: 2e-3, torch.bfloat16: 2e-2}.get(dtype, 1e-6)
    torch.testing.assert_close(got.cpu().double(), want.double(), rtol=tol, atol=tol)


DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int32, torch.int64, torch.int8,
          torch.uint8, torch.int16]
SIZES = [0, 1, 7, 1000, 65537]


def _all_reduce_body(rank, world, group_lists):
    import fastcomm as fc

    _setup(rank)
    groups = fc.new_groups(group_lists)
    case = 0
    for dtype in DTYPES:
        ops = [fc.ReduceOp.SUM, fc.ReduceOp.MAX, fc.ReduceOp.MIN, fc.ReduceOp.PRODUCT]
        if dtype.is_floating_point:
            ops.append(fc.ReduceOp.AVG)
        for op in ops:
            for numel in SIZES:
                case += 1
                # Every rank walks the same list of groups in the same order (the ordering rule
                # for groups sharing two ranks, see engine/cuda_ops.h).
                for gi, g in enumerate(groups):
                    if g.rank() < 0:
                        continue
                    t = _data(case * 100 + gi, rank, numel, dtype).cuda()
                    fc.all_reduce(t, op=op, group=g)
                    want = _fold([_data(case * 100 + gi, r, numel, dtype) for r in g.ranks], op)
                    if not dtype.is_floating_point:
                        want = want.to(dtype)
                    _check(t, want, dtype)
    torch.cuda.synchronize()
    return case


def test_all_reduce_pairs():
    harness.run(_all_reduce_body, 4, [[0, 1], [2, 3]], timeout=TIMEOUT, env=ENV)


def test_all_reduce_triples_and_overlapping_ring():
    # A triple and the ring (i, i+1): ranks 0-1 and 1-2 share two groups each.
    harness.run(_all_reduce_body, 4, [[0, 1, 2], [0, 1], [1, 2], [2, 3], [3, 0]], timeout=TIMEOUT, env=ENV)


def _collectives_body(rank, world):
    import fastcomm as fc

    _setup(rank)
    groups = fc.new_groups([[0, 1, 2], [1, 3], [0, 1, 2, 3]])
    for gi, g in enumerate(groups):
        if g.rank() < 0:
            continue
        n = g.size()
        for numel in [0, 1, 5, 4099]:
            for dtype in [torch.float32, torch.bfloat16, torch.int64]:
                key = gi * 1000 + numel
                # broadcast from each member
                for src in g.ranks:
                    t = _data(key, rank, numel, dtype).cuda()
                    fc.broadcast(t, src=src, group=g)
                    _check(t, _data(key, src, numel, dtype), dtype)
                # all_gather (list and tensor)
                inp = _data(key + 1, rank, numel, dtype).cuda()
                outs = [torch.empty(numel, dtype=dtype, device="cuda") for _ in range(n)]
                fc.all_gather(outs, inp, group=g)
                for i, r in enumerate(g.ranks):
                    _check(outs[i], _data(key + 1, r, numel, dtype), dtype)
                flat = torch.empty(n * numel, dtype=dtype, device="cuda")
                fc.all_gather_into_tensor(flat, inp, group=g)
                _check(flat, torch.cat([_data(key + 1, r, numel, dtype) for r in g.ranks]), dtype)
                # reduce_scatter (tensor and list)
                big = _data(key + 2, rank, n * numel, dtype).cuda()
                out = torch.empty(numel, dtype=dtype, device="cuda")
                fc.reduce_scatter_tensor(out, big, group=g)
                want = _fold([_data(key + 2, r, n * numel, dtype) for r in g.ranks], fc.ReduceOp.SUM)
                want = want[g.rank() * numel:(g.rank() + 1) * numel]
                _check(out, want if dtype.is_floating_point else want.to(dtype), dtype)
                out2 = torch.empty(numel, dtype=dtype, device="cuda")
                fc.reduce_scatter(out2, list(big.chunk(n)) if numel else [big[:0]] * n,
                                  op=fc.ReduceOp.SUM, group=g)
                _check(out2, want if dtype.is_floating_point else want.to(dtype), dtype)
    # send/recv within the pair [1, 3]
    g = groups[1]
    if g.rank() >= 0:
        t = torch.arange(11, dtype=torch.float32, device="cuda") * (rank + 1)
        if rank == 1:
            fc.send(t, dst=3, group=g)
            r = torch.empty(11, device="cuda")
            fc.recv(r, src=3, group=g)
            _check(r, torch.arange(11, dtype=torch.float32) * 4, torch.float32)
        else:
            r = torch.empty(11, device="cuda")
            fc.recv(r, src=1, group=g)
            fc.send(t, dst=1, group=g)
            _check(r, torch.arange(11, dtype=torch.float32) * 2, torch.float32)
    torch.cuda.synchronize()
    return True


def test_collectives():
    harness.run(_collectives_body, 4, timeout=TIMEOUT, env=ENV)


def _batch_body(rank, world):
    import fastcomm as fc

    _setup(rank)
    lists = [[i, i + 1] for i in range(0, world, 2)] + [[i, (i + 1) % world] for i in range(world)]
    lists = [sorted(x) for x in lists]
    groups = fc.new_groups(lists)
    mine = [(i, g) for i, g in enumerate(groups) if g.rank() >= 0]
    for numel in [0, 3, 100, 10000]:
        ts = [_data(numel + i, rank, numel, torch.float32).cuda() for i, _ in mine]
        with fc.batch() as b:
            for (i, g), t in zip(mine, ts):
                fc.all_reduce(t, group=g)
        b.wait()
        for (i, g), t in zip(mine, ts):
            _check(t, _fold([_data(numel + i, r, numel, torch.float32) for r in g.ranks], fc.ReduceOp.SUM),
                   torch.float32)
        # the same as a function, mixed ops via two dtypes
        ts = [_data(7 * numel + i, rank, numel, torch.float16).cuda() for i, _ in mine]
        fc.all_reduce_many(ts, [g for _, g in mine], op=fc.ReduceOp.MAX)
        for (i, g), t in zip(mine, ts):
            _check(t, _fold([_data(7 * numel + i, r, numel, torch.float16) for r in g.ranks], fc.ReduceOp.MAX),
                   torch.float16)
    torch.cuda.synchronize()
    return len(mine)


def test_batch_over_many_groups():
    harness.run(_batch_body, 4, timeout=TIMEOUT, env=ENV)


def _streams_body(rank, world):
    import fastcomm as fc

    _setup(rank)
    g = fc.new_group([0, 1])
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        # The input is produced on the side stream; the op must see it.
        t = torch.full((1 << 20,), float(rank + 1), device="cuda")
        w = fc.all_reduce(t, group=g, async_op=True)
        w.wait()  # the side stream waits: no host block
        u = t * 2  # ordered after the op on the side stream
    side.synchronize()
    assert torch.all(u == 6.0).item()
    w2 = fc.all_reduce(t, group=g, async_op=True)
    w2.synchronize()
    assert w2.is_completed() and w2.is_success() and w2.exception() is None
    assert torch.all(t == 6.0).item()
    fut = fc.all_reduce(t, group=g, async_op=True).get_future()
    res = fut.wait()
    assert torch.all(res[0] == 12.0).item()
    # Tensors dropped by the caller stay alive until the op is done (recordStream + Work).
    ws = [fc.all_reduce(torch.ones(4096, device="cuda"), group=g, async_op=True) for _ in range(20)]
    for x in ws:
        x.synchronize()
    # CUDA graph capture: replays re-run the exchange.
    x = torch.ones(256, device="cuda")
    fc.all_reduce(x, group=g)  # warm-up: connections exist before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    cap = torch.cuda.Stream()
    with torch.cuda.stream(cap):
        with torch.cuda.graph(graph, stream=cap):
            fc.all_reduce(x, group=g)
    torch.cuda.synchronize()
    x.fill_(1.0)
    for k in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert torch.all(x == 8.0).item(), x[:4]
    return True


def test_streams_async_future_graph():
    harness.run(_streams_body, 2, timeout=TIMEOUT, env=ENV)


def _errors_body(rank, world):
    import fastcomm as fc

    _setup(rank)
    g = fc.new_group([0, 1])
    other = fc.new_groups([[0], [1]])[1 - rank]  # the other rank's group of one
    t = torch.ones(8, device="cuda")
    checks = []

    def expect(exc, fn, *words):
        try:
            fn()
        except exc as e:
            msg = str(e)
            for w in words:
                assert w in msg, (w, msg)
            checks.append(type(e).__name__)
            return
        raise AssertionError(f"no {exc.__name__} from {fn}")

    expect(ValueError, lambda: fc.all_reduce(t, group=other), f"rank {rank}", "not a member", f"[{1 - rank}]")
    expect(ValueError, lambda: fc.all_reduce(torch.ones(4, 4, device="cuda").t(), group=g), "contiguous", "[0, 1]")
    expect(ValueError, lambda: fc.all_reduce(torch.ones(4, dtype=torch.int32, device="cuda"), op=fc.ReduceOp.AVG,
                                             group=g), "AVG")
    expect(TypeError, lambda: fc.all_reduce(torch.ones(4, dtype=torch.bool, device="cuda"), group=g), "dtype")
    # What the host path has and the CUDA path does not.
    expect(ValueError, lambda: fc.all_reduce(torch.ones(4, dtype=torch.int32, device="cuda"), op=fc.ReduceOp.BAND,
                                             group=g), "BAND", "not supported for CUDA tensors")
    expect(ValueError, lambda: fc.reduce(t, dst=0, group=g), "not supported for CUDA tensors")
    expect(ValueError, lambda: fc.all_to_all_single(torch.empty_like(t), t, group=g), "not supported for CUDA tensors")
    expect(ValueError, lambda: fc.all_gather([t], t, group=g), "tensor_list")
    expect(ValueError, lambda: fc.broadcast(t, src=3, group=g), "'src'")

    def mixed():
        with fc.batch():
            fc.all_reduce(torch.ones(2), group=g)
            fc.all_reduce(t, group=g)

    expect(ValueError, mixed, "CPU ops or CUDA ops")
    # After all the refusals the group still works.
    fc.all_reduce(t, group=g)
    torch.cuda.synchronize()
    assert torch.all(t == 2.0).item()
    return checks


def test_bad_arguments_raise_before_nccl():
    harness.run(_errors_body, 2, timeout=TIMEOUT, env=ENV)


def _death_body(rank, world):
    import time

    import fastcomm as fc

    _setup(rank)
    g = fc.new_group([0, 1])
    t = torch.ones(16, device="cuda")
    fc.all_reduce(t, group=g)
    torch.cuda.synchronize()
    if rank == 1:
        os._exit(0)
    time.sleep(0.5)
    start = time.monotonic()
    w = fc.all_reduce(t, group=g, async_op=True)
    try:
        w.synchronize()
    except torch.distributed.DistBackendError as e:
        assert "rank 1" in str(e) or "NCCL" in str(e), str(e)
    else:
        raise AssertionError("no error after the peer died")
    elapsed = time.monotonic() - start
    # Later CUDA ops refuse at once.
    try:
        fc.all_reduce(t, group=g)
    except torch.distributed.DistBackendError:
        pass
    else:
        raise AssertionError("CUDA op accepted after the communicator was aborted")
    return elapsed


def test_peer_death_raises():
    res = harness.run(_death_body, 2, timeout=TIMEOUT, env=ENV, init_timeout=60.0, allow_fail=(1,))
    assert res[0] is not None and res[0] < 30.0, res
