#!/usr/bin/env python
"""Same-host CUDA channels over IPC: ranks sharing one GPU, fastcomm against torch's NCCL
backend (each rank its own NCCL_HOSTID, as NCCL needs for ranks on one GPU), same run.

Per pair count P (2P ranks on the GPUs there are, round robin; torch NCCL only at 1 pair):
- back to back: wall time per op of N blocking pair all_reduces of --numel float32 (default 100,
  400 B), then a synchronize (the mean of the loop), and the forum MWE's shape (1,024 ops of
  10x10 float32, the slowest pair);
- bandwidth (1 pair): a 16 MB pair all_reduce, algorithm bandwidth (bytes / time per op),
  against the device-to-device copy bandwidth of one 16 MB cudaMemcpy measured in the same run;
- memory (1 pair): device memory in use on the GPU (mem_get_info, both ranks together, read
  when both are at the same point) before fastcomm's init, with the link up, and after
  fc.shutdown() and empty_cache (what IPC rings leave behind: nothing), and fastcomm's own count
  of each rank's ring bytes.

--fake runs the fastcomm side on the CPU fake (FASTCOMM_FAKE_DEVICE=1, FASTCOMM_DEVICE_IPC=1, CPU
tensors, no torch comparison, host memcpy as the copy bandwidth, rings counted by fastcomm): a
check of this script and of the path's logic, not a measurement.

Usage: python benchmarks/device_ipc.py [--pairs 1,8] [--ops 1000] [--numel 100] [--fake] [--json F]
       [--launcher spawn|fork|torchrun]
"""
from __future__ import annotations

import argparse
import os
import time
from datetime import timedelta

from _device_bench import add_device_args, parse_device_args, take_device
from _launch import run_job, write_json


