"""Correctness of the full collective set against references computed locally.

Every rank regenerates every member's input from (global rank, case seed), computes what the
collective must produce with plain torch ops (reductions fold left to right in group-rank order,
in the tensor's own dtype, as the engine promises) and compares. Members also return a digest
of each reduction result so the parent can check they are bit-identical across the group.

Covered: broadcast (src as a global rank, and group_src), all_gather into a list and into a
tensor, all_gather_into_tensor, reduce_scatter (list) and reduce_scatter_tensor, all_reduce on
its reduce-scatter + all-gather path, barrier (ordering), send/recv/isend/irecv; sizes 0, 1,
odd, larger than the shared-memory ring; every dtype and reduce op; pairs, a triple, the world
of 4, overlapping groups; blocking and async_op=True forms."""
from __future__ import annotations

import os

import pytest
import torch
from torch.distributed import ReduceOp

import harness
from _helpers import all_reduce_ref, digest, fold, gen  # noqa: F401  (test_batch imports them from here)

import fastcomm as fc

RING_ENV = {"FASTCOMM_SHM_RING_BYTES": "65536"}  # 64 KiB rings: "beyond the ring" is cheap
BIG = 40_003  # elements: 80-320 KB per tensor, past a 64 KiB ring in every dtype; odd

OPS = {"SUM": ReduceOp.SUM, "AVG": ReduceOp.AVG, "MIN": ReduceOp.MIN, "MAX": ReduceOp.MAX,
       "PRODUCT": ReduceOp.PRODUCT}
DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16,
          "bfloat16": torch.bfloat16, "int32": torch.int32, "int64": torch.int64}
SIZES = [0, 1, 7, 1001]  # 7 and 1001 divide by none of 2, 3, 4

# Equivalent spellings: "_2d" stacked (k, n) buffers instead of flat ones; "_inplace" the
# input is this member's own chunk of the output (all_gather) or the output is this member's
# own chunk of the input (reduce_scatter), as FSDP-style code does.
GATHERS = ("all_gather_list", "all_gather_tensor", "all_gather_into_tensor",
           "all_gather_into_tensor_2d", "all_gather_into_tensor_inplace")
SCATTERS = ("reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_tensor_2d",
            "reduce_scatter_tensor_inplace", "reduce_scatter_inplace")


# ---------------------------------------------------------------------------------------------
# Deterministic inputs and references


def same(out, ref, what, exact=True):
    """None, or a description of how ``out`` differs from ``ref``."""
    if out.dtype != ref.dtype or out.shape != ref.shape:
        return f"{what}: got {out.dtype} {tuple(out.shape)}, expected {ref.dtype} {tuple(ref.shape)}"
    try:
        if exact:
            torch.testing.assert_close(out, ref, rtol=0, atol=0, equal_nan=True)
        else:
            torch.testing.assert_close(out, ref, equal_nan=True)
    except AssertionError as e:
        return f"{what}: {str(e)[:300]}"
    return None


# ---------------------------------------------------------------------------------------------
# One collective: issue it, then check it


class Issued:
    """An issued collective and what it must produce."""

    def __init__(self, work, check):
        self.work = work
        self.check = check  # () -> (failure or None, digest or None)


def issued(w, check, async_op, what):
    """The Issued of a call that returned ``w``, which must be a Work for async_op=True, else
    None."""
    if async_op:
        assert isinstance(w, fc.Work), f"{what}: async_op=True returned {type(w).__name__}"
    else:
        assert w is None, f"{what}: blocking call returned {w!r}"
    return Issued(w, check)


