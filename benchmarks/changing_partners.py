#!/usr/bin/env python
"""Changing partners, the shape of gossip training: fastcomm vs MPI (where installed).

W local ranks (default 4) make the same 20,000 groups of 2 to 4 random ranks at once, then walk
the same sequence of 2,000 of them, each rank all_reducing 64 float32 on the groups it is in
and skipping the others (benchmarks/_partners.py builds the workload from a seed). fastcomm
walks it twice, in separate launches:

- blocking: every op a blocking `fc.all_reduce`;
- mixed: every third op `async_op=True` and then waited for, every seventh a `fc.batch()` of
  one, the rest blocking (a program that mixes the three should not pay for it).

MPI (mpi4py, when it and mpirun are installed) walks it blocking, over communicators its
members make with `Comm.Create_group` for the groups the sequence uses.

Per op = the slowest rank's walk time / the ops that rank took part in. Each cell is the median
over --repeat launches (fresh processes, the libraries alternating, each repetition starting
one cell later than the last). The ratios are also given
launch by launch: each repetition runs the cells back to back, so its ratio compares runs of the
same minutes (this VM's speed drifts by a quarter from one minute to the next). The first ops of each
walk are checked against a reference afterwards, so a wrong result fails its cell. Usage:

    python benchmarks/changing_partners.py [--world 4] [--groups 20000] [--ops 2000]
                                           [--repeat 3] [--seed 1] [--json FILE]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

from _launch import add_launcher_arg, use_launcher  # noqa: E402
from _launch import (STORE_TIMEOUT, JobError, Progress, find_mpi, finish, print_header, print_table, run_job,
                     run_mpi_worker)
from _partners import NUMEL, issue_mode, workload

JOB_TIMEOUT_S = 300.0
MPI_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_mpi_partners.py")
CHECKED = 50
WARMUP = 50  # the first ops of the sequence (a prefix of it, the same on every rank)


def _fastcomm_body(store, rank, world, n_groups, n_ops, seed, mixed):
    import fastcomm as fc

    fc.init(store=store, rank=rank, world_size=world, timeout=STORE_TIMEOUT)
    try:
        groups, sequence = workload(world, n_groups, n_ops, seed)
        fc.barrier()
        t0 = time.perf_counter()
        handles = fc.new_groups(groups)
        setup = time.perf_counter() - t0

        def walk(ops, tensor_of):
            for i, gi in ops:
                g, t = handles[gi], tensor_of(i)
                how = issue_mode(i, mixed)
                if how == "blocking":
                    fc.all_reduce(t, group=g)
                elif how == "async":
                    fc.all_reduce(t, group=g, async_op=True).wait()
                else:
                    with fc.batch() as b:
                        fc.all_reduce(t, group=g)
                    b.wait()

        mine = [(i, gi) for i, gi in enumerate(sequence) if rank in groups[gi]]
        buf = torch.zeros(NUMEL)  # zeros: the sums stay 0 however many ops
        walk([(i, gi) for i, gi in mine if i < WARMUP], lambda i: buf)
        fc.barrier()
        t0 = time.perf_counter()
        walk(mine, lambda i: buf)
        elapsed = time.perf_counter() - t0

        checked = [(i, gi) for i, gi in mine if i < CHECKED]
        out = {i: torch.full((NUMEL,), float(rank + 1 + i)) for i, _ in checked}
        walk(checked, lambda i: out[i])
        for i, gi in checked:
            exp = float(sum(r + 1 + i for r in groups[gi]))
            if not torch.equal(out[i], torch.full((NUMEL,), exp)):
                raise AssertionError(f"rank {rank}: wrong all_reduce result at op {i}")
        return {"setup_s": setup, "walk_s": elapsed, "ops": len(mine)}
    finally:
        fc.shutdown()


def run_mpi(mpirun, world, n_groups, n_ops, seed):
    res = run_mpi_worker(mpirun, world, MPI_SCRIPT, [n_groups, n_ops, seed], JOB_TIMEOUT_S)
    return [{"setup_s": s, "walk_s": w, "ops": n} for s, w, n in zip(res["setup_s"], res["walk_s"], res["ops"])]


def per_op(ranks):
    """The slowest rank's walk time per op it took part in, in seconds."""
    slowest = max(ranks, key=lambda r: r["walk_s"])
    return slowest["walk_s"] / max(1, slowest["ops"])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--groups", type=int, default=20000)
    ap.add_argument("--ops", type=int, default=2000)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", metavar="FILE")
    add_launcher_arg(ap)
    args = ap.parse_args()
    use_launcher(args.launcher)
    torch.set_num_threads(1)
    t_start = time.monotonic()

    mpirun, mpi_note = find_mpi()
    cells = [("fastcomm blocking", lambda: run_job(_fastcomm_body, args.world, args.groups, args.ops, args.seed,
                                                   False, timeout=JOB_TIMEOUT_S)),
             ("fastcomm mixed", lambda: run_job(_fastcomm_body, args.world, args.groups, args.ops, args.seed,
                                                True, timeout=JOB_TIMEOUT_S))]
    if mpirun:
        cells.append(("MPI blocking", lambda: run_mpi(mpirun, args.world, args.groups, args.ops, args.seed)))
    progress = Progress(len(cells) * args.repeat)
    runs = {name: [] for name, _ in cells}
    by_rep = [{} for _ in range(args.repeat)]  # per repetition: cell -> µs per op
    failures = []
    for rep in range(args.repeat):
        # Each repetition starts one cell later: the launch that follows another job ran
        # slower in some hours, and a fixed order would charge that to the same cell each time.
        for name, launch in cells[rep % len(cells):] + cells[:rep % len(cells)]:
            progress.launch(f"{name}, launch {rep + 1}/{args.repeat}")
            try:
                runs[name].append(launch())
                by_rep[rep][name] = per_op(runs[name][-1]) * 1e6
            except JobError as e:
                failures.append(f"{name}: {e}")

    print_header("Changing partners: all_reduce over a sequence of random small groups")
    print(f"- workload: {args.world} ranks, {args.groups:,} groups of 2-{min(4, args.world)} random ranks, "
          f"a walk over {args.ops:,} of them, {NUMEL} float32 per all_reduce, seed {args.seed}")
    if not mpirun:
        print(f"- MPI skipped: {mpi_note}")
    else:
        print(f"- MPI: {mpi_note}")
    print()
    rows, results = [], {"args": vars(args), "cells": {}}
    for name, _ in cells:
        if not runs[name]:
            continue
        ops = [per_op(r) * 1e6 for r in runs[name]]
        setups = [max(x["setup_s"] for x in r) for r in runs[name]]
        results["cells"][name] = {"us_per_op": ops, "setup_s": setups}
        rows.append([name, f"{statistics.median(ops):,.1f}", ", ".join(f"{x:,.1f}" for x in ops),
                     f"{statistics.median(setups):.2f}"])
    print_table(["run", "µs per op (median)", "each launch", "groups made in (s)"], rows, left=1)
    med = {n: statistics.median(c["us_per_op"]) for n, c in results["cells"].items()}

    def ratio(num, den, what):
        if num not in med or den not in med:
            return
        each = [r[num] / r[den] for r in by_rep if num in r and den in r]
        results[f"{num} / {den}"] = each
        print(f"{what}: {med[num] / med[den]:.2f}x of the medians; launch by launch "
              f"{', '.join(f'{x:.2f}' for x in each)}, median {statistics.median(each):.2f}x")

    print()
    ratio("fastcomm mixed", "fastcomm blocking", "mixed / blocking (target: at most 1.2x)")
    ratio("MPI blocking", "fastcomm blocking",
          "MPI / fastcomm blocking (how many times faster fastcomm is; target: at least 1.5x)")
    print("\n\"groups made in\": fastcomm makes all the groups (fc.new_groups); MPI makes a communicator "
          "for each group the walk uses (Create_group, members only).")
    return finish(results, failures, t_start, "Total benchmark time", args.json, None, None)


if __name__ == "__main__":
    sys.exit(main())
