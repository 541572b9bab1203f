#!/usr/bin/env python
"""How much work one CUDA stream takes behind a long kernel before the host blocks, without
fastcomm.

A host runs ahead of its GPU only as far as the driver's command buffer lets it: once a
stream's buffer is full, the next enqueue waits until the GPU has made room. This probe puts a
long kernel (torch.cuda._sleep) on a fresh stream, then enqueues N entries of one kind behind
it, timing each call; the first call that takes longer than --block-ms marks the buffer full.
Kinds: a small kernel (an in-place add), a small device-to-device copy (cudaMemcpyAsync), an
event record, a wait on an event not yet reached (recorded behind a long kernel on another
stream), a stream write and a stream wait of a 32-bit word in mapped host memory
(cuStreamWriteValue32 / cuStreamWaitValue32, as fastcomm's IPC links order their chunks),
"torch op": what torch's NCCL backend puts on its stream per op (an event wait, one kernel, an
event record), "ipc op": the eight entries fastcomm's IPC link put on its stream per small pair
all_reduce with FASTCOMM_DEVICE_IPC_FUSE_BYTES=0 (event wait, value wait, copy, value write,
value wait, kernel, value write, event record), and "ipc op fused": the six it puts there by
default (event wait, value wait, kernel, value wait, kernel, event record; a small kernel stands
in for the copy-and-flag and fold-and-flag kernels).

Each CUDA setting in --settings (environment assignments; "default" for none), e.g.
CUDA_SCALE_LAUNCH_QUEUES=4x, which grows the buffer, gets a process of its own; its kinds run
one after another there, each on a fresh stream.
Usage: python benchmarks/device_launch_queue.py [--n 4000] [--kinds kernel,copy,...]
       [--settings default,CUDA_SCALE_LAUNCH_QUEUES=4x] [--json FILE]
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import time

KINDS = ("kernel", "copy", "record", "wait_event", "write_value", "wait_value", "torch_op", "ipc_op",
         "ipc_op_fused")


def _driver():
    """cuStreamWriteValue32 / cuStreamWaitValue32 from the driver torch loaded."""
    lib = ctypes.CDLL("libcuda.so.1")
    fns = {}
    for name in ("cuStreamWriteValue32", "cuStreamWaitValue32"):
        for sym in (name + "_v2", name):
            f = getattr(lib, sym, None)
            if f is not None:
                f.restype = ctypes.c_int
                f.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
                fns[name] = f
                break
        else:
            raise RuntimeError(f"the driver has no {name}")
    return fns


def _probe(kind, n, sleep_cycles, block_ms):
    """One kind in this process: entries enqueued before the first blocking call, and times."""
    import torch

    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    other = torch.cuda.Stream()
    x = torch.zeros(100, device=dev)
    y = torch.zeros(100, device=dev)
    word = torch.zeros(16, dtype=torch.int32, pin_memory=True)  # mapped: UVA pinned memory
    wptr = word.data_ptr()
    drv = _driver() if kind in ("write_value", "wait_value", "ipc_op", "ipc_op_fused") else None
    events = [torch.cuda.Event() for _ in range(n + 1)]

    def write(v):
        rc = drv["cuStreamWriteValue32"](ctypes.c_void_p(s.cuda_stream), wptr, v, 0)
        if rc != 0:
            raise RuntimeError(f"cuStreamWriteValue32: CUresult {rc}")

    def wait_value():
        rc = drv["cuStreamWaitValue32"](ctypes.c_void_p(s.cuda_stream), wptr, 0, 0)  # GEQ 0: met
        if rc != 0:
            raise RuntimeError(f"cuStreamWaitValue32: CUresult {rc}")

    # Warm, before timing: the kernels, the copy, the driver's stream memory operations, and the
    # events (torch makes a CUDA event at its first record).
    with torch.cuda.stream(s):
        x.add_(1)
        y.copy_(x)
        torch.cuda._sleep(1000)
        if drv is not None:
            write(0)
            wait_value()
    for e in events:
        e.record(other)
    torch.cuda.synchronize()

    pending = torch.cuda.Event()
    with torch.cuda.stream(other):
        torch.cuda._sleep(int(sleep_cycles))
        pending.record(other)

    k0, k1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    k0.record(s)
    with torch.cuda.stream(s):
        torch.cuda._sleep(int(sleep_cycles))
    k1.record(s)
    times = []
    t0 = time.perf_counter()
    with torch.cuda.stream(s):
        for i in range(n):
            a = time.perf_counter()
            if kind == "kernel":
                x.add_(1)
            elif kind == "copy":
                y.copy_(x)
            elif kind == "record":
                events[i].record(s)
            elif kind == "wait_event":
                s.wait_event(pending)
            elif kind == "write_value":
                write(i + 1)
            elif kind == "wait_value":
                wait_value()
            elif kind == "torch_op":
                s.wait_event(pending)
                x.add_(1)
                events[i].record(s)
            elif kind == "ipc_op_fused":
                s.wait_event(pending)
                wait_value()
                y.add_(1)
                wait_value()
                x.add_(1)
                events[i].record(s)
            else:  # ipc_op
                s.wait_event(pending)
                wait_value()
                y.copy_(x)
                write(i + 1)
                wait_value()
                x.add_(1)
                write(i + 1)
                events[i].record(s)
            times.append(time.perf_counter() - a)
    host_s = time.perf_counter() - t0
    torch.cuda.synchronize()
    kernel_s = k0.elapsed_time(k1) / 1e3
    first_block = next((i for i, t in enumerate(times) if t * 1e3 > block_ms), None)
    return {
        "kind": kind,
        "n": n,
        "kernel_s": kernel_s,
        "host_s": host_s,
        "first_block": first_block,  # calls that returned at once before it (None: never blocked)
        "block_ms": max(times) * 1e3,
        "us_per_call_before_block": (sum(times if first_block is None else times[:first_block])
                                     / max(1, n if first_block is None else first_block) * 1e6),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=4000, help="entries (ops for ipc_op) enqueued behind the kernel")
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--settings", default="default,CUDA_SCALE_LAUNCH_QUEUES=4x",
                    help="comma-separated; each a space-separated list of VAR=VALUE, or 'default'")
    ap.add_argument("--sleep-cycles", type=float, default=2e9, help="torch.cuda._sleep cycles (about 1 s on an H100)")
    ap.add_argument("--block-ms", type=float, default=5.0, help="a call longer than this counts as blocked")
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds per setting's process")
    ap.add_argument("--json")
    ap.add_argument("--_in_child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._in_child:
        for kind in args._in_child.split(","):
            print(json.dumps(_probe(kind, args.n, args.sleep_cycles, args.block_ms)), flush=True)
        return
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    bad = sorted(set(kinds) - set(KINDS))
    if bad or not kinds:
        ap.error(f"--kinds: some of {', '.join(KINDS)} (got {bad or 'none'})")
    if args.n < 1:
        ap.error("--n: at least 1")
    import torch

    if not torch.cuda.is_available():
        print("device_launch_queue: torch sees no CUDA device here", file=sys.stderr)
        sys.exit(2)
    results = []
    print(f"entries one stream took behind a long kernel before the host blocked (> {args.block_ms} ms), "
          f"{args.n} enqueued")
    print(f"{'setting':<34} {'kind':<12} {'before block':>12} {'us/call':>8} {'longest ms':>11} {'kernel s':>9}")
    for setting in [x.strip() for x in args.settings.split(",") if x.strip()]:
        env = dict(os.environ)
        if setting != "default":
            env.update(kv.split("=", 1) for kv in setting.split())
        cmd = [sys.executable, os.path.abspath(__file__), "--_in_child", ",".join(kinds), "--n", str(args.n),
               "--sleep-cycles", str(args.sleep_cycles), "--block-ms", str(args.block_ms)]
        try:
            p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
            out, err = p.stdout, p.stderr.strip()[-300:]
        except subprocess.TimeoutExpired as e:
            out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
            err = f"timed out after {args.timeout:.0f} s"
        got = {}
        for line in out.splitlines():
            try:
                r = json.loads(line)
                got[r["kind"]] = r
            except (ValueError, KeyError, TypeError):
                pass
        for kind in kinds:
            r = got.get(kind)
            if r is None:
                print(f"{setting:<34} {kind:<12} failed: {err}")
                results.append({"setting": setting, "kind": kind, "error": err})
                continue
            r["setting"] = setting
            results.append(r)
            fb = "never" if r["first_block"] is None else str(r["first_block"])
            print(f"{setting:<34} {kind:<12} {fb:>12} {r['us_per_call_before_block']:>8.2f} "
                  f"{r['block_ms']:>11.1f} {r['kernel_s']:>9.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    if any("error" in r for r in results):
        sys.exit(1)


if __name__ == "__main__":
    main()