def issue(kind, g, ranks, me, seed, dt, n, op=None, vkind="int", async_op=False, variant=0):
    """Issues collective ``kind`` on group ``g`` (None: the default group over ``ranks``) for
    global rank ``me``; returns an Issued whose check() compares with the local reference.

    ``variant`` picks among equivalent spellings (src vs group_src, output shapes)."""
    k = len(ranks)
    gr = ranks.index(me)
    dtype = DTYPES[dt]
    what = f"rank {me}, group {ranks}, {kind} {dt} n={n} op={op} {vkind} async={async_op} seed={seed}"

    if kind == "broadcast":
        root = ranks[seed % k]
        t = gen(me, seed, dt, n, kind=vkind)
        if variant % 2 == 0:
            w = fc.broadcast(t, root, group=g, async_op=async_op)  # src: a global rank
        else:
            w = fc.broadcast(t, group=g, async_op=async_op, group_src=ranks.index(root))
        ptr = t.data_ptr()

        def check():
            ref = gen(root, seed, dt, n, kind=vkind)
            err = same(t, ref, what + f" root={root}")
            if err is None and t.data_ptr() != ptr:
                err = what + ": broadcast did not fill the tensor in place"
            return err, None

    elif kind in GATHERS:
        t = gen(me, seed, dt, n, kind=vkind)
        before = t.clone()
        if kind == "all_gather_into_tensor_inplace":
            out = torch.full((k, n), -99, dtype=dtype)
            out[gr].copy_(t)
            t = out[gr]  # a contiguous view into the output
            w = fc.all_gather_into_tensor(out, t, group=g, async_op=async_op)
        elif kind == "all_gather_list":
            out = [torch.full((n,), -99, dtype=dtype) for _ in range(k)]
            w = fc.all_gather(out, t, group=g, async_op=async_op)
        elif kind == "all_gather_tensor":  # torch-style all_gather given one output tensor
            out = torch.full((k * n,), -99, dtype=dtype)
            w = fc.all_gather(out, t, group=g, async_op=async_op)
        elif kind == "all_gather_into_tensor":
            out = torch.full((k * n,), -99, dtype=dtype)
            w = fc.all_gather_into_tensor(out, t, group=g, async_op=async_op)
        else:  # stacked output, as torch also accepts
            out = torch.full((k, n), -99, dtype=dtype)
            w = fc.all_gather_into_tensor(out, t, group=g, async_op=async_op)

        def check():
            refs = [gen(r, seed, dt, n, kind=vkind) for r in ranks]
            if kind == "all_gather_list":
                got = torch.stack(out) if n else torch.zeros((k, 0), dtype=dtype)
                ref = torch.stack(refs) if n else torch.zeros((k, 0), dtype=dtype)
            else:
                got = out.reshape(k, n)
                ref = torch.stack(refs) if n else torch.zeros((k, 0), dtype=dtype)
                if kind.endswith(("_2d", "_inplace")) and out.shape != (k, n):
                    return what + f": output reshaped to {tuple(out.shape)}", None
            err = same(got, ref, what)
            if err is None:
                err = same(t, before, what + " (input modified)")
            return err, None

    elif kind in SCATTERS:
        # Member r's input: k chunks of n; chunk i goes (reduced) to group rank i.
        full = gen(me, seed, dt, k * n, op=op, kind=vkind)
        before = full.clone()
        out = torch.full((n,), -99, dtype=dtype)
        if kind in ("reduce_scatter", "reduce_scatter_inplace"):
            ins = [c.clone() for c in full.split(n)] if n else [torch.zeros(0, dtype=dtype) for _ in range(k)]
            if kind == "reduce_scatter_inplace":
                out = ins[gr]  # the output is our own input chunk
            w = fc.reduce_scatter(out, ins, op=OPS[op], group=g, async_op=async_op)
            inp = None
        elif kind == "reduce_scatter_tensor_inplace":
            inp = full.reshape(k, n)
            out = inp[gr]  # a contiguous view into the input
            w = fc.reduce_scatter_tensor(out, inp, op=OPS[op], group=g, async_op=async_op)
        elif kind == "reduce_scatter_tensor":
            inp = full
            w = fc.reduce_scatter_tensor(out, inp, op=OPS[op], group=g, async_op=async_op)
        else:
            inp = full.reshape(k, n)
            w = fc.reduce_scatter_tensor(out, inp, op=OPS[op], group=g, async_op=async_op)

        def check():
            chunks = [gen(r, seed, dt, k * n, op=op, kind=vkind)[gr * n:(gr + 1) * n] for r in ranks]
            ref = fold(chunks, op)
            err = same(out, ref, what)
            if err is None and inp is not None and not kind.endswith("_inplace"):
                err = same(inp.reshape(-1), before, what + " (input modified)")
            return err, None  # each member gets its own chunk: nothing to compare across

    elif kind == "all_reduce":
        t = gen(me, seed, dt, n, op=op, kind=vkind)
        w = fc.all_reduce(t, op=OPS[op], group=g, async_op=async_op)

        def check():
            ref = all_reduce_ref([gen(r, seed, dt, n, op=op, kind=vkind) for r in ranks], ranks, op)
            return same(t, ref, what), digest(t)

    else:
        raise AssertionError(kind)

    return issued(w, check, async_op, what)


