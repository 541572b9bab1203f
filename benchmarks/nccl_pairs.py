#!/usr/bin/env python
"""Pairwise groups on CUDA tensors: fastcomm vs torch ProcessGroupNCCL.

P pairs [0,1], [2,3], ... (2P ranks, local processes this script launches), all measured in
one launch per pair count, torch first, then fastcomm:

- per-op time of a small all_reduce (NUMEL float32) on the rank's pair: torch with one
  ``dist.new_group`` per pair (every rank creates every pair's group, as torch requires; each
  gets its own NCCL communicator), fastcomm with ``fc.new_groups`` (groups made by their
  members; one NCCL communicator per peer, shared by every group over that peer);
- K ops at once (--batch, default 64): fastcomm issues one all_reduce on each of K groups over
  the pair inside one ``fc.batch()``; torch issues K all_reduces back to back on its pair group;
- setup: group creation plus the first op (where the communicators get made);
- GPU memory per added group (torch.cuda.mem_get_info, device-wide, measured while every rank
  waits between the same two steps): torch adds --torch-groups more groups per pair, fastcomm
  K more, each with one op on every added group; reported per added pair group, both members.

Times are the max over ranks of each rank's mean. All ranks may share one GPU (as on a
single-GPU machine): then each rank gets its own NCCL_HOSTID, so NCCL treats ranks as separate
hosts and connects them over loopback sockets; absolute times then include that socket path and
GPU time-slicing between processes, for both sides alike.

Usage: python benchmarks/nccl_pairs.py [--pairs 1 2 4 8] [--iters 1000] [--numel 100] [--batch 64]
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import sys
import time
import traceback
from datetime import timedelta

# fork: the parent never touches CUDA, each child initializes it itself.
_ctx = mp.get_context("fork")
MIB = 1 << 20


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _store_barrier(store, name, world, timeout=120.0):
    store.add(name, 1)
    deadline = time.monotonic() + timeout
    while store.add(name, 0) < world:
        if time.monotonic() > deadline:
            raise RuntimeError(f"barrier {name!r}: not every rank arrived within {timeout} s")
        time.sleep(0.0005)


def _rank_main(rank, world, port, args, conn):
    try:
        import torch
        import torch.distributed as dist

        ndev = torch.cuda.device_count()
        if ndev == 0:
            raise RuntimeError("no CUDA device visible")
        dev = rank % ndev
        if ndev < world:  # before any NCCL use: NCCL reads it once per process
            os.environ["NCCL_HOSTID"] = f"bench-{os.getppid()}-{rank}"
        os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
        os.environ.setdefault("NCCL_IB_DISABLE", "1")
        torch.cuda.set_device(dev)
        store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=timedelta(seconds=120))
        pairs = [[i, i + 1] for i in range(0, world, 2)]
        npairs = len(pairs)
        mine = rank // 2
        k = args.batch
        out = {"device": torch.cuda.get_device_name(dev)}

        def timed_loop(fn, iters):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            torch.cuda.synchronize()
            return (time.perf_counter() - t0) / iters

        def free_mem(name):
            torch.cuda.synchronize()
            _store_barrier(store, f"mem/{name}/in", world)
            free = torch.cuda.mem_get_info(dev)[0]
            _store_barrier(store, f"mem/{name}/out", world)
            return free

        x = torch.ones(args.numel, device="cuda")
        xs = [torch.ones(args.numel, device="cuda") for _ in range(k)]
        steps = max(1, args.iters // k)

        # ---- torch ProcessGroupNCCL, one group per pair
        dist.init_process_group("nccl", store=dist.PrefixStore("torch/", store), rank=rank, world_size=world,
                                device_id=torch.device("cuda", dev))
        t0 = time.perf_counter()
        groups = [dist.new_group(p) for p in pairs]
        g = groups[mine]
        dist.all_reduce(x, group=g)
        torch.cuda.synchronize()
        out["torch_setup"] = time.perf_counter() - t0
        timed_loop(lambda: dist.all_reduce(x, group=g), args.warmup)
        out["torch"] = timed_loop(lambda: dist.all_reduce(x, group=g), args.iters)
        out["torch_k"] = timed_loop(lambda: [dist.all_reduce(t, group=g) for t in xs], steps) / k
        x.fill_(1.0)
        dist.all_reduce(x, group=g)
        torch.cuda.synchronize()
        assert torch.all(x == 2.0).item(), "torch all_reduce gave a wrong result"
        before = free_mem("torch0")
        extra = [[dist.new_group(p) for p in pairs][mine] for _ in range(args.torch_groups)]
        for eg in extra:
            dist.all_reduce(x, group=eg)
        after = free_mem("torch1")
        out["torch_mem"] = (before - after) / (args.torch_groups * npairs)

        # ---- fastcomm: groups by their members, one NCCL communicator per peer
        import fastcomm as fc

        fc.init(store=store, rank=rank, world_size=world, timeout=timedelta(seconds=120))
        t0 = time.perf_counter()
        fg = fc.new_groups(pairs)[mine]
        fc.all_reduce(x, group=fg)
        torch.cuda.synchronize()
        out["fc_setup"] = time.perf_counter() - t0
        timed_loop(lambda: fc.all_reduce(x, group=fg), args.warmup)
        out["fc"] = timed_loop(lambda: fc.all_reduce(x, group=fg), args.iters)
        x.fill_(1.0)
        fc.all_reduce(x, group=fg)
        torch.cuda.synchronize()
        assert torch.all(x == 2.0).item(), "fastcomm all_reduce gave a wrong result"

        # K more groups over every pair (the same list on every rank), one op on each: the
        # memory they add, then K ops in one batch, one per group.
        before = free_mem("fc0")
        lists = [p for _ in range(k) for p in pairs]
        kgroups = [grp for p, grp in zip(lists, fc.new_groups(lists)) if rank in p]

        def batched():
            with fc.batch() as b:
                for t, grp in zip(xs, kgroups):
                    fc.all_reduce(t, group=grp)
            b.wait()  # orders the current stream after the batch, as a blocking op would

        batched()
        after = free_mem("fc1")
        out["fc_mem"] = (before - after) / (k * npairs)
        timed_loop(batched, max(1, args.warmup // k))
        out["fc_batch"] = timed_loop(batched, steps) / k
        for t in xs:
            t.fill_(1.0)
        batched()
        torch.cuda.synchronize()
        assert all(torch.all(t == 2.0).item() for t in xs), "fastcomm batch gave a wrong result"

        fc.shutdown()
        dist.barrier()
        dist.destroy_process_group()
        conn.send(("ok", out))
    except BaseException as e:
        conn.send(("error", f"rank {rank}: {type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        conn.close()
        os._exit(0)


def run(pairs, args):
    world = 2 * pairs
    port = _free_port()
    procs, conns = [], []
    for r in range(world):
        a, b = _ctx.Pipe(duplex=False)
        p = _ctx.Process(target=_rank_main, args=(r, world, port, args, b))
        p.start()
        b.close()
        procs.append(p)
        conns.append(a)
    results = []
    deadline = time.monotonic() + args.job_timeout
    ok = False
    try:
        for r, c in enumerate(conns):
            if not c.poll(max(0.0, deadline - time.monotonic())):
                raise RuntimeError(f"{pairs} pairs: rank {r} gave no result within {args.job_timeout}s")
            try:
                status, value = c.recv()
            except EOFError:
                status, value = "error", f"rank {r}: exited without a result"
            if status != "ok":
                raise RuntimeError(value)
            results.append(value)
        ok = True
    finally:
        # A rank that hangs after reporting (in shutdown) or on error must not outlive its run:
        # it would hold the GPU, and its NCCL threads, into the next cell's measurements.
        for p in procs:
            if ok:
                p.join(10)
            if p.is_alive():
                p.kill()
                p.join()
        for c in conns:
            c.close()
    # Memory figures are device-wide (every rank sees the same); times: the slowest rank's.
    merged = {k: max(res[k] for res in results) for k in results[0] if k != "device"}
    merged["device"] = results[0]["device"]
    return merged


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--iters", type=int, default=1000)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--numel", type=int, default=100, help="float32 elements per all_reduce (default 10x10)")
    ap.add_argument("--batch", type=int, default=64,
                    help="K: ops per fastcomm batch (one per group), torch ops back to back, and fastcomm "
                         "groups added for the memory figure")
    ap.add_argument("--torch-groups", type=int, default=2,
                    help="torch groups added per pair for the memory figure (each costs a communicator)")
    ap.add_argument("--job-timeout", type=float, default=240.0)
    args = ap.parse_args()
    if min(args.pairs) < 1 or args.iters < 1 or args.batch < 1 or args.torch_groups < 1:
        ap.error("--pairs, --iters, --batch and --torch-groups must be positive")
    import torch  # CPU-side only here: versions for the header
    from _launch import Progress

    print(f"# torch {torch.__version__}: all_reduce of {args.numel} float32 on pairwise groups, fastcomm vs "
          f"torch NCCL; {args.iters} timed ops per rank, K = {args.batch}; times are the max over ranks of "
          f"per-rank means; memory is device-wide per added pair group (both members)", flush=True)
    head = (f"{'pairs':>5} | {'torch setup s':>13} | {'fc setup s':>10} | {'torch us/op':>11} | {'fc us/op':>8} | "
            f"{'speedup':>7} | {'torch xK us/op':>14} | {'fc batch us/op':>14} | {'speedup':>7} | "
            f"{'torch MiB/group':>15} | {'fc MiB/group':>12}")
    print(head)
    print("-" * len(head), flush=True)
    progress = Progress(len(args.pairs))
    failed = 0
    device = None
    for p in args.pairs:
        progress.launch(f"{p} pair(s)")
        try:
            r = run(p, args)
        except Exception as e:
            failed += 1
            print(f"{p:>5} | FAILED: {(str(e) or repr(e)).splitlines()[0]}", flush=True)
            print(str(e), file=sys.stderr)
            continue
        device = r["device"]
        print(f"{p:>5} | {r['torch_setup']:>13.3f} | {r['fc_setup']:>10.3f} | {r['torch'] * 1e6:>11.1f} | "
              f"{r['fc'] * 1e6:>8.1f} | {r['torch'] / r['fc']:>6.2f}x | {r['torch_k'] * 1e6:>14.1f} | "
              f"{r['fc_batch'] * 1e6:>14.1f} | {r['torch_k'] / r['fc_batch']:>6.2f}x | "
              f"{r['torch_mem'] / MIB:>15.1f} | {r['fc_mem'] / MIB:>12.3f}", flush=True)
    if device:
        print(f"\ndevice: {device}; ranks per GPU: up to {2 * max(args.pairs)}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
