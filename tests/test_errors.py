"""Bad input gets a clear Python exception naming rank, group and argument, before anything is
sent; mismatched collectives fail on every member and leave the group usable.

"Before anything is sent" is checked by its consequence: rank 0 makes every bad call alone
(rank 1 makes none), and afterwards both ranks run correct all_reduces on the same group. Had a
bad call sent a message, or used up a sequence number, rank 1 would see a stray or mismatched
message and the correct op would fail or hang (the harness timeout turns a hang into a
failure)."""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

import harness
from _helpers import expect

import fastcomm as fc

SHORT = dict(init_timeout=10.0)  # op timeout too: a wrongly-sent message fails within 10 s


def _nonmember_group():
    g = fc.new_groups([[1]])[0]  # an entry this rank (0) is not in
    assert g.rank() == -1 and not g.is_member
    return g


# (name, exception type, call(group) -> None, words the message must hold besides "rank 0").
# A call gets the pair group [0, 1]; a tensor it passes is checked unchanged afterwards.
G = "[0, 1]"
ARG_ERRORS = [
    # -- group construction ----------------------------------------------------------------
    ("new_group-non-member", ValueError, lambda g: fc.new_group([1]), ["'ranks'", "[1]"]),
    ("new_group-duplicate", ValueError, lambda g: fc.new_group([0, 0, 1]), ["'ranks'", "twice"]),
    ("new_group-out-of-range", ValueError, lambda g: fc.new_group([0, 5]), ["'ranks'", "5"]),
    ("new_group-negative", ValueError, lambda g: fc.new_group([-1, 0]), ["'ranks'", "-1"]),
    ("new_group-empty", ValueError, lambda g: fc.new_group([]), ["'ranks'", "empty"]),
    ("new_groups-out-of-range", ValueError, lambda g: fc.new_groups([[0, 2], [1]]), ["'ranks'", "2"]),
    ("new_groups-duplicate", ValueError, lambda g: fc.new_groups([[1, 1]]), ["'ranks'", "twice"]),
    # -- a non-member entry of new_groups refuses collectives ------------------------------
    ("non-member-group", ValueError,
     lambda g: fc.all_reduce(torch.ones(4), group=_nonmember_group()), ["[1]", "'group'"]),
    # -- tensors -------------------------------------------------------------------------
    ("non-contiguous-transpose", ValueError,
     lambda g: fc.all_reduce(torch.arange(16.0).reshape(4, 4).t(), group=g), [G, "'tensor'", "contiguous"]),
    ("non-contiguous-stride", ValueError,
     lambda g: fc.all_reduce(torch.arange(10.0)[::2], group=g), [G, "'tensor'", "contiguous"]),
    ("dtype-uint32", TypeError,
     lambda g: fc.all_reduce(torch.ones(4, dtype=torch.uint32), group=g), [G, "'tensor'", "dtype", "UInt32"]),
    # complex runs as its real view, so only SUM and AVG fold it (torch's supports_complex)
    ("dtype-complex64", ValueError,
     lambda g: fc.all_reduce(torch.ones(4, dtype=torch.complex64), op=ReduceOp.MAX, group=g),
     [G, "'op'", "MAX", "complex", "ComplexFloat"]),
    ("dtype-complex128-PRODUCT", ValueError,
     lambda g: fc.all_reduce(torch.ones(4, dtype=torch.complex128), op=ReduceOp.PRODUCT, group=g),
     [G, "'op'", "PRODUCT", "ComplexDouble"]),
    ("dtype-complex-BXOR", ValueError,
     lambda g: fc.all_reduce(torch.ones(4, dtype=torch.complex64), op=ReduceOp.BXOR, group=g), [G, "'op'", "BXOR"]),
    ("complex-conj-view", ValueError,
     lambda g: fc.all_reduce(torch.ones(4, dtype=torch.complex64).conj(), group=g), [G, "'tensor'", "resolve_conj"]),
    ("neg-bit-view", ValueError,
     lambda g: fc.all_reduce(torch.ones(1, dtype=torch.complex64).conj().imag, group=g),  # 1 element: contiguous
     [G, "'tensor'", "resolve_neg"]),
    ("op-PREMUL_SUM", ValueError,
     lambda g: fc.all_reduce(torch.ones(4), op=dist._make_nccl_premul_sum(2.0), group=g),
     [G, "'op'", "PREMUL_SUM", "Gloo"]),
    ("sparse-csr", ValueError, lambda g: fc.all_reduce(torch.eye(4).to_sparse_csr(), group=g),
     [G, "'tensor'", "dense"]),
    ("sparse-MAX", ValueError,
     lambda g: fc.all_reduce(torch.ones(4).to_sparse(), op=ReduceOp.MAX, group=g), [G, "'op'", "MAX", "sparse"]),
    ("sparse-bool", TypeError,
     lambda g: fc.all_reduce(torch.ones(4, dtype=torch.bool).to_sparse(), group=g), [G, "'tensor'", "Bool"]),
    ("meta-device", ValueError,
     lambda g: fc.all_reduce(torch.empty(4, device="meta"), group=g), [G, "'tensor'", "meta"]),
    # -- ops -----------------------------------------------------------------------------
    ("op-BAND-float", ValueError,
     lambda g: fc.all_reduce(torch.ones(4), op=ReduceOp.BAND, group=g), [G, "'op'", "BAND", "integer or bool"]),
    ("op-BXOR-bfloat16", ValueError,
     lambda g: fc.all_reduce(torch.ones(4, dtype=torch.bfloat16), op=ReduceOp.BXOR, group=g), [G, "'op'", "BXOR"]),
    ("op-AVG-bool", ValueError,
     lambda g: fc.all_reduce(torch.ones(4, dtype=torch.bool), op=ReduceOp.AVG, group=g), [G, "'op'", "AVG"]),
    ("op-AVG-int32", ValueError,
     lambda g: fc.all_reduce(torch.ones(4, dtype=torch.int32), op=ReduceOp.AVG, group=g), [G, "'op'", "AVG"]),
    ("op-AVG-int64", ValueError,
     lambda g: fc.all_reduce(torch.ones(4, dtype=torch.int64), op=ReduceOp.AVG, group=g), [G, "'op'", "AVG"]),
    ("op-AVG-int32-async", ValueError,
     lambda g: fc.all_reduce(torch.ones(4, dtype=torch.int32), op=ReduceOp.AVG, group=g, async_op=True),
     [G, "'op'", "AVG"]),
    ("op-not-a-ReduceOp", TypeError, lambda g: fc.all_reduce(torch.ones(4), op="sum", group=g), ["'op'"]),
    # -- group of the wrong type -----------------------------------------------------------
    ("group-not-a-Group", TypeError, lambda g: fc.all_reduce(torch.ones(4), group=[0, 1]), ["'group'"]),
    # -- a group rank outside the group (it wrapped or raised IndexError) -----------------
    ("broadcast-group_src-too-large", ValueError, lambda g: fc.broadcast(torch.ones(2), group_src=5, group=g),
     [G, "'group_src'", "5"]),
    ("broadcast-group_src-negative", ValueError, lambda g: fc.broadcast(torch.ones(2), group_src=-1, group=g),
     [G, "'group_src'", "-1"]),
    ("reduce-group_dst-negative", ValueError, lambda g: fc.reduce(torch.ones(2), group_dst=-2, group=g),
     [G, "'group_dst'", "-2"]),
    ("send-group_dst-negative", ValueError, lambda g: fc.send(torch.ones(2), group_dst=-1, group=g),
     [G, "'group_dst'", "-1"]),
    ("irecv-group_src-too-large", ValueError, lambda g: fc.irecv(torch.ones(2), group_src=2, group=g),
     [G, "'group_src'", "2"]),
    # -- async_op=True refuses the same way, at the call ----------------------------------
    ("dtype-complex-async", ValueError,
     lambda g: fc.all_reduce(torch.ones(4, dtype=torch.complex64), op=ReduceOp.MIN, group=g, async_op=True),
     [G, "'op'", "MIN"]),
]
XFAIL_ARG = {}