def settle(issued):
    """Waits for the async ones (checking the Work API), then checks every result."""
    failures, digests = [], []
    for it in issued:
        if it.work is not None:
            fut = it.work.get_future()
            assert it.work.wait() is True
            assert it.work.is_completed() and it.work.exception() is None
            assert fut.wait() is not None and fut.done()
        err, d = it.check()
        if err:
            failures.append(err)
        digests.append(d)
    return failures, digests


def sweep_cases(sizes, dtypes=DTYPES):
    """(kind, dtype, numel, op, value kind) for each collective but all_reduce: every dtype x
    size for broadcast and the gathers, every dtype x size x op for the reduce-scatters (the
    equivalent spellings of each take turns, so each one meets every dtype)."""
    cases = []
    turn = 0
    for n in sizes:
        for dt in dtypes:
            floating = DTYPES[dt].is_floating_point
            cases.append(("broadcast", dt, n, None, "randn" if floating else "int"))
            for j in range(2):
                cases.append((GATHERS[(turn + j) % len(GATHERS)], dt, n, None, "int"))
            for op in OPS:
                if op == "AVG" and not floating:
                    continue
                cases.append((SCATTERS[turn % len(SCATTERS)], dt, n, op, "int"))
                if floating and n >= 7 and op in ("SUM", "AVG", "PRODUCT"):
                    cases.append((SCATTERS[(turn + 1) % len(SCATTERS)], dt, n, op, "randn"))
                turn += 1
    return cases


def shape_groups(shape, rank, world):
    """(group or None, ranks) for this rank in the given shape, or None for a non-member."""
    if shape == "pair":
        g = fc.new_group([0, 1] if rank < 2 else [2, 3])
        return g, g.ranks
    if shape == "triple":
        if rank == 0:
            return None  # [1, 2, 3] runs without rank 0
        g = fc.new_group([3, 1, 2])  # unsorted on purpose: group rank order is sorted
        assert g.ranks == [1, 2, 3] and g.rank() == rank - 1
        return g, g.ranks
    if shape == "world":
        return fc.new_group(range(world)), list(range(world))
    if shape == "default":
        return None, list(range(world))
    if shape == "single":
        g = fc.new_group([rank])
        assert g.size() == 1 and g.rank() == 0
        return g, [rank]
    raise AssertionError(shape)


# ---------------------------------------------------------------------------------------------
# The sweep: every collective x dtype x size (x op) on one group shape


def _sweep_body(rank, world, shape, sizes, window):
    got = shape_groups(shape, rank, world)
    if got is None:
        return None
    g, ranks = got
    cases = sweep_cases(sizes)
    failures, digests, modes = [], {}, set()
    # Windows of `window` cases, alternately blocking (one at a time) and async (the whole
    # window in flight on the group before the first wait).
    for w, start in enumerate(range(0, len(cases), window)):
        async_op = w % 2 == 1
        issued = []
        for i in range(start, min(start + window, len(cases))):
            kind, dt, n, op, vk = cases[i]
            issued.append(issue(kind, g, ranks, rank, i, dt, n, op, vk, async_op, variant=i + w))
            modes.add((kind, async_op, (i + w) % 2))
            if not async_op:
                failures += settle(issued[-1:])[0]
        if async_op:
            failures += settle(issued)[0]
    every = {(k, a) for k in ("broadcast",) + GATHERS + SCATTERS for a in (False, True)}
    missing = every - {(k, a) for k, a, _ in modes}
    assert not missing, f"sweep does not cover {sorted(missing)}"
    return ranks, digests, failures


