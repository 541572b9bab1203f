#!/usr/bin/env python
"""Soak: a long run of small fastcomm ops, checking that no resource grows (issue #7).

Every rank (local processes launched by this script, world 2 by default) runs the same
schedule of small ops, at least 10^6 per rank after a warm-up, in cycles of:

- 8 blocking ``fc.all_reduce`` of a 10x10 float32 on the rank's pair group;
- an async pair: two ``fc.all_reduce(..., async_op=True)`` on two groups, then both waits;
- a batch of K all_reduces over K groups with ``fc.all_reduce_many``, and another batch of K
  in a ``with fc.batch()`` block;

and every ``OTHER_EVERY`` cycles a broadcast, an all_gather and a barrier over the world, and
every ``NEW_GROUPS_EVERY`` cycles an ``fc.new_groups`` call (all ranks, the same lists) and one
all_reduce on one of the new groups. Every ``VERIFY_EVERY`` cycles (and for every op on a new
group) the tensors hold distinct values per rank, slot and element, and each result is checked
against the sum (or the source's, or every rank's tensor) computed locally; otherwise they hold
zeros, so no number of ops overflows.

Each rank samples, after the warm-up ("start"), at checkpoints in between and at the end: its
RSS (VmRSS of /proc/self/status), open fds (entries of /proc/self/fd), threads (entries of
/proc/self/task) and the /dev/shm entries named fastcomm-* (all of them, and those of this
job: fastcomm-<this job's token>-<rank>). Flat = RSS at the end within RSS_LIMIT_MIB of the
start, and fds, threads and this job's /dev/shm entries equal at every checkpoint, on every
rank. The script exits 1 when anything is not flat or a rank failed. Not run in CI. Usage,
from the repository root:

    python benchmarks/soak.py [--world 2] [--ops 1000000] [--checkpoints 10]
                              [--plot FILE.png] [--json FILE]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

from _launch import add_launcher_arg, use_launcher  # noqa: E402
from _launch import (STORE_TIMEOUT, JobError, cpu_model, finish, print_header, print_table,
                     pyplot_or_none, run_job, save_plot)

SHAPE = (10, 10)
K = 4                    # all_reduces (and groups) per batch
BLOCKING_PER_CYCLE = 8
OPS_PER_CYCLE = BLOCKING_PER_CYCLE + 2 + 2 * K
OTHER_EVERY = 64         # cycles between broadcast + all_gather + barrier
NEW_GROUPS_EVERY = 512   # cycles between new_groups calls
VERIFY_EVERY = 256       # cycles between checked cycles
RSS_LIMIT_MIB = 2.0      # allowed RSS growth from start to end


# --------------------------------------------------------------------------------------------
# Groups and values
# --------------------------------------------------------------------------------------------

def matchings(world):
    """Perfect matchings of the ranks, pairs {i, i ^ d} for d = 1 .. world - 1 (world is a
    power of 2): [[0, 1], [2, 3]], [[0, 2], [1, 3]], [[0, 3], [1, 2]] for world 4."""
    return [[[i, i ^ d] for i in range(world) if i < i ^ d] for d in range(1, world)]


def batch_lists(world):
    """K * world / 2 pair lists, cycling through the matchings: every rank is in K of them,
    with a partner that changes from one to the next (world 2: K times [0, 1])."""
    ms = matchings(world)
    return [pair for j in range(K) for pair in ms[j % len(ms)]]


def value(rank, slot):
    """Distinct per rank, slot and element; sums over 8 ranks stay exact in float32."""
    return torch.arange(100, dtype=torch.float32).reshape(SHAPE) + 1000 * slot + 100_000 * rank


def check(t, expected, what):
    if not torch.equal(t, expected):
        bad = (t != expected).nonzero()[0].tolist()
        raise AssertionError(f"{what}: wrong result at {bad}: {t[tuple(bad)].item()} != "
                             f"{expected[tuple(bad)].item()}")


def check_sum(t, members, slot, what):
    check(t, sum(value(r, slot) for r in members), what)


# --------------------------------------------------------------------------------------------
# Resource samples
# --------------------------------------------------------------------------------------------

def sample(token):
    """This process's resources now."""
    rss_kib = None
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss_kib = int(line.split()[1])
                break
    try:
        shm = [n for n in os.listdir("/dev/shm") if n.startswith("fastcomm-")]
    except FileNotFoundError:
        shm = []
    return {"rss_kib": rss_kib,
            "fds": len(os.listdir("/proc/self/fd")),
            "threads": len(os.listdir("/proc/self/task")),
            "shm_all": len(shm),
            "shm_job": sum(1 for n in shm if token is not None and n.startswith(f"fastcomm-{token}-"))}