def _argument_error_body(rank, world, name):
    g = fc.new_group([0, 1])
    msg = None
    if rank == 0:
        _, exc, call, needles = next(c for c in ARG_ERRORS if c[0] == name)
        seen = []
        real_all_reduce = fc.all_reduce

        def spy(t, *a, **k):  # remember the tensor to check it is left unchanged
            if t.layout == torch.strided and t.device.type == "cpu":
                seen.append((t, t.clone()))
            return real_all_reduce(t, *a, **k)

        fc.all_reduce = spy
        try:
            msg = expect(exc, lambda: call(g), "rank 0", *needles)
        finally:
            fc.all_reduce = real_all_reduce
        for t, before in seen:
            assert torch.equal(t, before), f"tensor modified by a refused call: {msg}"
    # Nothing was sent and no sequence number was used: the group works for both ranks.
    for i in range(3):
        t = torch.full((5,), float(rank + 1 + i))
        fc.all_reduce(t, group=g)
        assert torch.equal(t, torch.full((5,), float(3 + 2 * i))), t
    t = torch.full((5,), float(rank + 1))
    fc.all_reduce(t)  # and the world group too
    assert torch.equal(t, torch.full((5,), 3.0)), t
    return msg


@pytest.mark.parametrize("name", [
    pytest.param(c[0], marks=pytest.mark.xfail(reason=XFAIL_ARG[c[0]], strict=True))
    if c[0] in XFAIL_ARG else c[0] for c in ARG_ERRORS])
