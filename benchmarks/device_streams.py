#!/usr/bin/env python
"""CUDA stream semantics and host cost: fastcomm against torch's NCCL backend, same run.

Ranks are started with torch.multiprocessing.spawn (or --launcher fork|torchrun), as users start
them; all may share one GPU (each then gets its own NCCL_HOSTID, as torch's NCCL backend needs).
Per rank and backend:

- run-ahead: a long kernel (torch.cuda._sleep) on the current stream, then N blocking pair
  all_reduces: the host time for the N calls, whether the last op had run when they returned
  (it must not have: the host runs ahead of the GPU), and how many of them returned while the
  kernel still ran (its length timed by CUDA events);
- host cost: CPU seconds (time.thread_time) per issued async pair all_reduce, N ops issued
  back to back, then one synchronize; and the process's CPU seconds (time.process_time: the
  engine thread, the threads NCCL starts) per op from the first issue to that synchronize;
- back to back: wall time per op of N blocking pair all_reduces, then a synchronize (the mean
  of the loop);
- memory (fastcomm only, --groups G): device memory in use (mem_get_info) after 1,000 and
  after G steps of random pairings, one new pair group and one op per step.

--fake runs the fastcomm side on the CPU fake of CUDA/NCCL (FASTCOMM_FAKE_DEVICE=1, CPU
tensors, no torch comparison, a "hold" kernel instead of _sleep): a check of this script and of
the path's logic, not a measurement.

Usage: python benchmarks/device_streams.py [--world 2] [--ops 1000] [--numel 100] [--groups 10000] [--fake]
       [--sides torch,fc] [--launcher spawn|fork|torchrun]
"""
from __future__ import annotations

import argparse
import random
import time
from datetime import timedelta

from _device_bench import add_device_args, parse_device_args, take_device
from _launch import run_job, write_json


