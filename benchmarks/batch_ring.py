#!/usr/bin/env python
"""Batched collectives over many small groups: fastcomm batch vs single ops, and a ring of
overlapping neighbour groups, fastcomm vs torch Gloo.

(a) Batch scaling. Every rank issues k all_reduces of a 10x10 float32 tensor over k distinct
    groups, per step, either as k blocking ``fc.all_reduce`` calls ("single") or as one batch
    of k (``fc.all_reduce_many``, i.e. ``with fc.batch()``), or as one start of a plan that
    recorded the k ops once (``with fc.plan() as p`` ... ``p.start(async_op=False)``). World 2: the k groups are all
    over [0, 1] (made with ``fc.new_groups``). World 4: the k groups are pairs that cycle
    through the three perfect matchings of 4 ranks ({01,23}, {02,13}, {03,12}), so each rank
    has k distinct groups and its partner changes from one group to the next.
(b) Ring of overlapping neighbour groups at world 4: every step each rank i all_reduces a
    10x10 float32 with its left group (i-1, i) and another with its right group (i, i+1).
    fastcomm as a batch of 2, as a plan of the 2 started each step, and as two async_op=True
    calls then two waits, against torch
    Gloo's async version (``dist.new_group`` for every neighbour pair, created by all ranks,
    two ``dist.all_reduce(..., async_op=True)`` then both waits).
(c) The README's spellings side by side, world 2, k all_reduces of a 10x10 float32 over k
    groups on [0, 1] per step (k = 8 and 64), in one launch: k blocking calls, a fresh ``with
    fc.batch() as b:`` of the k then ``b.wait()``, ``p.start(async_op=False)`` and
    ``p.start().wait()`` of a plan of the k. Each is the mean over all its timed loops (12, each
    after a barrier), not the best; the spellings' loops take turns (each round starting with
    the next spelling); --repeat launches give the medians,
    and the ratios the README promises (batch / blocking at most 1, start().wait() /
    start(async_op=False) at most 1.1) are taken launch by launch, in the same run.

Time per step = the max over ranks of each rank's mean over the timed steps (after warm-up;
all ranks start each timed loop together after a barrier; each rank keeps the best of 3
timed loops, since the machine may be shared), after every rank has sent each peer enough
messages to go twice round its shared-memory ring. (b)'s fastcomm variants run in --repeat
launches, each starting with the next variant; their cells are the medians, and the batch's
time over the async pair's is also given launch by launch. Every variant's result is checked
once after its timed loop (distinct values per rank and element), so a broken op fails its
cell instead of being timed. Ranks are local processes forked by this script; each launch
has its own TCPStore on a free port and a hard timeout, and every child is joined or killed.

Usage, from the repository root:

    python benchmarks/batch_ring.py [--quick] [--repeat 5] [--parts abc] [--plot FILE.png] [--json FILE]
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
from _launch import (STORE_TIMEOUT, best_of_loops, cpu_model, finish, JobError, print_header,
                     print_table, Progress, pyplot_or_none, run_job, save_plot)

JOB_TIMEOUT_S = 120.0  # hard limit for one launch (all its ranks)
# Messages each rank sends every peer before any variant is timed: two laps of a default
# shared-memory ring (1 MB, 512 B per message of a 10x10 float32). On its first lap every
# message lands on lines no core has touched yet, and the variant timed first would pay for it.
LAP_MESSAGES = 4096
SHAPE = (10, 10)
# (c): timed loops per spelling, taken in turns with the other spellings' loops.
SPELLING_ROUNDS = 12
KS = (1, 2, 8, 64)
SPELLING_KS = (8, 64)
SPELLINGS = ("blocking calls", "fc.batch() + b.wait()", "p.start(async_op=False)", "p.start().wait()")
WORLDS = (2, 4)


# --------------------------------------------------------------------------------------------
# Group layouts and result checks
# --------------------------------------------------------------------------------------------

MATCHINGS_4 = ([[0, 1], [2, 3]], [[0, 2], [1, 3]], [[0, 3], [1, 2]])


def scaling_lists(world, k):
    """The group lists for part (a); every rank is in exactly k of them."""
    if world == 2:
        return [[0, 1]] * k
    assert world == 4
    return [pair for j in range(k) for pair in MATCHINGS_4[j % 3]]


def value(rank, j):
    """Distinct per rank, group slot and element; exact in float32."""
    return torch.arange(100, dtype=torch.float32).reshape(SHAPE) + 1000 * j + 100_000 * rank


def check(t, members, j, what):
    expected = sum(value(r, j) for r in members)
    if not torch.equal(t, expected):
        bad = (t != expected).nonzero()[0].tolist()
        raise AssertionError(f"{what}: wrong all_reduce result at {bad}: "
                             f"{t[tuple(bad)].item()} != {expected[tuple(bad)].item()}")


def ring_neighbours(rank, world):
    left = sorted([(rank - 1) % world, rank])
    right = sorted([rank, (rank + 1) % world])
    return left, right


# --------------------------------------------------------------------------------------------
# What each rank runs
# --------------------------------------------------------------------------------------------

def _scaling_body(store, rank, world, k, steps, warmup):
    import fastcomm as fc

    fc.init(store=store, rank=rank, world_size=world, timeout=STORE_TIMEOUT)
    try:
        lists = scaling_lists(world, k)
        groups = fc.new_groups(lists)
        mine = [(j, lists[j], g) for j, g in enumerate(groups) if g.rank() >= 0]
        assert len(mine) == k
        gs = [g for _, _, g in mine]
        ts = [torch.zeros(SHAPE) for _ in mine]  # zeros: sums stay 0 however many steps

        def single():
            for t, g in zip(ts, gs):
                fc.all_reduce(t, group=g)

        def batched():
            fc.all_reduce_many(ts, gs)

        with fc.plan() as p:
            for t, g in zip(ts, gs):
                fc.all_reduce(t, group=g)

        def planned():
            p.start(async_op=False)

        # Each step sends k messages, spread over the rank's world - 1 partners at most.
        for _ in range(-(-LAP_MESSAGES * (world - 1) // k)):
            planned()
        out = {}
        for name, step in (("single", single), ("batch", batched), ("plan", planned)):
            out[name] = best_of_loops(step, fc.barrier, steps, warmup)
            # one checked step
            for (j, members, _), t in zip(mine, ts):
                t.copy_(value(rank, j))
            step()
            for (j, members, _), t in zip(mine, ts):
                check(t, members, j, f"{name}, world {world}, k={k}, group {members}")
                t.zero_()
        return out
    finally:
        fc.shutdown()


def _ring_fastcomm_body(store, rank, world, steps, warmup, first=0):
    import fastcomm as fc

    fc.init(store=store, rank=rank, world_size=world, timeout=STORE_TIMEOUT)
    try:
        lm, rm = ring_neighbours(rank, world)
        left, right = fc.new_group(lm), fc.new_group(rm)
        tl, tr = torch.zeros(SHAPE), torch.zeros(SHAPE)

        def batch2():
            with fc.batch() as b:
                fc.all_reduce(tl, group=left)
                fc.all_reduce(tr, group=right)
            b.wait()

        with fc.plan() as p:
            fc.all_reduce(tl, group=left)
            fc.all_reduce(tr, group=right)

        def plan2():
            p.start(async_op=False)

        def async2():
            wl = fc.all_reduce(tl, group=left, async_op=True)
            wr = fc.all_reduce(tr, group=right, async_op=True)
            wl.wait()
            wr.wait()

        for _ in range(LAP_MESSAGES):  # a message to each neighbour per step
            plan2()
        out = {}
        variants = [("fastcomm batch of 2", batch2), ("fastcomm plan of 2", plan2),
                    ("fastcomm async_op pair", async2)]
        # Launch by launch the order rotates (`first`), so no variant always runs first or last.
        for name, step in variants[first:] + variants[:first]:
            out[name] = best_of_loops(step, fc.barrier, steps, warmup)
            # Slot j of a group = its lower rank, so both members agree on the values.
            tl.copy_(value(rank, lm[0]))
            tr.copy_(value(rank, rm[0]))
            step()
            check(tl, lm, lm[0], f"{name}: left group {lm}")
            check(tr, rm, rm[0], f"{name}: right group {rm}")
            tl.zero_()
            tr.zero_()
        return out
    finally:
        fc.shutdown()


def _spellings_body(store, rank, world, k, steps, warmup, first=0):
    import fastcomm as fc

    fc.init(store=store, rank=rank, world_size=world, timeout=STORE_TIMEOUT)
    try:
        gs = fc.new_groups([[0, 1]] * k)
        ts = [torch.zeros(SHAPE) for _ in gs]

        def blocking():
            for t, g in zip(ts, gs):
                fc.all_reduce(t, group=g)

        def batched():
            with fc.batch() as b:
                for t, g in zip(ts, gs):
                    fc.all_reduce(t, group=g)
            b.wait()

        with fc.plan() as p:
            for t, g in zip(ts, gs):
                fc.all_reduce(t, group=g)

        def start_blocking():
            p.start(async_op=False)

        def start_wait():
            p.start().wait()

        for _ in range(-(-LAP_MESSAGES // k)):
            start_blocking()
        steps_of = dict(zip(SPELLINGS, (blocking, batched, start_blocking, start_wait)))
        for step in steps_of.values():
            for _ in range(warmup):
                step()
        # The spellings take turns loop by loop, each round starting with the next one, so a
        # slow spell of a shared machine lands on all of them rather than on whichever ran then.
        total = dict.fromkeys(SPELLINGS, 0.0)
        for r in range(SPELLING_ROUNDS):
            for i in range(len(SPELLINGS)):
                name = SPELLINGS[(first + r + i) % len(SPELLINGS)]
                step = steps_of[name]
                fc.barrier()
                t0 = time.perf_counter()
                for _ in range(steps):
                    step()
                total[name] += time.perf_counter() - t0
        out = {name: total[name] / (SPELLING_ROUNDS * steps) for name in SPELLINGS}
        for name, step in steps_of.items():
            for j, t in enumerate(ts):
                t.copy_(value(rank, j))
            step()
            for j, t in enumerate(ts):
                check(t, [0, 1], j, f"{name}, k={k}, op {j}")
                t.zero_()
        return out
    finally:
        fc.shutdown()


def _ring_gloo_body(store, rank, world, steps, warmup):
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=STORE_TIMEOUT)
    try:
        # torch requires every rank to create every group, in the same order.
        pairs = [sorted([i, (i + 1) % world]) for i in range(world)]
        groups = {tuple(p): dist.new_group(p) for p in pairs}
        lm, rm = ring_neighbours(rank, world)
        left, right = groups[tuple(lm)], groups[tuple(rm)]
        tl, tr = torch.zeros(SHAPE), torch.zeros(SHAPE)

        def async2():
            wl = dist.all_reduce(tl, group=left, async_op=True)
            wr = dist.all_reduce(tr, group=right, async_op=True)
            wl.wait()
            wr.wait()

        per_step = best_of_loops(async2, dist.barrier, steps, warmup)
        tl.copy_(value(rank, lm[0]))
        tr.copy_(value(rank, rm[0]))
        async2()
        check(tl, lm, lm[0], f"gloo: left group {lm}")
        check(tr, rm, rm[0], f"gloo: right group {rm}")
        return {"torch Gloo async_op pair": per_step}
    finally:
        dist.destroy_process_group()


# --------------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------------

def measure(body, world, *args):
    """{variant: seconds per step (max over ranks)} or {"error": "..."}."""
    try:
        per_rank = run_job(body, world, *args, timeout=JOB_TIMEOUT_S)
    except JobError as e:
        print(f"  !! {body.__name__}, world {world}: {e}", file=sys.stderr, flush=True)
        return {"error": str(e)}
    return {name: max(r[name] for r in per_rank) for name in per_rank[0]}


def fmt_us(s):
    return "FAILED" if s is None else f"{s * 1e6:,.1f}"


def write_plot(path, results):
    plt = pyplot_or_none(path)
    if plt is None:
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for world in WORLDS:
        for name, style in (("single", "o-"), ("batch", "s--"), ("plan", "^:")):
            pts = [(k, results["scaling"][f"{world}/{k}"][name] * 1e6) for k in KS
                   if "error" not in results["scaling"][f"{world}/{k}"]]
            if pts:
                ax1.plot(*zip(*pts), style, label=f"world {world}, {name}")
    ax1.set(xscale="log", yscale="log", xlabel="k (all_reduces per step, one per group)",
            ylabel="µs per step (max over ranks)", title="(a) k single ops vs one batch of k")
    ax1.set_xticks(KS, [str(k) for k in KS])
    ax1.legend()
    ring = {k: v for k, v in results["ring"].items() if v is not None}
    ax2.bar(range(len(ring)), [v * 1e6 for v in ring.values()])
    ax2.set_xticks(range(len(ring)), list(ring), rotation=10, fontsize=8)
    ax2.set(yscale="log", ylabel="µs per step (max over ranks)",
            title="(b) ring of neighbour pairs, world 4")
    save_plot(fig, path)


def print_spellings(spell, repeat):
    print("\n## (c) The README's spellings, world 2: k all_reduces of a 10x10 float32 over k groups on "
          "[0, 1] per step\n")
    print(f"µs per op, the mean of each spelling's timed loops (max over ranks), the median of {repeat} "
          "launch(es); the ratios launch by launch.\n")
    head = ["k"] + [f"{n} µs/op" for n in SPELLINGS] + ["batch / blocking", "start().wait() / start(async_op=False)"]
    rows = []
    for k, cells in spell.items():
        ok = [c for c in cells if "error" not in c]
        if not ok:
            rows.append([str(k)] + ["FAILED"] * (len(SPELLINGS) + 2))
            continue
        med = [f"{statistics.median(c[n] for c in ok) / k * 1e6:,.2f}" for n in SPELLINGS]
        rb = [c[SPELLINGS[1]] / c[SPELLINGS[0]] for c in ok]
        rp = [c[SPELLINGS[3]] / c[SPELLINGS[2]] for c in ok]
        rows.append([str(k)] + med + [", ".join(f"{r:.2f}" for r in rb), ", ".join(f"{r:.2f}" for r in rp)])
    print_table(head, rows)
    print("\nTargets: batch / blocking at most 1.0; start().wait() / start(async_op=False) at most 1.1.")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="short run (fewer timed steps)")
    ap.add_argument("--plot", metavar="FILE.png", help="write a plot (needs matplotlib)")
    ap.add_argument("--json", metavar="FILE", help="dump the raw numbers as JSON")
    ap.add_argument("--repeat", type=int, default=None,
                    help="launches of (b)'s fastcomm variants, each starting with the next variant "
                         "(default 5; 1 with --quick)")
    ap.add_argument("--parts", default="abc", help="which parts to run (default abc)")
    add_launcher_arg(ap)
    args = ap.parse_args()
    use_launcher(args.launcher)
    repeat = args.repeat or (1 if args.quick else 5)
    parts = set(args.parts)
    # Timed all_reduces per rank per cell of (a); steps = ops // k (at least 20).
    ops_a = 1024 if args.quick else 16384
    steps_ring = 200 if args.quick else 5000
    steps_gloo = 50 if args.quick else 500
    warmup = 10 if args.quick else 50

    torch.set_num_threads(1)
    t_start = time.monotonic()
    print_header("fastcomm benchmark: batched collectives over many small groups")
    print(flush=True)

    results = {"command": sys.argv, "cores": os.cpu_count(), "cpu": cpu_model(),
               "torch": torch.__version__, "scaling": {}, "ring": {}}
    n_launches = (len(WORLDS) * len(KS) if "a" in parts else 0) + (repeat + 1 if "b" in parts else 0) \
        + (repeat * len(SPELLING_KS) if "c" in parts else 0)
    progress = Progress(n_launches)
    failed = []
    if "a" in parts:
        for world in WORLDS:
            for k in KS:
                steps = max(20, ops_a // k)  # per timed loop
                progress.launch(f"(a): world {world}, k={k}, {steps} steps")
                cell = measure(_scaling_body, world, k, steps, warmup)
                cell["steps"] = steps
                results["scaling"][f"{world}/{k}"] = cell
    if "b" in parts:
        launches = []
        for rep in range(repeat):
            progress.launch(f"(b): fastcomm, {steps_ring} steps, launch {rep + 1}/{repeat}")
            launches.append(measure(_ring_fastcomm_body, 4, steps_ring, warmup, rep % 3))
        fcr = next((cell for cell in launches if "error" in cell), None) or {
            name: statistics.median(cell[name] for cell in launches) for name in launches[0]}
        results["ring_launches"] = launches
        progress.launch(f"(b): torch Gloo, {steps_gloo} steps")
        gl = measure(_ring_gloo_body, 4, steps_gloo, min(warmup, 20))
        for name in ("torch Gloo async_op pair", "fastcomm batch of 2", "fastcomm plan of 2", "fastcomm async_op pair"):
            src = gl if name.startswith("torch") else fcr
            results["ring"][name] = src.get(name)
        steps_of = {"torch Gloo async_op pair": steps_gloo, "fastcomm batch of 2": steps_ring,
                    "fastcomm plan of 2": steps_ring, "fastcomm async_op pair": steps_ring}

    spell = {k: [] for k in SPELLING_KS}
    if "c" in parts:
        for rep in range(repeat):
            for k in SPELLING_KS:
                steps = max(20, ops_a // k)
                progress.launch(f"(c): k={k}, {steps} steps x {SPELLING_ROUNDS} loops, launch {rep + 1}/{repeat}")
                spell[k].append(measure(_spellings_body, 2, k, steps, warmup, rep % len(SPELLINGS)))
        results["spellings"] = {str(k): v for k, v in spell.items()}

    if "a" in parts:
        print("## (a) Batch scaling: k all_reduces of a 10x10 float32 over k distinct groups per step\n")
        print("single = k blocking `fc.all_reduce` calls; batch = one `fc.all_reduce_many` of k "
              "(a `with fc.batch()` block); plan = one start of a plan of the k. World 2: k groups over [0, 1]; world 4: k pair groups "
              "cycling through the 3 perfect matchings of 4 ranks.\n")
        head = ["world", "k", "steps/loop", "single µs/op", "batch µs/op", "plan µs/op", "batch/single",
                "plan/single"]
        rows = []
        for world in WORLDS:
            for k in KS:
                cell = results["scaling"][f"{world}/{k}"]
                if "error" in cell:
                    cells = [str(world), str(k), str(cell["steps"])] + ["FAILED"] * 5
                else:
                    s, b, pl = cell["single"], cell["batch"], cell["plan"]
                    cells = [str(world), str(k), str(cell["steps"]), f"{s / k * 1e6:,.2f}", f"{b / k * 1e6:,.2f}",
                             f"{pl / k * 1e6:,.2f}", f"{b / s:.2f}", f"{pl / s:.2f}"]
                rows.append(cells)
        print_table(head, rows)
        print("\nbatch/single < 1: the batch of k costs less than k single ops (plan/single: the same "
              "for a plan's start).")

    if "b" in parts:
        print("\n## (b) Ring of overlapping neighbour groups, world 4: per step every rank "
              "all_reduces a 10x10 float32 with (i-1, i) and with (i, i+1)\n")
        head = ["variant", "steps/loop", "µs/step", "speedup vs Gloo"]
        g = results["ring"]["torch Gloo async_op pair"]
        rows = []
        for name, v in results["ring"].items():
            speed = "n/a" if v is None or g is None else f"{g / v:,.1f}x"
            rows.append([name, str(steps_of[name]), fmt_us(v), speed])
        print_table(head, rows, left=1)
        print(f"\nfastcomm: the median of {repeat} launch(es). speedup = Gloo's µs/step / this variant's µs/step.")
        if "error" not in fcr:
            ratios = [cell["fastcomm batch of 2"] / cell["fastcomm async_op pair"] for cell in launches]
            print("batch of 2 / async_op pair (target: at most 1.0): "
                  f"{fcr['fastcomm batch of 2'] / fcr['fastcomm async_op pair']:.2f} of the medians; launch by launch "
                  + ", ".join(f"{r:.2f}" for r in ratios) + f", median {statistics.median(ratios):.2f}")

    if "c" in parts:
        print_spellings(spell, repeat)
    failed += [f"(a) world/k {key}: {cell['error']}" for key, cell in results["scaling"].items()
               if "error" in cell]
    failed += [f"(b) {name}" for name, v in results["ring"].items() if v is None]
    if "b" in parts:
        for part, cell in (("(b) fastcomm", fcr), ("(b) gloo", gl)):
            if "error" in cell:
                failed.append(f"{part}: {cell['error']}")
    failed += [f"(c) k={k}: {cell['error']}" for k in SPELLING_KS for cell in spell[k] if "error" in cell]
    return finish(results, failed, t_start, "Total benchmark time", args.json, args.plot,
                  lambda path: write_plot(path, results) if {"a", "b"} <= parts
                  else print("\nNote: the plot needs parts a and b; skipped."))


if __name__ == "__main__":
    sys.exit(main())
