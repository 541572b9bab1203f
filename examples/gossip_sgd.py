#!/usr/bin/env python
"""Gossip SGD: every rank trains its own replica of a small MLP on its own data, and after
each step averages its parameters with one partner; the pairing changes every step.

Every rank draws the same random permutation each step (a shared seed) and pairs with its
neighbour in it, so over a run each rank meets every other: world*(world-1)/2 pair groups,
made once up front (fastcomm: ``fc.new_groups`` with the same list on every rank; torch:
``dist.new_group`` per pair, called by every rank). The averaging is one ``fc.batch()`` of an
``all_reduce(op=AVG)`` per parameter tensor; on torch Gloo (which has no AVG), async SUMs then a
division. Prints time per step, communication time per step, the loss of the replicas on a
shared evaluation set before and after training, and how far apart the replicas ended.

    python examples/gossip_sgd.py [--nproc 4] [--steps 300] [--compare] [--backend torch]
    torchrun --nproc-per-node 4 examples/gossip_sgd.py [--compare]

``--check`` also trains every replica in one process (rank 0, no communication) and reports
the largest difference from the distributed run's parameters.
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fastcomm as fc  # noqa: E402
from _common import Teacher, add_common_args, run  # noqa: E402

IN_DIM = 32
EVAL_SAMPLES = 1024


def make_model(args):
    """The same initial replica on every rank (data-parallel training starts from one model)."""
    torch.manual_seed(args.seed)
    return nn.Sequential(nn.Linear(IN_DIM, args.hidden), nn.Tanh(), nn.Linear(args.hidden, 1))


def data_stream(args, rank):
    """Each rank's own samples (so the replicas drift apart between averagings)."""
    return torch.Generator().manual_seed(1000 * args.seed + 17 + rank)


def partner(perm, rank):
    """This step's partner: the neighbour in the shared permutation (None: odd one out)."""
    pos = perm.index(rank)
    other = pos ^ 1
    return perm[other] if other < len(perm) else None


def pairings(args, world):
    """The same sequence of permutations on every rank."""
    g = torch.Generator().manual_seed(args.seed + 2)
    for _ in range(args.steps):
        yield torch.randperm(world, generator=g).tolist()


def average_fastcomm(params, group):
    with fc.batch() as b:  # one fused step for all the parameter tensors
        for p in params:
            fc.all_reduce(p, op=fc.ReduceOp.AVG, group=group)
    b.wait()


def average_torch(params, group):
    # Gloo has no ReduceOp.AVG: sum, then halve.
    works = [dist.all_reduce(p, op=dist.ReduceOp.SUM, group=group, async_op=True) for p in params]
    for w in works:
        w.wait()
    for p in params:
        p.div_(2)


def sgd_step(model, opt, x, y):
    opt.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()


def eval_loss(model, eval_set):
    with torch.no_grad():
        return nn.functional.mse_loss(model(eval_set[0]), eval_set[1]).item()


def body(lib, rank, world, args):
    pairs = list(itertools.combinations(range(world), 2))
    if lib.name == "fastcomm":
        groups = dict(zip(pairs, fc.new_groups(pairs)))  # same list on every rank
        average = average_fastcomm
    else:
        groups = {p: dist.new_group(list(p)) for p in pairs}  # every rank makes every group
        average = average_torch

    model = make_model(args)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    params = [p.detach() for p in model.parameters()]  # same storage, outside autograd
    teacher = Teacher(args.seed, IN_DIM)
    eval_set = teacher.sample(EVAL_SAMPLES, torch.Generator().manual_seed(args.seed + 3))
    loss_first = eval_loss(model, eval_set)
    data = data_stream(args, rank)

    warmup = min(10, args.steps // 5)
    step_s = comm_s = 0.0
    for step, perm in enumerate(pairings(args, world)):
        t0 = time.perf_counter()
        sgd_step(model, opt, *teacher.sample(args.batch, data))
        t1 = time.perf_counter()
        other = partner(perm, rank)
        if other is not None:
            average(params, groups[tuple(sorted((rank, other)))])
        t2 = time.perf_counter()
        if step >= warmup:
            step_s += t2 - t0
            comm_s += t2 - t1
    timed = max(1, args.steps - warmup)

    flat = nn.utils.parameters_to_vector(params)
    mine = torch.cat([torch.tensor([step_s / timed, comm_s / timed, eval_loss(model, eval_set)],
                                   dtype=flat.dtype), flat])
    rows = lib.all_gather(mine)
    if rank != 0:
        return None
    replicas = rows[:, 3:]
    mean = replicas.mean(0)
    nn.utils.vector_to_parameters(mean, model.parameters())
    result = {
        "ranks": world, "steps": args.steps, "params": flat.numel(),
        "step_ms": rows[:, 0].max().item() * 1e3, "comm_ms": rows[:, 1].max().item() * 1e3,
        "loss_first": loss_first, "loss_final": rows[:, 2].mean().item(),
        "replica_losses": rows[:, 2].tolist(), "loss_of_mean": eval_loss(model, eval_set),
        # How far the replicas ended apart: the largest distance from their mean, relative.
        "replica_spread": ((replicas - mean).norm(dim=1).max() / mean.norm()).item(),
    }
    if args.check:
        ref = reference(args, world)
        result["check_max_abs_diff"] = (replicas - ref).abs().max().item()
    return result


def reference(args, world):
    """The same training in one process, the averaging done by hand: every replica's final
    parameters, as rows."""
    models = [make_model(args) for _ in range(world)]
    opts = [torch.optim.SGD(m.parameters(), lr=args.lr) for m in models]
    teacher = Teacher(args.seed, IN_DIM)
    streams = [data_stream(args, r) for r in range(world)]
    for perm in pairings(args, world):
        for m, o, g in zip(models, opts, streams):
            sgd_step(m, o, *teacher.sample(args.batch, g))
        with torch.no_grad():
            for i in range(0, world - 1, 2):
                a, b = models[perm[i]], models[perm[i + 1]]
                for pa, pb in zip(a.parameters(), b.parameters()):
                    avg = (pa + pb) / 2
                    pa.copy_(avg)
                    pb.copy_(avg)
    return torch.stack([nn.utils.parameters_to_vector(m.parameters()).detach() for m in models])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(ap, nproc=4, reference="the same training in one process")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=32, help="samples per step and rank")
    ap.add_argument("--hidden", type=int, default=64, help="hidden units of the MLP")
    ap.add_argument("--lr", type=float, default=0.05)
    args = ap.parse_args()
    if args.steps < 1:
        ap.error("--steps must be positive")

    def title(world):
        pairs = world * (world - 1) // 2
        return (f"gossip SGD: {world} ranks, {args.steps} steps, MLP {IN_DIM}-{args.hidden}-1, "
                f"partners change every step ({pairs} pair groups)")

    def details(r):
        return (f"replicas {r['replica_spread']:.1e} apart (relative), "
                f"averaged model's loss {r['loss_of_mean']:.4g}")

    return run(body, args, title, details)


if __name__ == "__main__":
    sys.exit(main())
