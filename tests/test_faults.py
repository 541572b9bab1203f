"""Faults: a peer that dies or stalls surfaces as an error on the members of its groups within
the timeout (never a hang), groups it is not in keep working, shutdown fails in-flight work,
and shared memory never outlives the job.

Every run inits with a short timeout (harness init_timeout is fc.init's timeout, which is also
the op timeout), and the harness timeout is a hard bound well above it, so a hang fails the test
instead of stalling the suite."""
from __future__ import annotations

import os
from datetime import timedelta
import signal
import stat
import threading
import time

import pytest
import torch
import torch.distributed as dist

import harness
from _helpers import expect, wait_dead

import fastcomm as fc

RING_ENV = {"FASTCOMM_SHM_RING_BYTES": "65536"}
OP_TIMEOUT = 10.0


def expect_backend_error(fn, *needles):
    return expect(dist.DistBackendError, fn, *needles, nothing="the op succeeded")


def die(how):
    if how == "exit":
        os._exit(3)
    os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)  # not reached


# ---------------------------------------------------------------------------------------------
# A dying peer




def _pair_death_body(rank, world, how, when, flag_dir):
    g = fc.new_group([0, 1])
    for i in range(3):  # a few good ops first: the peer dies mid-sequence
        t = torch.full((100,), float(rank + 1))
        fc.all_reduce(t, group=g)
        assert torch.equal(t, torch.full((100,), 3.0))
    pid_file = os.path.join(flag_dir, "pid")
    if rank == 1:
        if when == "survivor_mid_op":  # rank 0 is inside its op (and never gets our data)
            while not os.path.exists(os.path.join(flag_dir, "posted")):
                time.sleep(0.001)
            time.sleep(0.1)
        elif when == "in_flight":  # dies with a large async op of its own half sent
            fc.all_reduce(torch.ones(300_000), group=g, async_op=True)
        with open(pid_file + ".tmp", "w") as f:
            f.write(str(os.getpid()))
        os.rename(pid_file + ".tmp", pid_file)
        die(how)
    n = 300_000 if when != "between_ops" else 100
    if when == "survivor_mid_op":
        open(os.path.join(flag_dir, "posted"), "w").close()
    else:
        wait_dead(pid_file)  # so the op below cannot have the peer's data (nothing was drained)
    t = torch.ones(n)
    msg = expect_backend_error(lambda: fc.all_reduce(t, group=g), "rank 0", "[0, 1]", "rank 1")
    assert "exited" in msg, f"death reported as something else (a timeout?): {msg}"
    # Later ops on the group fail at once, naming the dead rank again.
    msg2 = expect_backend_error(lambda: fc.all_reduce(torch.ones(3), group=g), "rank 1")
    w = fc.all_reduce(torch.ones(3), group=g, async_op=True)
    expect_backend_error(w.wait, "rank 1")
    assert w.is_completed() and w.exception() is not None
    return msg, msg2


@pytest.mark.parametrize("how,when", [("exit", "between_ops"), ("sigkill", "between_ops"),
                                      ("sigkill", "in_flight"), ("sigkill", "survivor_mid_op"),
                                      ("exit", "survivor_mid_op")])
def test_dead_peer_fails_survivor_naming_it(tmp_path, how, when):
    res = harness.run(_pair_death_body, 2, how, when, str(tmp_path), timeout=60, env=RING_ENV,
                      init_timeout=OP_TIMEOUT, allow_fail=(1,))
    assert res[0] is not None and res[1] is None


def _queued_death_body(rank, world, flag_dir):
    # The survivor has several async ops queued on the group when its peer dies: every one of
    # them fails naming the dead rank; none hangs.
    g = fc.new_group([0, 1])
    fc.all_reduce(torch.ones(4), group=g)
    if rank == 1:
        for _ in range(3000):
            if os.path.exists(os.path.join(flag_dir, "queued")):
                break
            time.sleep(0.01)
        die("sigkill")
    works = [fc.all_reduce(torch.ones(n), group=g, async_op=True) for n in (5, 200_000, 5, 7)]
    open(os.path.join(flag_dir, "queued"), "w").close()
    msgs = [expect_backend_error(w.wait, "rank 0", "[0, 1]", "rank 1") for w in works]
    assert all(w.is_completed() and w.exception() is not None for w in works)
    return msgs


def test_dead_peer_fails_every_queued_async_op(tmp_path):
    res = harness.run(_queued_death_body, 2, str(tmp_path), timeout=60, env=RING_ENV,
                      init_timeout=OP_TIMEOUT, allow_fail=(1,))
    assert len(res[0]) == 4


