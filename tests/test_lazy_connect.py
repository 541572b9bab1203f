"""Connections across hosts made when first needed, per peer (fastcomm/_connect.py).

Hosts are simulated with FASTCOMM_HOST_ID (test_cross_host.py). A rank holds a Gloo connection
only to the peers it talks to: in a ring of neighbour pairs, to its two neighbours whatever the
world size; in a hierarchical world op, only the hosts' leaders to each other. A peer that is
gone before first contact fails only the ops that need it, naming it, within their group's
timeout, while ops with other peers go on."""
from __future__ import annotations

import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import fastcomm as fc
from _helpers import expect
from _cross_host import run

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import scale_out  # noqa: E402
from scale_out import _sockets  # noqa: E402  (every socket this process holds)


def _ring_body(rank, world, rounds):
    from fastcomm import _state

    e = _state._engine
    at_init = _sockets(), e.gloo_connected
    right, left = (rank + 1) % world, (rank - 1) % world
    groups = {r: fc.new_group(sorted([rank, r])) for r in (left, right)}
    failures = []
    for i in range(rounds):
        for peer, g in sorted(groups.items()):
            n = 1 + 1000 * (i % 3)  # 1 element, and spans of several pieces
            t = torch.full((n,), float(rank + 1 + i))
            fc.all_reduce(t, group=g)
            want = float(rank + 1 + i) + float(peer + 1 + i)
            if not torch.equal(t, torch.full((n,), want)):
                failures.append(f"rank {rank}, group {g.ranks}, round {i}: {t[:3].tolist()} != {want}")
    after = _sockets(), e.gloo_connected
    # Nobody leaves before every rank has counted: a neighbour's leaving closes its sockets.
    for w in [fc.barrier(group=g, async_op=True) for g in groups.values()]:
        w.wait()
    return at_init, after, failures


def test_a_ring_holds_connections_to_its_neighbours_only():
    world = 6
    res = run(_ring_body, world, 4, hosts=[f"h{r}" for r in range(world)], timeout=120)
    for rank, ((sock0, conn0), (sock1, conn1), failures) in enumerate(res):
        assert not failures, failures
        assert conn0 == 0, f"rank {rank}: {conn0} Gloo connection(s) at init"
        assert conn1 == 2, f"rank {rank}: {conn1} Gloo connections in a ring (want its 2 neighbours)"
        # Two neighbours: two sockets more than at init (the device's listening socket and the
        # store's client were there already), whatever the world size.
        assert sock1 - sock0 == 2, f"rank {rank}: sockets {sock0} at init, {sock1} after the ring"


def _store_connections(port):
    """This process's TCP connections to `port` (the store's server)."""
    import socket

    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            if not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                continue
            s = socket.socket(fileno=os.dup(int(fd)))
        except OSError:
            continue
        try:
            n += s.family in (socket.AF_INET, socket.AF_INET6) and s.getpeername()[1] == port
        except OSError:  # listening, or not connected
            pass
        finally:
            s.close()
    return n


def _store_clients_body(rank, world):
    import harness

    os.environ["FASTCOMM_HOST_ID"] = f"h{rank}"
    store = harness.child_store()  # the session's store client
    before = _store_connections(store.port)
    fc.init(store=store, rank=rank, world_size=world, timeout=timedelta(seconds=30))
    try:
        _, _, failures = _ring_body(rank, world, 2)
        after = _store_connections(store.port)
    finally:
        fc.shutdown()
    return before, after, failures


def test_no_store_client_of_its_own():
    # Each new client of the store costs its server (one thread for the whole job) a reverse
    # lookup of the client's address: fastcomm uses the session's client only.
    res = __import__("harness").run(_store_clients_body, 4, init=False, timeout=120)
    for rank, (before, after, failures) in enumerate(res):
        assert not failures, failures
        assert after == before, f"rank {rank}: {before} connections to the store before init, {after} after a ring"


def _hier_body(rank, world):
    from fastcomm import _state

    g = fc.new_group(list(range(world)))
    for n in (1, 1001, 70_001):
        t = torch.full((n,), float(rank + 1))
        fc.all_reduce(t, group=g)
        assert torch.equal(t, torch.full((n,), float(sum(range(1, world + 1))))), t[:3]
    connected = _state._engine.gloo_connected
    fc.barrier(group=g)
    return connected


def test_a_hierarchical_op_connects_only_the_leaders():
    # Hosts A: 0, 1, 2; B: 3, 4, 5: ranks 0 and 3 lead their hosts and talk to each other; the
    # members talk through shared memory only.
    res = run(_hier_body, 6, hosts=["A", "A", "A", "B", "B", "B"], timeout=120)
    assert res == [1, 0, 0, 1, 0, 0], res


def _gone_body(rank, world, op_timeout):
    store = __import__("harness").child_store()
    if rank == 2:
        os._exit(0)  # gone before anyone asked it for a connection
    g01 = fc.new_group([0, 1])
    if rank == 1:
        for i in range(20):
            t = torch.full((7,), float(i))
            fc.all_reduce(t, group=g01)
            assert torch.equal(t, torch.full((7,), 2.0 * i)), t
        t = torch.ones(3)
        fc.all_reduce(t, group=g01)
        assert torch.equal(t, torch.full((3,), 2.0)), t
        store.set("r1-done", "1")
        return None
    g02 = fc.new_group([0, 2], timeout=op_timeout)
    start = time.monotonic()
    w = fc.all_reduce(torch.ones(5), group=g02, async_op=True)  # waits for a connection
    for i in range(20):  # meanwhile the other peer's ops go on
        t = torch.full((7,), float(i))
        fc.all_reduce(t, group=g01)
        assert torch.equal(t, torch.full((7,), 2.0 * i)), t
    msg = expect(dist.DistBackendError, w.wait, "rank 0", "[0, 2]", "rank 2", "no connection")
    elapsed = time.monotonic() - start
    # The next op on the group fails the same way; the pair with rank 1 still works.
    expect(dist.DistBackendError, lambda: fc.all_reduce(torch.ones(5), group=g02), "rank 2")
    t = torch.ones(3)
    fc.all_reduce(t, group=g01)
    assert torch.equal(t, torch.full((3,), 2.0)), t
    store.wait(["r1-done"])
    return msg, elapsed


def test_a_peer_gone_before_first_contact_fails_only_its_ops():
    op_timeout = 3.0
    res = run(_gone_body, 3, op_timeout, hosts=["A", "B", "C"], allow_fail=(2,), timeout=90)
    msg, elapsed = res[0]
    # Bounded by the group's timeout (and the harness's), not by Gloo's connect retries.
    assert elapsed < op_timeout + 30, (elapsed, msg)


def test_scale_out_benchmark_runs_its_ring():
    # benchmarks/scale_out.py's measurement, one small job per library: every rank's ring
    # results are checked inside; a rank holds its two neighbours' connections and the listening
    # socket (fastcomm), or one per peer (torch's eager full mesh).
    m = scale_out.measure(4, 4, "fastcomm")
    assert m["sockets"] == [3, 3], m
    assert 0 <= m["init_last_s"][0] <= m["init_s"][1], m
    torch_m = scale_out.measure(4, 4, "torch eager")
    assert torch_m["sockets"][0] == 4 + 4, torch_m
