"""recv/irecv from any source on the device path (FASTCOMM_FAKE_DEVICE=1 sends CPU tensors
through csrc/device/ as CUDA tensors go) in groups of 3 to 5: natively (blocking recv and async
irecv, mixed with receives from a named member on the same group and tag) and through the torch
backend (dist.recv/dist.irecv without src), over pair channels that are NCCL communicators or
IPC links. A recv from any source takes some member's next message; which one depends on timing,
so the checks are what holds whatever the timing: every message is received exactly once, its
data is its sender's (against a local reference), the reported source rank is its sender's, and
each member's messages are taken in the order the receives were posted (MPI's rule), a plan's or
a batch's named recv posted while a recv from any source waits included (the host path's order
is the reference). A sender that dies while a recv from any source waits fails it with
DistBackendError naming that rank."""
from __future__ import annotations

import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import harness
from _device import DEV, ENV, ON_GPU, channels, dsync, setup
from _helpers import _DTYPES, expect, gen

import fastcomm as fc

fake_only = pytest.mark.skipif(ON_GPU, reason="kills a rank under the fake runtime")

# Group shapes 3 to 5, overlapping; each case names its group and the receiving member.
LISTS = [[0, 1, 2], [1, 2, 3, 4], [0, 1, 2, 3, 4], [0, 2, 4]]
DTYPES = ["float32", "int64", "bfloat16"]


def payload(sender, k, case, numel, dt):
    """Message k of global rank `sender` in `case`: the local reference both sides compute."""
    return gen(sender, 1000 * case + 10 * k + 1, dt, numel)


def plan(ranks, case):
    """Who receives, and how many messages each other member sends, in `case` over `ranks`:
    the receiver posts as many receives, the first one named (from `named`), the others from any
    source, some blocking, some async."""
    recv = ranks[case % len(ranks)]
    others = [r for r in ranks if r != recv]
    named = others[case % len(others)]
    counts = {r: 1 for r in others}
    counts[named] = 2  # one of its messages goes to the named receive
    return recv, named, counts


def _native_body(rank, world):
    setup(rank)
    groups = fc.new_groups(LISTS)
    seen = []
    case = 0
    for ranks, g in zip(LISTS, groups):
        for numel in (0, 1, 7):
            for dt in DTYPES:
                case += 1
                if rank not in ranks:
                    continue
                recv, named, counts = plan(ranks, case)
                if rank != recv:
                    for k in range(counts[rank]):
                        fc.send(payload(rank, k, case, numel, dt).to(DEV), dst=recv, group=g)
                    continue
                total = sum(counts.values())
                # Posting order: any, (named), any, ...; async and blocking alternate.
                posts = ["any", named] + ["any"] * (total - 2)
                bufs = [torch.empty(numel, dtype=_DTYPES[dt], device=DEV) for _ in posts]
                got = []  # (posting index, sender, tensor)
                works = []
                for i, (who, b) in enumerate(zip(posts, bufs)):
                    if who == "any" and i % 2 == 0:
                        works.append((i, fc.irecv(b, group=g)))
                    elif who == "any":
                        got.append((i, fc.recv(b, group=g), b))
                    else:
                        works.append((i, fc.irecv(b, src=who, group=g)))
                for i, w in works:
                    w.wait()
                    got.append((i, w.source_rank(), bufs[i]))
                dsync()
                got.sort(key=lambda x: x[0])
                taken = {}
                for i, sender, b in got:
                    if posts[i] != "any":
                        assert sender == posts[i], (case, i, sender)
                    k = taken.get(sender, 0)  # this sender's k-th message, in posting order
                    taken[sender] = k + 1
                    ref = payload(sender, k, case, numel, dt)
                    assert torch.equal(b.cpu(), ref), f"case {case}: recv {i} from {sender}: {b.tolist()} != {ref.tolist()}"
                assert taken == counts, (case, taken, counts)
                seen.append((case, sorted(s for _, s, _ in got)))
    fc.barrier()
    return seen