def _world4_death_body(rank, world, flag_dir):
    g01, g23 = fc.new_groups([[0, 1], [2, 3]])
    mine = g01 if rank < 2 else g23
    for i in range(3):
        t = torch.full((50,), float(rank + 1 + i))
        fc.all_reduce(t, group=mine)
        exp = float((3 if rank < 2 else 7) + 2 * i)  # (1+i)+(2+i) on [0, 1], (3+i)+(4+i) on [2, 3]
        assert torch.equal(t, torch.full((50,), exp)), (rank, i, t[:3])
    if rank == 3:
        die("sigkill")
    if rank == 2:
        msg = expect_backend_error(lambda: fc.all_reduce(torch.ones(10), group=g23),
                                   "rank 2", "[2, 3]", "rank 3", "exited")
    else:
        # The pair [0, 1] does not contain rank 3 and keeps working, before and after it died.
        for i in range(50):
            n = (7, 1000, 100_000)[i % 3]
            t = torch.full((n,), float(rank + i))
            fc.all_reduce(t, group=g01)
            assert torch.equal(t, torch.full((n,), float(1 + 2 * i))), (i, t[:3])
        msg = None
    # The world group contains rank 3: it fails on every survivor, naming rank 3.
    expect_backend_error(lambda: fc.all_reduce(torch.ones(10)), f"rank {rank}", "rank 3")
    # Having seen rank 3 dead, no survivor maps its segment any more (its memory is freed).
    seg = f"fastcomm-{harness.job_token()}-3"
    with open("/proc/self/maps") as f:
        still = [line.strip() for line in f if seg in line]
    assert not still, f"rank {rank} still maps the dead rank's segment: {still}"
    if rank < 2:  # and [0, 1] still works after that
        t = torch.full((9,), float(rank))
        fc.all_reduce(t, group=g01)
        assert torch.equal(t, torch.full((9,), 1.0))
        open(os.path.join(flag_dir, f"done.{rank}"), "w").close()
    else:  # rank 2 stays alive until 0 and 1 are done, so that only rank 3 is dead for them
        for _ in range(6000):
            if all(os.path.exists(os.path.join(flag_dir, f"done.{r}")) for r in (0, 1)):
                break
            time.sleep(0.01)
    return msg


def test_dead_rank_only_breaks_its_groups(tmp_path):
    res = harness.run(_world4_death_body, 4, str(tmp_path), timeout=60, env=RING_ENV,
                      init_timeout=OP_TIMEOUT, allow_fail=(3,))
    assert res[3] is None and res[2] is not None


# ---------------------------------------------------------------------------------------------
# A stalled peer


def _stall_body(rank, world, flag_dir, members, staller, numel):
    g = fc.new_group(members)
    t = torch.full((10,), float(rank + 1))
    fc.all_reduce(t, group=g)  # everyone is there once
    total = float(sum(r + 1 for r in members))
    assert torch.equal(t, torch.full((10,), total))
    label = "[" + ", ".join(map(str, members)) + "]"
    if rank == staller:
        # Never calls while the others wait; wakes up once every other member has timed out.
        for _ in range(6000):
            if all(os.path.exists(os.path.join(flag_dir, f"timed_out.{r}"))
                   for r in members if r != rank):
                break
            time.sleep(0.01)
        else:
            raise AssertionError("the other members never reported a timeout")
        # Its late call must not hang. It may fail (the others gave up on this op) or, when
        # their data had all been sent before they gave up, complete with the right values.
        t = torch.full((numel,), float(rank + 1))
        try:
            fc.all_reduce(t, group=g)
            assert torch.equal(t, torch.full((numel,), total)), "late op completed with wrong values"
            result = ("stalled", "completed")
        except dist.DistBackendError as e:
            result = ("stalled", str(e))
    else:
        t0 = time.monotonic()
        msg = expect_backend_error(lambda: fc.all_reduce(torch.full((numel,), float(rank + 1)), group=g),
                                   f"rank {rank}", label, "timed out")
        waited = time.monotonic() - t0
        open(os.path.join(flag_dir, f"timed_out.{rank}"), "w").close()
        result = ("waiter", msg, waited)
    # The group is back in step for everyone: the next ops are correct on every member.
    for n in (numel, 7):
        t = torch.full((n,), float(rank + 1))
        fc.all_reduce(t, group=g)
        assert torch.equal(t, torch.full((n,), total)), f"after the stall: {t[:4]} != {total}"
    return result


@pytest.mark.parametrize("members,staller,numel", [([0, 1], 1, 10), ([0, 1], 1, 200_000),
                                                   ([0, 1, 2], 2, 10), ([0, 1, 2], 2, 200_000)])
