"""reduce, gather, scatter, all_to_all and all_to_all_single, against references computed locally.

Every rank regenerates every member's input from (global rank, case seed) and checks what the
collective produced with plain torch ops (reduce folds left to right in group-rank order, in the
tensor's own dtype, as the engine promises). Members other than the root must find their tensors
unchanged.

Covered: sizes 0, 1, odd, larger than the shared-memory ring; float32, float64, int64, int8,
bfloat16; every reduce op; roots at every group rank, named by global rank (dst/src) and by
group rank (group_dst/group_src); pairs, a triple without rank 0, the world of 4, the default
group, groups of one, overlapping groups with everything in flight at once, simulated hosts
(Gloo, and bulk transfers); blocking, async_op=True and ``fc.batch()`` forms; all_to_all with equal and unequal (zero included) sizes, all_to_all_single
with no splits, explicit equal splits and uneven splits. bool, and BAND/BOR/BXOR on integer and
bool tensors, in all_reduce, reduce and reduce_scatter_tensor. Argument errors name rank, group
and argument and send nothing; mismatched calls fail with DistBackendError (not by timeout)
every member whose messages meet them, and leave the group usable. The same collectives through
torch.distributed with the "fastcomm" backend."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

import harness
from _helpers import expect, fold, gen
from test_collectives import BIG, OVERLAP_LISTS, RING_ENV, issued, same, settle, shape_groups

import fastcomm as fc

OPS = {"SUM": ReduceOp.SUM, "AVG": ReduceOp.AVG, "MIN": ReduceOp.MIN, "MAX": ReduceOp.MAX,
       "PRODUCT": ReduceOp.PRODUCT}
DTYPES = {"float32": torch.float32, "float64": torch.float64, "int64": torch.int64, "int8": torch.int8,
          "bfloat16": torch.bfloat16}
KINDS = ("reduce", "gather", "scatter", "all_to_all", "all_to_all_uneven", "all_to_all_single",
         "all_to_all_single_uneven")
SHORT = dict(init_timeout=10.0)  # the op timeout too: a hang would show as "timed out"


def mk(rank, seed, dt, n, op=None, vk="int"):
    """gen() for the dtypes used here (int8 from int64's small integers: exact for every op)."""
    if dt == "int8":
        return gen(rank, seed, "int64", n, op=op).to(torch.int8)
    return gen(rank, seed, dt, n, op=op, kind=vk)


def block(src, dst, seed, n, uneven):
    """Elements (all_to_all) or rows (all_to_all_single) global rank ``src`` sends ``dst``:
    ``n``, or, uneven, 0 to about n (0 for some pairs whatever n)."""
    if not uneven:
        return n
    return ((src * 7 + dst * 3 + seed) % 4) * n // 3 + (src + dst + seed) % 2


def issue(kind, g, ranks, me, seed, dt, n, op=None, vk="int", async_op=False, variant=0):
    """Issues ``kind`` on group ``g`` for global rank ``me``; returns an Issued whose check()
    compares with the local reference. ``variant`` picks among equivalent spellings."""
    k = len(ranks)
    gr = ranks.index(me)
    dtype = DTYPES[dt]
    root_gr = (seed + variant) % k
    root = ranks[root_gr]
    what = (f"rank {me}, group {ranks}, {kind} {dt} n={n} op={op} {vk} async={async_op} seed={seed} "
            f"variant={variant}")

    def at_root(name):  # the root by global rank, or by group rank
        return {name: root} if variant % 2 == 0 else {"group_" + name: root_gr}

    if kind == "reduce":
        what += f" dst={root}"
        t = mk(me, seed, dt, n, op, vk)
        before = t.clone()
        w = fc.reduce(t, op=OPS[op], group=g, async_op=async_op, **at_root("dst"))

        def check():
            if me != root:
                return same(t, before, what + " (a non-root's tensor changed)"), None
            return same(t, fold([mk(r, seed, dt, n, op, vk) for r in ranks], op), what), None

    elif kind == "gather":
        what += f" dst={root}"
        t = mk(me, seed, dt, n)
        before = t.clone()
        lst = [torch.full((n,), -99, dtype=dtype) for _ in range(k)] if me == root else (
            None if variant % 3 else [])
        w = fc.gather(t, lst, group=g, async_op=async_op, **at_root("dst"))

        def check():
            err = same(t, before, what + " (input changed)")
            for i, r in enumerate(ranks):
                if err is None and me == root:
                    err = same(lst[i], mk(r, seed, dt, n), what + f" gather_list[{i}]")
            return err, None

    elif kind == "scatter":
        what += f" src={root}"
        t = torch.full((n,), -99, dtype=dtype)
        lst = [mk(100 * root + i, seed, dt, n) for i in range(k)] if me == root else (None if variant % 3 else [])
        befores = [x.clone() for x in lst or []]
        w = fc.scatter(t, lst, group=g, async_op=async_op, **at_root("src"))

        def check():
            err = same(t, mk(100 * root + gr, seed, dt, n), what)
            for x, b in zip(lst or [], befores):
                err = err or same(x, b, what + " (scatter_list changed)")
            return err, None

    elif kind.startswith("all_to_all_single"):
        uneven = kind.endswith("_uneven")
        cols = 1 + 2 * (variant % 2)  # 2-d tensors of 3 columns on odd variants
        send_rows = [block(me, q, seed, n, uneven) for q in ranks]
        recv_rows = [block(q, me, seed, n, uneven) for q in ranks]
        pieces = [mk(1000 * me + q, seed, dt, r * cols).reshape(r, cols) for q, r in zip(ranks, send_rows)]
        inp = torch.cat(pieces)
        before = inp.clone()
        out = torch.full((sum(recv_rows), cols), -99, dtype=dtype)
        if uneven or variant % 3 == 0:
            splits = dict(output_split_sizes=recv_rows, input_split_sizes=send_rows)
        else:  # equal parts: no splits, or empty lists (torch's two spellings)
            splits = {} if variant % 3 == 1 else dict(output_split_sizes=[], input_split_sizes=[])
        w = fc.all_to_all_single(out, inp, group=g, async_op=async_op, **splits)

        def check():
            ref = torch.cat([mk(1000 * q + me, seed, dt, r * cols).reshape(r, cols)
                             for q, r in zip(ranks, recv_rows)])
            return same(out, ref, what) or same(inp, before, what + " (input changed)"), None

    elif kind.startswith("all_to_all"):
        uneven = kind.endswith("_uneven")
        ins = [mk(1000 * me + q, seed, dt, block(me, q, seed, n, uneven)) for q in ranks]
        befores = [x.clone() for x in ins]
        outs = [torch.full((block(q, me, seed, n, uneven),), -99, dtype=dtype) for q in ranks]
        w = fc.all_to_all(outs, ins, group=g, async_op=async_op)

        def check():
            err = None
            for i, q in enumerate(ranks):
                err = err or same(outs[i], mk(1000 * q + me, seed, dt, block(q, me, seed, n, uneven)),
                                  what + f" output_tensor_list[{i}]")
                err = err or same(ins[i], befores[i], what + " (input changed)")
            return err, None

    else:
        raise AssertionError(kind)

    return issued(w, check, async_op, what)


def cases(sizes, dtypes):
    """(kind, dtype, numel, op, value kind): every kind x dtype x size, reduce with every op
    (and normal floats where the fold order shows in the rounding)."""
    out = []
    for n in sizes:
        for dt in dtypes:
            floating = DTYPES[dt].is_floating_point
            for op in OPS:
                if op == "AVG" and not floating:
                    continue
                out.append(("reduce", dt, n, op, "int"))
                if floating and n >= 7 and op in ("SUM", "AVG"):
                    out.append(("reduce", dt, n, op, "randn"))
            out += [(kind, dt, n, None, "int") for kind in KINDS[1:]]
    return out


def run_cases(rank, g, ranks, todo, window=6):
    """Windows of ``window`` cases, in turn blocking (one at a time), async (the whole window
    in flight before the first wait) and in one fc.batch(); returns the failures."""
    failures, modes = [], set()
    for w, start in enumerate(range(0, len(todo), window)):
        mode = ("blocking", "async", "batch")[w % 3]
        chunk = list(enumerate(todo[start:start + window], start))
        if mode == "batch":
            with fc.batch() as b:
                issued = [issue(kind, g, ranks, rank, i, dt, n, op, vk, False, i + w)
                          for i, (kind, dt, n, op, vk) in chunk]
                assert len(b) == len(chunk)
            assert b.wait() is True and b.is_success()
            failures += settle(issued)[0]
        else:
            issued = []
            for i, (kind, dt, n, op, vk) in chunk:
                issued.append(issue(kind, g, ranks, rank, i, dt, n, op, vk, mode == "async", i + w))
                if mode == "blocking":
                    failures += settle(issued[-1:])[0]
            if mode == "async":
                failures += settle(issued)[0]
        modes |= {(kind, mode) for _, (kind, *_rest) in chunk}
    return failures, modes


def _sweep_body(rank, world, shape, sizes, big_dtypes):
    got = shape_groups(shape, rank, world)
    if got is None:
        return None
    g, ranks = got
    todo = cases(sizes, list(DTYPES)) + cases([BIG], big_dtypes)
    failures, modes = run_cases(rank, g, ranks, todo)
    missing = {(k, m) for k in KINDS for m in ("blocking", "async", "batch")} - modes
    assert not missing, f"sweep does not cover {sorted(missing)}"
    return failures


@pytest.mark.parametrize("shape", ["pair", "triple", "world", "default", "single"])
def test_sweep(shape):
    big = ["float64", "int8"] if shape not in ("default", "single") else []
    world = 2 if shape == "single" else 4  # single: each rank alone in a group of one
    results = harness.run(_sweep_body, world, shape, [0, 1, 7, 1001], big, timeout=120, env=RING_ENV)
    failures = [f for res in results if res for f in res]
    assert not failures, f"{len(failures)} wrong results:\n" + "\n".join(failures[:15])


def _on_hosts(rank, world, hosts, body, *args):
    """``body`` with ranks on simulated hosts (FASTCOMM_HOST_ID, as test_cross_host does):
    peers on other hosts talk through Gloo."""
    import os

    from fastcomm import _state

    os.environ["FASTCOMM_HOST_ID"] = f"host-{hosts[rank]}"
    harness.init_child(rank, world, timeout=30.0)
    assert _state._gloo is not None, "no Gloo transport: the hosts are not simulated"
    try:
        return body(rank, world, *args)
    finally:
        fc.shutdown()


# Pairs across two hosts; the world over four hosts and mixed over two; "bulk": every span of a
# byte or more as one Gloo transfer (an offer carries the pair's sizes in its tag too).
@pytest.mark.parametrize("shape,hosts,bulk", [("pair", "ABAB", False), ("world", "ABCD", True),
                                              ("triple", "ABAB", True)])
def test_sweep_across_hosts(shape, hosts, bulk):
    env = dict(RING_ENV, **({"FASTCOMM_GLOO_BULK_BYTES": "1"} if bulk else {}))
    results = harness.run(_on_hosts, 4, hosts, _sweep_body, shape, [0, 7, 1001], ["float64"], init=False,
                          timeout=120, env=env)
    failures = [f for res in results if res for f in res]
    assert not failures, f"{len(failures)} wrong results:\n" + "\n".join(failures[:15])


def _overlap_body(rank, world):
    """Every kind on every group of OVERLAP_LISTS (pairs in a ring, overlapping triples, the
    world, [0, 2]) in flight at once, issued in rank-dependent orders across groups."""
    groups = fc.new_groups(OVERLAP_LISTS)
    mine = [(gi, g) for gi, g in enumerate(groups) if g.rank() >= 0]
    todo = cases([1, 1001], ["float32", "int8", "bfloat16"])
    failures = []
    order = mine if rank % 2 == 0 else mine[::-1]
    for start in range(0, len(todo), 8):
        issued = []
        for i in range(start, min(start + 8, len(todo))):
            kind, dt, n, op, vk = todo[i]
            for gi, g in (order if i % 2 else order[::-1]):
                issued.append(issue(kind, g, g.ranks, rank, 1000 * gi + i, dt, n, op, vk, True, i))
        for it in issued[::-1]:
            it.work.wait()
        failures += settle(issued)[0]
    return failures


def test_overlapping_groups_async():
    results = harness.run(_overlap_body, 4, timeout=120, env=RING_ENV)
    failures = [f for res in results for f in res]
    assert not failures, f"{len(failures)} wrong results:\n" + "\n".join(failures[:15])


# ---------------------------------------------------------------------------------------------
# bool, and BAND / BOR / BXOR on integers and bool: all_reduce, reduce, reduce_scatter_tensor

BIT_DTYPES = {"int8": torch.int8, "uint8": torch.uint8, "int32": torch.int32, "int64": torch.int64,
              "bool": torch.bool}
BIT_OPS = {"BAND": ReduceOp.BAND, "BOR": ReduceOp.BOR, "BXOR": ReduceOp.BXOR}
# bool's arithmetic ops, as torch's other backends define them: SUM/MAX or, PRODUCT/MIN and.
BOOL_AS = {"SUM": "BOR", "MAX": "BOR", "PRODUCT": "BAND", "MIN": "BAND"}


def bits(rank, seed, dt, n):
    """Random bit patterns over the dtype's whole range (bool: 0/1, mostly 1s for BAND to show)."""
    g = torch.Generator().manual_seed(1_000_003 * seed + 7919 * rank + 4242)
    if dt == "bool":
        return torch.rand(n, generator=g) < 0.8
    info = torch.iinfo(BIT_DTYPES[dt])
    return torch.randint(info.min, info.max, (n,), generator=g, dtype=torch.int64).to(BIT_DTYPES[dt])


def bit_fold(xs, op):
    op = BOOL_AS.get(op, op)
    acc = xs[0].clone()
    for x in xs[1:]:
        acc = acc & x if op == "BAND" else acc | x if op == "BOR" else acc ^ x
    return acc


def _bitwise_body(rank, world, sizes):
    lists = [[0, 1], [2, 3], [1, 2, 3], [0, 1, 2, 3]]
    groups = fc.new_groups(lists)
    todo = [(dt, op, n) for n in sizes for dt in BIT_DTYPES for op in BIT_OPS]
    todo += [("bool", op, n) for n in sizes for op in BOOL_AS]
    failures, i = [], 0
    for gi, g in enumerate(groups):
        if g.rank() < 0:
            continue
        ranks = g.ranks
        k = len(ranks)
        for j, (dt, op, n) in enumerate(todo):
            seed = 100 * gi + j
            rop = BIT_OPS.get(op, OPS.get(op))
            what = f"rank {rank}, group {ranks}, {dt} {op} n={n}"
            refs = [bits(r, seed, dt, n) for r in ranks]
            # all_reduce: blocking, async, inside a batch in turn
            t = bits(rank, seed, dt, n)
            if j % 3 == 0:
                fc.all_reduce(t, op=rop, group=g)
            elif j % 3 == 1:
                fc.all_reduce(t, op=rop, group=g, async_op=True).wait()
            else:
                with fc.batch() as b:
                    fc.all_reduce(t, op=rop, group=g)
                b.wait()
            failures.append(same(t, bit_fold(refs, op), "all_reduce " + what))
            # reduce to a root that moves around the group
            root = ranks[(j + 1) % k]
            t = bits(rank, seed, dt, n)
            w = fc.reduce(t, dst=root, op=rop, group=g, async_op=bool(j % 2))
            if w is not None:
                w.wait()
            failures.append(same(t, bit_fold(refs, op) if rank == root else bits(rank, seed, dt, n),
                                 f"reduce root={root} " + what))
            # reduce_scatter_tensor: member i gets the fold of everyone's block i
            inp = bits(rank, seed + 7, dt, k * n)
            out = torch.empty(n, dtype=BIT_DTYPES[dt])
            fc.reduce_scatter_tensor(out, inp, op=rop, group=g)
            me = ranks.index(rank)
            failures.append(same(out, bit_fold([bits(r, seed + 7, dt, k * n)[me * n:(me + 1) * n] for r in ranks], op),
                                 "reduce_scatter_tensor " + what))
            i += 3
        # bool through the copying collectives too
        t = bits(rank, gi, "bool", 1001)
        fc.broadcast(t, ranks[-1], group=g)
        failures.append(same(t, bits(ranks[-1], gi, "bool", 1001), f"broadcast bool {ranks}"))
        outs = [torch.zeros(5, dtype=torch.bool) for _ in ranks]
        fc.all_to_all(outs, [bits(1000 * rank + q, gi, "bool", 5) for q in ranks], group=g)
        for q, o in zip(ranks, outs):
            failures.append(same(o, bits(1000 * q + rank, gi, "bool", 5), f"all_to_all bool {ranks}"))
    return [f for f in failures if f], i


def assert_bitwise_results(results):
    """Each rank's (failures, cases checked): none failed, and every rank checked over 100."""
    failures = [f for res in results for f in res[0]]
    assert not failures, f"{len(failures)} wrong results:\n" + "\n".join(failures[:15])
    assert all(res[1] > 100 for res in results), [res[1] for res in results]


def test_bitwise_ops_and_bool():
    assert_bitwise_results(harness.run(_bitwise_body, 4, [0, 1, 7, 1001, BIG], timeout=120, env=RING_ENV))


# ---------------------------------------------------------------------------------------------
# Argument errors: rank 0 makes every bad call alone; afterwards both ranks run correct ops on
# the group, which would fail or hang had a bad call sent anything.

def _t(n=4, dtype=torch.float32):
    return torch.ones(n, dtype=dtype)


G = "[0, 1]"
ARG_ERRORS = [
    ("reduce-dst-not-member", ValueError, lambda g: fc.reduce(_t(), dst=3, group=g), ["'dst'", "rank 3"]),
    ("reduce-AVG-int", ValueError, lambda g: fc.reduce(_t(dtype=torch.int64), dst=0, op=ReduceOp.AVG, group=g),
     ["'op'", "AVG"]),
    ("reduce-BOR-float", ValueError, lambda g: fc.reduce(_t(), dst=0, op=ReduceOp.BOR, group=g),
     ["'op'", "BOR", "integer or bool"]),
    ("reduce-complex-MAX", ValueError, lambda g: fc.reduce(_t(dtype=torch.complex64), dst=0, op=ReduceOp.MAX, group=g),
     ["'op'", "MAX", "complex"]),
    ("reduce-uint32", TypeError, lambda g: fc.reduce(_t(dtype=torch.uint32), dst=0, group=g), ["'tensor'", "dtype"]),
    ("gather-list-length", ValueError, lambda g: fc.gather(_t(), [_t()], dst=0, group=g),
     ["'gather_list'", "1 tensors", "expected 2"]),
    ("gather-no-list-on-dst", ValueError, lambda g: fc.gather(_t(), None, dst=0, group=g),
     ["'gather_list'", "0 tensors"]),
    ("gather-list-on-non-dst", ValueError, lambda g: fc.gather(_t(), [_t(), _t()], dst=1, group=g),
     ["'gather_list'", "None or empty", "rank 1"]),
    ("gather-list-dtype", TypeError, lambda g: fc.gather(_t(), [_t(), _t(dtype=torch.float64)], dst=0, group=g),
     ["'gather_list[1]'", "dtype"]),
    ("gather-list-numel", ValueError, lambda g: fc.gather(_t(), [_t(5), _t()], dst=0, group=g),
     ["'gather_list[0]'", "5 elements"]),
    ("scatter-no-list-on-src", ValueError, lambda g: fc.scatter(_t(), None, src=0, group=g),
     ["'scatter_list'", "0 tensors"]),
    ("scatter-list-on-non-src", ValueError, lambda g: fc.scatter(_t(), [_t(), _t()], src=1, group=g),
     ["'scatter_list'", "None or empty"]),
    ("scatter-list-dtype", TypeError,
     lambda g: fc.scatter(_t(), [_t(dtype=torch.int8), _t()], group_src=0, group=g), ["'scatter_list[0]'", "dtype"]),
    ("all_to_all-output-length", ValueError, lambda g: fc.all_to_all([_t()], [_t(), _t()], group=g),
     ["'output_tensor_list'", "1 tensors", "expected 2"]),
    ("all_to_all-input-length", ValueError, lambda g: fc.all_to_all([_t(), _t()], [_t()] * 3, group=g),
     ["'input_tensor_list'", "3 tensors"]),
    ("all_to_all-dtype", TypeError,
     lambda g: fc.all_to_all([_t(), _t(dtype=torch.int64)], [_t(), _t()], group=g),
     ["'output_tensor_list[1]'", "dtype"]),
    ("all_to_all-own-block", ValueError, lambda g: fc.all_to_all([_t(3), _t()], [_t(), _t()], group=g),
     ["'output_tensor_list[0]'", "3 elements"]),
    ("all_to_all_single-splits-length", ValueError,
     lambda g: fc.all_to_all_single(_t(), _t(), [2, 2], [1, 1, 2], group=g), ["'input_split_sizes'", "3 entries"]),
    ("all_to_all_single-splits-sum", ValueError,
     lambda g: fc.all_to_all_single(_t(), _t(), [2, 2], [1, 2], group=g), ["'input_split_sizes'", "sums to 3"]),
    ("all_to_all_single-negative", ValueError,
     lambda g: fc.all_to_all_single(_t(), _t(), [2, 2], [5, -1], group=g), ["'input_split_sizes'", "negative"]),
    ("all_to_all_single-not-divisible", ValueError,
     lambda g: fc.all_to_all_single(_t(3), _t(3), group=g), ["'input'", "3 rows", "input_split_sizes"]),
    ("all_to_all_single-0d", ValueError,
     lambda g: fc.all_to_all_single(torch.ones(()), torch.ones(()), group=g), ["'input'", "dimension"]),
    ("all_to_all_single-dtype", TypeError,
     lambda g: fc.all_to_all_single(_t(dtype=torch.int64), _t(), group=g), ["'output'", "dtype"]),
    ("all_to_all_single-own-block", ValueError,
     lambda g: fc.all_to_all_single(_t(), _t(), [1, 3], [2, 2], group=g), ["own block", "1 elements"]),
    ("gather-async", ValueError, lambda g: fc.gather(_t(), [_t()], dst=0, group=g, async_op=True),
     ["'gather_list'"]),
    ("scatter-in-batch", ValueError, lambda g: in_batch(lambda: fc.scatter(_t(), None, src=0, group=g)),
     ["'scatter_list'"]),
]


def in_batch(call):
    """Runs ``call`` (one op) inside an fc.batch(); returns the batch."""
    with fc.batch() as b:
        call()
    return b


def _argument_error_body(rank, world):
    g = fc.new_group([0, 1])
    msgs = {}
    if rank == 0:
        for name, exc, call, needles in ARG_ERRORS:
            msgs[name] = expect(exc, lambda: call(g), "rank 0", G, *needles)
        # gather/scatter default to global rank 0 as torch does; a group without it refuses.
        solo = fc.new_group([0])
        assert fc.gather(_t(), [_t()], group=solo) is None
    else:
        solo = fc.new_group([1])
        expect(ValueError, lambda: fc.gather(_t(), None, group=solo), "rank 1", "'dst'", "rank 0")
        expect(ValueError, lambda: fc.scatter(_t(), None, group=solo), "rank 1", "'src'", "rank 0")
    # Nothing was sent and no sequence number was used: the group works for both ranks.
    lst = [torch.zeros(3) for _ in range(2)] if rank == 0 else None
    fc.gather(torch.full((3,), float(rank)), lst, dst=0, group=g)
    if rank == 0:
        assert [x[0].item() for x in lst] == [0.0, 1.0], lst
    out = [torch.zeros(2), torch.zeros(2)]
    fc.all_to_all(out, [torch.full((2,), 10.0 * rank + q) for q in range(2)], group=g)
    assert [x[0].item() for x in out] == [rank, 10.0 + rank], out
    return msgs


def test_argument_errors_name_rank_group_argument_and_send_nothing():
    res = harness.run(_argument_error_body, 2, timeout=60, **SHORT)
    assert len(res[0]) == len(ARG_ERRORS)


# ---------------------------------------------------------------------------------------------
# Mismatched calls across members: every member fails with DistBackendError, none by timeout,
# and the group works afterwards.

def _a2a_single(rank, send, recv, g):
    out = torch.zeros(sum(recv))
    return lambda: fc.all_to_all_single(out, torch.ones(sum(send)), recv, send, group=g)


def _mismatch_calls(rank, g):
    """(name, this rank's call, words every member's message must hold)."""
    t = torch.ones(6)
    return [
        ("reduce-vs-gather",
         (lambda: fc.reduce(t, dst=0, group=g)) if rank == 0 else
         (lambda: fc.gather(t, None, dst=0, group=g)), ["mismatch"]),
        ("reduce-dst", lambda: fc.reduce(t, dst=rank, group=g), ["mismatch", "root"]),
        ("gather-vs-scatter-large",  # several pieces each way through 64 KiB rings
         (lambda: fc.gather(torch.ones(50_000), [torch.ones(50_000)] * 2, dst=0, group=g)) if rank == 0 else
         (lambda: fc.scatter(torch.ones(50_000), None, src=0, group=g)), ["mismatch"]),
        ("scatter-numel",
         lambda: fc.scatter(torch.ones(5 + rank), [torch.ones(5)] * 2 if rank == 0 else None, src=0, group=g),
         ["mismatch"]),
        # Rank 0 sends 3 to rank 1, which expects 2; the other direction agrees.
        ("all_to_all_single-split", _a2a_single(rank, [1, 3] if rank == 0 else [2, 2],
                                                [1, 2] if rank == 0 else [2, 2], g), ["disagree", "split"]),
        ("all_to_all-sizes-large",  # rank 1 expects one element more than rank 0 sends it
         lambda: fc.all_to_all([torch.zeros(20_000 + (rank == 1)), torch.zeros(20_000)],
                               [torch.ones(20_000), torch.ones(20_000)], group=g), ["disagree"]),
        ("all_to_all-dtype",
         lambda: fc.all_to_all([torch.zeros(2, dtype=torch.float64 if rank else torch.float32)] * 2,
                               [torch.zeros(2, dtype=torch.float64 if rank else torch.float32)] * 2, group=g),
         ["mismatch"]),
        ("reduce-op", lambda: fc.reduce(t, dst=0, op=ReduceOp.MAX if rank else ReduceOp.SUM, group=g),
         ["mismatch"]),
    ]


def _mismatch_body(rank, world):
    msgs = {}
    if rank < 2:
        g = fc.new_group([0, 1])
        for name, call, needles in _mismatch_calls(rank, g):
            msg = expect(dist.DistBackendError, call, f"rank {rank}", "[0, 1]", *needles,
                         nothing=f"{name}: nothing was raised")
            assert "timed out" not in msg, f"{name}: learnt of the mismatch only by timeout: {msg}"
            msgs[name] = msg
            # The group works right after.
            t = torch.full((3,), float(rank + 1))
            fc.reduce(t, dst=1, group=g)
            assert t.tolist() == ([3.0] * 3 if rank == 1 else [1.0] * 3), (name, t)
    # A triple whose root issued something else: every member hears from the root and fails.
    g3 = fc.new_group([0, 1, 2])
    t = torch.ones(4)
    call = (lambda: fc.scatter(t, [t] * 3, src=0, group=g3)) if rank == 0 else (lambda: fc.reduce(t, dst=0, group=g3))
    msg = expect(dist.DistBackendError, call, f"rank {rank}", "[0, 1, 2]", "mismatch")
    assert "timed out" not in msg, msg
    msgs["triple-root"] = msg
    # A non-root issued something else: it and the root fail. The other non-root talks only
    # to the root, whose message matched, so it may complete; it must not hang.
    t = torch.ones(4)
    call = (lambda: fc.gather(t, None, dst=0, group=g3)) if rank == 2 else (lambda: fc.reduce(t, dst=0, group=g3))
    try:
        call()
        assert rank == 1, f"rank {rank}: the mismatched reduce completed"
    except dist.DistBackendError as e:
        assert "timed out" not in str(e) and f"rank {rank}" in str(e), str(e)
    for dst in (2, 1):  # the group works afterwards
        t = torch.full((4,), float(rank))
        fc.reduce(t, dst=dst, group=g3)
        assert t.tolist() == [3.0 if rank == dst else float(rank)] * 4, t
    return msgs


@pytest.mark.parametrize("hosts", [None, "ABA"])
def test_mismatched_calls_fail_every_member_and_group_recovers(hosts):
    if hosts is None:
        res = harness.run(_mismatch_body, 3, timeout=60, env=RING_ENV, **SHORT)
    else:  # across hosts, every span as a bulk transfer: the unused offers must be drained
        res = harness.run(_on_hosts, 3, hosts, _mismatch_body, init=False, timeout=60,
                          env=dict(RING_ENV, FASTCOMM_GLOO_BULK_BYTES="1"))
    for r in range(2):
        assert set(res[r]) == {c[0] for c in _mismatch_calls(0, None)} | {"triple-root"}


# ---------------------------------------------------------------------------------------------
# Through torch.distributed with the "fastcomm" backend


def backend_groups(rank, world):
    """Initializes the "fastcomm" process group over the world; returns the (group, global
    ranks) this rank is in: the world (None), its pair [0, 1] or [2, 3], and the triple
    [1, 2, 3] (the pair and the triple made by their members only)."""
    dist.init_process_group("fastcomm", store=harness.child_store(), rank=rank, world_size=world)
    lo = 2 * (rank // 2)
    groups = [(None, list(range(world))),
              (dist.new_group([lo, lo + 1], backend="fastcomm", use_local_synchronization=True), [lo, lo + 1])]
    if rank >= 1:
        groups.append((dist.new_group([1, 2, 3], backend="fastcomm", use_local_synchronization=True), [1, 2, 3]))
    return groups


def _backend_body(rank, world):
    groups = backend_groups(rank, world)
    checked = 0
    for g, ranks in groups:
        k, me = len(ranks), ranks.index(rank)
        for dt in ("float32", "int64", "bfloat16"):
            dtype = DTYPES[dt]
            for n in (0, 7, 1001):
                for root_gr in range(k):
                    seed = 10 * n + root_gr
                    root = ranks[root_gr]
                    what = f"{ranks} {dt} n={n} root={root}"
                    a = root_gr % 2 == 1  # async on odd roots
                    # reduce (dst global; group_dst on odd roots)
                    t = mk(rank, seed, dt, n, "MAX")
                    before = t.clone()
                    kw = dict(group_dst=root_gr) if a else dict(dst=root)
                    w = dist.reduce(t, op=ReduceOp.MAX, group=g, async_op=a, **kw)
                    if a:
                        w.wait()
                    ref = fold([mk(r, seed, dt, n, "MAX") for r in ranks], "MAX") if rank == root else before
                    assert same(t, ref, "dist.reduce " + what) is None, same(t, ref, what)
                    # gather
                    lst = [torch.full((n,), -1, dtype=dtype) for _ in range(k)] if rank == root else None
                    w = dist.gather(mk(rank, seed, dt, n), lst, dst=root, group=g, async_op=a)
                    if a:
                        w.wait()
                    if rank == root:
                        for i, r in enumerate(ranks):
                            assert same(lst[i], mk(r, seed, dt, n), f"dist.gather [{i}] {what}") is None
                    # scatter
                    out = torch.full((n,), -1, dtype=dtype)
                    lst = [mk(100 + i, seed, dt, n) for i in range(k)] if rank == root else None
                    w = dist.scatter(out, lst, src=root, group=g, async_op=a)
                    if a:
                        w.wait()
                    assert same(out, mk(100 + me, seed, dt, n), f"dist.scatter {what}") is None
                    checked += 3
                # all_to_all (uneven sizes) and all_to_all_single (equal parts and uneven splits)
                seed = n
                ins = [mk(1000 * rank + q, seed, dt, block(rank, q, seed, n, True)) for q in ranks]
                outs = [torch.full((block(q, rank, seed, n, True),), -1, dtype=dtype) for q in ranks]
                dist.all_to_all(outs, ins, group=g)
                for i, q in enumerate(ranks):
                    assert same(outs[i], mk(1000 * q + rank, seed, dt, block(q, rank, seed, n, True)),
                                f"dist.all_to_all [{i}] {ranks} {dt} n={n}") is None
                inp = torch.cat([mk(1000 * rank + q, seed, dt, n) for q in ranks])
                out = torch.full((k * n,), -1, dtype=dtype)
                dist.all_to_all_single(out, inp, group=g, async_op=True).wait()
                assert same(out, torch.cat([mk(1000 * q + rank, seed, dt, n) for q in ranks]),
                            f"dist.all_to_all_single {ranks} {dt} n={n}") is None
                send = [block(rank, q, seed, n, True) for q in ranks]
                recv = [block(q, rank, seed, n, True) for q in ranks]
                inp = torch.cat([mk(1000 * rank + q, seed, dt, 2 * r).view(r, 2) for q, r in zip(ranks, send)])
                out = torch.full((sum(recv), 2), -1, dtype=dtype)
                dist.all_to_all_single(out, inp, recv, send, group=g)
                ref = torch.cat([mk(1000 * q + rank, seed, dt, 2 * r).view(r, 2) for q, r in zip(ranks, recv)])
                assert same(out, ref, f"dist.all_to_all_single uneven {ranks} {dt} n={n}") is None
                checked += 3
    # A bad argument surfaces as torch would raise it: before anything is sent.
    if rank == 0:
        expect(ValueError, lambda: dist.gather(torch.ones(2), [torch.ones(2)], dst=0), "rank 0", "'gather_list'")
    dist.barrier()
    dist.destroy_process_group()
    return checked


def test_through_torch_distributed_backend():
    counts = harness.run(_backend_body, 4, init=False, timeout=120)
    assert all(c > 50 for c in counts), counts
