#!/usr/bin/env python
"""fastcomm's main benchmark: the forum MWE, fastcomm vs torch Gloo (vs MPI where installed).

The forum thread "Improving inter-process communication costs for pytorch.distributed" times
1024 all_reduces of a 10x10 float32 tensor on pairwise groups [0,1], [2,3], ... for 1..8
pairs, its ranks started with ``torch.multiprocessing.spawn``. This script reruns that loop side
by side, on local processes it launches itself (spawned, as the post's are, unless --launcher
says otherwise):

1. the MWE: P pairs (2P ranks), each running the post's loop (a barrier, then 1024 blocking
   all_reduces, each of a fresh ``torch.randn(10, 10)``; --reuse: one reused tensor after
   warm-up ops instead), per-op time (the max over ranks of each rank's mean) with torch Gloo
   (``dist.new_group`` per pair, created by every rank as torch requires) and with fastcomm
   (``fc.new_group`` per pair, created by its members only), and how evenly the pairs fared;
2. large messages: one pair, all_reduce of 1 MB and 16 MB (or the sizes of --sizes: a size
   sweep), per-op time and algorithm bandwidth (tensor bytes / time), next to this machine's
   single-core memcpy bandwidth; fastcomm twice, on ordinary tensors and on tensors from
   ``fc.empty`` (which the pair reads from each other in place);
3. the same loops with MPI (mpi4py ``Allreduce`` on pair communicators) when mpi4py and mpirun
   are both installed.

Each measurement is launched --repeat times (fresh processes each) and the median reported.
Every measured op is checked for correctness once after its timed loop, so a broken op fails
the run instead of being timed. Usage, from the repository root:

    python benchmarks/forum_mwe.py [--quick] [--pairs 1 2 4 8] [--iters 1024] [--repeat 3]
                                   [--sizes 1M 16M] [--launcher spawn|fork|torchrun] [--reuse]
                                   [--plot FILE.png] [--json FILE]

``--plot`` draws the µs per op of the MWE against the number of pairs (with two or more pair
counts) and the bandwidth of one pair against the message size.
"""
from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
import sys
import time

import torch
import torch.distributed as dist

from _launch import (STORE_TIMEOUT, JobError, Progress, add_launcher_arg, command, cpu_model, find_mpi,
                     finish, launcher, machine, print_table, pyplot_or_none, run_job, run_mpi_worker,
                     save_plot, use_launcher)

JOB_TIMEOUT_S = 150.0  # hard limit for one launch (all its ranks); a hang fails that cell only
MWE_SHAPE = (10, 10)
MWE_NUMEL = 10 * 10
LARGE_SIZES = (2**20, 16 * 2**20)  # bytes
MPI_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_mpi_pairs.py")


# --------------------------------------------------------------------------------------------
# What each rank runs
# --------------------------------------------------------------------------------------------