def test_stalled_peer_times_out_naming_the_group(tmp_path, members, staller, numel):
    world = len(members)
    res = harness.run(_stall_body, world, str(tmp_path), members, staller, numel, timeout=60,
                      env=RING_ENV, init_timeout=2.0)
    for r in members:
        if r == staller:
            assert res[r][0] == "stalled"
        else:
            kind, msg, waited = res[r]
            # Not a speed assertion: only that the op waited for its timeout instead of failing
            # for another reason first.
            assert waited >= 1.5, f"rank {r} gave up after {waited:.2f}s, before the 2 s timeout: {msg}"


def _shutdown_inflight_body(rank, world, flag_dir):
    g = fc.new_group([0, 1])
    t = torch.ones(10)
    fc.all_reduce(t, group=g)
    if rank == 1:  # never joins the next ops; waits for rank 0 to finish
        for _ in range(6000):
            if os.path.exists(os.path.join(flag_dir, "done")):
                return True
            time.sleep(0.01)
        raise AssertionError("rank 0 never finished")
    try:
        # (a) a pending async op, nobody waiting: shutdown fails it
        t1 = torch.full((10,), 5.0)
        w1 = fc.all_reduce(t1, group=g, async_op=True)
        fut1 = w1.get_future()
        # (b) a thread blocked in wait() on another pending op: shutdown wakes it with an error
        w2 = fc.all_reduce(torch.ones(300_000), group=g, async_op=True)
        box = {}

        def waiter():
            try:
                w2.wait()
                box["r"] = "completed"
            except BaseException as e:  # noqa: BLE001
                box["r"] = e

        th = threading.Thread(target=waiter)
        th.start()
        time.sleep(0.2)  # let it block in wait()
        assert not w1.is_completed() and not w2.is_completed()
        fc.shutdown()
        th.join(timeout=20)
        assert not th.is_alive(), "Work.wait() still blocked after shutdown"
        assert isinstance(box["r"], dist.DistBackendError), box["r"]
        assert "shut down" in str(box["r"]) and "rank 0" in str(box["r"])
        assert w1.is_completed() and w1.exception() is not None
        expect_backend_error(w1.wait, "rank 0", "shut down")
        with pytest.raises(Exception, match="shut down"):
            fut1.wait()
        assert torch.equal(t1, torch.full((10,), 5.0))  # nothing was folded into it
    finally:
        open(os.path.join(flag_dir, "done"), "w").close()
    return True


def test_shutdown_fails_in_flight_work(tmp_path):
    harness.run(_shutdown_inflight_body, 2, str(tmp_path), timeout=60, env=RING_ENV,
                init_timeout=OP_TIMEOUT)


def _peer_shut_down_body(rank, world, backend):
    """Rank 1 shuts fastcomm down (and stays alive) while rank 0 waits on an op with it: rank 0's
    op fails at once naming that, as when a peer's process exits (Gloo: "Connection closed by
    peer"), instead of after the group's 300 s timeout; so does its next op with rank 1."""
    store = harness.child_store()
    g = fc.new_group([0, 1], timeout=300)
    fc.all_reduce(torch.ones(2), group=g)
    if backend:
        dist.init_process_group("fastcomm", store=harness.child_store(), rank=rank, world_size=world)
    msgs = []
    if rank == 1:
        if backend:
            dist.destroy_process_group()
        fc.shutdown()
        store.set("down", "1")
        store.wait(["seen"], timedelta(seconds=60))
        return msgs
    store.wait(["down"], timedelta(seconds=60))
    if backend:
        msgs.append(expect_backend_error(lambda: dist.all_reduce(torch.ones(3)), "rank 1", "shut fastcomm down"))
    msgs.append(expect_backend_error(lambda: fc.all_reduce(torch.ones(3), group=g), "rank 1", "shut fastcomm down"))
    msgs.append(expect_backend_error(lambda: fc.all_reduce(torch.ones(3), group=g), "cannot run", "rank 1",
                                     "shut fastcomm down"))
    store.set("seen", "1")
    return msgs


@pytest.mark.parametrize("backend", [False, True], ids=["native", "backend"])
def test_a_peer_that_shut_down_fails_ops_naming_it(backend):
    msgs = harness.run(_peer_shut_down_body, 2, backend, timeout=90)
    assert len(msgs[0]) == (3 if backend else 2), msgs


# ---------------------------------------------------------------------------------------------
# Shared memory: private to the job and gone once every rank has attached