def check_members_identical(results):
    failures = [f for res in results if res is not None for f in res[2]]
    assert not failures, f"{len(failures)} wrong results:\n" + "\n".join(failures[:15])
    by_group = {}
    for rank, res in enumerate(results):
        if res is not None:
            by_group.setdefault(tuple(res[0]), []).append((rank, res[1]))
    assert by_group
    for ranks, members in by_group.items():
        assert sorted(r for r, _ in members) == list(ranks), (ranks, [r for r, _ in members])
        r0, d0 = members[0]
        for r, d in members[1:]:
            diff = [i for i in d0 if d0[i] != d[i]]
            assert not diff, f"group {list(ranks)}: ranks {r0} and {r} got different bytes in cases {diff[:10]}"


@pytest.mark.parametrize("shape,env", [("pair", RING_ENV), ("triple", RING_ENV), ("world", RING_ENV),
                                       ("default", RING_ENV), ("single", RING_ENV),
                                       ("triple", {"FASTCOMM_SHM_STREAM_STORES": "1"})],
                         ids=["pair", "triple", "world", "default", "single", "triple-stream"])
def test_collectives_sweep(shape, env):
    # The stream case keeps the default 1 MiB ring, whose pieces take the non-temporal copy.
    sizes = SIZES + [BIG] if shape in ("pair", "triple", "world") else [0, 7, 1001]
    world = 2 if shape == "single" else 4
    results = harness.run(_sweep_body, world, shape, sizes, 8, timeout=120, env=env)
    check_members_identical(results)


# ---------------------------------------------------------------------------------------------
# Overlapping groups, all collectives in flight at once, issued in rank-dependent orders


OVERLAP_LISTS = ([[i, (i + 1) % 4] for i in range(4)]    # ring of neighbour pairs
                 + [[0, 1, 2], [1, 2, 3], [3, 0, 1]]     # overlapping triples
                 + [[0, 1, 2, 3], [0, 2]])


def _overlap_body(rank, world):
    groups = fc.new_groups(OVERLAP_LISTS)
    mine = [(gi, g) for gi, g in enumerate(groups) if g.rank() >= 0]
    for gi, g in enumerate(groups):
        assert (g.rank() >= 0) == (rank in OVERLAP_LISTS[gi])
    cases = sweep_cases([1, 1001], dtypes=["float32", "bfloat16", "int64"])
    cases += sweep_cases([BIG], dtypes=["float64"])
    cases += [("all_reduce", dt, n, op, "randn" if DTYPES[dt].is_floating_point else "int")
              for n in (7, 70_001) for dt in ("float32", "float16", "int32")
              for op in ("SUM", "MAX")]
    failures, digests = [], {}
    order = mine if rank % 2 == 0 else mine[::-1]
    for start in range(0, len(cases), 8):
        issued, keys = [], []
        for i in range(start, min(start + 8, len(cases))):
            kind, dt, n, op, vk = cases[i]
            # Every member issues each group's ops in case order; across groups the order
            # differs from rank to rank.
            for gi, g in (order if i % 2 else order[::-1]):
                issued.append(issue(kind, g, g.ranks, rank, 1000 * gi + i, dt, n, op, vk, True, i))
                keys.append((gi, i))
        # Wait in an order different again (reverse issue order).
        for it in issued[::-1]:
            it.work.wait()
        f, ds = settle(issued)
        failures += f
        digests.update(zip(keys, ds))
    return {gi: OVERLAP_LISTS[gi] for gi, _ in mine}, digests, failures


def test_overlapping_groups_all_collectives_async():
    results = harness.run(_overlap_body, 4, timeout=120, env=RING_ENV)
    failures = [f for res in results for f in res[2]]
    assert not failures, f"{len(failures)} wrong results:\n" + "\n".join(failures[:15])
    for gi, lst in enumerate(OVERLAP_LISTS):
        members = [r for r in lst]
        d0 = {k: v for k, v in results[members[0]][1].items() if k[0] == gi}
        assert d0
        for r in members[1:]:
            d = {k: v for k, v in results[r][1].items() if k[0] == gi}
            assert d == d0, f"group {lst}: rank {r} differs from rank {members[0]}"


# ---------------------------------------------------------------------------------------------
# all_reduce on the reduce-scatter + all-gather path


