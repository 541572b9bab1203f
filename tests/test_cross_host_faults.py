"""Faults across hosts (tests/_cross_host.py simulates the hosts): a peer that dies or stalls
on another host, members of hierarchical groups dying, queued async ops failing, and shutdown
handshakes over Gloo (a rank leaving right after its last op, a leader leaving while ops that
no longer need it run, both sides leaving); the bodies are test_faults' where they exist, so
the behaviour is that on one host. A last test runs two ranks in real network namespaces joined
by a veth pair; it skips, with the reason, where namespaces cannot be made (not root, no `ip`,
no CAP_NET_ADMIN)."""
from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import time
import uuid
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import harness
import test_faults
from _cross_host import BULK_ENV, RING_ENV, SPLIT, run

import fastcomm as fc


# ---------------------------------------------------------------------------------------------
# Peer death and stalls across hosts


# ("sigkill", "in_flight") is left out: Gloo buffers without bound, so the dying rank's whole
# op may legitimately reach the survivor before the rank dies (on one host the ring stops it).
@pytest.mark.parametrize("how,when", [("sigkill", "between_ops"), ("exit", "between_ops"),
                                      ("sigkill", "survivor_mid_op"), ("exit", "survivor_mid_op")])
def test_dead_peer_on_other_host(tmp_path, how, when):
    res = run(test_faults._pair_death_body, 2, how, when, str(tmp_path), op_timeout=test_faults.OP_TIMEOUT,
              allow_fail=(1,), timeout=60)
    assert res[0] is not None and res[1] is None


@pytest.mark.parametrize("how,when", [("sigkill", "between_ops"), ("exit", "survivor_mid_op")])
def test_dead_peer_during_bulk_transfers(tmp_path, how, when):
    # Every span as a bulk transfer: the survivor's transfers to the dead rank fail (or are
    # abandoned) and its op fails naming the rank, as with frames.
    res = run(test_faults._pair_death_body, 2, how, when, str(tmp_path), op_timeout=test_faults.OP_TIMEOUT,
              allow_fail=(1,), timeout=60, env=BULK_ENV)
    assert res[0] is not None and res[1] is None


def test_dead_rank_on_other_host_only_breaks_its_groups(tmp_path):
    res = run(test_faults._world4_death_body, 4, str(tmp_path), op_timeout=test_faults.OP_TIMEOUT,
              allow_fail=(3,), timeout=60)
    assert res[3] is None and res[2] is not None


def _hier_death_body(rank, world, victim):
    g = fc.new_group(list(range(world)))
    for i in range(3):
        t = torch.full((1000,), float(rank + i))
        fc.all_reduce(t, group=g)
        assert torch.equal(t, torch.full((1000,), float(sum(range(world)) + world * i)))
    store = harness.child_store()
    store.set(f"fc-test/hier-good-{rank}", "1")
    if rank == victim:
        # Not before every survivor has its good ops: Gloo's thread may write our last frame
        # after the op completed here, and a SIGKILL takes it down unwritten (as with MPI's
        # eager sends), which would fail a survivor's good op instead of the ops under test.
        store.wait([f"fc-test/hier-good-{r}" for r in range(world)])
        test_faults.die("sigkill")
    # Every survivor fails the next ops on the dead rank, naming it, whether it talks to the
    # victim in a hierarchical op (its leader, its member) or never does (the other host).
    msgs = []
    for n in (10, 100_000):
        msgs.append(test_faults.expect_backend_error(
            lambda: fc.all_reduce(torch.ones(n), group=g), f"rank {rank}", f"rank {victim}", "exited"))
    # No survivor leaves before all have checked: one that exits early would be a second dead
    # member for the others' ops.
    store.set(f"fc-test/hier-death-done-{rank}", "1")
    store.wait([f"fc-test/hier-death-done-{r}" for r in range(world) if r != victim])
    return msgs


@pytest.mark.parametrize("victim", [2, 3])  # SPLIT: rank 2 leads host B, rank 3 is its member
def test_dead_member_of_a_hierarchical_group(victim):
    res = run(_hier_death_body, 4, victim, hosts=SPLIT, op_timeout=test_faults.OP_TIMEOUT,
              allow_fail=(victim,), timeout=60)
    assert res[victim] is None and all(res[r] for r in range(4) if r != victim)


def test_dead_peer_fails_every_queued_async_op_across_hosts(tmp_path):
    res = run(test_faults._queued_death_body, 2, str(tmp_path), op_timeout=test_faults.OP_TIMEOUT,
              allow_fail=(1,), timeout=60)
    assert res[0] is not None


def _shutdown_returns_after(release):
    """Whether fc.shutdown() returned only after ``release()`` (what lets the peer answer) ran:
    a thread runs it a second from now, time enough for a shutdown that does not wait to return
    first; the peer is never left waiting, whatever shutdown does."""
    import threading

    released = threading.Event()

    def later():
        time.sleep(1.0)
        released.set()  # before the release: the peer can answer only after it
        release()

    th = threading.Thread(target=later)
    th.start()
    try:
        fc.shutdown()
        return released.is_set()
    finally:
        th.join()


