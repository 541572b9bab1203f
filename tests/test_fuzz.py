"""Fuzz: random families of groups, random collectives, ops, dtypes and sizes, issued blocking,
async and in batches, each result checked against a reference computed locally.

Every rank derives the same plan from one seed, so all of them agree on the groups and on the
global order of ops without talking; each rank issues, in that order, the ops of the groups it
is in (the one rule fastcomm asks of callers). Inputs are small integers drawn from a
generator seeded per (round, op, rank), so each rank can rebuild every member's input and
compute the exact result itself (sums and products of small integers are exact in every dtype
used; AVG is compared with a tolerance).

Why this cannot deadlock: take the earliest op in the plan that has not completed. Each of its
members has completed every earlier op of its own, so it has issued this one (blocking, async
or inside a batch it posted), and posted ops progress without anyone waiting on them.

The default run is bounded for CI; more on demand:
    FASTCOMM_FUZZ_ROUNDS=500 FASTCOMM_FUZZ_SEED=7 python -m pytest -q tests/test_fuzz.py
"""
from __future__ import annotations

import os
import random

import pytest
import torch
from torch.distributed import ReduceOp

import fastcomm as fc
import harness

SEED = int(os.environ.get("FASTCOMM_FUZZ_SEED", "20261122"))
ROUNDS = int(os.environ.get("FASTCOMM_FUZZ_ROUNDS", "40"))
OPS_PER_ROUND = 10

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64,
          torch.int8, torch.uint8]
# Small sizes dominate (the hot path); a few exceed one shared-memory record (the rings are
# 64 KiB here, so records carry ~16 KiB) and the reduce-scatter + all-gather threshold.
SIZES = [0, 1, 2, 3, 7, 64, 100, 1023, 4097, 70_001]
SIZE_WEIGHTS = [3, 4, 2, 3, 3, 2, 3, 2, 2, 1]
KINDS = ["all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter",
         "reduce_scatter_tensor", "barrier"]
MODES = ["blocking", "async", "batch"]
ENV = {"FASTCOMM_SHM_RING_BYTES": str(64 * 1024), "FASTCOMM_RSAG_THRESHOLD": str(16 * 1024)}


def _family(rng: random.Random, world: int):
    """A random family of groups: every size 1..world, overlapping, some rank lists repeated
    (distinct groups over the same ranks)."""
    groups = [list(range(world))]
    for _ in range(rng.randint(6, 10)):
        k = rng.choice([1, 2, 2, 2, 3, 3, world])
        groups.append(sorted(rng.sample(range(world), min(k, world))))
    groups.append(list(groups[-1]))  # a second group over the same list
    return groups


def _plan(world: int):
    rng = random.Random(SEED)
    groups = _family(rng, world)
    rounds = []
    for _ in range(ROUNDS):
        ops = []
        for _ in range(OPS_PER_ROUND):
            gi = rng.randrange(len(groups))
            kind = rng.choice(KINDS)
            dtype = rng.choice(DTYPES)
            redops = [ReduceOp.SUM, ReduceOp.MAX, ReduceOp.MIN, ReduceOp.PRODUCT]
            if dtype.is_floating_point:
                redops.append(ReduceOp.AVG)
            ops.append({
                "group": gi,
                "kind": kind,
                "dtype": dtype,
                "n": rng.choices(SIZES, SIZE_WEIGHTS)[0],
                "redop": rng.choice(redops),
                "root": rng.randrange(len(groups[gi])),
                "mode": rng.choice(MODES),
            })
        rounds.append(ops)
    return groups, rounds


def _input(rnd: int, i: int, rank: int, n: int, dtype: torch.dtype, redop, salt: int = 0):
    """The tensor global rank `rank` contributes to op i of round rnd (any rank can rebuild it)."""
    g = torch.Generator().manual_seed(SEED * 1_000_003 + rnd * 10_007 + i * 101 + rank * 7 + salt)
    if redop == ReduceOp.PRODUCT:
        lo, hi = (1, 3) if dtype == torch.uint8 else (-1, 3)  # |product| <= 2**4 = 16
        v = torch.randint(lo, hi, (n,), generator=g)
        v[v == 0] = 1
    elif dtype == torch.uint8:
        v = torch.randint(0, 20, (n,), generator=g)
    else:
        v = torch.randint(-20, 21, (n,), generator=g)
    return v.to(dtype)


def _reduce(parts, redop, dtype):
    acc = torch.stack([p.to(torch.float64) for p in parts])
    if redop == ReduceOp.SUM:
        r = acc.sum(0)
    elif redop == ReduceOp.AVG:
        r = acc.sum(0) / len(parts)
    elif redop == ReduceOp.PRODUCT:
        r = acc.prod(0)
    elif redop == ReduceOp.MAX:
        r = acc.max(0).values if len(parts) else acc
    else:
        r = acc.min(0).values
    return r.to(dtype)


