"""What the plan-graph tests share: a plan over overlapping groups of 2 to 5 (sizes 0, 1 and
odd; all_reduce SUM and MAX, broadcast, all_gather_into_tensor, reduce_scatter_tensor), its
inputs refilled in place for each run, and each run's results against a local reference."""
from __future__ import annotations

import torch
import torch.distributed as dist

from _device import DEV, dsync
from _helpers import _DTYPES, fold, gen

import fastcomm as fc

LISTS5 = [[0, 1], [1, 2], [3, 4], [0, 1, 2], [1, 2, 3, 4], [0, 1, 2, 3, 4]]


def same(got, ref, what):
    got = got.cpu()
    assert torch.equal(got, ref), f"{what}: got {got.tolist()}, expected {ref.tolist()}"


class PlanCases:
    """The ops of one rank, issued by record() inside the caller's ``with fc.plan()``."""

    def __init__(self, rank):
        self.rank = rank
        self.cases = []  # (tensors, kind, ranks, numel, dtype name, op, seed)

    def __len__(self):
        return len(self.cases)

    def record(self, groups, lists=LISTS5):
        for gi, (ranks, g) in enumerate(zip(lists, groups)):
            if self.rank not in ranks:
                continue
            for numel in (0, 1, 7):
                for dt, op in (("float32", "SUM"), ("int64", "MAX")):
                    t = torch.zeros(numel, dtype=_DTYPES[dt], device=DEV)
                    fc.all_reduce(t, op=getattr(dist.ReduceOp, op), group=g)
                    self.cases.append(((t,), "all_reduce", ranks, numel, dt, op, 100 * gi + 10 * numel))
            b = torch.zeros(5, dtype=torch.float64, device=DEV)
            fc.broadcast(b, src=ranks[-1], group=g)
            self.cases.append(((b,), "broadcast", ranks, 5, "float64", None, 100 * gi + 3))
            ag = torch.zeros(len(ranks) * 3, dtype=torch.int32, device=DEV)
            src = torch.zeros(3, dtype=torch.int32, device=DEV)
            fc.all_gather_into_tensor(ag, src, group=g)
            self.cases.append(((ag, src), "all_gather", ranks, 3, "int32", None, 100 * gi + 5))
            rs = torch.zeros(9, dtype=torch.float32, device=DEV)
            rin = torch.zeros(9 * len(ranks), dtype=torch.float32, device=DEV)
            fc.reduce_scatter_tensor(rs, rin, group=g)
            self.cases.append(((rs, rin), "reduce_scatter", ranks, 9, "float32", "SUM", 100 * gi + 7))

    def refill(self, r):
        """Run r's inputs, written in place (a graph reads the same buffers at each run)."""
        for ts, kind, ranks, numel, dt, op, seed in self.cases:
            if kind == "all_reduce":
                ts[0].copy_(gen(self.rank, seed + r, dt, numel, op))
            elif kind == "broadcast":
                ts[0].copy_(gen(self.rank, seed + r, dt, numel))
            else:
                ts[1].copy_(gen(self.rank, seed + r, dt, ts[1].numel()))

    def check(self, r, how):
        for ts, kind, ranks, numel, dt, op, seed in self.cases:
            what = f"{how} {r}: {kind} {ranks} numel {numel} {dt}"
            if kind == "all_reduce":
                same(ts[0], fold([gen(q, seed + r, dt, numel, op) for q in ranks], op), what)
            elif kind == "broadcast":
                same(ts[0], gen(ranks[-1], seed + r, dt, numel), what)
            elif kind == "all_gather":
                same(ts[0], torch.cat([gen(q, seed + r, dt, numel) for q in ranks]), what)
            else:
                me = ranks.index(self.rank)
                full = fold([gen(q, seed + r, dt, numel * len(ranks)) for q in ranks], "SUM")
                same(ts[0], full[numel * me:numel * (me + 1)], what)

    def tensors(self):
        return [ts for ts, *_ in self.cases]


def pair_plan(t, group):
    """A captured plan of one all_reduce of ``t`` over ``group``."""
    with fc.plan() as p:
        fc.all_reduce(t, group=group)
    return p.capture()


def others_go_on(rank, other, msgs):
    """Ranks 0 and 2 all_reduce over ``other`` (a group the dead or stalled rank is not in) and
    note the result, which is [4.0, 4.0] when the group still works."""
    if rank in (0, 2):
        x = torch.full((2,), float(rank + 1), device=DEV)
        fc.all_reduce(x, group=other)
        dsync()
        msgs.append(x.tolist())
