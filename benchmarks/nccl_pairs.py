#!/usr/bin/env python
"""Pairwise groups on CUDA tensors: fastcomm virtual groups vs torch ProcessGroupNCCL.

P pairs [0,1], [2,3], ... (2P ranks, local processes this script launches). Each rank runs
ITERS all_reduces of a NUMEL float32 CUDA tensor on its pair, then synchronizes:

- torch: ``dist.init_process_group("nccl")`` and one ``dist.new_group`` per pair (every rank
  creates every pair's group, as torch requires; each pair gets its own NCCL communicator);
- fastcomm: ``fc.new_groups`` over the same pairs: virtual groups over one world communicator.

Reported per cell: setup (group creation + first op, where the communicators get made) and
per-op time (max over ranks of each rank's mean), plus a batched fastcomm run where every rank
issues K ops on its pair inside one ``fc.batch()``.

All ranks may share one GPU (as on a single-GPU machine): then each rank gets its own
NCCL_HOSTID, so NCCL treats ranks as separate hosts and connects them over loopback sockets;
absolute times then include that socket path and GPU time-slicing between processes, for both
sides alike. Usage: python benchmarks/nccl_pairs.py [--pairs 1 2 4 8] [--iters 1000] [--numel 100]
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


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank, world, port, args, conn):
    try:
        import torch
        import torch.distributed as dist

        ndev = torch.cuda.device_count()
        dev = rank % ndev
        torch.cuda.set_device(dev)
        if ndev < world:
            os.environ["NCCL_HOSTID"] = f"bench-{os.getppid()}-{rank}"
        os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
        os.environ.setdefault("NCCL_IB_DISABLE", "1")
        store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=timedelta(seconds=120))
        pairs = [[i, i + 1] for i in range(0, world, 2)]
        mine = rank // 2
        out = {}

        def timed_loop(fn, iters):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            torch.cuda.synchronize()
            return (time.perf_counter() - t0) / iters

        x = torch.ones(args.numel, device="cuda")
        # torch ProcessGroupNCCL, one group per pair
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
        x.fill_(1.0)
        dist.all_reduce(x, group=g)
        assert torch.all(x == 2.0).item()

        import fastcomm as fc

        fc.init(store=store, rank=rank, world_size=world, timeout=timedelta(seconds=120))
        t0 = time.perf_counter()
        fgroups = fc.new_groups(pairs)
        fg = fgroups[mine]
        fc.all_reduce(x, group=fg)
        torch.cuda.synchronize()
        out["fc_setup"] = time.perf_counter() - t0
        timed_loop(lambda: fc.all_reduce(x, group=fg), args.warmup)
        out["fc"] = timed_loop(lambda: fc.all_reduce(x, group=fg), args.iters)
        x.fill_(1.0)
        fc.all_reduce(x, group=fg)
        torch.cuda.synchronize()
        assert torch.all(x == 2.0).item()

        # K ops on the pair in one batch: one NCCL group call + one fused fold.
        xs = [torch.ones(args.numel, device="cuda") for _ in range(args.batch)]

        def batched():
            with fc.batch():
                for t in xs:
                    fc.all_reduce(t, group=fg)

        timed_loop(batched, max(1, args.warmup // args.batch))
        out["fc_batch"] = timed_loop(batched, max(1, args.iters // args.batch)) / args.batch
        # and the same K ops with torch, one by one
        out["torch_k"] = timed_loop(lambda: [dist.all_reduce(t, group=g) for t in xs],
                                    max(1, args.iters // args.batch)) / args.batch

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
    return {k: max(res[k] for res in results) for k in results[0]}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--iters", type=int, default=1000)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--numel", type=int, default=100, help="float32 elements per all_reduce (default 10x10)")
    ap.add_argument("--batch", type=int, default=8, help="ops per fastcomm batch")
    ap.add_argument("--job-timeout", type=float, default=240.0)
    args = ap.parse_args()
    import torch  # CPU-side only here: versions for the header
    from _launch import Progress

    print(f"# torch {torch.__version__}, {args.iters} all_reduce of {args.numel} float32 per rank, "
          f"batch of {args.batch}; times are the max over ranks of per-rank means")
    print(f"{'pairs':>5} | {'torch setup s':>13} | {'fc setup s':>10} | {'torch us/op':>11} | {'fc us/op':>8} | "
          f"{'speedup':>7} | {'torch xK us/op':>14} | {'fc batch us/op':>14} | {'speedup':>7}")
    print("-" * 116)
    progress = Progress(len(args.pairs))
    for p in args.pairs:
        progress.launch(f"{p} pair(s)")
        try:
            r = run(p, args)
        except Exception as e:
            print(f"{p:>5} | FAILED: {(str(e) or repr(e)).splitlines()[0]}")
            print(str(e), file=sys.stderr)
            continue
        print(f"{p:>5} | {r['torch_setup']:>13.3f} | {r['fc_setup']:>10.3f} | {r['torch'] * 1e6:>11.1f} | "
              f"{r['fc'] * 1e6:>8.1f} | {r['torch'] / r['fc']:>6.2f}x | {r['torch_k'] * 1e6:>14.1f} | "
              f"{r['fc_batch'] * 1e6:>14.1f} | {r['torch_k'] / r['fc_batch']:>6.2f}x", flush=True)


if __name__ == "__main__":
    main()