def test_argument_error_names_rank_group_argument_and_sends_nothing(name):
    res = harness.run(_argument_error_body, 2, name, timeout=60, **SHORT)
    assert res[0] and res[1] is None


def _before_init_body(rank, world):
    assert not fc.is_initialized()
    expect(RuntimeError, lambda: fc.all_reduce(torch.ones(3)), "not initialized")
    expect(RuntimeError, lambda: fc.all_reduce(torch.ones(3), async_op=True), "not initialized")
    expect(RuntimeError, lambda: fc.new_group([0]), "not initialized")
    expect(RuntimeError, lambda: fc.new_groups([[0]]), "not initialized")
    expect(RuntimeError, lambda: fc.get_rank(), "not initialized")
    expect(RuntimeError, lambda: fc.get_world_size(), "not initialized")
    fc.shutdown()  # harmless before init
    return True


def test_use_before_init():
    harness.run(_before_init_body, 1, timeout=30, init=False)


def _after_shutdown_body(rank, world):
    g = fc.new_group([0, 1])
    t = torch.ones(3)
    fc.all_reduce(t, group=g)
    fc.shutdown()
    assert not fc.is_initialized()
    before = t.clone()
    expect(RuntimeError, lambda: fc.all_reduce(t, group=g), "init")  # an old group handle
    expect(RuntimeError, lambda: fc.all_reduce(t), "init")
    expect(RuntimeError, lambda: fc.all_reduce(t, group=g, async_op=True), "init")
    expect(RuntimeError, lambda: fc.new_group([0, 1]), "init")
    expect(RuntimeError, lambda: fc.get_rank(), "init")
    assert torch.equal(t, before)
    fc.shutdown()  # a second shutdown is harmless
    return True


def test_use_after_shutdown():
    harness.run(_after_shutdown_body, 2, timeout=30)


def _reinit_body(rank, world):
    """A group made before shutdown belongs to the old session: after init() again it must be
    refused (RuntimeError naming the rank), like any use after shutdown."""
    g_old = fc.new_group([0, 1])
    fc.all_reduce(torch.ones(3), group=g_old)
    fc.shutdown()
    harness.init_child(rank, world, timeout=5.0)
    g_new = fc.new_group([0, 1])
    fc.all_reduce(torch.ones(3), group=g_new)  # both groups have run one op now
    t = torch.full((3,), float(rank + 1))
    try:
        fc.all_reduce(t, group=g_old)
        refused = False
    except ValueError as e:  # a bad 'group' argument, like a group this rank is not in
        assert f"rank {rank}" in str(e) and "'group'" in str(e) and "shutdown" in str(e), str(e)
        refused = True
    if not refused:
        # Accepted: show what that costs. g_old and g_new carry the same group id (same rank
        # list, first instance of each session), so ops of the two distinct groups with equal
        # sequence numbers take each other's messages when issued in different orders.
        ta = torch.full((3,), float(rank + 1))  # g_new: 1 + 2 = 3
        tb = torch.full((3,), 10.0 * (rank + 1))  # g_old: 10 + 20 = 30
        if rank == 0:
            wa = fc.all_reduce(ta, group=g_new, async_op=True)
            wb = fc.all_reduce(tb, group=g_old, async_op=True)
        else:
            wb = fc.all_reduce(tb, group=g_old, async_op=True)
            wa = fc.all_reduce(ta, group=g_new, async_op=True)
        wa.wait()
        wb.wait()
        assert torch.equal(ta, torch.full((3,), 3.0)) and torch.equal(tb, torch.full((3,), 30.0)), (
            f"stale group accepted and results mixed: new group got {ta.tolist()}, "
            f"stale group got {tb.tolist()}")
    assert refused, "a group handle from before shutdown()/init() was accepted"
    # the new session's group still works
    t = torch.full((3,), float(rank + 1))
    fc.all_reduce(t, group=g_new)
    assert torch.equal(t, torch.full((3,), 3.0))
    return True


