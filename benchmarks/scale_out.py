"""What a rank pays, against the world size, to join a job spread over hosts and talk to its
two ring neighbours: fastcomm and torch Gloo (eager and lazy connections) in the same run.

    .venv/bin/python benchmarks/scale_out.py --world 4 8 16 32 --hosts every 4 --plot scale_out.png

Hosts are simulated (FASTCOMM_HOST_ID per rank for fastcomm; torch Gloo never shares memory, so
its layout does not matter to it): ``every`` gives each rank a host of its own, a number H puts
W/H consecutive ranks on each of H hosts. Each rank makes a group with each neighbour, (r-1, r)
and (r, r+1) mod W (fastcomm.new_group by the two members; torch's new_group by every rank for every ring
pair, in the same order, as its docs require: with use_local_synchronization=True, by the two
members only, the second pair's ProcessGroupGloo constructor hung on both members here, torch
2.13), runs ROUNDS all_reduces of 1,000
float32 on each and checks the results. Per rank (the median rank, and the most any rank
paid), it reports:

- init s: the init call (fastcomm.init; torch's init_process_group), in the process;
- init s after last: from the moment the last rank of the job called init to this rank's
  return from it: init without the wait for ranks still starting (forking, importing,
  connecting to the store: the launcher's cost, the same for every library);
- init cpu ms: the CPU time the process spent in the init call (all its threads): with more
  ranks than cores, init after last is at least about W times this over the cores;
- ring s: making the two groups and the first round of all_reduces (where connections made on
  first use are paid);
- store ops: calls to the store (round trips), init and ring together, counted by a wrapper
  around each rank's TCPStore client (benchmarks/init_store_ops.py), clones included;
- sockets: sockets the process opened from just before init to after the ring, and still
  holds (/proc/self/fd): connections to peers, listening sockets, store clients of its own
  (the session's store client, made before, is not counted; nor are the socket pairs of the
  launcher's pipes that a forked rank inherits from the ranks forked before it);
- job s: the job's wall time, forking the processes included.

torch lazy is torch Gloo with TORCH_GLOO_LAZY_INIT=1 (connections on first use of a pair).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _launch  # noqa: E402
from init_store_ops import CountingStore  # noqa: E402

ROUNDS = 5
NUMEL = 1000
IMPLS = ("fastcomm", "torch eager", "torch lazy")


def _sockets():
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        except OSError:
            pass
    return n


def _pairs(rank, world):
    """This rank's two neighbour groups, each as sorted ranks, in the order every member makes
    them (by lowest rank: no member waits on one that waits on it)."""
    return sorted({tuple(sorted((rank, (rank + d) % world))) for d in (-1, 1)})


def _body(tcp, rank, world, impl, hosts):
    per_host = world // hosts
    os.environ["FASTCOMM_HOST_ID"] = f"h{rank // per_host}"
    if impl == "torch lazy":
        os.environ["TORCH_GLOO_LAZY_INIT"] = "1"
    store = CountingStore(tcp)
    timeout = timedelta(seconds=120)
    if impl == "fastcomm":
        import fastcomm as fc  # (loading the extension is starting the process, not init)
    sockets0 = _sockets()
    start = time.time()  # one clock for every rank of the job (init s after last)
    c0 = time.process_time()
    t0 = time.perf_counter()
    if impl == "fastcomm":
        fc.init(store=store, rank=rank, world_size=world, timeout=timeout)
        t1 = time.perf_counter()
        c1 = time.process_time()
        groups = [fc.new_group(p) for p in _pairs(rank, world)]

        def all_reduce(t, g):
            fc.all_reduce(t, group=g)
    else:
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
        t1 = time.perf_counter()
        c1 = time.process_time()
        made = {}
        for i in range(world):
            p = tuple(sorted((i, (i + 1) % world)))
            if p not in made:
                made[p] = dist.new_group(list(p))
        groups = [made[p] for p in _pairs(rank, world)]

        def all_reduce(t, g):
            dist.all_reduce(t, group=g)
    pairs = _pairs(rank, world)
    for i in range(ROUNDS):
        for p, g in zip(pairs, groups):
            t = torch.full((NUMEL,), float(rank + i))
            all_reduce(t, g)
            want = float(sum(p) + 2 * i)
            if not torch.equal(t, torch.full((NUMEL,), want)):
                raise AssertionError(f"rank {rank}, group {list(p)}, round {i}: {t[0].item()} != {want}")
        if i == 0:
            t2 = time.perf_counter()
    sockets = _sockets() - sockets0
    ops = sum(c[0] for c in store.counts.values())
    # Nobody leaves before its neighbours are done with it (async: a ring of blocking
    # barriers would wait on itself).
    if impl == "fastcomm":
        for w in [fc.barrier(group=g, async_op=True) for g in groups]:
            w.wait()
        fc.shutdown()
    else:
        for w in [dist.barrier(group=g, async_op=True) for g in groups]:
            w.wait()
        dist.destroy_process_group()
    return {"init_s": t1 - t0, "init_cpu_ms": (c1 - c0) * 1e3, "ring_s": t2 - t1, "store_ops": ops, "sockets": sockets,
            "start": start, "init_end": start + (t1 - t0)}


def measure(world, hosts, impl):
    t0 = time.monotonic()
    res = _launch.run_job(_body, world, impl, hosts, timeout=600)
    job_s = time.monotonic() - t0
    out = {"job_s": job_s}
    last = max(r.pop("start") for r in res)
    for r in res:
        r["init_last_s"] = max(0.0, r.pop("init_end") - last)
    for k in res[0]:
        vals = sorted(r[k] for r in res)
        out[k] = [statistics.median(vals), vals[-1]]
    return out


def _plot(results, path):
    plt = _launch.pyplot_or_none(path)
    if plt is None:
        return
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    for ax, key, label in zip(axes, ("sockets", "store_ops", "init_last_s"),
                              ("sockets per rank", "store ops per rank",
                               "init s after the last rank called it (median rank)")):
        for layout, rows in results["runs"].items():
            for impl in IMPLS:
                pts = [(r["world"], r[impl][key][0]) for r in rows if impl in r]
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=f"{impl}, hosts={layout}")
        ax.set_xlabel("world size")
        ax.set_ylabel(label)
        ax.set_xscale("log", base=2)
    axes[0].legend(fontsize=7)
    _launch.save_plot(fig, path)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, nargs="+", default=[4, 8, 16, 32])
    ap.add_argument("--hosts", nargs="+", default=["every", "4"],
                    help="'every' (a host per rank) and/or host counts H (W/H ranks each)")
    ap.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS)
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=None)
    a = ap.parse_args()
    t_start = time.monotonic()
    _launch.print_header("Scale-out: what a rank pays to join and talk to two neighbours")
    print(f"- load average at start: {os.getloadavg()[0]:.2f}\n")
    results, failures = {"runs": {}}, []
    head = ["W", "hosts"] + [f"{impl}: {k}" for impl in a.impls
                             for k in ("init s", "init s after last", "init cpu ms", "ring s", "store ops",
                                       "sockets", "job s")]
    rows = []
    for layout in a.hosts:
        results["runs"][layout] = []
        for w in a.world:
            hosts = w if layout == "every" else int(layout)
            if w % hosts or hosts > w:
                continue
            row = {"world": w, "hosts": hosts}
            cells = [str(w), str(hosts)]
            for impl in a.impls:
                try:
                    m = measure(w, hosts, impl)
                except _launch.JobError as e:
                    failures.append(f"W={w} hosts={hosts} {impl}: {e}")
                    cells += ["failed"] * 7
                    continue
                row[impl] = m
                cells += [f"{m['init_s'][0]:.2f}/{m['init_s'][1]:.2f}",
                          f"{m['init_last_s'][0]:.2f}/{m['init_last_s'][1]:.2f}",
                          f"{m['init_cpu_ms'][0]:.0f}/{m['init_cpu_ms'][1]:.0f}",
                          f"{m['ring_s'][0]:.2f}/{m['ring_s'][1]:.2f}",
                          f"{m['store_ops'][0]:.0f}/{m['store_ops'][1]:.0f}",
                          f"{m['sockets'][0]:.0f}/{m['sockets'][1]:.0f}", f"{m['job_s']:.1f}"]
            results["runs"][layout].append(row)
            rows.append(cells)
            print(" | ".join(cells), flush=True, file=sys.stderr)
    print("Per rank: median rank / most any rank paid.\n")
    _launch.print_table(head, rows)
    print(f"\n- load average at end: {os.getloadavg()[0]:.2f}")
    return _launch.finish(results, failures, t_start, "Total", a.json, a.plot, lambda p: _plot(results, p))


if __name__ == "__main__":
    sys.exit(main())