def _job_token(store):
    """The random token of this rank's fastcomm session (it names the job's segments), or
    None if fastcomm's rendezvous keys are not where fc.init puts them today."""
    import torch.distributed as dist
    from fastcomm import _state

    try:
        return dist.PrefixStore(_state._store_prefix(_state._generation), store).get("token").decode()
    except Exception:  # noqa: BLE001 - the metric then counts nothing as this job's
        return None


# --------------------------------------------------------------------------------------------
# What each rank runs
# --------------------------------------------------------------------------------------------

def _soak_body(store, rank, world, ops, warmup_ops, checkpoints):
    import fastcomm as fc

    fc.init(store=store, rank=rank, world_size=world, timeout=STORE_TIMEOUT)
    try:
        token = _job_token(store)
        lo = 2 * (rank // 2)
        pair_members = [lo, lo + 1]
        pair = fc.new_group(pair_members)
        lists = batch_lists(world)
        mine = [(lst, g) for lst, g in zip(lists, fc.new_groups(lists)) if g.rank() >= 0]
        assert len(mine) == K
        bgroups = [g for _, g in mine]
        members = [lst for lst, _ in mine]
        second = mine[1]  # the async pair's second group

        t = torch.zeros(SHAPE)
        ta, tb = torch.zeros(SHAPE), torch.zeros(SHAPE)
        ts = [torch.zeros(SHAPE) for _ in range(K)]
        us = [torch.zeros(SHAPE) for _ in range(K)]
        tw = torch.zeros(SHAPE)
        gathered = [torch.zeros(SHAPE) for _ in range(world)]
        counts = {"cycles": 0, "verified_cycles": 0, "other": 0, "new_groups": 0}

        def cycle(c, verify):
            if verify:
                t.copy_(value(rank, 0))
            for _ in range(BLOCKING_PER_CYCLE):
                fc.all_reduce(t, group=pair)
                if verify:  # each op checked, then the next one starts from fresh values
                    check_sum(t, pair_members, 0, f"cycle {c}: blocking all_reduce {pair_members}")
                    t.copy_(value(rank, 0))
            if verify:
                t.zero_()
                ta.copy_(value(rank, 1))
                tb.copy_(value(rank, 2))
            wa = fc.all_reduce(ta, group=pair, async_op=True)
            wb = fc.all_reduce(tb, group=second[1], async_op=True)
            wa.wait()
            wb.wait()
            if verify:
                check_sum(ta, pair_members, 1, f"cycle {c}: async all_reduce {pair_members}")
                check_sum(tb, second[0], 2, f"cycle {c}: async all_reduce {second[0]}")
                ta.zero_()
                tb.zero_()
                for j in range(K):
                    ts[j].copy_(value(rank, 3 + j))
                    us[j].copy_(value(rank, 3 + K + j))
            fc.all_reduce_many(ts, bgroups)
            with fc.batch() as b:
                for u, g in zip(us, bgroups):
                    fc.all_reduce(u, group=g)
            b.wait()
            if verify:
                for j in range(K):
                    check_sum(ts[j], members[j], 3 + j, f"cycle {c}: all_reduce_many {members[j]}")
                    check_sum(us[j], members[j], 3 + K + j, f"cycle {c}: fc.batch {members[j]}")
                    ts[j].zero_()
                    us[j].zero_()
            done = OPS_PER_CYCLE

            if c % OTHER_EVERY == OTHER_EVERY - 1:
                src = (c // OTHER_EVERY) % world
                tw.copy_(value(rank, 20))
                fc.broadcast(tw, src=src)
                check(tw, value(src, 20), f"cycle {c}: broadcast from {src}")
                tw.copy_(value(rank, 21))
                fc.all_gather(gathered, tw)
                for r, x in enumerate(gathered):
                    check(x, value(r, 21), f"cycle {c}: all_gather, rank {r}'s tensor")
                fc.barrier()
                counts["other"] += 1
                done += 3
            if c % NEW_GROUPS_EVERY == NEW_GROUPS_EVERY - 1:
                # All ranks, the same lists: a matching chosen by the cycle number.
                ms = matchings(world)
                lists_now = ms[(c // NEW_GROUPS_EVERY) % len(ms)]
                for lst, g in zip(lists_now, fc.new_groups(lists_now)):
                    if g.rank() >= 0:
                        tw.copy_(value(rank, 22))
                        fc.all_reduce(tw, group=g)
                        check_sum(tw, lst, 22, f"cycle {c}: all_reduce on new group {lst}")
                counts["new_groups"] += 1
                done += 1
            counts["cycles"] += 1
            counts["verified_cycles"] += verify
            return done

        # Warm-up: every kind of op (the first cycles include a checked one, and the
        # other collectives and new_groups come up within OTHER_EVERY / NEW_GROUPS_EVERY).
        c, n = 0, 0
        while n < warmup_ops or c < NEW_GROUPS_EVERY:
            n += cycle(c, c % VERIFY_EVERY == 0)
            c += 1
        fc.barrier()
        marks = [ops * i // checkpoints for i in range(1, checkpoints + 1)]
        samples = [dict(ops=0, elapsed_s=0.0, **sample(token))]
        start = time.perf_counter()
        n = 0
        for mark in marks:
            while n < mark:
                n += cycle(c, c % VERIFY_EVERY == 0)
                c += 1
            elapsed = time.perf_counter() - start
            samples.append(dict(ops=n, elapsed_s=elapsed, **sample(token)))
        fc.barrier()
        return {"samples": samples, "ops": n, "elapsed_s": samples[-1]["elapsed_s"],
                "ops_per_s": n / samples[-1]["elapsed_s"], "token_found": token is not None,
                **counts}
    finally:
        fc.shutdown()


# --------------------------------------------------------------------------------------------
# Verdict and report
# --------------------------------------------------------------------------------------------

METRICS = ("rss_kib", "fds", "threads", "shm_job")


def verdict(per_rank):
    """{metric: (flat?, description)} over all ranks."""
    out = {}
    growth = [(r["samples"][-1]["rss_kib"] - r["samples"][0]["rss_kib"]) / 1024 for r in per_rank]
    worst = max(growth)
    out["rss_kib"] = (worst < RSS_LIMIT_MIB,
                      f"RSS {worst:+.2f} MiB start to end (max over ranks; limit {RSS_LIMIT_MIB:g} MiB)")
    for m, label in (("fds", "fds"), ("threads", "threads"), ("shm_job", "/dev/shm fastcomm-* of this job")):
        values = [[s[m] for s in r["samples"]] for r in per_rank]
        flat = all(len(set(v)) == 1 for v in values)
        span = " / ".join(f"{min(v)}..{max(v)}" if len(set(v)) > 1 else str(v[0]) for v in values)
        out[m] = (flat, f"{label} {span}")
    return out


def joined(values, fmt="{}"):
    return " / ".join(fmt.format(v) for v in values)


def write_plot(path, per_rank):
    plt = pyplot_or_none(path)
    if plt is None:
        return
    fig, axes = plt.subplots(1, 4, figsize=(14, 3.6))
    for ax, (m, title) in zip(axes, (("rss_kib", "RSS (MiB)"), ("fds", "open fds"),
                                     ("threads", "threads"), ("shm_all", "/dev/shm fastcomm-*"))):
        for rank, r in enumerate(per_rank):
            xs = [s["ops"] for s in r["samples"]]
            ys = [s[m] / 1024 if m == "rss_kib" else s[m] for s in r["samples"]]
            ax.plot(xs, ys, marker="o", label=f"rank {rank}")
        ax.set(xlabel="ops after warm-up (per rank)", title=title)
    axes[0].legend()
    save_plot(fig, path)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=2, choices=(2, 4, 8),
                    help="local ranks (default 2)")
    ap.add_argument("--ops", type=int, default=1_000_000,
                    help="ops per rank after the warm-up (default 10^6)")
    ap.add_argument("--warmup", type=int, default=None,
                    help="warm-up ops per rank (default: 5%% of --ops, at least one new_groups "
                         "period of cycles)")
    ap.add_argument("--checkpoints", type=int, default=10,
                    help="samples after the start one (default 10)")
    ap.add_argument("--timeout", type=float, default=None,
                    help="hard limit for the whole job in seconds (default 300 + 2 ms per op)")
    ap.add_argument("--plot", metavar="FILE.png", help="write a plot (needs matplotlib)")
    ap.add_argument("--json", metavar="FILE", help="dump the raw numbers as JSON")
    add_launcher_arg(ap)
    args = ap.parse_args()
    use_launcher(args.launcher)
    if args.ops < 1 or args.checkpoints < 1:
        ap.error("--ops and --checkpoints must be positive")
    warmup = args.warmup if args.warmup is not None else args.ops // 20
    timeout = args.timeout or 300 + 2e-3 * (args.ops + warmup)

    torch.set_num_threads(1)  # no parallel region in the parent before any fork
    t_start = time.monotonic()
    print_header("fastcomm soak: resources over a long run of small ops")
    print(f"- world {args.world}; {args.ops:,} ops per rank after {warmup:,}+ warm-up ops; cycle = "
          f"{BLOCKING_PER_CYCLE} blocking all_reduce + async pair + all_reduce_many of {K} + "
          f"fc.batch of {K}; broadcast/all_gather/barrier every {OTHER_EVERY} cycles, "
          f"new_groups every {NEW_GROUPS_EVERY}, checked cycle every {VERIFY_EVERY}")
    print(flush=True)

    results = {"command": sys.argv, "cores": os.cpu_count(), "cpu": cpu_model(),
               "torch": torch.__version__, "world": args.world, "ops": args.ops,
               "warmup_ops": warmup, "rss_limit_mib": RSS_LIMIT_MIB}
    print(f"  running: world {args.world}, {args.ops:,} ops per rank (timeout {timeout:.0f} s) ...",
          file=sys.stderr, flush=True)
    try:
        per_rank = run_job(_soak_body, args.world, args.ops, warmup, args.checkpoints,
                           timeout=timeout)
    except JobError as e:
        print(f"  !! soak, world {args.world}: {e}", file=sys.stderr, flush=True)
        return finish(results, [f"soak, world {args.world}: {e}"], t_start, "Total time",
                      args.json, None, None)
    results["ranks"] = per_rank

    ranks = "/".join(f"r{r}" for r in range(args.world))
    print(f"## Resources per rank ({ranks}), sampled after the warm-up (start) and at "
          f"{args.checkpoints} checkpoints\n")
    head = ["checkpoint", "ops", "s", f"RSS MiB ({ranks})", "fds", "threads",
            "shm fastcomm-* (this job)", "shm fastcomm-* (all)"]
    rows = []
    for i in range(args.checkpoints + 1):
        ss = [r["samples"][i] for r in per_rank]
        name = "start" if i == 0 else ("end" if i == args.checkpoints else str(i))
        rows.append([name, f"{ss[0]['ops']:,}", f"{max(s['elapsed_s'] for s in ss):.1f}",
                     joined([s["rss_kib"] / 1024 for s in ss], "{:.2f}"),
                     joined([s["fds"] for s in ss]), joined([s["threads"] for s in ss]),
                     joined([s["shm_job"] for s in ss]), joined([s["shm_all"] for s in ss])])
    first, last = [r["samples"][0] for r in per_rank], [r["samples"][-1] for r in per_rank]
    rows.append(["end - start", "", "",
                 joined([(b["rss_kib"] - a["rss_kib"]) / 1024 for a, b in zip(first, last)], "{:+.2f}"),
                 joined([b["fds"] - a["fds"] for a, b in zip(first, last)], "{:+d}"),
                 joined([b["threads"] - a["threads"] for a, b in zip(first, last)], "{:+d}"),
                 joined([b["shm_job"] - a["shm_job"] for a, b in zip(first, last)], "{:+d}"),
                 joined([b["shm_all"] - a["shm_all"] for a, b in zip(first, last)], "{:+d}")])
    print_table(head, rows, left=1)

    v = verdict(per_rank)
    flat = all(ok for ok, _ in v.values())
    slowest = min(r["ops_per_s"] for r in per_rank)
    r0 = per_rank[0]
    print(f"\nPer rank: {r0['cycles']:,} cycles in all ({r0['verified_cycles']:,} checked), "
          f"{r0['other']:,} rounds of broadcast/all_gather/barrier, {r0['new_groups']:,} "
          f"new_groups calls; every checked result was right.")
    if not all(r["token_found"] for r in per_rank):
        print("Note: this job's token was not found in the store; \"this job\" counts nothing.")
    print("shm (all) counts every job's segments on the machine (other jobs come and go); "
          "the verdict uses this job's.")
    results["verdict"] = {m: {"flat": ok, "what": what} for m, (ok, what) in v.items()}
    results["flat"] = flat
    results["ops_per_s_slowest_rank"] = slowest
    print(f"\nVerdict: {'FLAT' if flat else 'NOT FLAT'}: "
          + "; ".join(f"{what} {'flat' if ok else 'NOT FLAT'}" for ok, what in v.values())
          + f". {args.ops:,} ops per rank at {slowest:,.0f} ops/s (slowest rank, all ranks "
            f"running at once).")
    failures = [f"not flat: {what}" for ok, what in v.values() if not ok]
    return finish(results, failures, t_start, "Total time", args.json, args.plot,
                  lambda path: write_plot(path, per_rank))


if __name__ == "__main__":
    sys.exit(main())