def _timed_all_reduce(all_reduce, group, barrier, rank, numel, iters, warmup, fresh=False, empty=torch.empty):
    """Seconds per op of ``all_reduce(t, group=group)`` on this rank (the mean over the loop),
    then one checked op.

    ``all_reduce`` is dist.all_reduce or fc.all_reduce (same signature), called directly in
    the loop so that no wrapper of ours adds to the time of either. ``fresh``: the forum
    post's own loop, exactly: one barrier, then a new ``torch.randn(10, 10)`` for every op,
    with no warm-up (``warmup`` is 0). Otherwise one reused tensor of ``numel`` elements
    (allocated by ``empty``: torch.empty or fc.empty) after ``warmup`` untimed ops."""
    if fresh:
        barrier()
        start = time.perf_counter()
        for _ in range(iters):
            all_reduce(torch.randn(*MWE_SHAPE), group=group)
        per_op = (time.perf_counter() - start) / iters
    else:
        t = empty(numel).zero_()  # zeros: the sum stays 0, so no number of ops overflows to inf
        for _ in range(warmup):
            all_reduce(t, group=group)
        # All pairs enter the timed loop together and contend for the cores, as in the MWE.
        # Twice: ranks that waited long in the first (for the slowest rank to start) may
        # sleep, and each leaves it when woken, up to a millisecond apart on a VM; the second
        # finds every rank awake and releases them together. A rank's own start skew would
        # otherwise count in its time (1024 ops take a few milliseconds).
        barrier()
        barrier()
        start = time.perf_counter()
        for _ in range(iters):
            all_reduce(t, group=group)
        per_op = (time.perf_counter() - start) / iters

    # Distinct values per element and per rank (exact in float32 below 2**24), so a result
    # that misses a contribution or misplaces a chunk cannot pass.
    lo = 2 * (rank // 2)
    base = torch.arange(numel, dtype=torch.float32)
    t = empty(numel).copy_(base + (rank + 1))
    all_reduce(t, group=group)
    expected = 2 * base + (lo + 1) + (lo + 2)
    if not torch.equal(t, expected):
        bad = (t != expected).nonzero()[0].item()
        raise AssertionError(f"wrong all_reduce result: element {bad} is {t[bad].item()}, "
                             f"expected {expected[bad].item()}")
    return per_op


def _gloo_body(store, rank, world, numel, iters, warmup, fresh=False):
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=STORE_TIMEOUT)
    try:
        # torch requires every rank to create every group, in the same order, members or not.
        groups = [dist.new_group([2 * i, 2 * i + 1]) for i in range(world // 2)]
        return _timed_all_reduce(dist.all_reduce, groups[rank // 2], dist.barrier, rank,
                                 numel, iters, warmup, fresh)
    finally:
        dist.destroy_process_group()


def _fastcomm_body(store, rank, world, numel, iters, warmup, fresh=False, shared=False):
    import fastcomm as fc

    fc.init(store=store, rank=rank, world_size=world, timeout=STORE_TIMEOUT)
    try:
        lo = 2 * (rank // 2)
        group = fc.new_group([lo, lo + 1])  # only the two members call this
        return _timed_all_reduce(fc.all_reduce, group, fc.barrier, rank, numel, iters, warmup, fresh,
                                 fc.empty if shared else torch.empty)
    finally:
        fc.shutdown()


def _fastcomm_shared_body(store, rank, world, numel, iters, warmup, fresh=False):
    return _fastcomm_body(store, rank, world, numel, iters, warmup, fresh, shared=True)


BACKENDS = {"gloo": _gloo_body, "fastcomm": _fastcomm_body, "fc.empty": _fastcomm_shared_body}
LABELS = {"gloo": "torch Gloo", "fastcomm": "fastcomm", "fc.empty": "fastcomm, fc.empty", "mpi": "MPI"}
COLORS = {"gloo": "tab:blue", "fastcomm": "tab:orange", "fc.empty": "tab:red", "mpi": "tab:green"}  # same in both panels


# --------------------------------------------------------------------------------------------
# MPI (optional): the same loop under mpirun, in benchmarks/_mpi_pairs.py
# --------------------------------------------------------------------------------------------

def run_mpi(mpirun, world, numel, iters, warmup, fresh=False, timeout=JOB_TIMEOUT_S):
    """Per-rank seconds per op of the pairwise loop under MPI (the worker checks results)."""
    return run_mpi_worker(mpirun, world, MPI_SCRIPT, [numel, iters, warmup, "fresh" if fresh else "same"],
                          timeout)["per_op_s"]


# --------------------------------------------------------------------------------------------
# Reference: single-core memcpy bandwidth
# --------------------------------------------------------------------------------------------

def of_memcpy(cell, nbytes, memcpy_gbps):
    """A cell's algorithm bandwidth as a fraction of single-core memcpy's."""
    return "n/a" if "error" in cell else f"{nbytes / cell['per_op_s'] / 1e9 / memcpy_gbps:.2f}"


def memcpy_bandwidth(nbytes, reps):
    """Bytes copied per second by one core, best of ``reps`` copies of ``nbytes``."""
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    # torch splits a large copy_ over its intra-op threads: one thread, or it is not one core.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        dst.copy_(src)  # fault the pages in
        best = float("inf")
        for _ in range(reps):
            start = time.perf_counter()
            dst.copy_(src)
            best = min(best, time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)
    return nbytes / best


# --------------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------------

def measure_row(backends, world, numel, iters, warmup, mpirun, repeat, what, progress, fresh=False):
    """One table row: each backend's cell, {"runs": [per-rank seconds per op of each launch],
    "per_op_s": the median over launches of their max over ranks}, or with "error" once a
    launch failed. Launches alternate between backends, so that a burst of outside load on
    the machine hits them alike."""
    row = {b: {"iters": iters, "runs": []} for b in backends}
    for rep in range(repeat):
        for backend in backends:
            cell = row[backend]
            if "error" in cell:
                continue
            progress.launch(f"{what}: {backend}, launch {rep + 1}/{repeat}")
            try:
                if backend == "mpi":
                    cell["runs"].append(run_mpi(mpirun, world, numel, iters, warmup, fresh))
                else:
                    cell["runs"].append(run_job(BACKENDS[backend], world, numel, iters, warmup,
                                                   fresh, timeout=JOB_TIMEOUT_S))
            except JobError as e:
                print(f"  !! {what}, {backend}: {e}", file=sys.stderr, flush=True)
                cell["error"] = str(e)
                progress.skip(repeat - rep - 1)
    for cell in row.values():
        if "error" not in cell:
            cell["per_op_s"] = statistics.median(max(run) for run in cell["runs"])
    return row


def pair_times(run):
    """A launch's seconds per op by pair: the slower of its two ranks."""
    return [max(run[i], run[i + 1]) for i in range(0, len(run) - 1, 2)]


def fairness(cell):
    """(slowest pair, median pair) seconds per op, medians over launches, the largest
    slowest / median ratio of any one launch, and the launches whose every pair stayed within
    2x of their median."""
    pairs = [pair_times(run) for run in cell["runs"]]
    ratios = [max(p) / statistics.median(p) for p in pairs]
    return (statistics.median(max(p) for p in pairs), statistics.median(statistics.median(p) for p in pairs),
            max(ratios), sum(r <= 2 for r in ratios))


SKIPPED = {"skipped": True}  # torch Gloo's cells under --no-gloo


def fmt_us(cell):
    if "skipped" in cell:
        return "-"
    if "error" in cell:
        return "FAILED"
    return f"{cell['per_op_s'] * 1e6:,.1f}"


def fmt_ratio(slow, fast):
    if "skipped" in slow or "skipped" in fast:
        return "-"
    if "error" in slow or "error" in fast:
        return "n/a"
    ratio = slow["per_op_s"] / fast["per_op_s"]
    return f"{ratio:,.0f}x" if ratio >= 10 else f"{ratio:.1f}x"


def fmt_gbs(cell, nbytes):
    if "skipped" in cell or "error" in cell:
        return "n/a"
    return f"{nbytes / cell['per_op_s'] / 1e9:.2f}"


def parse_size(text):
    """A message size in bytes: a number with an optional K or M suffix (2**10, 2**20)."""
    scale = {"K": 2**10, "M": 2**20}.get(text[-1:].upper(), 1)
    try:
        nbytes = int(text[:-1] if scale > 1 else text) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 4096, 64K, 16M)") from None
    if nbytes < 4 or nbytes % 4:
        raise argparse.ArgumentTypeError(f"{text!r}: a size must be a positive multiple of 4 bytes "
                                         f"(float32 elements)")
    return nbytes


def fmt_size(nbytes):
    for unit, scale in (("MB", 2**20), ("KB", 2**10)):
        if nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def plain_log_y(ax):
    """Plain numbers ("600", "0.4") on a log y axis instead of "6 x 10^2"; the ticks between
    powers of ten get labels (2, 3, 5 only, so they do not crowd) when the axis spans less
    than a decade and a half, where a power of ten alone may leave it unlabelled."""
    from matplotlib.ticker import FuncFormatter

    def minor(v, _):
        lo, hi = ax.get_ylim()
        mantissa = round(v / 10 ** math.floor(math.log10(v)))
        return f"{v:g}" if hi / lo < 30 and mantissa in (2, 3, 5) else ""

    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(FuncFormatter(minor))


def write_plot(path, results, args, backends):
    """µs per op against pairs, and bandwidth against size; with a single pair count and a
    size sweep (or the reverse) only the panel that has a curve."""
    plt = pyplot_or_none(path)
    if plt is None:
        return
    show_mwe = len(args.pairs) > 1 or len(args.sizes) <= 1
    show_bw = len(args.sizes) > 1 or len(args.pairs) <= 1
    fig, axes = plt.subplots(1, show_mwe + show_bw, figsize=(5.5 * (show_mwe + show_bw), 4.2),
                             squeeze=False)
    axes = list(axes[0])
    if show_mwe:
        ax = axes.pop(0)
        for backend in backends:
            pts = [(p, results["mwe"][str(p)][backend]["per_op_s"] * 1e6) for p in args.pairs
                   if "error" not in results["mwe"][str(p)][backend]]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=LABELS[backend], color=COLORS[backend])
        ax.set(xscale="log", yscale="log", xlabel="pairs (ranks = 2 x pairs)",
               ylabel="µs per all_reduce (max over ranks)",
               title=f"Forum MWE: 10x10 float32 all_reduce, {os.cpu_count()} cores")
        ax.set_xticks(args.pairs, [str(p) for p in args.pairs])
        ax.set_xticks([], minor=True)  # no "3 x 10^0" labels between the pair counts
        plain_log_y(ax)
        ax.legend()
    if show_bw:
        ax = axes.pop(0)
        for backend in backends[:2] + ["fc.empty"] + backends[2:]:
            pts = [(n, n / results["large"][str(n)][backend]["per_op_s"] / 1e9) for n in args.sizes
                   if "error" not in results["large"][str(n)][backend]]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=LABELS[backend], color=COLORS[backend])
        # Labelled on the line, not in the legend, which would otherwise sit on top of it.
        ax.axhline(results["memcpy_GBps"], color="gray", linestyle="--")
        ax.annotate("1-core memcpy", (0.02, results["memcpy_GBps"]),
                    xycoords=("axes fraction", "data"), xytext=(0, -3),
                    textcoords="offset points", va="top", color="gray")
        ax.set(xscale="log", yscale="log", xlabel="tensor size (float32)",
               ylabel="algorithm bandwidth (GB/s)",
               title=f"One pair: all_reduce bandwidth by size, {os.cpu_count()} cores")
        ax.set_xticks(args.sizes, [fmt_size(n) for n in args.sizes])
        ax.set_xticks([], minor=True)
        plain_log_y(ax)
        ax.legend()
    save_plot(fig, path)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="short run: 128 iterations (unless --iters), 5 for large messages, 1 launch")
    ap.add_argument("--pairs", type=int, nargs="+", default=[1, 2, 4, 8],
                    help="pair counts for the MWE (default: 1 2 4 8)")
    ap.add_argument("--iters", type=int, default=None,
                    help="timed all_reduces per rank in the MWE (default 1024, --quick 128)")
    ap.add_argument("--repeat", type=int, default=None,
                    help="launches per measurement, the median is reported (default 3, "
                         "--quick 1)")
    ap.add_argument("--sizes", type=parse_size, nargs="+", default=list(LARGE_SIZES),
                    metavar="SIZE", help="tensor sizes for the one-pair large-message part, bytes "
                                         "with an optional K or M suffix (default: 1M 16M)")
    ap.add_argument("--reuse", action="store_true",
                    help="the MWE on one reused tensor after warm-up ops, the ranks entering the "
                         "timed loop through two barriers, instead of the forum post's loop (a "
                         "barrier, then a new torch.randn(10, 10) for every op; MPI: a new numpy "
                         "array)")
    ap.add_argument("--no-gloo", action="store_true",
                    help="leave torch Gloo out (its MWE takes the longest: seconds per launch)")
    add_launcher_arg(ap, default="spawn")
    ap.add_argument("--plot", metavar="FILE.png",
                    help="write a plot (needs matplotlib): µs per op against pairs, bandwidth "
                         "against size")
    ap.add_argument("--json", metavar="FILE", help="dump the raw numbers as JSON")
    args = ap.parse_args()
    if args.iters is None:
        args.iters = 128 if args.quick else 1024
    if args.repeat is None:
        args.repeat = 1 if args.quick else 3
    if args.iters < 1 or args.repeat < 1 or min(args.pairs) < 1:
        ap.error("--iters, --repeat and --pairs must be positive")
    args.sizes = sorted(set(args.sizes))  # the table and the plot go by size
    use_launcher(args.launcher)
    fresh = not args.reuse
    warmup = 20 if args.quick else 50
    mwe_warmup = 0 if fresh else warmup
    large_iters, large_warmup = (5, 2) if args.quick else (20, 5)

    torch.set_num_threads(1)  # see _launch._ctx: no parallel region in the parent before any fork
    t_start = time.monotonic()
    cores = os.cpu_count()
    mpirun, mpi_note = find_mpi()
    backends = ([] if args.no_gloo else ["gloo"]) + ["fastcomm"] + (["mpi"] if mpirun else [])

    print("# fastcomm benchmark: forum MWE and large messages, fastcomm vs torch Gloo\n")
    print(f"- command: {command()}")
    print(f"- machine: {machine()}")
    print(f"- torch {torch.__version__}, Python {platform.python_version()}, "
          f"MPI: {mpi_note if mpirun else 'not found (' + mpi_note + ')'}")
    env = {k: os.environ[k] for k in ("FASTCOMM_SPIN_NS", "FASTCOMM_YIELD_NS") if k in os.environ}
    print(f"- fastcomm waiting policy: {env or 'defaults'}; ranks started by the {launcher()} "
          f"launcher, each with 1 torch thread")
    print(flush=True)

    results = {"command": sys.argv, "cores": cores, "cpu": cpu_model(), "torch": torch.__version__,
               "mpi": mpi_note, "iters": args.iters, "warmup": mwe_warmup, "launcher": launcher(),
               "loop": "fresh" if fresh else "reuse", "repeat": args.repeat, "mwe": {}, "large": {}}

    def sized(count, nbytes, cap):
        # Below 1 MB an op is short: more of them (up to the MWE's count) keep a loop as long.
        return min(max(count, cap), count * max(1, 2**20 // nbytes))

    # The large messages also run fastcomm on fc.empty tensors, read in place by the pair.
    large_backends = backends[:2] + ["fc.empty"] + backends[2:]
    progress = Progress((len(args.pairs) * len(backends) + len(args.sizes) * len(large_backends)) * args.repeat)
    for pairs in args.pairs:
        results["mwe"][str(pairs)] = measure_row(backends, 2 * pairs, MWE_NUMEL, args.iters,
                                                 mwe_warmup, mpirun, args.repeat,
                                                 f"MWE, {pairs} pair(s)", progress, fresh)
    for nbytes in args.sizes:
        results["large"][str(nbytes)] = measure_row(
            large_backends, 2, nbytes // 4, sized(large_iters, nbytes, args.iters),
            sized(large_warmup, nbytes, warmup),
            mpirun, args.repeat, f"large, {fmt_size(nbytes)}", progress)
    results["memcpy_GBps"] = memcpy_bandwidth(16 * 2**20, 20) / 1e9
    if args.no_gloo:
        for part in ("mwe", "large"):
            for row in results[part].values():
                row["gloo"] = SKIPPED

    mpi_cols = mpirun is not None
    launches = f"median of {args.repeat} launches" if args.repeat > 1 else "1 launch"
    loop = (f"a barrier, then {args.iters} timed ops, each on a fresh torch.randn(10, 10) (MPI: a "
            f"new numpy array), as the forum post's loop" if fresh else
            f"{args.iters} timed ops on one reused tensor after {warmup} warm-up ops (--reuse)")
    print(f"## 1. Forum MWE: pairwise all_reduce of a 10x10 float32 tensor ({loop}; ranks "
          f"started by the {launcher()} launcher)\n")
    print(f"µs per op = the max over ranks of each rank's mean ({launches}); all pairs run "
          f"at once. "
          "The forum's Gloo numbers (48 cores): 381 µs/op for 1 pair, 2,021 µs/op for 8.\n")
    head = ["pairs", "ranks", "torch Gloo µs/op", "fastcomm µs/op"]
    head += ["MPI µs/op"] if mpi_cols else []
    head += ["fastcomm vs Gloo"] + (["fastcomm vs MPI"] if mpi_cols else [])
    rows = []
    for pairs in args.pairs:
        row = results["mwe"][str(pairs)]
        cells = [str(pairs), str(2 * pairs), fmt_us(row["gloo"]), fmt_us(row["fastcomm"])]
        cells += [fmt_us(row["mpi"])] if mpi_cols else []
        cells += [fmt_ratio(row["gloo"], row["fastcomm"])]
        cells += [fmt_ratio(row["mpi"], row["fastcomm"])] if mpi_cols else []
        rows.append(cells)
    print_table(head, rows)
    print("\n\"fastcomm vs X\" = X's time / fastcomm's time (how many times faster fastcomm is).")

    several = [p for p in args.pairs if p > 1]
    if several:
        print("\n### Fairness: every pair's µs per op (a pair's time: the slower of its ranks)\n")
        print("The job's time is its slowest pair's; \"worst launch\" is the largest slowest / median "
              "ratio of any single launch, \"fair launches\" how many launches had every pair within "
              "2x of their median.\n")
        rows = []
        for pairs in several:
            for backend in backends:
                cell = results["mwe"][str(pairs)][backend]
                if "error" in cell:
                    rows.append([str(pairs), LABELS[backend], "FAILED", "", "", "", ""])
                    continue
                slow, med, worst, fair = fairness(cell)
                rows.append([str(pairs), LABELS[backend], f"{slow * 1e6:,.1f}", f"{med * 1e6:,.1f}",
                             f"{slow / med:.1f}x", f"{worst:.1f}x", f"{fair}/{len(cell['runs'])}"])
        print_table(["pairs", "library", "slowest pair µs/op", "median pair µs/op", "slowest / median",
                     "worst launch", "fair launches"], rows, left=2)

    counts = sorted({sized(large_iters, n, args.iters) for n in args.sizes})
    ops = f"{counts[0]}" if len(counts) == 1 else f"{counts[0]}-{counts[-1]} (by size)"
    warm = sorted({sized(large_warmup, n, warmup) for n in args.sizes})
    warm = f"{warm[0]}" if len(warm) == 1 else f"{warm[0]}-{warm[-1]}"
    print(f"\n## 2. Large messages: one pair, all_reduce of float32 "
          f"({ops} timed ops after {warm} warm-up ops, {launches})\n")
    head = ["size", "torch Gloo µs/op", "Gloo GB/s", "fastcomm µs/op", "fastcomm GB/s",
            "fc.empty µs/op", "fc.empty GB/s"]
    head += ["MPI µs/op", "MPI GB/s"] if mpi_cols else []
    head += ["fastcomm vs Gloo", "fastcomm / memcpy", "fc.empty / memcpy"]
    head += ["fastcomm vs MPI", "fc.empty vs MPI"] if mpi_cols else []
    rows = []
    for nbytes in args.sizes:
        row = results["large"][str(nbytes)]
        shared = row["fc.empty"]
        cells = [fmt_size(nbytes), fmt_us(row["gloo"]), fmt_gbs(row["gloo"], nbytes),
                 fmt_us(row["fastcomm"]), fmt_gbs(row["fastcomm"], nbytes),
                 fmt_us(shared), fmt_gbs(shared, nbytes)]
        cells += [fmt_us(row["mpi"]), fmt_gbs(row["mpi"], nbytes)] if mpi_cols else []
        cells += [fmt_ratio(row["gloo"], row["fastcomm"]),
                  of_memcpy(row["fastcomm"], nbytes, results["memcpy_GBps"]),
                  of_memcpy(shared, nbytes, results["memcpy_GBps"])]
        cells += [fmt_ratio(row["mpi"], row["fastcomm"]), fmt_ratio(row["mpi"], shared)] if mpi_cols else []
        rows.append(cells)
    print_table(head, rows)
    print(f"\nGB/s = algorithm bandwidth: tensor bytes / time per op (1 GB = 1e9 B). "
          f"Reference: single-core memcpy of 16 MB here: {results['memcpy_GBps']:.2f} GB/s "
          f"(bytes copied / time, best of 20). fc.empty: the same all_reduce on tensors from "
          f"fastcomm.empty, which the pair reads from each other in place.")
    if not mpi_cols:
        print(f"\nMPI: not found ({mpi_note}); its columns are left out.")

    failed = [f"{part} {key} {backend}: {cell['error']}"
              for part in ("mwe", "large") for key, row in results[part].items()
              for backend, cell in row.items() if "error" in cell]
    return finish(results, failed, t_start, "Total benchmark time (after imports)", args.json,
                  args.plot, lambda path: write_plot(path, results, args, backends))


if __name__ == "__main__":
    sys.exit(main())
