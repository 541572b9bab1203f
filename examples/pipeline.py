#!/usr/bin/env python
"""Pipeline parallelism: an MLP split into stages, one rank each, trained on micro-batches.

Each step cuts the batch into micro-batches. Stage s runs its layers on micro-batch m as soon
as the activations arrive from stage s-1 and sends its output on to s+1, then the gradients
travel back the same way (a GPipe schedule: all forwards, then all backwards, the gradients
accumulated over the micro-batches before one SGD update). A stage posts the receives of all
its micro-batches at once with ``irecv`` and sends with ``isend``, so it works on micro-batch
m+1 while m is still on the wire and several micro-batches are in flight; ``--blocking`` uses
``send``/``recv`` instead. The calls are the same on both libraries: ``comm`` below is the
``fastcomm`` module or ``torch.distributed``. Prints time per step, the time each stage spends
in communication calls (waiting for its neighbours included: the pipeline's bubble), and the
training loss.

    python examples/pipeline.py [--nproc 2] [--steps 50] [--micro-batches 4] [--compare] [--device cuda]
    torchrun --nproc-per-node 4 examples/pipeline.py [--backend torch]

``--check`` also trains the unsplit model in one process (rank 0) on the same batches and
reports the largest difference between the two loss curves.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fastcomm as fc  # noqa: E402
from _common import Teacher, add_common_args, add_device_arg, run  # noqa: E402

IN_DIM = 32


def make_blocks(args, stages):
    """The whole model, built identically on every rank, as the list of its blocks (a Linear,
    then a Tanh except after the last): each stage keeps its own slice."""
    torch.manual_seed(args.seed)
    n = stages * args.layers_per_stage
    dims = [IN_DIM] + [args.hidden] * (n - 1) + [1]
    return [nn.Sequential(nn.Linear(dims[i], dims[i + 1]), *([nn.Tanh()] if i < n - 1 else []))
            for i in range(n)]


def batches(args):
    """Every step's micro-batches, the same on every rank (stage 0 uses the inputs, the last
    stage the targets)."""
    teacher = Teacher(args.seed, IN_DIM)
    g = torch.Generator().manual_seed(args.seed + 5)
    for _ in range(args.steps):
        x, y = teacher.sample(args.micro_batches * args.micro_batch_size, g)
        yield x.chunk(args.micro_batches), y.chunk(args.micro_batches)


class Timed:
    """Adds the time spent in communication calls (posting, and waiting for completion)."""

    def __init__(self):
        self.s = 0.0

    def __call__(self, fn, *a, **kw):
        t0 = time.perf_counter()
        out = fn(*a, **kw)
        self.s += time.perf_counter() - t0
        return out


def train_step(comm, stage, stages, model, xs, ys, width, blocking, timed):
    """One GPipe step on this stage; returns the loss (last stage) or None. The caller applies
    the accumulated gradients."""
    first, last, m_count = stage == 0, stage == stages - 1, len(xs)
    acts = [torch.empty(len(x), width, device=xs[0].device) for x in xs]  # this stage's inputs, from stage-1
    pending = []
    if not blocking:
        # All the step's activation receives posted now: each completes as its data arrives.
        recv_acts = [] if first else [timed(comm.irecv, a, src=stage - 1) for a in acts]
    outs, ins, loss = [], [], 0.0
    for m in range(m_count):
        if first:
            inp = xs[m]
        else:
            if blocking:
                timed(comm.recv, acts[m], src=stage - 1)
            else:
                timed(recv_acts[m].wait)
            inp = acts[m].requires_grad_()
        out = model(inp)
        if last:
            out = nn.functional.mse_loss(out, ys[m]) / m_count  # the batch's mean
            loss += out.item()
        elif blocking:
            timed(comm.send, out.detach(), dst=stage + 1)
        else:
            pending.append(timed(comm.isend, out.detach(), dst=stage + 1))
        outs.append(out)
        ins.append(inp)
    if not last:
        grads = [torch.empty_like(o) for o in outs]  # d(loss)/d(output), from stage+1
        if not blocking:  # likewise all the gradient receives, once their shapes are known
            recv_grads = [timed(comm.irecv, g, src=stage + 1) for g in grads]
    for m in range(m_count):
        if last:
            outs[m].backward()
        else:
            if blocking:
                timed(comm.recv, grads[m], src=stage + 1)
            else:
                timed(recv_grads[m].wait)
            outs[m].backward(grads[m])
        if not first:
            if blocking:
                timed(comm.send, ins[m].grad, dst=stage - 1)
            else:
                pending.append(timed(comm.isend, ins[m].grad, dst=stage - 1))
    for w in pending:  # the sends' tensors must stay untouched until they complete
        timed(w.wait)
    return loss if last else None


def body(lib, rank, world, args):
    comm = lib.comm
    blocks = make_blocks(args, world)
    k = args.layers_per_stage
    model = nn.Sequential(*blocks[rank * k:(rank + 1) * k]).to(args.device)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    width = IN_DIM if rank == 0 else args.hidden

    warmup = min(3, args.steps // 5)
    losses, step_s, timed = [], 0.0, Timed()
    for step, (xs, ys) in enumerate(batches(args)):
        xs, ys = [x.to(args.device) for x in xs], [y.to(args.device) for y in ys]
        if step == warmup:
            step_s, timed.s = 0.0, 0.0
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = train_step(comm, rank, world, model, xs, ys, width, args.blocking, timed)
        opt.step()
        step_s += time.perf_counter() - t0
        losses.append(loss if loss is not None else 0.0)
    timed_steps = args.steps - warmup

    rows = lib.all_gather(torch.tensor([step_s / timed_steps, timed.s / timed_steps] + losses,
                                       dtype=torch.float64))
    if rank != 0:
        return None
    curve = rows[-1, 2:].tolist()  # the last stage computes the loss
    result = {
        "stages": world, "steps": args.steps, "micro_batches": args.micro_batches,
        "step_ms": rows[:, 0].max().item() * 1e3, "comm_ms": rows[:, 1].max().item() * 1e3,
        "comm_ms_per_stage": (rows[:, 1] * 1e3).tolist(),
        "loss_first": curve[0], "loss_final": curve[-1], "loss_curve": curve,
    }
    if args.check:
        ref = reference(args, world)
        result["check_max_abs_diff"] = max(abs(a - b) for a, b in zip(curve, ref))
    return result


def reference(args, stages):
    """The unsplit model trained in one process on the same micro-batches: its loss curve."""
    model = nn.Sequential(*make_blocks(args, stages))
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    curve = []
    for xs, ys in batches(args):
        opt.zero_grad()
        loss = 0.0
        for x, y in zip(xs, ys):
            part = nn.functional.mse_loss(model(x), y) / len(xs)
            part.backward()
            loss += part.item()
        opt.step()
        curve.append(loss)
    return curve


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(ap, nproc=2, reference="the unsplit model's loss curve")
    add_device_arg(ap)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument("--micro-batch-size", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=256, help="width of the hidden layers")
    ap.add_argument("--layers-per-stage", type=int, default=2)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--blocking", action="store_true",
                    help="send/recv one micro-batch at a time instead of isend/irecv")
    args = ap.parse_args()
    if args.steps < 1 or args.micro_batches < 1 or args.layers_per_stage < 1:
        ap.error("--steps, --micro-batches and --layers-per-stage must be positive")

    def title(world):
        return (f"pipeline: {world} stages of {args.layers_per_stage} layers (width "
                f"{args.hidden}), {args.micro_batches} micro-batches of {args.micro_batch_size} "
                f"per step, {args.steps} steps, {'send/recv' if args.blocking else 'isend/irecv'}")

    def details(r):
        return "communication per stage " + ", ".join(f"{c:.2f}" for c in r["comm_ms_per_stage"]) + " ms"

    return run(body, args, title, details)


if __name__ == "__main__":
    sys.exit(main())