def _rank(store, rank, world, args):
    import torch
    import torch.distributed as dist

    fake = args.fake
    device, sync = take_device(rank, world, fake, "streams")
    pair_ranks = [rank - rank % 2, rank - rank % 2 + 1]
    out = {"rank": rank}
    n = args.ops

    def long_kernel():
        if fake:
            fc._state._engine.device_debug("cpu", "hold", 0)
        else:
            torch.cuda._sleep(int(args.sleep_cycles))

    def end_kernel():
        if fake:
            fc._state._engine.device_debug("cpu", "release", 0)

    def measure(prefix, allreduce, is_done):
        x = torch.ones(args.numel, device=device)
        for _ in range(50):
            allreduce(x, False)
        sync()
        # run-ahead: the host time of each blocking call, and how many returned while the long
        # kernel still ran (its length timed by events around it; the GPU starts it at once)
        if not fake:
            k0, k1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            k0.record()
        long_kernel()
        if not fake:
            k1.record()
        t0 = time.perf_counter()
        returned = []
        for _ in range(n):
            w = allreduce(x, True)
            w.wait()
            returned.append(time.perf_counter())
        out[f"{prefix}_ahead_host_s"] = returned[-1] - t0
        out[f"{prefix}_ahead_last_pending"] = not is_done(w)
        end_kernel()
        sync()
        t1 = time.perf_counter()
        out[f"{prefix}_ahead_total_s"] = t1 - t0
        if not fake:
            kernel_s = k0.elapsed_time(k1) / 1e3
            out[f"{prefix}_kernel_s"] = kernel_s
            out[f"{prefix}_ahead_during_kernel"] = sum(1 for r in returned if r - t0 < kernel_s)
        # host cost per issued async op: the caller's thread, and the whole process (the engine
        # thread's launches, and any thread NCCL starts per launch) until the ops have run
        c0, p0 = time.thread_time(), time.process_time()
        ws = [allreduce(x, True) for _ in range(n)]
        out[f"{prefix}_cpu_us_per_op"] = (time.thread_time() - c0) / n * 1e6
        for w in ws:
            w.wait()
        sync()
        out[f"{prefix}_proc_cpu_us_per_op"] = (time.process_time() - p0) / n * 1e6
        # back to back, blocking
        t0 = time.perf_counter()
        for _ in range(n):
            allreduce(x, False)
        sync()
        out[f"{prefix}_us_per_op"] = (time.perf_counter() - t0) / n * 1e6

    if not fake and "torch" in args.sides:
        dist.init_process_group("nccl", store=dist.PrefixStore("torch/", store), rank=rank, world_size=world,
                                device_id=torch.device("cuda", torch.cuda.current_device()))
        tg = [dist.new_group([i, i + 1]) for i in range(0, world, 2)][rank // 2]
        measure("torch", lambda x, a: dist.all_reduce(x, group=tg, async_op=a), lambda w: w.is_completed())

    import fastcomm as fc

    fc.init(store=dist.PrefixStore("fc/", store), rank=rank, world_size=world, timeout=timedelta(seconds=120))
    fg = fc.new_group(pair_ranks)
    if "fc" in args.sides:
        measure("fc", lambda x, a: fc.all_reduce(x, group=fg, async_op=a), lambda w: w.is_completed())

    # memory over changing pairs: every rank draws the same pairing each step
    if args.groups and world >= 2:
        rng = random.Random(7)
        x = torch.ones(args.numel, device=device)
        used = {}
        for step in range(1, args.groups + 1):
            order = list(range(world))
            rng.shuffle(order)
            mine = next([a, b] for a, b in zip(order[::2], order[1::2]) if rank in (a, b))
            g = fc.new_group(sorted(mine))
            fc.all_reduce(x, group=g)
            if step in (1000, args.groups):
                sync()
                if fake:
                    used[step] = fc._state._engine.device_debug("cpu", "live_comms", 0)
                else:
                    free, total = torch.cuda.mem_get_info()
                    used[step] = total - free
        out["mem_steps"] = used
    fc.shutdown()
    if dist.is_initialized():
        dist.destroy_process_group()
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--ops", type=int, default=1000)
    ap.add_argument("--numel", type=int, default=100)
    ap.add_argument("--groups", type=int, default=10000)
    ap.add_argument("--sides", default="torch,fc", help="which libraries to measure (comma-separated)")
    ap.add_argument("--sleep-cycles", type=float, default=2e9, help="torch.cuda._sleep cycles of the long kernel")
    add_device_args(ap, job_timeout=300)
    args = parse_device_args(ap)
    args.sides = [s.strip() for s in args.sides.split(",") if s.strip()]
    unknown = sorted(set(args.sides) - {"torch", "fc"})
    if unknown or not args.sides:
        ap.error(f"--sides: torch and/or fc, comma-separated (got {unknown or 'none'})")
    if args.ops < 1:
        ap.error("--ops: at least 1")
    res = run_job(_rank, args.world, args, timeout=args.job_timeout)
    sides = [s for s in ("torch", "fc") if s in args.sides and not (args.fake and s == "torch")]
    print(f"{args.world} ranks, {args.ops} ops of {args.numel} float32 per pair, {'fake' if args.fake else 'GPU'}")
    print(f"{'':>8} {'ahead host s':>13} {'last pending':>13} {'during kernel':>14} {'CPU us/issued':>14} "
          f"{'proc CPU us/op':>15} {'us/op b2b':>10}")
    for s in sides:
        worst = lambda k: max(r[f"{s}_{k}"] for r in res)  # noqa: E731
        pending = all(r[f"{s}_ahead_last_pending"] for r in res)
        during = "-" if args.fake else f"{min(r[f'{s}_ahead_during_kernel'] for r in res)}/{args.ops}"
        print(f"{s:>8} {worst('ahead_host_s'):>13.4f} {str(pending):>13} {during:>14} {worst('cpu_us_per_op'):>14.2f} "
              f"{worst('proc_cpu_us_per_op'):>15.2f} {worst('us_per_op'):>10.2f}")
    if "mem_steps" in res[0]:
        unit = "live communicators" if args.fake else "bytes in use on the device"
        print(f"memory ({unit}) after steps of random pairings: {res[0]['mem_steps']}")
    if args.json:
        write_json(args.json, res)


if __name__ == "__main__":
    main()
