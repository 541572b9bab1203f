#!/usr/bin/env python
"""Where one pair's small all_reduce spends its time: the forum loop taken apart.

Two local ranks (spawned, as the forum post starts them, unless --launcher) run, one after
another in every round, loops of ``--iters`` calls of:

- ``forum loop``: ``fc.all_reduce(torch.randn(10, 10), group=pair)``, the post's loop;
- ``torch.randn(10, 10)``: the loop's tensor alone, no communication;
- ``pair all_reduce``: ``fc.all_reduce(t, group=pair)`` on one reused 10x10 tensor;
- ``group of one``: the same call on a group holding only this rank: the Python call, the
  binding and the engine's own work for an op, with no peer to exchange with;
- ``fc.get_rank()``: a call of the Python API that reaches no engine (the floor of any call).

Both ranks enter each loop together (a barrier), so the loops without a peer run on both cores
at once as the pair's do. A loop's time is the max over ranks of its mean per call, and the
table gives the median over ``--repeat`` rounds. ``forum loop - pair all_reduce`` is what the
fresh tensor costs the loop. With mpi4py and mpirun installed, Open MPI's loops run the same two
ways (reused buffer, fresh array per call) for comparison. ``--perf`` also profiles rank 0
during an extra pair loop with ``perf record -g`` (where perf exists and the kernel allows it):
the share of samples polling for the peer's message, in the fold, in Python and in torch, and
the symbols above 1 %. Usage, from the repository root:

    python benchmarks/pair_breakdown.py [--iters 20000] [--repeat 5] [--perf] [--json FILE]
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from _launch import (JobError, add_launcher_arg, find_mpi, finish, print_header, print_table,
                     run_job, run_mpi_worker, use_launcher)

MPI_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_mpi_pairs.py")
SHAPE = (10, 10)
LOOPS = ("forum loop", "torch.randn(10, 10)", "pair all_reduce", "group of one", "fc.get_rank()")
PERF_SECONDS = 3.0


# Where a sample's symbol belongs, first match wins: (category, dso part, symbol part).
CATEGORIES = (
    ("polling for the peer's message", "_C", ("peek", "step_alone", "cpu_relax")),
    ("the fold", "_C", ("kernel_", "reduce_into", "fold")),
    ("fastcomm, the rest", "_C", ("",)),
    ("Python", "python", ("",)),
    ("torch", "libtorch", ("",)),
    ("torch", "libc10", ("",)),
    ("libc (malloc, locks, copies)", "libc", ("",)),
    ("the kernel", "kernel", ("",)),
)


def _perf(pid, seconds):
    """(share of samples per category, the symbols above 1 %) of ``perf record -g`` on process
    ``pid`` for ``seconds``, or (None, why there is no profile)."""
    perf = shutil.which("perf")
    if perf is None:
        return None, "no profile: perf is not installed"
    with tempfile.TemporaryDirectory() as d:
        data = os.path.join(d, "perf.data")
        rec = subprocess.run([perf, "record", "-q", "-g", "-o", data, "-p", str(pid), "--", "sleep",
                              str(seconds)], capture_output=True, text=True)
        if rec.returncode != 0 or not os.path.exists(data):
            return None, f"no profile: perf record failed ({(rec.stderr or '').strip()[-300:]})"
        rep = subprocess.run([perf, "report", "-i", data, "--stdio", "--no-children", "-g", "none",
                              "--sort", "dso,symbol"], capture_output=True, text=True)
    shares, top = {}, []
    for ln in rep.stdout.splitlines():
        m = re.match(r"\s*([0-9.]+)%\s+(\S+)\s+\[[.k]\]\s+(.*?)(\s+-\s+-)?\s*$", ln)
        if not m:
            continue
        pct, dso, sym = float(m.group(1)), m.group(2), m.group(3)
        cat = next((c for c, d_part, syms in CATEGORIES
                    if d_part in dso and any(x in sym for x in syms)), "other")
        shares[cat] = shares.get(cat, 0.0) + pct
        if pct >= 1.0:
            top.append(f"{pct:6.2f}%  {dso}  {sym}")
    if not shares:
        return None, f"no profile: empty report ({rep.stderr.strip()[-200:]})"
    return shares, "\n".join(top)


def _body(store, rank, world, iters, repeat, perf):
    import threading

    import fastcomm as fc

    fc.init(store=store, rank=rank, world_size=world)
    try:
        pair = fc.new_group([0, 1])
        solo = fc.new_group([rank])
        t = torch.zeros(*SHAPE)
        loops = {
            "forum loop": lambda: fc.all_reduce(torch.randn(*SHAPE), group=pair),
            "torch.randn(10, 10)": lambda: torch.randn(*SHAPE),
            "pair all_reduce": lambda: fc.all_reduce(t, group=pair),
            "group of one": lambda: fc.all_reduce(t, group=solo),
            "fc.get_rank()": fc.get_rank,
        }
        for call in loops.values():  # warm-up: first calls allocate and fault pages in
            for _ in range(200):
                call()
        times = {name: [] for name in loops}
        for _ in range(repeat):
            for name, call in loops.items():
                fc.barrier(group=pair)
                fc.barrier(group=pair)  # the second finds both ranks awake (see forum_mwe.py)
                start = time.perf_counter()
                for _ in range(iters):
                    call()
                times[name].append((time.perf_counter() - start) / iters)
        profile = None
        if perf:
            # An extra pair loop long enough for the profile; rank 0 profiles itself from a
            # thread that only waits for perf, so the samples are the loop's.
            box = {}
            fc.barrier(group=pair)
            if rank == 0:
                th = threading.Thread(target=lambda: box.setdefault("perf", _perf(os.getpid(), PERF_SECONDS)))
                th.start()
            deadline = time.monotonic() + PERF_SECONDS + 1.0
            while True:  # both ranks stop together: the flag travels in the all_reduce itself
                flag = torch.tensor([1.0 if time.monotonic() < deadline else 0.0])
                fc.all_reduce(flag, op=fc.ReduceOp.MIN, group=pair)
                if flag.item() == 0.0:
                    break
                for _ in range(1000):
                    fc.all_reduce(t, group=pair)
            if rank == 0:
                th.join()
                profile = box.get("perf")
        # The timed loops' result, checked: distinct values per element and rank.
        base = torch.arange(100, dtype=torch.float32).reshape(*SHAPE)
        x = base + (rank + 1)
        fc.all_reduce(x, group=pair)
        if not torch.equal(x, 2 * base + 3):
            raise AssertionError(f"rank {rank}: wrong pair all_reduce result")
        return {"times": times, "profile": profile}
    finally:
        fc.shutdown()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iters", type=int, default=20000, help="calls per timed loop (default 20000)")
    ap.add_argument("--repeat", type=int, default=5, help="rounds of every loop (default 5); the median is reported")
    ap.add_argument("--perf", action="store_true", help="profile rank 0 in an extra pair loop (perf record -g)")
    ap.add_argument("--json", metavar="FILE", help="dump the raw numbers as JSON")
    ap.add_argument("--job-timeout", type=float, default=300.0, help="hard limit for the launch, seconds")
    add_launcher_arg(ap, default="spawn")
    args = ap.parse_args()
    use_launcher(args.launcher)
    torch.set_num_threads(1)
    t_start = time.monotonic()
    print_header("fastcomm benchmark: one pair's small all_reduce taken apart")
    results, failures = {"us": {}, "mpi_us": {}}, []
    try:
        res = run_job(_body, 2, args.iters, args.repeat, args.perf, timeout=args.job_timeout)
    except JobError as e:
        failures.append(f"fastcomm: {e}")
        res = None
    if res:
        for name in LOOPS:
            per_round = [max(r["times"][name][i] for r in res) for i in range(args.repeat)]
            results["us"][name] = statistics.median(per_round) * 1e6
            results["us"][name + " rounds"] = [x * 1e6 for x in per_round]
        results["profile"] = res[0]["profile"]
    mpirun, mpi_info = find_mpi()
    if mpirun is not None:
        for kind, label in (("same", "pair all_reduce"), ("fresh", "forum loop")):
            runs = []
            for _ in range(args.repeat):
                try:
                    out = run_mpi_worker(mpirun, 2, MPI_SCRIPT, [100, args.iters, 0 if kind == "fresh" else 200, kind],
                                         args.job_timeout)
                    runs.append(max(out["per_op_s"]))
                except JobError as e:
                    failures.append(f"MPI {label}: {e}")
                    break
            if runs:
                results["mpi_us"][label] = statistics.median(runs) * 1e6
    print(f"\n- MPI: {mpi_info}")
    print(f"\n## A pair's 10x10 float32 all_reduce, 2 ranks ({args.iters} calls per loop, median of "
          f"{args.repeat} rounds; a round's time: the max over ranks of each rank's mean)\n")
    us = results["us"]
    if us:
        rows = [[name, f"{us[name]:.3f}", f"{results['mpi_us'][name]:.3f}" if name in results["mpi_us"] else "-",
                 ", ".join(f"{x:.3f}" for x in us[name + " rounds"])] for name in LOOPS]
        print_table(["loop", "fastcomm µs per call", "MPI µs per call", "fastcomm rounds"], rows, left=1)
        print(f"\nThe fresh tensor costs the forum loop {us['forum loop'] - us['pair all_reduce']:.3f} µs per op "
              f"(forum loop - pair all_reduce); making it alone takes {us['torch.randn(10, 10)']:.3f}.")
        if args.perf:
            shares, top = results.get("profile") or (None, "no profile")
            print("\n## perf: rank 0 during a pair loop\n")
            if shares:
                pair_us = us["pair all_reduce"]
                print("| where | share of samples | µs of a pair all_reduce |\n| :--- | ---: | ---: |")
                for cat, pct in sorted(shares.items(), key=lambda kv: -kv[1]):
                    print(f"| {cat} | {pct:.1f} % | {pct / 100 * pair_us:.3f} |")
                print()
            print("```text\n" + top + "\n```")
    return finish(results, failures, t_start, "Total benchmark time", args.json, None, None)


if __name__ == "__main__":
    sys.exit(main())
