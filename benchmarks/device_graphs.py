#!/usr/bin/env python
"""A plan of pair all_reduces captured into a CUDA graph (p.capture()) and replayed, against the
same plan started without a graph and against torch NCCL's captured ops, in the same run.

Each pair of ranks records --ops all_reduces (AVG, so repeated runs stay finite) of --numel
float32 each on its pair group, then, per rank:
- fc graph: g = p.capture(); --replays replays back to back, one g.wait() and a synchronize;
- fc plan: the same plan's p.start() --plain-iters times (each started once the last is done);
- torch graph: the same ops on a torch NCCL pair group captured with torch.cuda.graph, replayed
  --replays times.
Reported per side: wall microseconds per op (the loop's time over runs x ops; runs are waited
for in chunks of 50, and stop early past --side-budget seconds, --torch-budget for torch's, so a
slow transport shortens the run instead of overrunning the step), the runs done, whether the
results match the reference (the pair's average), and what the graph's pairs go over: a link of
the plan's own where the ranks share a host and IPC links are on, else a communicator. A side that fails is reported as such; the others still run,
and each rank prints its figures as soon as it has them.

--fake runs the fastcomm sides on the CPU fake of CUDA/NCCL (FASTCOMM_FAKE_DEVICE=1): a check of
the script, not a measurement.

Usage: python benchmarks/device_graphs.py [--world 2] [--ops 64] [--replays 1000] [--plain-iters 200]
       [--numel 16] [--side-budget S] [--torch-budget S] [--fake] [--json F]
       [--launcher spawn|fork|torchrun]
"""
from __future__ import annotations

import argparse
import sys
import time
import traceback
from datetime import timedelta

from _device_bench import add_device_args, parse_device_args, take_device
from _launch import run_job, write_json


def _rank(store, rank, world, args):
    import torch
    import torch.distributed as dist

    fake = args.fake
    device, sync = take_device(rank, world, fake, "graphs")
    pair = [rank - rank % 2, rank - rank % 2 + 1]
    other = pair[1] if rank == pair[0] else pair[0]
    out = {"rank": rank}

    import fastcomm as fc

    def tensors():
        return [torch.full((args.numel,), float(rank + 1 + i), device=device) for i in range(args.ops)]

    def check(ts):
        return all(t.cpu().tolist() == [((rank + 1 + i) + (other + 1 + i)) / 2] * args.numel for i, t in enumerate(ts))

    def side(name, body):
        try:
            out[f"{name}_us_per_op"], out[f"{name}_runs"], out[f"{name}_ok"] = body()
            print(f"rank {rank} {name}: {out[f'{name}_us_per_op']:.2f} us/op over {out[f'{name}_runs']} runs, "
                  f"results ok: {out[f'{name}_ok']}", flush=True)  # seen even if a later side hangs
        except Exception as e:  # reported; the other sides still run
            out[f"{name}_error"] = f"{type(e).__name__}: {e}"[:300]
            traceback.print_exc()

    def timed(run_once, wait_all, total, budget=None):
        """Runs in chunks, each waited for, until `total` runs or `budget` seconds: a slow
        transport (ranks sharing a GPU over NCCL's sockets) shortens the run, never the step."""
        budget = args.side_budget if budget is None else budget
        done, t0 = 0, time.perf_counter()
        while done < total:
            k = min(50, total - done)
            for _ in range(k):
                run_once()
            wait_all()
            done += k
            if time.perf_counter() - t0 > budget:
                break
        return (time.perf_counter() - t0) / (done * args.ops) * 1e6, done

    fc.init(store=dist.PrefixStore("fc/", store), rank=rank, world_size=world, timeout=timedelta(seconds=60))
    fg = fc.new_group(pair, timeout=timedelta(seconds=20))  # a hung replay raises, it does not stall
    avg = dist.ReduceOp.AVG

    def fc_graph():
        ts = tensors()
        with fc.plan() as p:
            for t in ts:
                fc.all_reduce(t, op=avg, group=fg)
        links = fc._state._engine.device_debug(device, "plan_ipc_links", 0)
        g = p.capture()
        linked = fc._state._engine.device_debug(device, "plan_ipc_links", 0) > links
        out["fc_graph_over"] = "IPC link" if linked else "communicator"
        g.replay()  # warm up
        g.wait()
        sync()

        def wait_all():
            g.wait()
            sync()
        us, runs = timed(g.replay, wait_all, args.replays)
        return us, runs, check(ts)

    def fc_plan():
        ts = tensors()
        with fc.plan() as p:
            for t in ts:
                fc.all_reduce(t, op=avg, group=fg)
        p.start().wait()
        sync()
        us, runs = timed(lambda: p.start().wait(), sync, args.plain_iters)
        return us, runs, check(ts)

    side("fc_graph", fc_graph)
    side("fc_plan", fc_plan)
    fc.shutdown()

    if not fake:
        def torch_graph():
            dist.init_process_group("nccl", store=dist.PrefixStore("torch/", store), rank=rank, world_size=world,
                                    device_id=torch.device("cuda", torch.cuda.current_device()))
            tg = [dist.new_group([i, i + 1]) for i in range(0, world, 2)][rank // 2]
            ts = tensors()
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):  # warm up: the communicator exists before the capture
                for t in ts[:3]:
                    dist.all_reduce(t, op=avg, group=tg)
            torch.cuda.current_stream().wait_stream(s)
            sync()
            ts = tensors()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for t in ts:
                    dist.all_reduce(t, op=avg, group=tg)
            graph.replay()
            sync()
            us, runs = timed(graph.replay, sync, args.replays, args.torch_budget)
            return us, runs, check(ts)

        side("torch_graph", torch_graph)
        try:
            dist.destroy_process_group()
        except Exception:
            pass
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--ops", type=int, default=64)
    ap.add_argument("--replays", type=int, default=1000)
    ap.add_argument("--plain-iters", type=int, default=200)
    ap.add_argument("--numel", type=int, default=16)
    ap.add_argument("--side-budget", type=float, default=10, help="seconds per fastcomm side before its runs stop early")
    ap.add_argument("--torch-budget", type=float, default=10, help="seconds for torch's side before its runs stop early")
    add_device_args(ap, job_timeout=120)
    args = parse_device_args(ap)
    res = run_job(_rank, args.world, args, timeout=args.job_timeout)
    sides = ["fc_graph", "fc_plan"] + ([] if args.fake else ["torch_graph"])
    print(f"{args.world} ranks, a plan of {args.ops} pair all_reduces of {args.numel} float32; "
          f"{args.replays} replays ({args.plain_iters} plain starts); {'fake' if args.fake else 'GPU'}")
    print(f"{'':>12} {'us/op (worst rank)':>19} {'runs':>6} {'results ok':>11}")
    bad = False
    for s in sides:
        errs = [r[f"{s}_error"] for r in res if f"{s}_error" in r]
        if errs:
            print(f"{s:>12} FAILED: {errs[0]}")
            bad = True
            continue
        ok = all(r[f"{s}_ok"] for r in res)
        bad = bad or not ok
        over = res[0].get(f"{s}_over", "")
        print(f"{s:>12} {max(r[f'{s}_us_per_op'] for r in res):>19.2f} {min(r[f'{s}_runs'] for r in res):>6} "
              f"{str(ok):>11}  {over}")
    if args.json:
        write_json(args.json, res)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