def _rsag_body(rank, world, shape, sizes, ops, dtypes):
    got = shape_groups(shape, rank, world)
    if got is None:
        return None
    g, ranks = got
    failures, digests = [], {}
    i = 0
    for n in sizes:
        for dt in dtypes:
            for op in ops:
                if op == "AVG" and not DTYPES[dt].is_floating_point:
                    continue
                kinds = ["int"] + (["randn"] if DTYPES[dt].is_floating_point and n >= 2 else [])
                for vk in kinds:
                    f, d = settle([issue("all_reduce", g, ranks, rank, i, dt, n, op, vk, bool(i % 2))])
                    failures += f
                    digests[i] = d[0]
                    i += 1
    return ranks, digests, failures


@pytest.mark.parametrize("shape,ring", [("triple", "64k"), ("world", "default")])
def test_all_reduce_rsag_large(shape, ring):
    """>= 256 KiB in a group of 3 or 4: reduce-scatter + all-gather, with uneven chunks
    (300001 elements), through the default 1 MiB rings and through 64 KiB ones."""
    env = RING_ENV if ring == "64k" else {}
    results = harness.run(_rsag_body, 4, shape, [300_001], list(OPS), ["float32"],
                          timeout=120, env=env)
    check_members_identical(results)
    results = harness.run(_rsag_body, 4, shape, [300_001], ["SUM", "AVG", "MAX"],
                          ["bfloat16", "float64"], timeout=120, env=env)
    check_members_identical(results)
    results = harness.run(_rsag_body, 4, shape, [300_001], ["SUM", "PRODUCT", "MIN"],
                          ["int64"], timeout=120, env=env)
    check_members_identical(results)


@pytest.mark.parametrize("shape", ["triple", "world"])
def test_all_reduce_rsag_low_threshold(shape):
    """FASTCOMM_RSAG_THRESHOLD lowered: small odd sizes take the two-phase path (at 1024 bytes),
    and with a 1-byte threshold even tensors with fewer elements than members, so that some
    members own an empty chunk."""
    env = dict(RING_ENV, FASTCOMM_RSAG_THRESHOLD="1024")
    results = harness.run(_rsag_body, 4, shape, [257, 1001, 4099, 30_001], list(OPS),
                          list(DTYPES), timeout=120, env=env)
    check_members_identical(results)
    env = dict(RING_ENV, FASTCOMM_RSAG_THRESHOLD="1")
    results = harness.run(_rsag_body, 4, shape, [0, 1, 2, 3, 5, 7], list(OPS), list(DTYPES),
                          timeout=120, env=env)
    check_members_identical(results)


# ---------------------------------------------------------------------------------------------
# barrier: everything a member did before it is visible to every member after it


def _barrier_body(rank, world, tmp):
    shapes = {"world": (None, list(range(world))),
              "pair": (fc.new_group([0, 1] if rank < 2 else [2, 3]), None),
              "triple": (fc.new_group([0, 1, 2]) if rank < 3 else None, None)}
    seen = 0
    for name, (g, ranks) in shapes.items():
        if name == "triple" and rank == 3:
            continue
        ranks = ranks or g.ranks
        for it in range(12):
            writer = ranks[it % len(ranks)]
            path = os.path.join(tmp, f"{name}-{ranks[0]}-{it}")
            if rank == writer:
                if it % 3 == 0:
                    # Make the writer late: a barrier that let anyone through early would
                    # have them read before the file exists.
                    for _ in range(200_000):
                        pass
                with open(path + ".tmp", "w") as f:
                    f.write(str(it))
                os.rename(path + ".tmp", path)
            if it % 2:
                w = fc.barrier(group=g, async_op=True)
                assert isinstance(w, fc.Work)
                w.wait()
                assert w.is_completed() and w.exception() is None
            else:
                assert fc.barrier(group=g) is None
            with open(path) as f:  # raises if the barrier did not order the write before us
                assert f.read() == str(it)
            seen += 1
    return seen


def test_barrier_orders_writes_before_reads(tmp_path):
    res = harness.run(_barrier_body, 4, str(tmp_path), timeout=60)
    assert res == [36, 36, 36, 24]


