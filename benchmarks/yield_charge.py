#!/usr/bin/env python
"""What a sched_yield costs a process in the kernel's books, without fastcomm.

Two processes of one session, both pinned to CPU 0: one computes, the other waits for a second
by calling ``os.sched_yield()`` in a loop (then, for comparison, by sleeping 50 µs at a time).
The waiter's CPU time and virtual runtime (``se.sum_exec_runtime``, ``se.vruntime`` in
/proc/self/sched, which needs a kernel with CONFIG_SCHED_DEBUG) before and after. On an EEVDF
kernel that charges yields (Linux 6.18 here), every yield beside a runnable task advances the
yielder's virtual runtime by a whole slice (``se.slice``), whatever CPU it used: ranks that
wait by yielding count, against the other ranks of their scheduling group, as if they had
computed. Usage: ``python benchmarks/yield_charge.py [--seconds 1]``."""
from __future__ import annotations

import argparse
import os
import platform
import time


def _sched():
    out = {}
    with open("/proc/self/sched") as f:
        for line in f:
            key, _, value = line.partition(":")
            key = key.strip()
            if key in ("se.vruntime", "se.sum_exec_runtime", "se.slice"):
                out[key] = float(value)
    return out


def _wait(how, seconds):
    """(calls, CPU ms, virtual runtime ms) of waiting `seconds` by `how` beside a busy task."""
    a = _sched()
    n, end = 0, time.monotonic() + seconds
    while time.monotonic() < end:
        if how == "yield":
            os.sched_yield()
        else:
            time.sleep(50e-6)
        n += 1
    b = _sched()
    return n, b["se.sum_exec_runtime"] - a["se.sum_exec_runtime"], b["se.vruntime"] - a["se.vruntime"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=1.0)
    args = ap.parse_args()
    try:
        _sched()
    except OSError:
        raise SystemExit("/proc/self/sched is missing (a kernel without CONFIG_SCHED_DEBUG)")
    os.sched_setaffinity(0, {0})
    busy = os.fork()
    if busy == 0:  # the task that computes, on the same CPU, in the same session
        end = time.monotonic() + 2 * args.seconds + 1
        while time.monotonic() < end:
            pass
        os._exit(0)
    try:
        time.sleep(0.1)
        with open("/proc/sys/kernel/sched_autogroup_enabled") as f:
            autogroup = f.read().strip()
        slice_ms = _sched().get("se.slice", float("nan")) / 1e6
        print(f"Linux {platform.release()}, sched_autogroup_enabled={autogroup}, slice {slice_ms:.2f} ms; "
              f"waiting {args.seconds:g} s on CPU 0 beside a busy process\n")
        print("| waiting by | calls | CPU used (ms) | virtual runtime charged (ms) | charged per call (ms) |")
        print("| :--- | ---: | ---: | ---: | ---: |")
        for how in ("yield", "sleep 50 µs"):
            n, cpu, vrun = _wait("yield" if how == "yield" else "sleep", args.seconds)
            print(f"| {how} | {n:,} | {cpu:.2f} | {vrun:.1f} | {vrun / max(n, 1):.3f} |")
    finally:
        os.kill(busy, 9)
        os.waitpid(busy, 0)
    print("\nA yielder charged about a slice per call is charged as if it had computed; a sleeper's "
          "charge follows the queue it rejoins (its lag is kept), not its calls.")


if __name__ == "__main__":
    main()
