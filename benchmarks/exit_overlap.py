#!/usr/bin/env python
"""Ranks that exit while others still run, without fastcomm.

P pairs of ranks started by ``torch.multiprocessing.spawn`` (one session, so one scheduling
group), each rank importing torch as users' ranks do. A pair plays ping-pong through a counter
in shared memory for ``--iters`` rounds, each round on a fresh ``torch.randn(10, 10)`` as in
the forum loop, waiting the way Open MPI does with more ranks than cores (poll, then
``sched_yield``) or by sleeping in a blocking pipe read. The pairs that finish first exit,
and a torch process spends most of a second of CPU tearing its interpreter down: that CPU is
taken from the ranks still running. With ``exit: nice 19`` each rank lowers its priority at
exit; with ``exit: idle`` it switches to SCHED_IDLE there (what fastcomm does,
``FASTCOMM_EXIT_IDLE``), which a woken rank preempts at once. A pair's time is from its first
rank's start to its last rank's end; a launch is fair when every pair is within 2x of the
median pair.

Usage: ``python benchmarks/exit_overlap.py [--pairs 4] [--launches 6] [--iters 1024]``."""
from __future__ import annotations

import argparse
import atexit
import os
import statistics
import sys
import tempfile
import time
from multiprocessing import shared_memory

import numpy as np
import torch
import torch.multiprocessing as tmp

# (how a rank waits, how it exits)
_MODES = [("yield", "as is"), ("yield", "nice 19"), ("yield", "idle"), ("pipe", "as is"), ("pipe", "idle")]


def _exit_low():
    os.setpriority(os.PRIO_PROCESS, 0, 19)


def _exit_idle():
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))


def _rank(rank, world, shm_name, fifo_dir, wait, exit_how, iters):
    torch.set_num_threads(1)
    shm = shared_memory.SharedMemory(name=shm_name)
    # Pair p's counters at 2p, 2p + 1; then each rank's ready flag, start, and loop length.
    cell = np.ndarray((5 * world,), dtype=np.float64, buffer=shm.buf)
    ready, starts, lengths = 2 * world, 3 * world, 4 * world
    side = rank % 2
    mine, theirs = rank, rank ^ 1
    # FIFOs opened read-write never block at open, whoever comes first.
    rd = os.open(os.path.join(fifo_dir, str(rank)), os.O_RDWR)
    wr = os.open(os.path.join(fifo_dir, str(rank ^ 1)), os.O_RDWR)
    if exit_how != "as is":
        atexit.register(_exit_low if exit_how == "nice 19" else _exit_idle)

    def send(i):
        cell[mine] = i
        if wait == "pipe":
            os.write(wr, b"x")

    def await_peer(i):
        if wait == "pipe":
            os.read(rd, 1)
        while cell[theirs] < i:
            os.sched_yield()

    cell[ready + rank] = 1
    while not all(cell[ready:ready + world]):
        time.sleep(1e-4)
    start = time.monotonic()
    for i in range(1, iters + 1):
        torch.randn(10, 10)
        if side == 0:
            send(i)
            await_peer(i)
        else:
            await_peer(i)
            send(i)
    cell[lengths + rank] = time.monotonic() - start
    cell[starts + rank] = start
    del cell
    shm.close()
    os.close(rd)
    os.close(wr)


def _launch(pairs, wait, exit_how, iters):
    world = 2 * pairs
    shm = shared_memory.SharedMemory(create=True, size=8 * 5 * world)
    try:
        with tempfile.TemporaryDirectory(prefix="exit-overlap-") as fifo_dir:
            for r in range(world):
                os.mkfifo(os.path.join(fifo_dir, str(r)))
            cell = np.ndarray((5 * world,), dtype=np.float64, buffer=shm.buf)
            cell[:] = 0
            tmp.start_processes(_rank, args=(world, shm.name, fifo_dir, wait, exit_how, iters), nprocs=world,
                                start_method="spawn")
            starts, lengths = cell[3 * world:4 * world].copy(), cell[4 * world:].copy()
            del cell
    finally:
        shm.close()
        shm.unlink()
    ends = starts + lengths
    return [(max(ends[2 * p], ends[2 * p + 1]) - min(starts[2 * p], starts[2 * p + 1])) / iters * 1e6
            for p in range(pairs)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", type=int, default=4)
    ap.add_argument("--launches", type=int, default=6)
    ap.add_argument("--iters", type=int, default=1024)
    args = ap.parse_args()
    print(f"# {args.pairs} pairs, {args.iters} rounds, {os.cpu_count()} cores, "
          f"sched_autogroup_enabled={open('/proc/sys/kernel/sched_autogroup_enabled').read().strip()}"
          if os.path.exists("/proc/sys/kernel/sched_autogroup_enabled") else f"# {args.pairs} pairs")
    runs = {m: [] for m in _MODES}
    for i in range(args.launches):
        for m in _MODES:  # alternating, so that a burst of outside load hits every mode alike
            pt = _launch(args.pairs, m[0], m[1], args.iters)
            runs[m].append(pt)
            print(f"  launch {i + 1}, wait {m[0]}, exit {m[1]}: "
                  + " ".join(f"{x:.1f}" for x in pt) + " µs per round", file=sys.stderr, flush=True)
    print("\n| wait | exit | job µs per round (median) | median pair | worst launch (slowest / median pair) | fair launches |")
    print("| :--- | :--- | ---: | ---: | ---: | ---: |")
    for m, pts in runs.items():
        ratios = [max(p) / statistics.median(p) for p in pts]
        print(f"| {'poll + sched_yield' if m[0] == 'yield' else 'blocking pipe read'} | "
              f"{m[1]} | {statistics.median(max(p) for p in pts):.1f} | "
              f"{statistics.median(statistics.median(p) for p in pts):.1f} | {max(ratios):.2f}x | "
              f"{sum(r <= 2 for r in ratios)}/{len(pts)} |")


if __name__ == "__main__":
    main()