def _segments_body(rank, world):
    token = harness.job_token()
    assert len(token) >= 32 and all(c in "0123456789abcdef" for c in token), token  # unguessable
    fc.all_reduce(torch.ones(4))  # after this every rank has finished init, i.e. unlinked
    left = [n for n in harness.shm_entries() if token in n]
    assert not left, f"segments still named after init: {left}"
    g = fc.new_group([0, 1] if rank < 2 else [2, 3])
    t = torch.ones(200_000)
    fc.all_reduce(t, group=g)  # the unlinked segments still carry traffic
    assert torch.equal(t, torch.full((200_000,), 2.0))
    return token


def test_segments_unlinked_after_init():
    tokens = harness.run(_segments_body, 4, timeout=60, env=RING_ENV)
    assert len(set(tokens)) == 1
    assert not [n for n in harness.shm_entries() if tokens[0] in n]


def _segment_mode_body(rank, world):
    """Catches this rank's own segment in the window between creation and unlink: fc.init is
    run with the engine wrapped so that unlink_segment() first stats the segment."""
    from fastcomm import _state

    os.umask(0)  # the mode must come from the creation call itself, not from the umask
    seen = {}
    real_c = _state._C

    class EngineSpy:
        def __init__(self, *args, **kwargs):
            self._e = real_c.Engine(*args, **kwargs)

        def unlink_segment(self):
            token = harness.job_token()
            path = f"/dev/shm/fastcomm-{token}-{rank}"
            st = os.stat(path)
            seen["mode"] = stat.S_IMODE(st.st_mode)
            seen["uid"] = st.st_uid
            seen["names"] = [n for n in harness.shm_entries() if token in n]
            return self._e.unlink_segment()

        def __getattr__(self, name):
            return getattr(self._e, name)

    class CSpy:
        Engine = EngineSpy

        def __getattr__(self, name):
            return getattr(real_c, name)

    _state._C = CSpy()
    try:
        harness.init_child(rank, world, timeout=30.0)
    finally:
        _state._C = real_c
    assert seen, "init never unlinked its segment"
    assert seen["mode"] == 0o600, f"segment mode {oct(seen['mode'])}, expected 0o600"
    assert seen["uid"] == os.getuid()
    t = torch.full((3,), float(rank))
    fc.all_reduce(t)
    assert torch.equal(t, torch.full((3,), float(sum(range(world)))))
    fc.shutdown()
    return seen["names"]


def test_segments_are_mode_0600():
    res = harness.run(_segment_mode_body, 2, timeout=60, init=False)
    for r, names in enumerate(res):
        assert any(n.endswith(f"-{r}") for n in names), names


def _init_peer_missing_body(rank, world):
    if rank == 1:
        os._exit(0)  # never arrives
    before = set(harness.shm_entries())
    with pytest.raises(Exception):
        harness.init_child(rank, world, timeout=2.0)
    assert not fc.is_initialized()
    leaked = set(harness.shm_entries()) - before
    assert not leaked, f"failed init left {sorted(leaked)}"
    return True


def test_failed_init_leaves_nothing():
    harness.run(_init_peer_missing_body, 2, timeout=60, init=False, allow_fail=(1,))


def _init_peer_dies_after_create_body(rank, world):
    """Rank 1 creates its segment and is SIGKILLed before attaching its peers (so before it
    could unlink its name); rank 0's init must fail, not hang."""
    from fastcomm import _state

    if rank == 1:
        real_c = _state._C

        class EngineDies:
            def __init__(self, *args, **kwargs):
                self._e = real_c.Engine(*args, **kwargs)

            def attach_peers(self):
                os.kill(os.getpid(), signal.SIGKILL)

            def __getattr__(self, name):
                return getattr(self._e, name)

        class CSpy:
            Engine = EngineDies

            def __getattr__(self, name):
                return getattr(real_c, name)

        _state._C = CSpy()
    with pytest.raises(Exception):
        harness.init_child(rank, world, timeout=3.0)
    assert not fc.is_initialized()
    return True


def test_rank_killed_during_init_leaves_no_segment():
    before = set(harness.shm_entries())
    tokens_before = set(harness.TOKENS_SEEN)
    harness.run(_init_peer_dies_after_create_body, 2, timeout=60, init=False, allow_fail=(1,))
    tokens = harness.TOKENS_SEEN - tokens_before
    leaked = sorted(n for n in set(harness.shm_entries()) - before if any(t in n for t in tokens))
    for n in leaked:  # clean up here, so that only this test reports it
        try:
            os.unlink(os.path.join("/dev/shm", n))
        except FileNotFoundError:
            pass
    assert not leaked, f"segments of a rank killed during init survive the job: {leaked}"
