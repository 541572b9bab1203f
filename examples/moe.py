#!/usr/bin/env python
"""Mixture of experts: tokens routed to experts on other ranks with all_to_all_single.

The ranks form expert groups of 4 (ranks 0-3, 4-7, ...); every rank holds one expert (a small
MLP), a local input layer and a batch of tokens. A fixed gate (the argmax of a fixed random
projection of each token) sends each token to one expert of its group. A step routes the
tokens as an MoE layer does: the ranks first swap how many tokens each sends to each expert
(an ``all_to_all_single`` of the counts), then the tokens themselves (an ``all_to_all_single``
with those uneven splits); each rank applies its expert and the results go back by a second
``all_to_all_single``, are scaled by the gate's probability and scored against the target.
The backward pass runs both exchanges in reverse (the splits swapped), so the experts learn
from every rank's loss and the input layers from the gradients their tokens bring back.
``comm`` below is the ``fastcomm`` module or ``torch.distributed``: same calls, same
arguments (groups from ``fc.new_groups``, or ``dist.new_group`` per group). Prints time per
step, time in the exchanges per step, and the training loss.

    python examples/moe.py [--nproc 4] [--steps 100] [--tokens 256] [--compare] [--device cuda]
    torchrun --nproc-per-node 8 examples/moe.py [--backend torch]

``--check`` also trains every rank's layers in one process (rank 0), the exchanges done by
slicing and concatenating, and reports the largest difference in parameters and losses.
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
from _common import add_common_args, add_device_arg, run, world_size  # noqa: E402

GROUP = 4  # experts (ranks) per expert group
DIM = 32  # token width


class Model:
    """One rank's layers: its input layer (applied before dispatch) and its expert."""

    def __init__(self, args, rank, device="cpu"):
        torch.manual_seed(args.seed * 1000 + rank)  # every expert its own start
        self.embed = nn.Linear(DIM, DIM).to(device)
        self.expert = nn.Sequential(nn.Linear(DIM, args.hidden), nn.Tanh(),
                                    nn.Linear(args.hidden, DIM)).to(device)

    def parameters(self):
        return [*self.embed.parameters(), *self.expert.parameters()]

    def flat(self):
        return nn.utils.parameters_to_vector(self.parameters()).detach()


class Task:
    """The fixed gate and the function to learn (a different one per expert slot, so the
    experts specialize), and every rank's token stream."""

    def __init__(self, args):
        g = torch.Generator().manual_seed(args.seed + 1)
        self.gate = torch.randn(DIM, GROUP, generator=g)
        self.teach = torch.randn(GROUP, DIM, DIM, generator=g) / DIM ** 0.5
        self.args = args

    def stream(self, rank):
        return torch.Generator().manual_seed(1000 * self.args.seed + 17 + rank)

    def batch(self, g):
        """This step's tokens and targets (the target of a token is its slot's function)."""
        x = torch.randn(self.args.tokens, DIM, generator=g)
        slot = (x @ self.gate).argmax(1)
        y = torch.tanh(torch.einsum("td,tde->te", x, self.teach[slot]))
        return x, y

    def route(self, x):
        """Each token's expert slot in the group, as the order that sorts the tokens by slot,
        the number of tokens per slot, and the gate's probability of the chosen slot."""
        logits = x @ self.gate.to(x.device)
        slot = logits.argmax(1)
        prob = logits.softmax(1).gather(1, slot[:, None])
        order = slot.argsort(stable=True)
        return order, torch.bincount(slot, minlength=GROUP), prob


class Timer:
    def __init__(self):
        self.s = 0.0


def all_to_all(comm, group, timer, inp, out_splits, in_splits):
    out = inp.new_empty((sum(out_splits), *inp.shape[1:]))
    t0 = time.perf_counter()
    comm.all_to_all_single(out, inp, out_splits, in_splits, group=group)
    timer.s += time.perf_counter() - t0
    return out


class Exchange(torch.autograd.Function):
    """all_to_all_single with a backward: each gradient block goes back to the rank whose
    rows it belongs to, i.e. the same exchange with the splits swapped."""

    @staticmethod
    def forward(ctx, inp, comm, group, timer, out_splits, in_splits):
        ctx.args = comm, group, timer, out_splits, in_splits
        return all_to_all(comm, group, timer, inp, out_splits, in_splits)

    @staticmethod
    def backward(ctx, grad):
        comm, group, timer, out_splits, in_splits = ctx.args
        return (all_to_all(comm, group, timer, grad.contiguous(), in_splits, out_splits),
                None, None, None, None, None)


def train_step(comm, group, timer, task, model, x, y):
    """One forward and backward of the MoE layer on this rank's tokens; returns the loss and
    how many tokens this rank's expert received. The caller applies the gradients."""
    order, counts, prob = task.route(x)
    recv_counts = all_to_all(comm, group, timer, counts, [1] * GROUP, [1] * GROUP)
    sent, got = counts.tolist(), recv_counts.tolist()
    tokens = model.embed(x)[order]  # grouped by destination, in group rank order
    h = model.expert(Exchange.apply(tokens, comm, group, timer, got, sent))
    back = Exchange.apply(h, comm, group, timer, sent, got)
    out = prob * back[order.argsort()]  # back in token order
    loss = nn.functional.mse_loss(out, y)
    loss.backward()
    return loss.item(), sum(got)


