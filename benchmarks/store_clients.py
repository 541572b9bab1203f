"""What a new client of torch's TCPStore costs the whole job, with no fastcomm in it.

    .venv/bin/python benchmarks/store_clients.py --world 8 16 32 --launcher spawn

W ranks each hold a store client (made by the launcher); once all are in, every rank makes one
more (``store.clone()``, a new connection to the same server) at the same moment and times it.
torch's TCPStore server accepts a client on its one event-loop thread and there formats the
client's address with getnameinfo, a reverse DNS lookup: while the resolver answers, every
client of the store waits. The report also times that lookup alone, in a row, as the server
makes it (``--lookups``). Why fastcomm opens no store client of its own (docs/design.md,
"Connections across hosts").
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
from datetime import timedelta

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _launch  # noqa: E402


def _body(store, rank, world):
    if store.add("in", 1) == world:
        store.set("all-in", "1")
    store.wait(["all-in"], timedelta(seconds=120))
    t0 = time.perf_counter()
    client = store.clone()
    dt = time.perf_counter() - t0
    client.set(f"cloned/{rank}", "1")
    # Nobody closes its clients before every rank has timed its own.
    if store.add("out", 1) == world:
        store.set("all-out", "1")
    store.wait(["all-out"], timedelta(seconds=120))
    return dt


def _lookups(n):
    """Seconds per reverse lookup of a loopback client's address, as the server sees it
    (IPv4-mapped: the server listens on IPv6)."""
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        try:
            socket.getnameinfo(("::ffff:127.0.0.1", 1, 0, 0), socket.NI_NUMERICSERV)
        except OSError:
            pass
        out.append(time.perf_counter() - t0)
    return sorted(out)


def _plot(results, path):
    plt = _launch.pyplot_or_none(path)
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(5, 4))
    rows = results["clone"]
    ax.plot([r["world"] for r in rows], [r["median_s"] for r in rows], marker="o", label="median rank")
    ax.plot([r["world"] for r in rows], [r["max_s"] for r in rows], marker="o", label="slowest rank")
    ax.set_xlabel("ranks making a client at once")
    ax.set_ylabel("seconds for store.clone()")
    ax.legend()
    _launch.save_plot(fig, path)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, nargs="+", default=[8, 16, 32])
    ap.add_argument("--lookups", type=int, default=100)
    _launch.add_launcher_arg(ap, default="spawn")
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=None)
    a = ap.parse_args()
    _launch.use_launcher(a.launcher)
    t_start = time.monotonic()
    _launch.print_header("New TCPStore clients made at once (no fastcomm)")
    print(f"- load average at start: {os.getloadavg()[0]:.2f}\n")
    results, failures, rows = {"clone": []}, [], []
    for w in a.world:
        try:
            secs = sorted(_launch.run_job(_body, w, timeout=300))
        except _launch.JobError as e:
            failures.append(f"W={w}: {e}")
            continue
        med, top = statistics.median(secs), secs[-1]
        slow = sum(s > 1.0 for s in secs)
        results["clone"].append({"world": w, "median_s": med, "max_s": top, "over_1s": slow})
        rows.append([str(w), f"{med:.3f}", f"{top:.3f}", str(slow)])
    _launch.print_table(["ranks", "clone s, median", "clone s, slowest", "ranks over 1 s"], rows)
    look = _lookups(a.lookups)
    results["lookups"] = look
    print(f"\n{a.lookups} reverse lookups of ::ffff:127.0.0.1 in a row: median "
          f"{statistics.median(look) * 1e3:.2f} ms, slowest {look[-1]:.2f} s, "
          f"{sum(x > 1.0 for x in look)} over 1 s (RES_OPTIONS={os.environ.get('RES_OPTIONS', 'unset')})")
    print(f"- load average at end: {os.getloadavg()[0]:.2f}")
    return _launch.finish(results, failures, t_start, "Total", a.json, a.plot, lambda p: _plot(results, p))


if __name__ == "__main__":
    sys.exit(main())
