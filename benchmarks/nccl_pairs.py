#!/usr/bin/env python
"""Pairwise groups on CUDA tensors: fastcomm vs torch ProcessGroupNCCL.

P pairs [0,1], [2,3], ... (2P local ranks, started as users start theirs: torch.multiprocessing.spawn
by default, or --launcher fork|torchrun), all measured in one launch per pair count, torch first,
then fastcomm:

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

Times are the max over ranks of each rank's mean over its timed loop. All ranks may share one GPU (as on a
single-GPU machine): then each rank gets its own NCCL_HOSTID, so NCCL treats ranks as separate
hosts and connects them over loopback sockets; absolute times then include that socket path and
GPU time-slicing between processes, for both sides alike.

--fake runs the fastcomm side on the CPU fake of CUDA/NCCL (FASTCOMM_FAKE_DEVICE=1, CPU tensors,
no torch side, no memory figure): a check of this script, not a measurement.

Usage: python benchmarks/nccl_pairs.py [--pairs 1 2 4 8] [--iters 1000] [--numel 100] [--batch 64]
       [--fake] [--json F] [--launcher spawn|fork|torchrun]
"""
from __future__ import annotations

import argparse
import sys
import time
from datetime import timedelta

from _device_bench import add_device_args, parse_device_args, take_device
from _launch import JobError, Progress, run_job, write_json

MIB = 1 << 20


def _store_barrier(store, name, world, timeout=120.0):
    store.add(name, 1)
    deadline = time.monotonic() + timeout
    while store.add(name, 0) < world:
        if time.monotonic() > deadline:
            raise RuntimeError(f"barrier {name!r}: not every rank arrived within {timeout} s")
        time.sleep(0.0005)


def _rank(store, rank, world, args):
    import torch
    import torch.distributed as dist

    fake = args.fake
    device, sync = take_device(rank, world, fake, "bench")
    dev = None if fake else torch.cuda.current_device()
    import fastcomm as fc

    pairs = [[i, i + 1] for i in range(0, world, 2)]
    npairs = len(pairs)
    mine = rank // 2
    k = args.batch
    out = {"device": "the CPU fake of CUDA/NCCL" if fake else torch.cuda.get_device_name(dev), "rank": rank}

    def timed_loop(fn, iters):
        """Seconds per call: the mean over the loop, as a user's loop sees it."""
        sync()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        sync()
        return (time.perf_counter() - t0) / iters

    def free_mem(name):
        """Free device memory, read while every rank waits between the same two steps (the
        fake has none to read: 0)."""
        sync()
        _store_barrier(store, f"mem/{name}/in", world)
        free = 0 if fake else torch.cuda.mem_get_info(dev)[0]
        _store_barrier(store, f"mem/{name}/out", world)
        return free

    x = torch.ones(args.numel, device=device)
    xs = [torch.ones(args.numel, device=device) for _ in range(k)]
    steps = max(1, args.iters // k)

    # ---- torch ProcessGroupNCCL, one group per pair
    if not fake:
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
    fc.init(store=store, rank=rank, world_size=world, timeout=timedelta(seconds=120))
    t0 = time.perf_counter()
    fg = fc.new_groups(pairs)[mine]
    fc.all_reduce(x, group=fg)
    sync()
    out["fc_setup"] = time.perf_counter() - t0
    timed_loop(lambda: fc.all_reduce(x, group=fg), args.warmup)
    out["fc"] = timed_loop(lambda: fc.all_reduce(x, group=fg), args.iters)
    x.fill_(1.0)
    fc.all_reduce(x, group=fg)
    sync()
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
    out["fc_mem"] = None if fake else (before - after) / (k * npairs)
    timed_loop(batched, max(1, args.warmup // k))
    out["fc_batch"] = timed_loop(batched, steps) / k
    for t in xs:
        t.fill_(1.0)
    batched()
    sync()
    assert all(torch.all(t == 2.0).item() for t in xs), "fastcomm batch gave a wrong result"

    fc.shutdown()
    if not fake:
        dist.barrier()
        dist.destroy_process_group()
    return out


def run(pairs, args):
    """One launch of 2 x ``pairs`` ranks: the figures of every rank merged."""
    results = run_job(_rank, 2 * pairs, args, timeout=args.job_timeout)
    # Memory figures are device-wide (every rank sees the same); times: the slowest rank's.
    merged = {k: max(res[k] for res in results) for k in results[0] if k not in ("device", "rank")
              and results[0][k] is not None}
    merged["device"] = results[0]["device"]
    return merged, results


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
    add_device_args(ap, job_timeout=240)
    args = parse_device_args(ap)
    if min(args.pairs) < 1 or args.iters < 1 or args.batch < 1 or args.torch_groups < 1:
        ap.error("--pairs, --iters, --batch and --torch-groups must be positive")
    import torch  # CPU-side only here: versions for the header

    print(f"# torch {torch.__version__}: all_reduce of {args.numel} float32 on pairwise groups, fastcomm vs "
          f"torch NCCL; {args.iters} timed ops per rank, K = {args.batch}; times are the max over ranks of "
          f"per-rank means; memory is device-wide per added pair group (both members); ranks started by the "
          f"{args.launcher} launcher{'; fake (CPU, not a measurement)' if args.fake else ''}", flush=True)
    head = (f"{'pairs':>5} | {'torch setup s':>13} | {'fc setup s':>10} | {'torch us/op':>11} | {'fc us/op':>8} | "
            f"{'speedup':>7} | {'torch xK us/op':>14} | {'fc batch us/op':>14} | {'speedup':>7} | "
            f"{'torch MiB/group':>15} | {'fc MiB/group':>12}")
    print(head)
    print("-" * len(head), flush=True)
    progress = Progress(len(args.pairs))
    failed = 0
    device = None
    per_rank = {}

    def cell(r, key, width, fmt, scale=1.0):
        return f"{r[key] * scale:>{width}{fmt}}" if key in r else f"{'-':>{width}}"

    def speedup(r, num, den):
        return f"{r[num] / r[den]:>6.2f}x" if num in r else f"{'-':>7}"

    for p in args.pairs:
        progress.launch(f"{p} pair(s)")
        try:
            r, per_rank[p] = run(p, args)
        except JobError as e:
            failed += 1
            print(f"{p:>5} | FAILED: {(str(e) or repr(e)).splitlines()[0]}", flush=True)
            continue
        device = r["device"]
        print(f"{p:>5} | {cell(r, 'torch_setup', 13, '.3f')} | {r['fc_setup']:>10.3f} | "
              f"{cell(r, 'torch', 11, '.1f', 1e6)} | {r['fc'] * 1e6:>8.1f} | {speedup(r, 'torch', 'fc')} | "
              f"{cell(r, 'torch_k', 14, '.1f', 1e6)} | {r['fc_batch'] * 1e6:>14.1f} | "
              f"{speedup(r, 'torch_k', 'fc_batch')} | {cell(r, 'torch_mem', 15, '.1f', 1 / MIB)} | "
              f"{cell(r, 'fc_mem', 12, '.3f', 1 / MIB)}", flush=True)
    if device:
        print(f"\ndevice: {device}" + ("" if args.fake else f"; ranks per GPU: up to {2 * max(args.pairs)}"))
    if args.json:
        write_json(args.json, per_rank)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
