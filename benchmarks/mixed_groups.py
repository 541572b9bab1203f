#!/usr/bin/env python
"""Mixed groups: one group over several hosts with several members per host, fastcomm's
hierarchical all_reduce vs its flat one vs torch Gloo.

Hosts are simulated on this machine with FASTCOMM_HOST_ID (``--hosts AABB``: ranks 0 and 1 on
host A, 2 and 3 on host B). Each host gets its own share of the CPUs, as separate machines
would (``--placement free`` leaves it to the scheduler). Three forms of the same all_reduce over
the group of all ranks:

- torch Gloo: ``dist.all_reduce`` on the world group (every byte over TCP, inside a host too);
- fastcomm, flat (``FASTCOMM_HIERARCHICAL=0``): every member exchanges with every other, over
  shared memory inside a host and over Gloo between hosts;
- fastcomm, hierarchical (the default): each host's members reduce into the host's lowest rank
  over shared memory, those leaders all-reduce over Gloo, and each copies the result back.

Two loops per size: one all_reduce per step, and k groups over the same ranks with one
all_reduce each per step (torch: async_op=True, then wait for all; fastcomm: one ``fc.batch``).
Reported: the mean step time divided by the ops in it (µs per op), max over ranks, median
over --repeat launches, the forms' launches alternating. Every loop ends with a checked op.

    python benchmarks/mixed_groups.py [--hosts AABB] [--sizes 100 2500 262144] [--k 8]
                                      [--iters 300] [--repeat 3] [--placement hosts|free]
                                      [--json FILE] [--plot FILE.png]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _launch import add_launcher_arg, use_launcher  # noqa: E402
from _launch import (STORE_TIMEOUT, Progress, all_reduce_steps, alternate_launches,  # noqa: E402
                     batched_steps, finish, print_header, print_table, pyplot_or_none,
                     ratio_cell, save_plot, us_cell)


def host_cpus(rank, hosts, placement):
    """Under placement "hosts", the CPUs of rank's simulated host: the machine's CPUs dealt out
    to the hosts in order of first appearance (a host may get one CPU of several, or share one
    when there are more hosts than CPUs); else None (any CPU)."""
    cpus = sorted(os.sched_getaffinity(0))
    if placement != "hosts":
        return None
    order = list(dict.fromkeys(hosts))
    i, H = order.index(hosts[rank]), len(order)
    if len(cpus) >= H:
        per = len(cpus) // H
        return set(cpus[i * per:(i + 1) * per])
    return {cpus[i % len(cpus)]}


def _gloo_body(store, rank, world, hosts, numel, k, iters, warmup, placement):
    cpus = host_cpus(rank, hosts, placement)
    if cpus:
        os.sched_setaffinity(0, cpus)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=STORE_TIMEOUT)
    try:
        groups = [dist.new_group(list(range(world))) for _ in range(k)]
        everyone = range(world)
        single = all_reduce_steps(dist.all_reduce, groups[:1], numel, rank, everyone, iters, warmup)
        batched = all_reduce_steps(dist.all_reduce, groups, numel, rank, everyone, batched_steps(iters, k),
                                   warmup, async_wait=True)
        dist.barrier()
        return single, batched
    finally:
        dist.destroy_process_group()


def _fastcomm_body(store, rank, world, hosts, numel, k, iters, warmup, placement, hierarchical):
    cpus = host_cpus(rank, hosts, placement)
    if cpus:
        os.sched_setaffinity(0, cpus)
    os.environ["FASTCOMM_HOST_ID"] = "bench-host-" + hosts[rank]
    os.environ["FASTCOMM_HIERARCHICAL"] = "1" if hierarchical else "0"
    import fastcomm as fc

    fc.init(store=store, rank=rank, world_size=world, timeout=STORE_TIMEOUT)
    try:
        groups = fc.new_groups([list(range(world))] * k)
        everyone = range(world)
        single = all_reduce_steps(fc.all_reduce, groups[:1], numel, rank, everyone, iters, warmup)
        batched = all_reduce_steps(fc.all_reduce, groups, numel, rank, everyone, batched_steps(iters, k),
                                   warmup, batch=fc.batch)
        fc.barrier()
        return single, batched
    finally:
        fc.shutdown()


def _flat(store, rank, world, *args):
    return _fastcomm_body(store, rank, world, *args, hierarchical=False)


def _hier(store, rank, world, *args):
    return _fastcomm_body(store, rank, world, *args, hierarchical=True)


BODIES = {"torch Gloo": _gloo_body, "fastcomm flat": _flat, "fastcomm hierarchical": _hier}


def measure(hosts, numel, k, iters, repeat, placement, failures, progress):
    return alternate_launches(BODIES, len(hosts), (hosts, numel, k, iters, max(5, iters // 10), placement),
                              repeat, f"{numel} elements", failures, progress)


def write_plot(path, results):
    plt = pyplot_or_none(path)
    if plt is None:
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, kind, title in ((axes[0], "single_us", "one all_reduce per step"),
                            (axes[1], "batched_us", f"k = {results['k']} per step")):
        for name in BODIES:
            pts = [(c["bytes"], c[name][kind]) for c in results["cells"] if c.get(name)]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=name)
        ax.set(xscale="log", yscale="log", xlabel="bytes per all_reduce", ylabel="µs per op", title=title)
        ax.legend(fontsize=7)
    save_plot(fig, path)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hosts", default="AABB", help="one letter per rank: its host")
    ap.add_argument("--sizes", type=int, nargs="+", default=[100, 2500, 262144],
                    help="float32 elements per tensor")
    ap.add_argument("--k", type=int, default=8, help="groups (ops) per batched step")
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--placement", choices=["hosts", "free"], default="hosts")
    ap.add_argument("--plot", metavar="FILE.png", help="write a plot (needs matplotlib)")
    ap.add_argument("--json", metavar="FILE", help="dump the raw numbers as JSON")
    add_launcher_arg(ap)
    args = ap.parse_args()
    use_launcher(args.launcher)
    hosts = list(args.hosts)
    if len(hosts) < 2 or args.iters < 1 or args.repeat < 1 or args.k < 1:
        ap.error("--hosts needs 2+ ranks; --iters, --repeat and --k must be positive")
    torch.set_num_threads(1)
    t_start = time.monotonic()

    print_header("Mixed groups: fastcomm hierarchical vs flat vs torch Gloo")
    where = ", ".join(f"host {h}: ranks {[r for r in range(len(hosts)) if hosts[r] == h]}"
                      + (f" on CPUs {sorted(host_cpus(hosts.index(h), hosts, args.placement))}"
                         if args.placement == "hosts" else "")
                      for h in dict.fromkeys(hosts))
    print(f"- hosts simulated on this machine (FASTCOMM_HOST_ID), TCP over loopback; {where}")
    print(f"- float32 all_reduce over all {len(hosts)} ranks, mean µs per op (max over ranks), "
          f"median of {args.repeat} launch(es), forms alternating; batched = {args.k} groups "
          f"over the same ranks per step\n", flush=True)
    results = {"command": sys.argv, "hosts": args.hosts, "placement": args.placement, "k": args.k,
               "cells": []}
    failures, rows = [], []
    progress = Progress(len(args.sizes) * len(BODIES) * args.repeat)

    for n in args.sizes:
        iters = args.iters if n * 4 <= 65536 else max(20, args.iters // 10)
        cell = {"bytes": 4 * n, "iters": iters}
        cell.update(measure(hosts, n, args.k, iters, args.repeat, args.placement, failures,
                            progress))
        results["cells"].append(cell)
        g, f, h = cell["torch Gloo"], cell["fastcomm flat"], cell["fastcomm hierarchical"]
        for kind, label in (("single_us", "single"), ("batched_us", f"batched, k={args.k}")):
            rows.append([f"{4 * n:,}", label, us_cell(g, kind), us_cell(f, kind),
                         us_cell(h, kind), ratio_cell(g, h, kind), ratio_cell(f, h, kind)])
    print_table(["bytes", "loop", "torch Gloo", "fastcomm flat", "fastcomm hierarchical",
                 "torch / hier.", "flat / hier."], rows)
    print("\nratios above 1: the hierarchical form is faster; in brackets, the launches in which "
          "it was the faster, of those run.")
    return finish(results, failures, t_start, "Total benchmark time", args.json, args.plot,
                  lambda path: write_plot(path, results))


if __name__ == "__main__":
    sys.exit(main())