@channels
def test_recv_from_any_source_in_groups_of_three_to_five(channel):
    res = harness.run(_native_body, 5, timeout=180, env={**ENV, **channel}, init_timeout=60)
    case = 0
    for ranks in LISTS:
        for _ in range(3 * len(DTYPES)):
            case += 1
            recv, named, counts = plan(ranks, case)
            expected = sorted(r for r, n in counts.items() for _ in range(n))
            assert (case, expected) in res[recv], (case, res[recv])


def _backend_body(rank, world):
    setup(rank)
    backend = "cpu:fastcomm,cuda:fastcomm" if ON_GPU else "fastcomm"
    dist.init_process_group(backend, store=harness.child_store(), rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    try:
        sub = dist.new_group([1, 2, 3])
        out = {}
        # World: rank 0 takes one message from each other rank, blocking and async.
        if rank == 0:
            srcs = []
            for i in range(world - 1):
                t = torch.empty(5, device=DEV)
                if i % 2 == 0:
                    s = dist.recv(t)
                else:
                    w = dist.irecv(t)
                    w.wait()
                    s = w._source_rank()
                dsync()
                assert torch.equal(t.cpu(), payload(s, 0, 1, 5, "float32")), (s, t.tolist())
                srcs.append(s)
            out["world"] = sorted(srcs)
        else:
            dist.send(payload(rank, 0, 1, 5, "float32").to(DEV), dst=0)
        # A subgroup: global rank 2 (group rank 1) receives; dist.recv returns global ranks.
        if rank == 2:
            srcs = []
            for _ in range(2):
                t = torch.empty(3, dtype=torch.int64, device=DEV)
                s = dist.recv(t, group=sub)
                dsync()
                assert torch.equal(t.cpu(), payload(s, 0, 2, 3, "int64")), (s, t.tolist())
                srcs.append(s)
            out["sub"] = sorted(srcs)
        elif rank in (1, 3):
            dist.send(payload(rank, 0, 2, 3, "int64").to(DEV), dst=2, group=sub)
        dist.barrier()
        return out
    finally:
        dist.destroy_process_group()


@channels
def test_the_torch_backend_recv_without_src(channel):
    res = harness.run(_backend_body, 4, timeout=120, env={**ENV, **channel}, init=False)
    assert res[0]["world"] == [1, 2, 3]
    assert res[2]["sub"] == [1, 3]


def _dead_sender_body(rank, world):
    setup(rank)
    g, pair = fc.new_groups([[0, 1, 2], [0, 1]])
    fc.all_reduce(torch.ones(2, device=DEV), group=g)  # every channel made
    out = {}
    # Rank 1's one message is taken while every member lives; then rank 2 exits, and a second
    # recv from any source, which only rank 2 could still have served, fails naming it.
    if rank == 0:
        t = torch.empty(4, device=DEV)
        out["first"] = fc.recv(t, group=g)
        dsync()
        assert torch.equal(t.cpu(), payload(1, 0, 3, 4, "float32"))
    elif rank == 1:
        fc.send(payload(1, 0, 3, 4, "float32").to(DEV), dst=0, group=g)
    dsync()
    fc.barrier(group=g)
    if rank == 2:
        os._exit(0)
    if rank == 0:
        out["msg"] = expect(dist.DistBackendError, lambda: fc.recv(torch.empty(4, device=DEV), group=g),
                            "recv from any source", "rank 2")
    fc.barrier(group=pair)
    return out


@fake_only
def test_a_sender_dying_fails_an_unbound_recv_naming_it():
    res = harness.run(_dead_sender_body, 3, timeout=90, env=ENV, init_timeout=20, allow_fail=(2,))
    assert res[0]["first"] == 1
    msg = res[0]["msg"]
    assert "rank 2, a member that could have sent it, is gone" in msg and "exited" in msg, msg
    assert msg.count("Exception raised from") <= 1, msg  # the channel's reason without its C++ stack


def _timeout_body(rank, world):
    setup(rank)
    g = fc.new_group([0, 1, 2], timeout=3.0)  # the later ops must fit it, under load too
    out = {}
    if rank == 0:
        out["alone"] = expect(ValueError, lambda: fc.recv(torch.empty(1, device=DEV), group=fc.new_group([0])),
                              "no other member")
        # Nobody sends: the recv fails at the group's timeout, taking no message; then a named
        # recv takes rank 1's first message, and the next recv from any source rank 2's.
        w = fc.irecv(torch.empty(2, device=DEV), group=g)
        out["msg"] = expect(dist.DistBackendError, w.wait, "recv from any source", "timeout")
        fc.barrier()  # the senders go only now
        named = torch.empty(2, device=DEV)
        fc.recv(named, src=1, group=g)
        t = torch.empty(2, device=DEV)
        out["next"] = fc.recv(t, group=g)
        dsync()
        assert torch.equal(named.cpu(), payload(1, 0, 4, 2, "float32"))
        assert torch.equal(t.cpu(), payload(2, 0, 4, 2, "float32"))
    else:
        fc.barrier()
        if rank == 1:
            fc.send(payload(1, 0, 4, 2, "float32").to(DEV), dst=0, group=g)
        fc.barrier(group=fc.new_group([1, 2]))
        if rank == 2:
            fc.send(payload(2, 0, 4, 2, "float32").to(DEV), dst=0, group=g)
    fc.barrier()
    return out


def test_an_unbound_recv_times_out_taking_no_message():
    res = harness.run(_timeout_body, 3, timeout=90, env=ENV, init_timeout=30)
    assert res[0]["next"] == 2, res[0]


def _queue_behind_body(rank, world, dev, on_device):
    """Rank 0 posts a recv from any source on (g, tag), then, while it is unbound, a plan's (or a
    batch's) recv from rank 1 on the same (g, tag); only then does rank 1 send its two messages.
    Posting order decides: the recv from any source takes rank 1's first message, the later
    named recv its second."""
    setup(rank)
    g = fc.new_group([0, 1, 2])
    out = {}
    if rank == 0:
        a, b = torch.empty(6, device=dev), torch.empty(6, device=dev)
        with fc.plan() as p:
            fc.irecv(b, src=1, group=g, tag=7)
    for case, tag in (("plan", 7), ("plan again", 7), ("batch", 8)):
        if rank == 0:
            w = fc.irecv(a, group=g, tag=tag)
            if case == "batch":
                with fc.batch() as later:
                    fc.irecv(b, src=1, group=g, tag=tag)
            else:
                later = p.start(async_op=True)
        fc.barrier()  # rank 1 sends only once both receives are posted
        if rank == 1:
            for k in range(2):
                fc.send(payload(1, k, tag, 6, "float32").to(dev), dst=0, group=g, tag=tag)
        if rank == 0:
            w.wait()
            later.wait()
            if on_device:
                dsync()
            out[case] = (w.source_rank(), torch.equal(a.cpu(), payload(1, 0, tag, 6, "float32")),
                         torch.equal(b.cpu(), payload(1, 1, tag, 6, "float32")))
        fc.barrier()
    return out


@pytest.mark.parametrize("path", ["host", "nccl", "ipc"])
def test_a_later_named_recv_of_a_plan_or_batch_queues_behind_an_unbound_one(path):
    # The host path (CPU tensors, csrc/engine's receive ports) is the reference for the order;
    # the device path's pair channels are NCCL communicators or IPC links.
    on_device = path != "host"
    env = {**ENV, "FASTCOMM_DEVICE_IPC": "1" if path == "ipc" else "0"} if on_device else {}
    res = harness.run(_queue_behind_body, 3, DEV if on_device else "cpu", on_device, timeout=90, env=env,
                      init_timeout=30)
    # (source_rank of the recv from any source, it got message 0, the later recv got message 1)
    assert res[0] == {case: (1, True, True) for case in ("plan", "plan again", "batch")}, res[0]
