"""Bad input gets a clear Python exception naming rank, group and argument, before anything is
sent; mismatched collectives fail on every member and leave the group usable.

"Before anything is sent" is checked by its consequence: rank 0 makes every bad call alone
(rank 1 makes none), and afterwards both ranks run correct all_reduces on the same group. Had a
bad call sent a message, or used up a sequence number, rank 1 would see a stray or mismatched
message and the correct op would fail or hang (the harness timeout turns a hang into a
failure)."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

import harness

import fastcomm as fc

SHORT = dict(init_timeout=10.0)  # op timeout too: a wrongly-sent message fails within 10 s


def expect(exc_type, fn, *must_contain):
    """Calls fn, requires exc_type (exactly that class or a subclass) and every string of
    must_contain in the message; returns the message."""
    try:
        fn()
    except exc_type as e:
        msg = str(e)
        missing = [s for s in must_contain if s not in msg]
        assert not missing, f"message lacks {missing}: {msg!r}"
        return msg
    except BaseException as e:  # noqa: BLE001
        raise AssertionError(f"expected {exc_type.__name__}, got {type(e).__name__}: {e}") from e
    raise AssertionError(f"expected {exc_type.__name__}, nothing was raised")


def _argument_errors_body(rank, world):
    g = fc.new_group([0, 1])
    label = "[0, 1]"
    me = f"rank {rank}"
    checked = []

    def bad_reduce(t, exc, *needles, op=ReduceOp.SUM, group=g):
        before = t.clone() if t.layout == torch.strided and t.device.type == "cpu" else None
        msg = expect(exc, lambda: fc.all_reduce(t, op=op, group=group), me, *needles)
        if before is not None:  # a refused call leaves the caller's tensor alone
            assert torch.equal(t, before), f"tensor modified by a refused call: {msg}"
        checked.append(msg)

    if rank == 0:
        # -- group construction --------------------------------------------------------------
        checked.append(expect(ValueError, lambda: fc.new_group([1]), me, "'ranks'", "[1]"))
        checked.append(expect(ValueError, lambda: fc.new_group([0, 0, 1]), me, "'ranks'", "twice"))
        checked.append(expect(ValueError, lambda: fc.new_group([0, 5]), me, "'ranks'", "5"))
        checked.append(expect(ValueError, lambda: fc.new_group([-1, 0]), me, "'ranks'", "-1"))
        checked.append(expect(ValueError, lambda: fc.new_group([]), me, "'ranks'", "empty"))
        checked.append(expect(ValueError, lambda: fc.new_groups([[0, 2], [1]]), me, "'ranks'", "2"))
        # -- a non-member entry of new_groups refuses collectives ----------------------------
        g_other = fc.new_groups([[1]])[0]
        assert g_other.rank() == -1 and not g_other.is_member
        bad_reduce(torch.ones(4), ValueError, "[1]", "'group'", group=g_other)
        # -- tensors ---------------------------------------------------------------------
        bad_reduce(torch.arange(16.0).reshape(4, 4).t(), ValueError, label, "'tensor'", "contiguous")
        bad_reduce(torch.arange(10.0)[::2], ValueError, label, "'tensor'", "contiguous")
        bad_reduce(torch.ones(4, dtype=torch.bool), TypeError, label, "'tensor'", "dtype", "Bool")
        bad_reduce(torch.ones(4, dtype=torch.complex64), TypeError, label, "'tensor'", "dtype")
        bad_reduce(torch.ones(4).to_sparse(), ValueError, label, "'tensor'")
        bad_reduce(torch.empty(4, device="meta"), ValueError, label, "'tensor'", "meta")
        # -- ops -------------------------------------------------------------------------
        bad_reduce(torch.ones(4, dtype=torch.int32), ValueError, label, "'op'", "BAND", op=ReduceOp.BAND)
        bad_reduce(torch.ones(4, dtype=torch.int32), ValueError, label, "'op'", "AVG", op=ReduceOp.AVG)
        bad_reduce(torch.ones(4, dtype=torch.int64), ValueError, label, "'op'", "AVG", op=ReduceOp.AVG)
        bad_reduce(torch.ones(4), TypeError, "'op'", op="sum")
        # -- group argument of the wrong type --------------------------------------------
        bad_reduce(torch.ones(4), TypeError, "'group'", group=[0, 1])
        # -- async_op=True refuses the same way, at the call ------------------------------
        t = torch.ones(4, dtype=torch.bool)
        checked.append(expect(TypeError, lambda: fc.all_reduce(t, group=g, async_op=True), me, "'tensor'"))
    # Nothing was sent and no sequence number was used: the group works for both ranks.
    for i in range(3):
        t = torch.full((5,), float(rank + 1 + i))
        fc.all_reduce(t, group=g)
        assert torch.equal(t, torch.full((5,), float(3 + 2 * i))), t
    t = torch.full((5,), float(rank + 1))
    fc.all_reduce(t)  # and the world group too
    assert torch.equal(t, torch.full((5,), 3.0)), t
    return checked


def test_argument_errors_name_rank_group_argument_and_send_nothing():
    res = harness.run(_argument_errors_body, 2, timeout=60, **SHORT)
    assert len(res[0]) >= 20 and res[1] == []


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
    # A group made before shutdown belongs to the old session: after init() again it must be
    # refused with a clear error (or work), never silently talk to the new session's groups.
    g_old = fc.new_group([0, 1])
    t = torch.ones(3)
    fc.all_reduce(t, group=g_old)
    fc.shutdown()
    harness.init_child(rank, world, timeout=5.0)
    g_new = fc.new_group([0, 1])
    t = torch.full((3,), float(rank + 1))
    fc.all_reduce(t, group=g_new)
    assert torch.equal(t, torch.full((3,), 3.0))
    t = torch.full((3,), float(rank + 1))
    try:
        fc.all_reduce(t, group=g_old)
    except RuntimeError as e:
        assert f"rank {rank}" in str(e), str(e)
        assert not isinstance(e, dist.DistBackendError), f"refused only after talking: {e}"
    else:
        assert torch.equal(t, torch.full((3,), 3.0)), t
    # the new session's group still works
    t = torch.full((3,), float(rank + 1))
    fc.all_reduce(t, group=g_new)
    assert torch.equal(t, torch.full((3,), 3.0))
    return True


def test_group_from_before_reinit_is_refused_or_works():
    harness.run(_reinit_body, 2, timeout=40)


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