def _leave_early_body(rank, world, numel):
    """A rank that shuts down right after its last op must not close the connection before
    the peer has read what it sent (closing with unread bytes resets the connection, and the
    reset discards them). Rank 1 freezes itself (SIGSTOP) once rank 0's op is done, so it
    cannot read anything more; rank 0 then shuts down while a thread of it resumes rank 1 a
    second later. shutdown() must return only after that resume (rank 1 can only confirm the
    read once running), and rank 1's op completes with the right result."""
    import signal

    store = harness.child_store()
    g = fc.new_group([0, 1])
    fc.all_reduce(torch.zeros(1), group=g)  # both sides connected, receives posted
    t = torch.arange(numel, dtype=torch.float32) + 1000 * rank
    exp = 2 * torch.arange(numel, dtype=torch.float32) + 1000
    if rank == 1:
        w = fc.all_reduce(t, group=g, async_op=True)
        store.wait(["r0-done"])
        store.set("pid1", str(os.getpid()))
        os.kill(os.getpid(), signal.SIGSTOP)
        w.wait()
        assert torch.equal(t, exp), t[:4]
        return None
    fc.all_reduce(t, group=g)
    assert torch.equal(t, exp), t[:4]
    store.set("r0-done", "1")
    pid1 = int(store.get("pid1"))
    while open(f"/proc/{pid1}/stat").read().rsplit(")", 1)[1].split()[0] not in ("T", "t"):
        time.sleep(0.005)
    return _shutdown_returns_after(lambda: os.kill(pid1, signal.SIGCONT))  # rank 1 resumes


@pytest.mark.parametrize("numel", [25, 300_001])
def test_shutdown_waits_until_peer_has_read_our_last_frame(numel):
    res = run(_leave_early_body, 2, numel, hosts=["A", "B"], env={}, timeout=60)
    assert res[0] is True, "rank 0's shutdown returned before rank 1 could read its last frame"


def _leader_leaves_body(rank, world, numel):
    """Host A: rank 0; host B: ranks 1 and 2. Rank 1 broadcasts over [0, 1, 2]: rank 0 has all
    of it at once, and shuts down right after, while rank 1's op still runs: rank 2 issues it
    only a second later, and until then rank 1 cannot hand it more than a ring's worth. Rank 1's
    op no longer needs rank 0, but rank 0 leaving (its connections closing) would fail it as
    rank 0's death: so rank 1 answers rank 0's "closing" only once no op of a group with rank 0
    runs, and rank 0's shutdown returns only after rank 2 was let go."""
    store = harness.child_store()
    g = fc.new_group([0, 1, 2])
    fc.all_reduce(torch.zeros(1), group=g)  # connected, receivers posted
    exp = torch.arange(numel, dtype=torch.float32) + 7
    t = exp.clone() if rank == 1 else torch.zeros(numel)
    if rank == 2:
        store.wait(["go"])
    fc.broadcast(t, 1, group=g)
    assert torch.equal(t, exp), t[:4]
    if rank != 0:
        return True
    return _shutdown_returns_after(lambda: store.set("go", "1"))  # rank 2 issues its op


@pytest.mark.parametrize("env", [RING_ENV, BULK_ENV])
def test_a_leader_leaving_does_not_fail_ops_that_no_longer_need_it(env):
    # Through the rings only (no in-place reads): rank 1 cannot hand rank 2 8 MB through a
    # 64 KiB ring before rank 2 issues the op.
    env = {**env, "FASTCOMM_SHM_DIRECT_BYTES": "0"}
    res = run(_leader_leaves_body, 3, 2_000_003, hosts=["A", "B", "B"], env=env, timeout=90)
    assert res == [True] * 3


def _both_leave_body(rank, world):
    """Rank 1 shuts down first while a Work it still holds keeps its engine (and its Gloo
    connections) alive, then waits for rank 0. Rank 1's shutdown asks rank 0 to confirm it
    read rank 1's frames; rank 0 answered before rank 1's shutdown returned, and so knows
    rank 1 is closing. Rank 0's shutdown must then not ask rank 1 (whose receivers are gone,
    so no answer would come and it would wait out the handshake's limit)."""
    from fastcomm import _state

    e = _state._engine
    store = harness.child_store()
    g = fc.new_group([0, 1])
    t = torch.full((1000,), float(rank))
    w = fc.all_reduce(t, group=g, async_op=True)
    w.wait()
    if rank == 1:
        fc.shutdown()
        store.set("r1-down", "1")
        store.wait(["r0-down"], timedelta(seconds=30))
        return w.is_completed(), e.gloo_closes_sent
    store.wait(["r1-down"], timedelta(seconds=30))
    fc.shutdown()
    store.set("r0-down", "1")
    return w.is_completed(), e.gloo_closes_sent