def body(lib, rank, world, args):
    comm = lib.comm
    lists = [list(range(i, i + GROUP)) for i in range(0, world, GROUP)]
    if lib.name == "fastcomm":
        group = fc.new_groups(lists)[rank // GROUP]  # same list on every rank
    else:
        group = [dist.new_group(r) for r in lists][rank // GROUP]  # every rank makes every group
    task = Task(args)
    model = Model(args, rank, args.device)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    data = task.stream(rank)

    warmup = min(3, args.steps // 5)
    losses, step_s, timer = [], 0.0, Timer()
    for step in range(args.steps):
        if step == warmup:
            step_s, timer.s = 0.0, 0.0
        x, y = (v.to(args.device) for v in task.batch(data))  # the same tokens on any device
        t0 = time.perf_counter()
        opt.zero_grad()
        loss, load = train_step(comm, group, timer, task, model, x, y)
        opt.step()
        step_s += time.perf_counter() - t0
        losses.append(loss)
    timed = args.steps - warmup

    flat = model.flat().cpu()
    rows = lib.all_gather(torch.cat([
        torch.tensor([step_s / timed, timer.s / timed, load] + losses, dtype=torch.float64),
        flat.double()]))
    if rank != 0:
        return None
    n = 3 + args.steps
    curve = rows[:, 3:n].mean(0).tolist()  # the mean over all ranks' tokens
    result = {
        "ranks": world, "groups": len(lists), "steps": args.steps, "tokens": args.tokens,
        "step_ms": rows[:, 0].max().item() * 1e3, "comm_ms": rows[:, 1].max().item() * 1e3,
        "loss_first": curve[0], "loss_final": curve[-1], "loss_curve": curve,
        "expert_load": rows[:, 2].long().tolist(),  # tokens per expert in the last step
    }
    if args.check:
        ref_params, ref_losses = reference(args, world)
        result["check_max_abs_diff"] = max(
            (rows[:, n:] - ref_params.double()).abs().max().item(),
            (rows[:, 3:n] - ref_losses).abs().max().item())
    return result


def reference(args, world):
    """The same training in one process, each exchange done by splitting and concatenating:
    every rank's final parameters and every rank's loss curve, as rows."""
    task = Task(args)
    models = [Model(args, r) for r in range(world)]
    opts = [torch.optim.SGD(m.parameters(), lr=args.lr) for m in models]
    streams = [task.stream(r) for r in range(world)]
    losses = [[] for _ in range(world)]
    for _ in range(args.steps):
        batches = [task.batch(g) for g in streams]
        for o in opts:
            o.zero_grad()
        for first in range(0, world, GROUP):
            members = range(first, first + GROUP)
            routes = {s: task.route(batches[s][0]) for s in members}
            sizes = {s: routes[s][1].tolist() for s in members}
            pieces = {s: models[s].embed(batches[s][0])[routes[s][0]].split(sizes[s])
                      for s in members}
            outs = {}  # expert j's output, split back by source
            for j, e in enumerate(members):
                h = models[e].expert(torch.cat([pieces[s][j] for s in members]))
                outs[e] = h.split([sizes[s][j] for s in members])
            total = 0
            for i, s in enumerate(members):
                order, _, prob = routes[s]
                back = torch.cat([outs[e][i] for e in members])
                loss = nn.functional.mse_loss(prob * back[order.argsort()], batches[s][1])
                losses[s].append(loss.item())
                total = total + loss
            total.backward()  # the group's losses: what each expert gets gradients from
        for o in opts:
            o.step()
    return (torch.stack([m.flat() for m in models]),
            torch.tensor(losses, dtype=torch.float64))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(ap, nproc=4, reference="the same training in one process")
    add_device_arg(ap)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--tokens", type=int, default=256, help="tokens per rank and step")
    ap.add_argument("--hidden", type=int, default=64, help="hidden units of each expert")
    ap.add_argument("--lr", type=float, default=2.0)
    args = ap.parse_args()
    if args.steps < 1 or args.tokens < 1:
        ap.error("--steps and --tokens must be positive")
    if world_size(args) % GROUP:
        ap.error(f"the number of ranks must be a multiple of {GROUP}, got {world_size(args)}")

    def title(world):
        return (f"mixture of experts: {world} ranks in {world // GROUP} expert group(s) of "
                f"{GROUP}, expert MLP {DIM}-{args.hidden}-{DIM}, {args.tokens} tokens per rank, "
                f"{args.steps} steps")

    def details(r):
        return "tokens per expert in the last step " + ", ".join(str(n) for n in r["expert_load"])

    return run(body, args, title, details)


if __name__ == "__main__":
    sys.exit(main())
