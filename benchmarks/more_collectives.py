#!/usr/bin/env python
"""all_to_all_single, gather, scatter and reduce over small groups: fastcomm vs torch Gloo.

1. all_to_all_single inside groups of 4 ranks, 4 KB per peer (1024 float32 to each member,
   16 KB in and out per rank), for 1 group (world 4) and, with ``--groups 1 2``, 2 disjoint
   groups of 4 running at once (world 8);
2. gather, scatter and reduce in pairs [0, 1], [2, 3], ... of a 10x10 float32 tensor (the
   forum MWE's size), root = the pair's lower rank, for ``--pairs`` pairs at once.

Per-op time = the max over ranks of each rank's mean over a timed loop, the best of 3 loops
(after warm-up; all ranks start each loop together after a barrier; the machine may be shared).
Each launch is repeated ``--repeat`` times (fresh processes, fastcomm and Gloo alternating) and
the median reported. Gloo groups come from ``dist.new_group`` (created by every rank, as torch
requires), fastcomm's from ``fc.new_group`` (created by their members only). Every op's result
is checked once after its timed loop, so a broken op fails its cell instead of being timed.
Usage, from the repository root:

    python benchmarks/more_collectives.py [--quick] [--iters N] [--repeat R] [--groups 1 2]
                                          [--pairs 1 2] [--json FILE]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

from _launch import add_launcher_arg, use_launcher  # noqa: E402
from _launch import (STORE_TIMEOUT, JobError, timed_loops, cpu_model, finish, print_header, print_table,
                     run_job)

JOB_TIMEOUT_S = 300.0  # hard limit for one launch (all its ranks); a hang fails that cell only
A2A_PER_PEER = 1024  # float32 elements each rank sends each member: 4 KB
PAIR_NUMEL = 10 * 10
PAIR_OPS = ("gather", "scatter", "reduce")


# --------------------------------------------------------------------------------------------
# The ops, spelled alike for both libraries (fastcomm's names and arguments are torch's)
# --------------------------------------------------------------------------------------------

def _value(rank, j, n):
    """Distinct per rank, slot and element; exact in float32."""
    return torch.arange(n, dtype=torch.float32) + 1000 * j + 100_000 * rank


def _pair_op(lib, name, group, rank, lo):
    """(step, check) for one of PAIR_OPS in the pair [lo, lo + 1], root lo."""
    me = rank - lo
    t = torch.zeros(PAIR_NUMEL)
    lst = [torch.zeros(PAIR_NUMEL) for _ in range(2)] if rank == lo else None
    if name == "gather":
        def step():
            lib.gather(t, lst, dst=lo, group=group)

        def check():
            t.copy_(_value(rank, 0, PAIR_NUMEL))
            step()
            if rank == lo:
                for i in range(2):
                    assert torch.equal(lst[i], _value(lo + i, 0, PAIR_NUMEL)), f"gather [{i}]"
    elif name == "scatter":
        def step():
            lib.scatter(t, lst, src=lo, group=group)

        def check():
            if rank == lo:
                for i in range(2):
                    lst[i].copy_(_value(lo, i, PAIR_NUMEL))
            step()
            assert torch.equal(t, _value(lo, me, PAIR_NUMEL)), "scatter"
    else:
        def step():  # zeros: the sum stays 0 however many steps
            lib.reduce(t, dst=lo, group=group)

        def check():
            t.copy_(_value(rank, 0, PAIR_NUMEL))
            step()
            if rank == lo:  # (Gloo leaves the other member's tensor undefined)
                assert torch.equal(t, _value(lo, 0, PAIR_NUMEL) + _value(lo + 1, 0, PAIR_NUMEL)), "reduce"
    return step, check


def _a2a_op(lib, group, rank, members):
    k = len(members)
    inp = torch.zeros(k * A2A_PER_PEER)
    out = torch.zeros(k * A2A_PER_PEER)

    def step():
        lib.all_to_all_single(out, inp, group=group)

    def check():
        inp.copy_(torch.cat([_value(rank, q, A2A_PER_PEER) for q in members]))
        step()
        want = torch.cat([_value(q, rank, A2A_PER_PEER) for q in members])
        assert torch.equal(out, want), "all_to_all_single"
    return step, check


def _body(store, rank, world, lib_name, part, iters, warmup):
    """{op: (mean, best loop's) seconds per op} on this rank for part "a2a" (groups of 4) or
    "pairs"."""
    size = 4 if part == "a2a" else 2
    lo = size * (rank // size)
    members = list(range(lo, lo + size))
    if lib_name == "fastcomm":
        import fastcomm as lib

        lib.init(store=store, rank=rank, world_size=world, timeout=STORE_TIMEOUT)
        group = lib.new_group(members)  # only the members call this
    else:
        lib = dist
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=STORE_TIMEOUT)
        # torch requires every rank to create every group, in the same order, members or not.
        group = [dist.new_group(list(range(s, s + size))) for s in range(0, world, size)][rank // size]
    try:
        ops = {"all_to_all_single": _a2a_op(lib, group, rank, members)} if part == "a2a" else {
            name: _pair_op(lib, name, group, rank, lo) for name in PAIR_OPS}
        out = {}
        for name, (step, check) in ops.items():
            out[name] = timed_loops(step, lib.barrier, iters, warmup)
            check()
        return out
    finally:
        if lib_name == "fastcomm":
            lib.shutdown()
        else:
            dist.destroy_process_group()


# --------------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------------

def measure(part, world, iters, warmup, repeat, failures):
    """{lib: {op: median over launches of the max over ranks (s)}}; a failed lib is None."""
    runs = {"gloo": [], "fastcomm": []}
    for _ in range(repeat):
        for lib in runs:
            if runs[lib] is None:
                continue
            print(f"  running {part}, world {world}, {lib} ...", file=sys.stderr, flush=True)
            try:
                res = run_job(_body, world, lib, part, iters[lib], warmup, timeout=JOB_TIMEOUT_S)
            except JobError as e:
                failures.append(f"{part}, world {world}, {lib}: {e}")
                runs[lib] = None
                continue
            runs[lib].append({op: [max(r[op][i] for r in res) for i in (0, 1)] for op in res[0]})
    return {lib: None if r is None else {op: [statistics.median(x[op][i] for x in r) for i in (0, 1)] for op in r[0]}
            for lib, r in runs.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="short run (fewer timed ops, 1 launch)")
    ap.add_argument("--iters", type=int, help="timed ops per loop for fastcomm (Gloo: a quarter)")
    ap.add_argument("--repeat", type=int, help="launches per cell (median reported)")
    ap.add_argument("--groups", type=int, nargs="*", default=[1],
                    help="groups of 4 for all_to_all_single (none: skip)")
    ap.add_argument("--pairs", type=int, nargs="*", default=[1],
                    help="pairs for gather/scatter/reduce (none: skip)")
    ap.add_argument("--json", metavar="FILE", help="dump the raw numbers as JSON")
    add_launcher_arg(ap)
    args = ap.parse_args()
    use_launcher(args.launcher)
    fc_iters = args.iters or (300 if args.quick else 2000)
    iters = {"fastcomm": fc_iters, "gloo": max(20, fc_iters // 4)}
    repeat = args.repeat or (1 if args.quick else 3)
    warmup = 20 if args.quick else 100

    torch.set_num_threads(1)
    t_start = time.monotonic()
    print_header("fastcomm benchmark: all_to_all_single, gather, scatter, reduce over small groups")
    print(f"- timed ops per loop: fastcomm {iters['fastcomm']}, Gloo {iters['gloo']}; {repeat} launch(es) "
          f"per cell, median reported\n", flush=True)

    failures = []
    results = {"command": sys.argv, "cores": os.cpu_count(), "cpu": cpu_model(), "torch": torch.__version__,
               "cells": []}
    rows = []
    for part, counts, per in (("a2a", args.groups, 4), ("pairs", args.pairs, 2)):
        for c in counts:
            world = c * per
            got = measure(part, world, iters, warmup, repeat, failures)
            ops = ("all_to_all_single",) if part == "a2a" else PAIR_OPS
            for op in ops:
                g, gb = got["gloo"][op] if got["gloo"] else (None, None)
                f, fb = got["fastcomm"][op] if got["fastcomm"] else (None, None)
                what = (f"{c} group{'s' if c > 1 else ''} of 4, 4 KB per peer" if part == "a2a"
                        else f"{c} pair{'s' if c > 1 else ''}, 10x10 float32")
                results["cells"].append({"op": op, "groups": c, "world": world, "gloo_s": g, "fastcomm_s": f,
                                         "gloo_best_s": gb, "fastcomm_best_s": fb})
                rows.append([op, what, str(world), "failed" if g is None else f"{g * 1e6:,.1f}",
                             "failed" if f is None else f"{f * 1e6:,.1f}",
                             "-" if g is None or f is None else f"{g / f:,.1f}x",
                             "-" if fb is None else f"{fb * 1e6:,.1f}"])
    print_table(["op", "groups", "ranks", "torch Gloo µs/op", "fastcomm µs/op", "Gloo / fastcomm",
                 "fastcomm best loop µs/op"], rows, left=2)
    print("\nµs/op: the mean over a launch's 3 timed loops (max over ranks, median over launches); "
          "best loop: the fastest of those loops.")
    print("\nGloo / fastcomm > 1: fastcomm is that many times faster.")
    return finish(results, failures, t_start, "Total benchmark time", args.json, None, None)


if __name__ == "__main__":
    sys.exit(main())