def test_shutdown_after_the_peer_shut_down_does_not_wait_for_it():
    res = run(_both_leave_body, 2, hosts=["A", "B"], op_timeout=60.0)
    assert res[1] == (True, 1), f"rank 1 (first to leave): {res[1]}"
    assert res[0] == (True, 0), f"rank 0 asked {res[0][1]} peer(s) that had said it was closing"


@pytest.mark.parametrize("members,staller,numel", [([0, 1], 1, 200_000), ([0, 1, 2], 2, 10)])
def test_stalled_peer_on_other_host_times_out(tmp_path, members, staller, numel):
    res = run(test_faults._stall_body, len(members), str(tmp_path), members, staller, numel,
              op_timeout=2.0, timeout=60)
    for r in members:
        assert res[r][0] == ("stalled" if r == staller else "waiter"), res[r]


# ---------------------------------------------------------------------------------------------
# Real network namespaces


CLONE_NEWNET = 0x40000000


def _netns_body(rank, world, ns_names, addrs, port):
    # Enter this rank's namespace before anything opens a socket: from here on the rank sees
    # only its veth end and its own loopback, as a process on another machine would.
    fd = os.open(f"/run/netns/{ns_names[rank]}", os.O_RDONLY)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, CLONE_NEWNET) != 0:
        raise OSError(ctypes.get_errno(), "setns")
    os.close(fd)
    os.environ["GLOO_SOCKET_IFNAME"] = f"fcv{rank}"
    # The namespaces still share this machine's hostname and /dev/shm, so the host id is
    # given explicitly, as a launcher would for containers that must not share memory.
    os.environ["FASTCOMM_HOST_ID"] = ns_names[rank]
    store = dist.TCPStore(addrs[0], port, world, rank == 0, timeout=timedelta(seconds=30))
    fc.init(store=store, rank=rank, world_size=world, timeout=timedelta(seconds=30))
    from fastcomm import _state

    try:
        out = []
        g = fc.new_group([0, 1])
        for n in (0, 7, 100_003):
            t = torch.arange(n, dtype=torch.float32) * (rank + 1)
            fc.all_reduce(t, group=g)
            assert torch.equal(t, torch.arange(n, dtype=torch.float32) * 3), n
            out.append(n)
        gs = fc.new_groups([[0, 1]] * 4)
        ts = [torch.full((10, 10), float(rank + i)) for i in range(4)]
        with fc.batch() as b:
            for t, gg in zip(ts, gs):
                fc.all_reduce(t, group=gg)
        b.wait()
        assert all(torch.equal(t, torch.full((10, 10), float(1 + 2 * i))) for i, t in enumerate(ts))
        return out, _state._gloo is not None
    finally:
        fc.shutdown()
        del store


def _netns_setup():
    """Creates two namespaces joined by a veth pair; returns (names, addresses) or a reason."""
    if os.geteuid() != 0:
        return None, "needs root (CAP_NET_ADMIN) to create network namespaces"
    ip = shutil.which("ip")
    if ip is None:
        return None, "the `ip` tool (iproute2) is not installed"
    tag = uuid.uuid4().hex[:6]
    names = [f"fc{tag}a", f"fc{tag}b"]
    addrs = ["10.213.7.1", "10.213.7.2"]  # only on the veth pair, invisible outside the netns
    cmds = [[ip, "netns", "add", names[0]], [ip, "netns", "add", names[1]],
            [ip, "link", "add", "fcv0", "netns", names[0], "type", "veth", "peer", "name", "fcv1",
             "netns", names[1]]]
    for i in range(2):
        cmds += [[ip, "-n", names[i], "addr", "add", f"{addrs[i]}/30", "dev", f"fcv{i}"],
                 [ip, "-n", names[i], "link", "set", f"fcv{i}", "up"],
                 [ip, "-n", names[i], "link", "set", "lo", "up"]]
    for c in cmds:
        r = subprocess.run(c, capture_output=True, text=True, timeout=20)
        if r.returncode != 0:
            _netns_teardown(names)
            return None, f"cannot create network namespaces: `{' '.join(c[1:])}`: {r.stderr.strip()}"
    return (names, addrs), None


def _netns_teardown(names):
    for n in names:
        subprocess.run(["ip", "netns", "del", n], capture_output=True, timeout=20)


def test_two_network_namespaces_over_veth():
    got, why = _netns_setup()
    if got is None:
        pytest.skip(why)
    names, addrs = got
    try:
        res = harness.run(_netns_body, 2, names, addrs, 29511, init=False, timeout=90)
        assert [r[0] for r in res] == [[0, 7, 100_003]] * 2
        assert [r[1] for r in res] == [True, True], "namespaces were taken for one host"
    finally:
        _netns_teardown(names)
