#!/usr/bin/env python
"""The forum MWE through torch.distributed on the "fastcomm" backend, vs fastcomm's own API.

The forum thread "Improving inter-process communication costs for pytorch.distributed" times
1024 all_reduces of a 10x10 float32 tensor on pairwise groups [0,1], [2,3], ... . Here that
loop runs three ways on the same engine, on local processes this script launches itself:

- ``dist.all_reduce``: the MWE unchanged (``dist.init_process_group("fastcomm")``, every rank
  creates every pair with ``dist.new_group``, ``dist.all_reduce(t, group=g)`` in the loop);
- ``pg.allreduce``: the same group's ProcessGroup called directly
  (``pg.allreduce([t], opts).wait()``), which skips the Python wrapper of ``dist.all_reduce``
  but keeps torch's C++ path (ProcessGroup, op dispatcher, Backend);
- ``fc.all_reduce``: fastcomm's native API (``fc.init``, ``fc.new_group``);
- ``fake``: ``dist.all_reduce`` on torch's own do-nothing backend ("fake", a C++ Backend from
  ``torch.testing._internal.distributed.fake_pg``, registered through the same creator hook as
  fastcomm's), which costs torch's layers and nothing else.

The difference between the first and the last is the cost of going through torch.distributed;
the middle column splits it into torch's Python layer (dist - pg) and its C++ path (pg - fc).
In the group of one, what the backend adds beyond torch's layers (fake) and the op itself (fc)
is dist - fake - fc.
Pair count 0 runs one rank alone in a group of one (no communication at all), which isolates
that per-call overhead from the noise of the communication itself.
Time per op = the max over ranks of each rank's mean over the timed loop (all pairs run at
once), the median over ``--repeats`` timed loops. Every mode's result is checked once after
timing. Usage, from the repository root:

    python benchmarks/backend_mwe.py [--pairs 1 2 4] [--iters 1024] [--repeats 5]
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import torch
import torch.distributed as dist

from _launch import add_launcher_arg, use_launcher  # noqa: E402
from _launch import (STORE_TIMEOUT, JobError, Progress, assert_no_children, command, print_table,
                     run_job)

JOB_TIMEOUT_S = 180.0  # hard limit for one launch, all its ranks
NUMEL = 10 * 10
MODES = ("dist.all_reduce", "pg.allreduce", "fc.all_reduce", "fake")


def _loop(op, barrier, iters, warmup, repeats):
    """Seconds per op of ``op()`` for each of ``repeats`` timed loops."""
    for _ in range(warmup):
        op()
    times = []
    for _ in range(repeats):
        barrier()  # every pair enters the loop together and contends for the cores, as in the MWE
        start = time.perf_counter()
        for _ in range(iters):
            op()
        times.append((time.perf_counter() - start) / iters)
    return times


def _members(rank, world):
    """The rank's pair, or the one-rank group of the 1-rank overhead run."""
    lo = 2 * (rank // 2)
    return [lo, lo + 1] if world > 1 else [0]


def _check(all_reduce_t, rank, world):
    members = _members(rank, world)
    t = torch.arange(NUMEL, dtype=torch.float32).view(10, 10) + rank
    all_reduce_t(t)
    expected = len(members) * torch.arange(NUMEL, dtype=torch.float32).view(10, 10) + sum(members)
    if not torch.equal(t, expected):
        raise AssertionError(f"rank {rank}: wrong all_reduce result")


def body(store, rank, world, mode, iters, warmup, repeats):
    import fastcomm as fc  # registers the "fastcomm" torch.distributed backend

    t = torch.zeros(10, 10)  # zeros: the sum stays 0 however many ops run
    if mode == "fc.all_reduce":
        fc.init(store=store, rank=rank, world_size=world, timeout=STORE_TIMEOUT)
        try:
            g = fc.new_group(_members(rank, world))
            times = _loop(lambda: fc.all_reduce(t, group=g), fc.barrier, iters, warmup, repeats)
            _check(lambda x: fc.all_reduce(x, group=g), rank, world)
        finally:
            fc.shutdown()
        return times
    if mode == "fake":
        from torch.testing._internal.distributed.fake_pg import FakeStore  # registers "fake"

        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
        try:
            groups = [dist.new_group([2 * i, 2 * i + 1]) for i in range(world // 2)]
            g = groups[rank // 2] if world > 1 else dist.new_group([0])
            # Nothing to check: the fake backend leaves the tensor as it is.
            return _loop(lambda: dist.all_reduce(t, group=g), lambda: None, iters, warmup, repeats)
        finally:
            dist.destroy_process_group()
    # The forum MWE: every rank creates every pair group, then all_reduces on its own.
    dist.init_process_group("fastcomm", store=store, rank=rank, world_size=world, timeout=STORE_TIMEOUT)
    try:
        groups = [dist.new_group([2 * i, 2 * i + 1]) for i in range(world // 2)]
        g = groups[rank // 2] if world > 1 else dist.new_group([0])
        if mode == "dist.all_reduce":
            op = lambda: dist.all_reduce(t, group=g)  # noqa: E731
        else:
            opts = dist.AllreduceOptions()
            opts.reduceOp = dist.ReduceOp.SUM
            opts.asyncOp = False
            op = lambda: g.allreduce([t], opts).wait()  # noqa: E731
        times = _loop(op, dist.barrier, iters, warmup, repeats)
        _check(lambda x: dist.all_reduce(x, group=g), rank, world)
    finally:
        dist.destroy_process_group()
    return times


def measure(pairs, mode, iters, warmup, repeats):
    per_rank = run_job(body, max(1, 2 * pairs), mode, iters, warmup, repeats,
                       timeout=JOB_TIMEOUT_S)
    # per repeat: the slowest rank's mean; then the median over repeats
    return statistics.median(max(r[i] for r in per_rank) for i in range(repeats))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", type=int, nargs="+", default=[0, 1, 2, 4],
                    help="pair counts; 0 = one rank alone in a group of one: no communication, "
                         "so the three columns differ by call overhead only")
    ap.add_argument("--iters", type=int, default=1024, help="all_reduces per timed loop (the MWE's 1024)")
    ap.add_argument("--repeats", type=int, default=5, help="timed loops per launch (median reported)")
    ap.add_argument("--warmup", type=int, default=100)
    add_launcher_arg(ap)
    args = ap.parse_args()
    use_launcher(args.launcher)
    torch.set_num_threads(1)

    print("# The forum MWE through torch.distributed (backend \"fastcomm\") vs fastcomm's API\n")
    print(f"- command: {command()}")
    print(f"- machine: {os.cpu_count()} cores, {platform.system()} {platform.release()}; "
          f"torch {torch.__version__}, Python {platform.python_version()}")
    print(f"- 10x10 float32 all_reduce(SUM) per pair; {args.iters} timed ops x {args.repeats} "
          f"loops after {args.warmup} warm-up ops; µs/op = median over loops of the slowest "
          f"rank's mean\n", flush=True)

    rows, failed = [], False
    progress = Progress(len(args.pairs) * len(MODES))
    for pairs in args.pairs:
        cells = {}
        for mode in MODES:
            progress.launch(f"{pairs} pair(s), {mode}")
            try:
                cells[mode] = measure(pairs, mode, args.iters, args.warmup, args.repeats)
            except JobError as e:
                print(f"  !! {pairs} pair(s), {mode}: {e}", file=sys.stderr, flush=True)
                cells[mode] = None
                failed = True
        rows.append((pairs, cells))

    head = ["pairs", "ranks", "dist.all_reduce µs/op", "pg.allreduce µs/op", "fc.all_reduce µs/op",
            "fake µs/op", "torch overhead µs/op (dist - fc)", "of which Python (dist - pg)",
            "of which C++ (pg - fc)", "backend's own (dist - fake - fc)", "dist / fc"]

    def us(x):
        return "FAILED" if x is None else f"{x * 1e6:,.2f}"

    def diff(a, b):
        return "n/a" if a is None or b is None else f"{(a - b) * 1e6:+,.2f}"

    table = []
    for pairs, c in rows:
        d, p, f, k = c["dist.all_reduce"], c["pg.allreduce"], c["fc.all_reduce"], c["fake"]
        ratio = "n/a" if d is None or f is None else f"{d / f:.2f}x"
        own = "n/a" if None in (d, f, k) else f"{(d - k - f) * 1e6:+,.2f}"
        table.append([str(pairs) if pairs else "0 (alone)", str(max(1, 2 * pairs)), us(d), us(p),
                      us(f), us(k), diff(d, f), diff(d, p), diff(p, f), own, ratio])
    print_table(head, table)
    if 0 in args.pairs:
        print("\nRow \"0 (alone)\": one rank, a group of one, so no data moves: the columns differ "
              "only by what each API costs per call.")
    assert_no_children()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