def _rank(store, rank, world, args):
    import torch
    import torch.distributed as dist

    fake = args.fake
    os.environ["FASTCOMM_DEVICE_IPC"] = "1"
    device, sync = take_device(rank, world, fake, "ipc")
    pair = [rank - rank % 2, rank - rank % 2 + 1]
    one_pair = world == 2
    out = {"rank": rank, "world": world}
    import fastcomm as fc

    def used(name):
        # Device-wide (the ranks share the GPU): read once every rank is at the same point.
        store.add(f"mem/{name}", 1)
        while int(store.add(f"mem/{name}", 0)) < world:
            time.sleep(0.001)
        if fake:
            return 0
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        return total - free

    def per_op(allreduce, x, n):
        for _ in range(min(50, n)):
            allreduce(x)
        sync()
        t0 = time.perf_counter()
        for _ in range(n):
            allreduce(x)
        sync()
        return (time.perf_counter() - t0) / n * 1e6

    if not fake and one_pair and not args.no_torch:
        dist.init_process_group("nccl", store=dist.PrefixStore("torch/", store), rank=rank, world_size=world,
                                device_id=torch.device("cuda", torch.cuda.current_device()))
        tg = dist.new_group(pair)
        out["torch_us_per_op"] = per_op(lambda x: dist.all_reduce(x, group=tg), torch.ones(args.numel, device=device),
                                        args.ops)
        out["torch_mwe_s"] = per_op(lambda x: dist.all_reduce(x, group=tg), torch.ones(10, 10, device=device),
                                    1024) * 1024 / 1e6
        dist.destroy_process_group()
        sync()

    if not fake:
        # Load the kernels a rank's first ops use (CUDA loads modules lazily, into device
        # memory) before the first reading, so that the readings see fastcomm's memory alone.
        w = torch.ones(args.numel, device=device)
        (w + w).sum().item()
        torch.empty_like(w).copy_(w)
        del w
        # ... and give back the warm-up's cached block, which the last reading's empty_cache
        # would free and count against fastcomm.
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    mem0 = used("before")
    fc.init(store=dist.PrefixStore("fc/", store), rank=rank, world_size=world, timeout=timedelta(seconds=120))
    fg = fc.new_group(pair)
    ar = lambda x: fc.all_reduce(x, group=fg)  # noqa: E731
    out["fc_us_per_op"] = per_op(ar, torch.ones(args.numel, device=device), args.ops)
    out["fc_mwe_s"] = per_op(ar, torch.ones(10, 10, device=device), 1024) * 1024 / 1e6
    out["ipc_links"] = fc._state._engine.device_debug(device, "ipc_links", 0)
    out["ipc_ring_bytes"] = fc._state._engine.device_debug(device, "ipc_ring_bytes", 0)
    if one_pair:
        # Before the 16 MB tensors exist: the link's memory (its rings) and the small ops' leftovers.
        out["mem_link_up"] = used("link_up") - mem0
        big = torch.ones(args.big_bytes // 4, device=device)
        t = per_op(ar, big, args.big_ops)
        out["fc_big_GBps"] = big.numel() * 4 / (t * 1e-6) / 1e9
        src, dst = torch.ones_like(big), torch.empty_like(big)
        t = per_op(lambda x: dst.copy_(src), big, args.big_ops)
        out["memcpy_GBps"] = big.numel() * 4 / (t * 1e-6) / 1e9
        del big, src, dst
    sync()
    fc.shutdown()
    if not fake:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    out["mem_after_shutdown"] = used("after") - mem0
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", default="1,8", help="pair counts, comma-separated")
    ap.add_argument("--ops", type=int, default=1000)
    ap.add_argument("--numel", type=int, default=100)
    ap.add_argument("--big-bytes", type=int, default=16 << 20)
    ap.add_argument("--big-ops", type=int, default=20)
    ap.add_argument("--no-torch", action="store_true", help="skip the torch NCCL side")
    add_device_args(ap, job_timeout=300)
    args = parse_device_args(ap)
    results = {}
    for p in [int(x) for x in args.pairs.split(",")]:
        results[p] = run_job(_rank, 2 * p, args, timeout=args.job_timeout)
    where = "fake (CPU, not a measurement)" if args.fake else "GPU"
    print(f"pair all_reduce over IPC, {args.ops} ops of {args.numel} float32 back to back, {where}")
    print(f"{'pairs':>5} {'fc us/op':>9} {'torch us/op':>12} {'ratio':>7} {'fc MWE s':>9} {'torch MWE s':>12} {'links':>6}")
    for p, res in results.items():
        fc_us = max(r["fc_us_per_op"] for r in res)
        t_us = max((r.get("torch_us_per_op", 0.0) for r in res), default=0.0)
        ratio = f"{t_us / fc_us:.1f}x" if t_us else "-"
        t_mwe = max((r.get("torch_mwe_s", 0.0) for r in res), default=0.0)
        t_col = f"{t_us:>12.2f}" if t_us else f"{'-':>12}"
        t_mwe_col = f"{t_mwe:>12.4f}" if t_mwe else f"{'-':>12}"
        print(f"{p:>5} {fc_us:>9.2f} {t_col} {ratio:>7} {max(r['fc_mwe_s'] for r in res):>9.4f} "
              f"{t_mwe_col} {min(r['ipc_links'] for r in res):>6}")
    if 1 in results:
        r0 = results[1][0]
        print(f"16 MB pair all_reduce: {min(r['fc_big_GBps'] for r in results[1]):.2f} GB/s algorithm bandwidth; "
              f"copy {r0['memcpy_GBps']:.2f} GB/s (ratio {min(r['fc_big_GBps'] for r in results[1]) / r0['memcpy_GBps']:.2f})")
        print(f"device memory in use, both ranks together: +{r0['mem_link_up']} B with the link up (each rank's own "
              f"rings: {r0['ipc_ring_bytes']} B; the rest is torch's caching allocator's), "
              f"{r0['mem_after_shutdown']:+d} B after fc.shutdown()")
    for p, res in results.items():
        if p != 1:
            print(f"{p} pairs: device memory in use after fc.shutdown(), all {2 * p} ranks together: "
                  f"{res[0]['mem_after_shutdown']:+d} B")
    if args.json:
        write_json(args.json, results)


if __name__ == "__main__":
    main()