def _check(got, want, what):
    if want.dtype.is_floating_point:
        torch.testing.assert_close(got, want, rtol=1e-2 if want.element_size() == 2 else 1e-6,
                                   atol=1e-2 if want.element_size() == 2 else 1e-6, msg=what)
    else:
        assert torch.equal(got, want), f"{what}: got {got[:8].tolist()}, want {want[:8].tolist()}"


class _Op:
    """One planned op on this rank: builds its arguments and, afterwards, checks its outputs."""

    def __init__(self, rank, rnd, i, spec, ranks, group):
        self.spec, self.ranks, self.group = spec, ranks, group
        self.what = (f"round {rnd} op {i}: {spec['kind']} {spec['dtype']} n={spec['n']} "
                     f"{spec['redop']} group {ranks} mode {spec['mode']}")
        k, n, dt, op = len(ranks), spec["n"], spec["dtype"], spec["redop"]
        me = ranks.index(rank)
        inp = lambda r, salt=0: _input(rnd, i, r, n, dt, op, salt)  # noqa: E731
        kind = spec["kind"]
        if kind == "all_reduce":
            self.t = inp(rank)
            self.want = [_reduce([inp(r) for r in ranks], op, dt)]
            self.got = [self.t]
            self.call = lambda **kw: fc.all_reduce(self.t, op=op, group=group, **kw)
        elif kind == "broadcast":
            src = ranks[spec["root"]]
            self.t = inp(rank)
            self.want, self.got = [inp(src)], [self.t]
            self.call = lambda **kw: fc.broadcast(self.t, src=src, group=group, **kw)
        elif kind == "all_gather":
            self.outs = [torch.full((n,), 99, dtype=dt) for _ in range(k)]
            self.want, self.got = [inp(r) for r in ranks], self.outs
            self.call = lambda **kw: fc.all_gather(self.outs, inp(rank), group=group, **kw)
        elif kind == "all_gather_into_tensor":
            self.out = torch.full((k * n,), 99, dtype=dt)
            self.want, self.got = [torch.cat([inp(r) for r in ranks])], [self.out]
            self.call = lambda **kw: fc.all_gather_into_tensor(self.out, inp(rank), group=group, **kw)
        elif kind == "reduce_scatter":
            # member r contributes input_list[j] = inp(r, salt=j) for destination j
            self.out = torch.full((n,), 99, dtype=dt)
            self.want = [_reduce([inp(r, me) for r in ranks], op, dt)]
            self.got = [self.out]
            ins = [inp(rank, j) for j in range(k)]
            self.call = lambda **kw: fc.reduce_scatter(self.out, ins, op=op, group=group, **kw)
        elif kind == "reduce_scatter_tensor":
            self.out = torch.full((n,), 99, dtype=dt)
            full = [torch.cat([inp(r, 1000 + j) for j in range(k)]) for r in ranks]
            self.want = [_reduce([f[me * n:(me + 1) * n] for f in full], op, dt)]
            self.got = [self.out]
            mine = full[me].clone()
            self.call = lambda **kw: fc.reduce_scatter_tensor(self.out, mine, op=op, group=group, **kw)
        else:
            self.want, self.got = [], []
            self.call = lambda **kw: fc.barrier(group=group, **kw)

    def verify(self):
        for j, (g, w) in enumerate(zip(self.got, self.want)):
            _check(g, w, f"{self.what}, output {j}")


def _fuzz_body(rank, world):
    lists, rounds = _plan(world)
    groups = fc.new_groups(lists)
    checked = 0
    for rnd, ops in enumerate(rounds):
        pending, batch_ops, batch = [], [], None
        for i, spec in enumerate(ops):
            ranks = lists[spec["group"]]
            if rank not in ranks:
                continue
            op = _Op(rank, rnd, i, spec, ranks, groups[spec["group"]])
            mode = spec["mode"]
            if mode == "batch":
                if batch is None:
                    batch = fc.batch()
                    batch.__enter__()
                op.call()
                batch_ops.append(op)
                continue
            if batch is not None:  # a non-batched op ends the batch being collected
                batch.__exit__(None, None, None)
                pending.append((batch, batch_ops))
                batch, batch_ops = None, []
            if mode == "async":
                pending.append((op.call(async_op=True), [op]))
            else:
                op.call()
                op.verify()
                checked += 1
        if batch is not None:
            batch.__exit__(None, None, None)
            pending.append((batch, batch_ops))
        for w, done in pending:
            w.wait()
            assert w.is_completed() and w.exception() is None
            for op in done:
                op.verify()
                checked += 1
    return checked


@pytest.mark.parametrize("world", [3, 4])
def test_fuzz_random_groups_collectives_dtypes_sizes(world):
    res = harness.run(_fuzz_body, world, timeout=240, env=ENV)
    assert all(c > 0 for c in res), res
