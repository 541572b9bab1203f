#!/usr/bin/env python
"""Cross-host pairs: fastcomm's Gloo transport vs torch Gloo pairs (same transport underneath).

Each pair [2i, 2i+1] spans two hosts, simulated on this machine with FASTCOMM_HOST_ID (even
ranks on host A, odd ranks on host B), so fastcomm sends every byte through its world-level
Gloo process group, over TCP, as torch Gloo does. Two loops per size:

- single: one all_reduce per step on one group per pair (torch: ``dist.new_group`` per pair);
- batched: K groups over the same pair, one all_reduce on each per step. torch Gloo issues
  them with async_op=True and waits for all (its best form); fastcomm issues them inside one
  ``fc.batch()``, which sends one Gloo frame per peer for the whole step.

Placement (``--placement``): ``hosts`` (the default) gives each simulated host its own half of
the CPUs (host A's ranks run on the first half, host B's on the second), for torch Gloo and
fastcomm alike, as separate machines would; ``free`` leaves placement to the scheduler, which
on a small machine often runs both members of a "cross-host" pair on one core, where loopback
TCP costs much less than between two machines (no cross-CPU wake-ups, data still in cache);
``pairs`` forces that case (both members of a pair on one CPU), to show its effect.

Reference (``--reference``, ``Gloo send/recv``): the same bytes moved by plain Gloo point-to-point on one
world-level process group, with no reduction: per step each member of a pair sends every
tensor to the other and receives the other's into a buffer (one message per tensor each way,
all posted at once, then waited for). Any all_reduce over the same transport moves at least
these bytes, so for large tensors this is about what the transport alone costs: a cell where
both torch Gloo and fastcomm are near it is bound by the transport, not by either library.
(For small messages it is no floor: several Gloo messages in flight on one tag and pair take
milliseconds to complete on this kind of machine.)

Reported: the mean over timed steps of the step time divided by the ops in it (µs per op),
max over ranks, then the median over --repeat launches (fresh processes each). The launches of
torch Gloo and fastcomm alternate, so a slow spell of a shared machine hits both alike, and a
batched loop times at least MIN_BATCHED_STEPS steps. Every loop is followed by a checked op, so
a wrong result fails the run instead of being timed. Usage, from the repository root:

    python benchmarks/cross_host.py [--pairs 1 2] [--sizes 100 2500 262144] [--k 8]
                                    [--k 8 [2 ...]] [--iters 300] [--repeat 3]
                                    [--placement hosts|free|pairs] [--reference]
                                    [--json FILE] [--plot FILE.png]
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
from _launch import add_launcher_arg, use_launcher  # noqa: E402
from _launch import (MIN_BATCHED_STEPS, STORE_TIMEOUT, Progress, all_reduce_steps,  # noqa: E402
                     alternate_launches, batched_steps, finish, print_header, print_table,
                     pyplot_or_none, ratio_cell, save_plot, us_cell)


def host_cpus(rank, placement):
    """The CPUs rank `rank` may run on: under placement "hosts", its simulated host's half of
    the machine (host A = even ranks); under "pairs", one CPU shared by both members of its
    pair (pair i on the i-th CPU, round robin); None: any CPU."""
    cpus = sorted(os.sched_getaffinity(0))
    if placement == "pairs":
        return {cpus[(rank // 2) % len(cpus)]}
    if placement != "hosts" or len(cpus) < 2:
        return None
    half = len(cpus) // 2
    return set(cpus[:half] if rank % 2 == 0 else cpus[half:])


def _place(rank, placement):
    cpus = host_cpus(rank, placement)
    if cpus:
        os.sched_setaffinity(0, cpus)  # threads made from here on (Gloo's, fastcomm's) inherit it


def _gloo_body(store, rank, world, numel, k, iters, warmup, placement):
    _place(rank, placement)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=STORE_TIMEOUT)
    try:
        # torch requires every rank to create every group, members or not.
        pairs = [[dist.new_group([2 * i, 2 * i + 1]) for _ in range(k)] for i in range(world // 2)]
        mine = pairs[rank // 2]
        pair = [2 * (rank // 2), 2 * (rank // 2) + 1]
        single = all_reduce_steps(dist.all_reduce, mine[:1], numel, rank, pair, iters, warmup)
        batched = all_reduce_steps(dist.all_reduce, mine, numel, rank, pair, batched_steps(iters, k), warmup,
                             async_wait=True)
        dist.barrier()
        return single, batched
    finally:
        dist.destroy_process_group()


def _fastcomm_body(store, rank, world, numel, k, iters, warmup, placement):
    _place(rank, placement)
    os.environ["FASTCOMM_HOST_ID"] = "bench-host-" + "AB"[rank % 2]
    import fastcomm as fc

    fc.init(store=store, rank=rank, world_size=world, timeout=STORE_TIMEOUT)
    try:
        lo = 2 * (rank // 2)
        mine = fc.new_groups([[lo, lo + 1]] * k)  # only the two members call this
        single = all_reduce_steps(fc.all_reduce, mine[:1], numel, rank, [lo, lo + 1], iters, warmup)
        batched = all_reduce_steps(fc.all_reduce, mine, numel, rank, [lo, lo + 1], batched_steps(iters, k), warmup,
                             batch=fc.batch)
        fc.barrier()
        return single, batched
    finally:
        fc.shutdown()


def _exchange_steps(pg, peer, numel, k, iters, warmup):
    """Median seconds per message over `iters` steps of k messages each way with `peer`."""
    src = [torch.ones(numel) for _ in range(k)]
    dst = [torch.zeros(numel) for _ in range(k)]

    def step():
        ws = [pg.send([t], peer, 7) for t in src] + [pg.recv([d], peer, 7) for d in dst]
        for w in ws:
            w.wait()

    for _ in range(warmup):
        step()
    per = []
    for _ in range(iters):
        t0 = time.perf_counter()
        step()
        per.append((time.perf_counter() - t0) / k)
    if not all(torch.equal(d, t) for d, t in zip(dst, src)):
        raise AssertionError("Gloo send/recv delivered wrong bytes")
    return statistics.fmean(per)


def _exchange_body(store, rank, world, numel, k, iters, warmup, placement):
    _place(rank, placement)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=STORE_TIMEOUT)
    try:
        pg = dist.group.WORLD
        single = _exchange_steps(pg, rank ^ 1, numel, 1, iters, warmup)
        batched = _exchange_steps(pg, rank ^ 1, numel, k, batched_steps(iters, k), warmup)
        dist.barrier()
        return single, batched
    finally:
        dist.destroy_process_group()


BODIES = {"torch Gloo": _gloo_body, "fastcomm": _fastcomm_body}
REFERENCE = {"Gloo send/recv": _exchange_body}


def measure(bodies, world, numel, k, iters, repeat, placement, failures, progress):
    return alternate_launches(bodies, world, (numel, k, iters, max(5, iters // 10), placement),
                              repeat, f"{world // 2} pair(s), {numel} elements", failures,
                              progress)


def write_plot(path, results):
    plt = pyplot_or_none(path)
    if plt is None:
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, kind, title in ((axes[0], "single_us", "single op per step"),
                            (axes[1], "batched_us", "k ops per step, batched")):
        for name in list(BODIES) + list(REFERENCE):
            for pairs in results["pairs"]:
                for k in (results["k"][:1] if kind == "single_us" else results["k"]):
                    pts = [(c["bytes"], c[name][kind]) for c in results["cells"]
                           if c["pairs"] == pairs and c["k"] == k and c.get(name)]
                    label = f"{name}, {pairs} pair(s)" + (f", k={k}" if kind == "batched_us" else "")
                    if pts:
                        ax.plot(*zip(*pts), marker="o", label=label)
        ax.set(xscale="log", yscale="log", xlabel="bytes per all_reduce", ylabel="µs per op",
               title=title)
        ax.legend(fontsize=7)
    save_plot(fig, path)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--sizes", type=int, nargs="+", default=[100, 2500, 262144],
                    help="float32 elements per tensor (100 = the MWE's 10x10)")
    ap.add_argument("--k", type=int, nargs="+", default=[8],
                    help="groups (ops) per batched step; several values: one row each")
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--placement", choices=["hosts", "free", "pairs"], default="hosts",
                    help="hosts: each simulated host on its own half of the CPUs (default); "
                         "free: the scheduler decides; pairs: both members of a pair on one CPU")
    ap.add_argument("--reference", action="store_true",
                    help="also time plain Gloo send/recv of the same bytes (see above)")
    ap.add_argument("--plot", metavar="FILE.png", help="write a plot (needs matplotlib)")
    ap.add_argument("--json", metavar="FILE", help="dump the raw numbers as JSON")
    add_launcher_arg(ap)
    args = ap.parse_args()
    use_launcher(args.launcher)
    bodies = dict(BODIES, **(REFERENCE if args.reference else {}))
    if min(args.pairs) < 1 or args.iters < 1 or args.repeat < 1 or min(args.k) < 1:
        ap.error("--pairs, --iters, --repeat and --k must be positive")
    torch.set_num_threads(1)
    t_start = time.monotonic()

    print_header("Cross-host pairs: fastcomm over Gloo vs torch Gloo")
    a, b = host_cpus(0, args.placement), host_cpus(1, args.placement)
    if args.placement == "pairs":
        where = "both members of each pair on one CPU (pair i on the i-th CPU, round robin)"
    elif a:
        where = f"host A on CPUs {sorted(a)}, host B on CPUs {sorted(b)}"
    else:
        where = "free (the scheduler places every rank)"
    print(f"- hosts simulated on this machine (FASTCOMM_HOST_ID), TCP over loopback; placement: "
          f"{where}")
    print(f"- float32 all_reduce, mean µs per op over the timed steps (max over ranks), median "
          f"of {args.repeat} launch(es), the launches of {', '.join(bodies)} alternating; "
          f"batched = k groups over the same pair per step (k = "
          f"{', '.join(map(str, args.k))}), at least {MIN_BATCHED_STEPS} steps\n", flush=True)
    results = {"command": sys.argv, "placement": args.placement, "k": args.k,
               "pairs": args.pairs, "cells": []}
    failures, rows, ref_rows = [], [], []
    progress = Progress(len(args.pairs) * len(args.sizes) * len(args.k) * len(bodies) * args.repeat)

    def share(x, ref, kind):
        return f"{x[kind] / ref[kind]:.2f}" if x and ref else "-"

    for P in args.pairs:
        for n in args.sizes:
            iters = args.iters if n * 4 <= 65536 else max(20, args.iters // 10)
            for k in args.k:
                cell = {"pairs": P, "bytes": 4 * n, "k": k, "iters": iters,
                        "batched_steps": batched_steps(iters, k)}
                cell.update(measure(bodies, 2 * P, n, k, iters, args.repeat, args.placement,
                                    failures, progress))
                results["cells"].append(cell)
                g, f, x = cell["torch Gloo"], cell["fastcomm"], cell.get("Gloo send/recv")
                rows.append([str(P), f"{4 * n:,}", str(k),
                             us_cell(g, "single_us"), us_cell(f, "single_us"),
                             ratio_cell(g, f, "single_us"),
                             us_cell(g, "batched_us"), us_cell(f, "batched_us"),
                             ratio_cell(g, f, "batched_us")])
                ref_rows.append([str(P), f"{4 * n:,}", str(k), us_cell(x, "single_us"),
                                 share(g, x, "single_us"), share(f, x, "single_us"),
                                 us_cell(x, "batched_us"), share(g, x, "batched_us"),
                                 share(f, x, "batched_us")])
    print_table(["pairs", "bytes", "k", "torch Gloo single", "fastcomm single", "ratio",
                 "torch Gloo batched (async)", "fastcomm batched (fc.batch)", "ratio"], rows)
    print("\nratio = torch Gloo's time / fastcomm's time (above 1: fastcomm is faster); in "
          "brackets, the launches in which fastcomm was the faster, of those run.")
    if args.reference:
        print("\nReference: the transport alone (Gloo send/recv of the same bytes, no reduction), "
              "µs per message, and each library's time divided by it:\n")
        print_table(["pairs", "bytes", "k", "Gloo send/recv single", "torch Gloo / it",
                     "fastcomm / it", "Gloo send/recv batched", "torch Gloo / it",
                     "fastcomm / it"], ref_rows)
    return finish(results, failures, t_start, "Total benchmark time", args.json, args.plot,
                  lambda path: write_plot(path, results))


if __name__ == "__main__":
    sys.exit(main())