def _barrier_chain_body(rank, world):
    """An async barrier makes progress while its caller blocks in another op: rank 1 sends
    to rank 0 only after its own barrier completed, which needs rank 0's barrier message; rank
    0 posts its barrier async and then blocks in recv, before it ever waits on the barrier."""
    g = fc.new_group([0, 1, 2])
    if rank == 0:
        w = fc.barrier(group=g, async_op=True)
        t = torch.zeros(1)
        # rank 1 sends only after *its* barrier completed, which needs rank 0 in the barrier.
        assert fc.recv(t, src=1) == 1
        w.wait()
        return t.item()
    if rank == 1:
        fc.barrier(group=g)
        fc.send(torch.full((1,), 42.0), dst=0)
        return None
    fc.barrier(group=g)
    return None


def test_barrier_async_then_p2p():
    assert harness.run(_barrier_chain_body, 3, timeout=30)[0] == 42.0


# ---------------------------------------------------------------------------------------------
# send / recv / isend / irecv


def _p2p_body(rank, world):
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    out = {}
    for i, (dt, n) in enumerate([("float32", 0), ("float32", 1), ("int64", 7), ("bfloat16", 1001),
                                 ("float64", BIG), ("int32", 3 * BIG)]):
        mine = gen(rank, i, dt, n, kind="int")
        got = torch.full((n,), -1, dtype=DTYPES[dt])
        # Blocking ring, ordered so no one blocks on a full ring with nobody receiving.
        if rank % 2 == 0:
            fc.send(mine, nxt)
            src = fc.recv(got, prv)
        else:
            src = fc.recv(got, src=prv)
            assert fc.send(mine, dst=nxt) is None
        assert src == prv
        assert torch.equal(got, gen(prv, i, dt, n, kind="int")), f"blocking ring {dt} {n}"
        # Non-blocking ring: everybody isends first (larger than the ring too).
        got2 = torch.full((n,), -1, dtype=DTYPES[dt])
        ws = fc.isend(mine, nxt)
        wr = fc.irecv(got2, prv)
        assert isinstance(ws, fc.Work) and isinstance(wr, fc.Work)
        fut = wr.get_future()
        assert wr.wait() is True and ws.wait() is True
        assert ws.is_completed() and wr.is_completed()
        assert ws.exception() is None and wr.exception() is None
        assert fut.wait()[0].data_ptr() == got2.data_ptr()
        assert torch.equal(got2, gen(prv, i, dt, n, kind="int")), f"async ring {dt} {n}"
        out[i] = digest(got2)
    return out


def test_send_recv_ring():
    harness.run(_p2p_body, 4, timeout=60, env=RING_ENV)


def _tags_body(rank, world, n):
    g = fc.new_group([0, 1])
    if rank == 0:
        # Same peer, several tags and groups, all sent before the receiver asks.
        ws = [fc.isend(torch.full((n,), float(tag)), 1, tag=tag) for tag in (1, 2, 3)]
        ws.append(fc.isend(torch.full((n,), 100.0), 1, group=g, tag=1))   # same tag, other group
        ws.append(fc.isend(torch.full((n,), 4.0), 1, tag=1))              # second message, tag 1
        ws.append(fc.isend(torch.full((n,), 7.0), group=g, group_dst=1))  # group_dst, tag 0
        for w in ws:
            w.wait()
        return None
    t = {}
    for key in ("g0", "3", "g1", "1a", "2", "1b"):
        t[key] = torch.zeros(n)
    # Received in an order different from the send order: each must match by (group, tag, order).
    assert fc.recv(t["g0"], group=g, group_src=0) == 0
    assert fc.recv(t["3"], 0, tag=3) == 0
    assert fc.recv(t["g1"], 0, group=g, tag=1) == 0
    w1 = fc.irecv(t["1a"], 0, tag=1)
    w2 = fc.irecv(t["2"], src=0, tag=2)
    w3 = fc.irecv(t["1b"], 0, tag=1)
    for w in (w3, w2, w1):
        w.wait()
    return {k: v.unique().tolist() for k, v in t.items()}


@pytest.mark.parametrize("n", [5, 50_001])
def test_send_recv_tags_and_groups_kept_apart(n):
    res = harness.run(_tags_body, 2, n, timeout=60, env=RING_ENV)
    assert res[1] == {"g0": [7.0], "3": [3.0], "g1": [100.0], "1a": [1.0], "2": [2.0], "1b": [4.0]}