def test_group_from_before_reinit_is_refused():
    harness.run(_reinit_body, 2, timeout=40)


def _ring_mismatch_body(rank, world):
    os.environ["FASTCOMM_SHM_RING_BYTES"] = str(65536 * (rank + 1))
    with pytest.raises(ValueError, match="FASTCOMM_SHM_RING_BYTES") as err:
        harness.init_child(rank, world)
    assert not fc.is_initialized()
    return str(err.value)


def test_ring_size_must_agree_on_every_rank():
    # Pieces (and, across hosts, the largest frame) follow from the ring size: ranks that
    # disagree are refused at init, each naming its value and the other rank's.
    msgs = harness.run(_ring_mismatch_body, 2, timeout=60, init=False)
    assert "is 65536 here but 131072 on rank 1" in msgs[0], msgs[0]
    assert "is 131072 here but 65536 on rank 0" in msgs[1], msgs[1]


def _bad_setting_body(rank, world):
    with pytest.raises(ValueError, match="FASTCOMM_SHM_STREAM_STORES must be '0', '1' or 'auto', got 'yes'"):
        harness.init_child(rank, world)
    assert not fc.is_initialized()
    return True


def test_malformed_setting_is_refused_at_init():
    assert harness.run(_bad_setting_body, 2, timeout=60, init=False,
                       env={"FASTCOMM_SHM_STREAM_STORES": "yes"}) == [True, True]


@pytest.mark.parametrize("name,bad,good,field,value", [
    ("FASTCOMM_HIERARCHICAL", "false", "0", "hierarchical", False),
    ("FASTCOMM_FAKE_DEVICE", "true", "1", "fake_device", True),
    ("FASTCOMM_DEVICE_PAIR_BLOCKING", "off", "0", "device_pair_blocking", False),
    ("FASTCOMM_REDUCE_KERNELS", "basline", "baseline", "baseline_kernels", True),
])
def test_switches_refuse_what_they_do_not_name(monkeypatch, name, bad, good, field, value):
    # Read in this process: the settings parser is the one init calls (Settings::from_env).
    from fastcomm import _C
    monkeypatch.setenv(name, bad)
    with pytest.raises(ValueError, match=f"{name} must be .*got '{bad}'"):
        _C.Settings.from_env()
    monkeypatch.setenv(name, good)
    assert getattr(_C.Settings.from_env(), field) is value


def _init_twice_body(rank, world):
    msg = expect(RuntimeError, lambda: harness.init_child(rank, world, timeout=5.0), f"rank {rank}",
                 "twice")
    t = torch.full((3,), float(rank + 1))
    fc.all_reduce(t)  # the first session is intact
    assert torch.equal(t, torch.full((3,), 3.0))
    expect(ValueError, lambda: (fc.shutdown(), fc.init(store=harness.child_store()))[1], "rank")
    assert not fc.is_initialized()
    return msg


def test_init_twice_and_store_without_rank():
    harness.run(_init_twice_body, 2, timeout=40)


def _init_args_body(rank, world, port):
    """fc.init(rank=, world_size=) on the env:// path stand in for RANK and WORLD_SIZE, as
    init_process_group's do (they were ignored: "environment variable RANK expected"); with
    torch.distributed initialized, arguments that contradict it are refused."""
    import os

    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        os.environ.pop(k, None)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    fc.init(rank=rank, world_size=world, timeout=30)
    t = torch.full((3,), float(rank + 1))
    fc.all_reduce(t)
    fc.shutdown()
    dist.init_process_group("gloo", store=harness.child_store(), rank=rank, world_size=world)
    msg = expect(ValueError, lambda: fc.init(rank=1 - rank), "argument 'rank' is", "torch.distributed")
    fc.init(rank=rank, world_size=world)  # agreeing arguments are fine
    fc.shutdown()
    dist.destroy_process_group()
    return t.tolist(), msg


def test_init_rank_and_world_size_arguments_on_env():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for values, msg in harness.run(_init_args_body, 2, port, timeout=60, init=False):
        assert values == [3.0] * 3 and msg, (values, msg)


# ---------------------------------------------------------------------------------------------
# Mismatched collectives: seen on the wire, reported on both members


