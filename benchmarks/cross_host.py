#!/usr/bin/env python
"""Cross-host pairs: fastcomm's Gloo transport vs torch Gloo pairs (same transport underneath).

Each pair [2i, 2i+1] spans two hosts, simulated on this machine with FASTCOMM_HOST_ID (even
ranks on host A, odd ranks on host B), so fastcomm sends every byte through its world-level
Gloo process group, over TCP, as torch Gloo does. Two loops per size:

- single: one all_reduce per step on one group per pair (torch: ``dist.new_group`` per pair);
- batched: K groups over the same pair, one all_reduce on each per step. torch Gloo issues
  them with async_op=True and waits for all (its best form); fastcomm issues them inside one
  ``fc.batch()``, which sends one Gloo frame per peer for the whole step.

Reported: the median over timed steps of the step time divided by the ops in it (µs per op),
max over ranks, then the median over --repeat launches (fresh processes each). Every loop is
followed by a checked op, so a wrong result fails the run instead of being timed. Usage, from
the repository root:

    python benchmarks/cross_host.py [--pairs 1 2] [--sizes 100 2500 262144] [--k 8]
                                    [--iters 300] [--repeat 3]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _launch import STORE_TIMEOUT, JobError, run_job  # noqa: E402


def _run_steps(all_reduce, groups, numel, rank, iters, warmup, batch=None, async_wait=False):
    """Median seconds per op over `iters` steps of one all_reduce per group, then a checked
    step. `batch`: issue the step inside fastcomm's batch; `async_wait`: issue every op with
    async_op=True, then wait for all."""
    k = len(groups)

    def step(ts):
        if batch is not None:
            with batch() as b:
                for t, g in zip(ts, groups):
                    all_reduce(t, group=g)
            b.wait()
        elif async_wait:
            for w in [all_reduce(t, group=g, async_op=True) for t, g in zip(ts, groups)]:
                w.wait()
        else:
            for t, g in zip(ts, groups):
                all_reduce(t, group=g)

    ts = [torch.zeros(numel) for _ in groups]  # zeros: sums stay 0 however many steps
    for _ in range(warmup):
        step(ts)
    per = []
    for _ in range(iters):
        t0 = time.perf_counter()
        step(ts)
        per.append((time.perf_counter() - t0) / k)
    lo = 2 * (rank // 2)
    ts = [torch.full((numel,), float(rank + 1 + i)) for i in range(k)]
    step(ts)
    for i, t in enumerate(ts):
        exp = float((lo + 1 + i) + (lo + 2 + i))
        if not torch.equal(t, torch.full_like(t, exp)):
            raise AssertionError(f"wrong all_reduce result {t[:3]} != {exp}")
    return statistics.median(per)


def _gloo_body(store, rank, world, numel, k, iters, warmup):
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=STORE_TIMEOUT)
    try:
        # torch requires every rank to create every group, members or not.
        pairs = [[dist.new_group([2 * i, 2 * i + 1]) for _ in range(k)] for i in range(world // 2)]
        mine = pairs[rank // 2]
        single = _run_steps(dist.all_reduce, mine[:1], numel, rank, iters, warmup)
        batched = _run_steps(dist.all_reduce, mine, numel, rank, max(1, iters // k), warmup,
                             async_wait=True)
        dist.barrier()
        return single, batched
    finally:
        dist.destroy_process_group()


def _fastcomm_body(store, rank, world, numel, k, iters, warmup):
    os.environ["FASTCOMM_HOST_ID"] = "bench-host-" + "AB"[rank % 2]
    import fastcomm as fc

    fc.init(store=store, rank=rank, world_size=world, timeout=STORE_TIMEOUT)
    try:
        lo = 2 * (rank // 2)
        mine = fc.new_groups([[lo, lo + 1]] * k)  # only the two members call this
        single = _run_steps(fc.all_reduce, mine[:1], numel, rank, iters, warmup)
        batched = _run_steps(fc.all_reduce, mine, numel, rank, max(1, iters // k), warmup,
                             batch=fc.batch)
        fc.barrier()
        return single, batched
    finally:
        fc.shutdown()


BODIES = {"torch Gloo": _gloo_body, "fastcomm": _fastcomm_body}


def measure(body, world, numel, k, iters, repeat):
    singles, batches = [], []
    for _ in range(repeat):
        # Hard limit per launch: generous for the slowest cell (torch Gloo, 256 KiB x k ops per
        # step on an oversubscribed machine), short of letting a hang stall the run.
        res = run_job(body, world, numel, k, iters, max(5, iters // 10), timeout=600)
        singles.append(max(r[0] for r in res))
        batches.append(max(r[1] for r in res))
    return statistics.median(singles) * 1e6, statistics.median(batches) * 1e6


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--sizes", type=int, nargs="+", default=[100, 2500, 262144],
                    help="float32 elements per tensor (100 = the MWE's 10x10)")
    ap.add_argument("--k", type=int, default=8, help="groups (ops) per batched step")
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)

    print(f"cross-host pairs (simulated hosts, TCP loopback), float32 all_reduce, "
          f"median µs per op; batched = {args.k} groups over the same pair per step; "
          f"{os.cpu_count()} CPUs")
    hdr = (f"| pairs | bytes | torch Gloo single | fastcomm single | ratio "
           f"| torch Gloo batched (async) | fastcomm batched (fc.batch) | ratio |")
    print(hdr)
    print("|" + "---|" * 8)
    for P in args.pairs:
        for n in args.sizes:
            iters = args.iters if n * 4 <= 65536 else max(20, args.iters // 10)
            cells = {}
            for name, body in BODIES.items():
                try:
                    cells[name] = measure(body, 2 * P, n, args.k, iters, args.repeat)
                except JobError as e:
                    cells[name] = None
                    print(f"  {name}, {P} pairs, {n} elements failed: {e}", file=sys.stderr)
            g, f = cells["torch Gloo"], cells["fastcomm"]

            def c(x, i):
                return f"{x[i]:,.0f}" if x else "failed"

            def r(i):
                return f"{g[i] / f[i]:.1f}x" if g and f else "-"

            print(f"| {P} | {4 * n:,} | {c(g, 0)} | {c(f, 0)} | {r(0)} | {c(g, 1)} | {c(f, 1)} "
                  f"| {r(1)} |", flush=True)


if __name__ == "__main__":
    main()