MISMATCHES = [
    # (name, rank-0 tensor/op, rank-1 tensor/op, words the message must hold)
    ("numel", (lambda: torch.ones(5), ReduceOp.SUM), (lambda: torch.ones(6), ReduceOp.SUM)),
    ("numel-large", (lambda: torch.ones(7), ReduceOp.SUM), (lambda: torch.ones(200_000), ReduceOp.SUM)),
    ("numel-both-large", (lambda: torch.ones(150_000), ReduceOp.SUM),
     (lambda: torch.ones(200_000), ReduceOp.SUM)),
    ("dtype", (lambda: torch.ones(5), ReduceOp.SUM), (lambda: torch.ones(5, dtype=torch.float64), ReduceOp.SUM)),
    ("dtype-int", (lambda: torch.ones(5, dtype=torch.int32), ReduceOp.SUM),
     (lambda: torch.ones(5, dtype=torch.int64), ReduceOp.SUM)),
    ("op", (lambda: torch.ones(5), ReduceOp.SUM), (lambda: torch.ones(5), ReduceOp.MAX)),
    ("op-avg", (lambda: torch.ones(5), ReduceOp.AVG), (lambda: torch.ones(5), ReduceOp.SUM)),
]


def _mismatch_body(rank, world, name):
    g = fc.new_group([0, 1])
    case = next(c for c in MISMATCHES if c[0] == name)
    make, op = case[1 + rank]
    t = make()
    msgs = []
    expect_msg = expect(dist.DistBackendError, lambda: fc.all_reduce(t, op=op, group=g),
                        f"rank {rank}", "[0, 1]", "mismatch")
    msgs.append(expect_msg)
    # The group keeps working: a correct all_reduce right after, then one more.
    for i in range(2):
        n = 100_000 if i else 9
        t = torch.full((n,), float(rank + 1 + i))
        fc.all_reduce(t, group=g)
        assert torch.equal(t, torch.full((n,), float(3 + 2 * i))), f"{name}: after mismatch {t[:4]}"
    # ... and so does an async one.
    t = torch.full((4,), float(rank + 1))
    fc.all_reduce(t, op=ReduceOp.MAX, group=g, async_op=True).wait()
    assert torch.equal(t, torch.full((4,), 2.0))
    return msgs


@pytest.mark.parametrize("name", [c[0] for c in MISMATCHES])
def test_mismatch_fails_on_both_members_and_group_recovers(name):
    res = harness.run(_mismatch_body, 2, name, timeout=60, env={"FASTCOMM_SHM_RING_BYTES": "65536"},
                      **SHORT)
    for r in (0, 1):
        assert "timed out" not in res[r][0], f"rank {r} learnt of the mismatch only by timeout: {res[r][0]}"


def _mismatch_async_body(rank, world):
    # Mismatch inside a queue of async ops: only the mismatched op fails, the others succeed.
    g = fc.new_group([0, 1])
    works = []
    for i in range(5):
        n = 6 if (i == 2 and rank == 1) else 5  # op #2 differs in numel
        t = torch.full((n,), float(rank + 1 + i))
        works.append((fc.all_reduce(t, group=g, async_op=True), t, i))
    for w, t, i in works:
        if i == 2:
            expect(dist.DistBackendError, w.wait, f"rank {rank}", "[0, 1]")
            assert w.is_completed() and w.exception() is not None
            with pytest.raises(Exception):
                w.get_future().wait()
        else:
            w.wait()
            assert torch.equal(t, torch.full_like(t, float(3 + 2 * i))), (i, t)
    return True


def test_mismatch_in_async_queue_fails_only_that_op():
    harness.run(_mismatch_async_body, 2, timeout=60, **SHORT)


def _mismatch_triple_body(rank, world):
    """Rank 2 issues a different dtype in a triple, with a payload larger than the ring: every
    member fails, and then the group must work again."""
    import time

    g = fc.new_group([0, 1, 2])
    t = torch.ones(50_000, dtype=torch.float64 if rank == 2 else torch.float32)  # 200/400 KB
    if rank == 2:
        time.sleep(0.3)  # ranks 0 and 1 fill their rings to each other before anyone fails
    msg = expect(dist.DistBackendError, lambda: fc.all_reduce(t, group=g), f"rank {rank}", "[0, 1, 2]",
                 "mismatch")
    for n in (3, 120_000):
        t = torch.full((n,), float(rank + 1))
        fc.all_reduce(t, group=g)
        assert torch.equal(t, torch.full((n,), 6.0)), f"after mismatch: {t[:4]}"
    return msg


def test_mismatch_in_triple_fails_everywhere_and_group_recovers():
    res = harness.run(_mismatch_triple_body, 3, timeout=60, env={"FASTCOMM_SHM_RING_BYTES": "65536"},
                      init_timeout=2.0)
    for r in range(3):
        assert "timed out" not in res[r], f"rank {r} learnt of the mismatch only by timeout: {res[r]}"

