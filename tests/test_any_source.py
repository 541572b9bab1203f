"""recv from any source: fc.recv / fc.irecv with neither src nor group_src, and dist.recv /
dist.irecv without src on the "fastcomm" backend.

Every message's contents come from (sender, index, case) through _helpers.gen, so the receiver
checks each one against a reference computed locally: the sender it reports must be a member
that still had a message of the case to send, and the contents must be that sender's next one
(messages of one sender arrive in the order sent). At the end every sender's count must be
complete: every message received exactly once.

Covered: sizes 0, 1, odd, beyond the shared-memory ring (many pieces); float32, float64,
int64, bfloat16; several senders racing to one receiver, on the default group and on a
triple whose receiver is not rank 0; blocking recv, several irecvs in flight (their
Work.source_rank()), and fc.batch(); specific and any-source receives mixed on one (group,
tag), in both posting orders and with the messages there before or after the receives are
posted (MPI's rule: a message goes to the earliest posted receive that accepts it); tags kept
apart; simulated hosts (Gloo); the torch backend; a timeout and a dead sender (errors naming
rank and group); argument errors."""
from __future__ import annotations

import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import harness
from _helpers import expect, gen

import fastcomm as fc

RING_ENV = {"FASTCOMM_SHM_RING_BYTES": "65536"}  # max_payload ~16 KiB: multi-piece messages are cheap
BIG = 40_003  # elements: past a 64 KiB ring in every dtype; odd
SIZES = [0, 1, 7, 1001, BIG]
DTYPES = ["float32", "float64", "int64", "bfloat16"]
PER_SENDER = 3
SHORT = dict(init_timeout=20.0)


def payload(sender, index, case, dt, n):
    """The ``index``-th message of ``sender`` in case ``case``."""
    return gen(sender, 1000 * case + index, dt, n)


def check(t, sender, index, case, dt, n, what):
    ref = payload(sender, index, case, dt, n)
    if t.dtype != ref.dtype or t.shape != ref.shape or not torch.equal(t, ref):
        return f"{what}: message {index} of rank {sender} (case {case}, {dt}, n={n}) differs"
    return None


def fresh(dt, n):
    return torch.full((n,), -99, dtype=payload(0, 0, 0, dt, 0).dtype)


# ---------------------------------------------------------------------------------------------
# Several senders racing to one receiver


def _race_body(rank, world, mode, dtypes, sizes):
    """Each case: every other member sends PER_SENDER messages to the receiver, which takes them
    from any source, blocking (mode "blocking"), all posted at once as irecvs ("async"), or in
    one fc.batch ("batch"). Runs on the default group (receiver 0) and on the triple [1, 2, 3]
    (receiver 3). Each case has its own tag: a sender may already be sending the next case's
    messages, which any receive of this case on the same tag could rightly take."""
    sub = fc.new_group([1, 2, 3]) if rank >= 1 else None
    errors, order = [], []
    case = 0
    for dt in dtypes:
        for n in sizes:
            case += 1
            for g, ranks, receiver in ((None, list(range(world)), 0), (sub, [1, 2, 3], 3)):
                if rank not in ranks:
                    continue
                what = f"rank {rank}, group {ranks}, {mode}, {dt} n={n}"
                senders = [r for r in ranks if r != receiver]
                if rank != receiver:
                    for i in range(PER_SENDER):
                        fc.send(payload(rank, i, case, dt, n), dst=receiver, group=g, tag=case)
                    continue
                nxt = {s: 0 for s in senders}
                total = PER_SENDER * len(senders)
                got = []  # (sender, tensor) in posting order
                if mode == "blocking":
                    for _ in range(total):
                        t = fresh(dt, n)
                        got.append((fc.recv(t, group=g, tag=case), t))
                elif mode == "async":
                    ts = [fresh(dt, n) for _ in range(total)]
                    works = [fc.irecv(t, group=g, tag=case) for t in ts]
                    for w, t in zip(works, ts):
                        assert w.wait() is True
                        got.append((w.source_rank(), t))
                else:
                    # A batch's ops report no sender: each message is told by its contents
                    # (n >= 7 here), and per sender the ones posted first must hold the earlier.
                    ts = [fresh(dt, n) for _ in range(total)]
                    with fc.batch() as b:
                        for t in ts:
                            assert fc.irecv(t, group=g, tag=case) is None
                    b.wait()
                    for t in ts:
                        src = [s for s in senders
                               if nxt.get(s, PER_SENDER) < PER_SENDER
                               and torch.equal(t, payload(s, nxt[s], case, dt, n))]
                        got.append((src[0] if src else -1, t))
                        if src:
                            nxt[src[0]] += 1
                    nxt = {s: 0 for s in senders}
                for src, t in got:
                    if src not in nxt or nxt[src] >= PER_SENDER:
                        errors.append(f"{what}: unexpected sender {src}")
                        continue
                    err = check(t, src, nxt[src], case, dt, n, what)
                    if err:
                        errors.append(err)
                    nxt[src] += 1
                    order.append(src)
                if any(c != PER_SENDER for c in nxt.values()):
                    errors.append(f"{what}: received {nxt}, expected {PER_SENDER} from each")
    fc.barrier()
    return errors, order


@pytest.mark.parametrize("mode", ["blocking", "async"])
def test_senders_race_to_one_receiver(mode):
    res = harness.run(_race_body, 4, mode, DTYPES, SIZES, timeout=240, env=RING_ENV, **SHORT)
    errors = [e for errs, _ in res for e in errs]
    assert not errors, errors
    # Rank 0 heard from every other rank, rank 3 from both members of its triple.
    assert set(res[0][1]) == {1, 2, 3} and set(res[3][1]) == {1, 2}


def test_senders_race_into_a_batch():
    res = harness.run(_race_body, 4, "batch", ["float64", "int64"], [7, BIG], timeout=180, env=RING_ENV, **SHORT)
    errors = [e for errs, _ in res for e in errs]
    assert not errors, errors


# ---------------------------------------------------------------------------------------------
# Specific and any-source receives on one (group, tag): matched in posting order


def _mixed_body(rank, world):
    """Rank 0 receives; ranks 1 and 2 send. Each case has its own tag, so cases never meet, and
    runs twice: the messages sent before the receives are posted (early) and after."""
    dt, n = "float32", 5
    out = {}

    def msg(sender, i, case):
        return payload(sender, i, case, dt, n)

    def sync():
        fc.barrier()

    def case(name, tag, early, sends, srcs, batched=False):
        """Rank 0 posts one receive per entry of ``srcs`` (a sender, or None: any source), in
        order, with the messages ``sends`` ((sender, index), each sent by its sender in order)
        there before the receives are posted (early) or sent after; ``batched``: the sends and
        the receives each in one fc.batch(). Records the receives' senders (None for a batch: its
        receives have no Work of their own) and, per receive, whether it got sends[i]."""
        def send():
            mine = [(s, i) for s, i in sends if s == rank]
            if batched and mine:
                with fc.batch():
                    for s, i in mine:
                        fc.isend(msg(s, i, tag), dst=0, tag=tag)
            else:
                for s, i in mine:
                    fc.send(msg(s, i, tag), dst=0, tag=tag)

        if early:
            send()
            sync()
        if rank == 0:
            ts = [fresh(dt, n) for _ in srcs]
            if batched:
                with fc.batch() as b:
                    for t, src in zip(ts, srcs):
                        fc.irecv(t, src=src, tag=tag)
            else:
                ws = [fc.irecv(t, src=src, tag=tag) for t, src in zip(ts, srcs)]
        if not early:
            sync()
            send()
        if rank == 0:
            for w in [b] if batched else ws:
                w.wait()
            out[(name, early)] = (None if batched else [w.source_rank() for w in ws],
                                  [torch.equal(t, msg(*sent, tag)) for t, sent in zip(ts, sends)])

    for early in (True, False):
        base = 100 if early else 200
        # A: R1 (from 1), any, R2 (from 1); only rank 1 sends: R1 gets m0, any m1, R2 m2.
        case("A", base + 1, early, [(1, 0), (1, 1), (1, 2)], [1, None, 1])
        # B: any, then R (from 1); only rank 1 sends: any gets m0 (R must not take it).
        case("B", base + 2, early, [(1, 0), (1, 1)], [None, 1])
        # C: R (from 1), then any; ranks 1 and 2 send one each: the any-source receive must
        # leave rank 1's message to R and take rank 2's.
        case("C", base + 3, early, [(1, 0), (2, 0)], [1, None])
        # D: both kinds in one batch (any, then from 1); only rank 1 sends.
        case("D", base + 4, early, [(1, 0), (1, 1)], [None, 1], batched=True)

    # Tags stay apart: rank 1 sends on tag 0, then tag 5; the any-source receive on tag 5 takes
    # the second, and the first still waits for its own receive.
    if rank == 1:
        fc.send(msg(1, 0, 300), dst=0, tag=0)
        fc.send(msg(1, 1, 300), dst=0, tag=5)
    if rank == 0:
        a, c = fresh(dt, n), fresh(dt, n)
        s5 = fc.recv(a, tag=5)
        s0 = fc.recv(c, src=1, tag=0)
        out["tags"] = ([s5, s0], [torch.equal(a, msg(1, 1, 300)), torch.equal(c, msg(1, 0, 300))])

    # A receive not matched yet has no sender: the senders wait for the barrier, which rank 0
    # joins only after asking.
    if rank == 0:
        t = fresh(dt, n)
        w = fc.irecv(t, tag=400)
        out["unmatched"] = expect(RuntimeError, w.source_rank, "not matched to a sender yet")
    sync()
    if rank == 2:
        fc.send(msg(2, 0, 400), dst=0, tag=400)
    if rank == 0:
        w.wait()
        out["matched"] = ([w.source_rank()], [torch.equal(t, msg(2, 0, 400))])
    fc.barrier()
    return out


def _check_mixed(out):
    want = {"A": [1, 1, 1], "B": [1, 1], "C": [1, 2], "D": None}
    for (case, early), (sources, ok) in ((k, v) for k, v in out.items() if isinstance(k, tuple)):
        assert sources == want[case], (case, early, sources)
        assert all(ok), (case, early, ok)
    assert out["tags"] == ([1, 1], [True, True]), out["tags"]
    assert out["matched"] == ([2], [True])
    assert len([k for k in out if isinstance(k, tuple)]) == 8


def test_specific_and_any_source_receives_match_in_posting_order():
    res = harness.run(_mixed_body, 3, timeout=120, **SHORT)
    _check_mixed(res[0])


# ---------------------------------------------------------------------------------------------
# Across hosts (Gloo)

ALTERNATE = ["A", "B", "A", "B"]


def _on_hosts(rank, world, hosts, body, *args):
    os.environ["FASTCOMM_HOST_ID"] = f"host-{hosts[rank]}"
    harness.init_child(rank, world, timeout=30.0)
    try:
        return body(rank, world, *args)
    finally:
        fc.shutdown()


def test_senders_race_across_hosts():
    # Rank 0 (host A) hears from 1 and 3 over Gloo and from 2 over shared memory; rank 3 (B)
    # from 1 over shared memory and from 2 over Gloo.
    res = harness.run(_on_hosts, 4, ALTERNATE, _race_body, "async", ["float32", "int64"], [0, 7, BIG],
                      init=False, timeout=240, env=RING_ENV)
    errors = [e for errs, _ in res for e in errs]
    assert not errors, errors
    assert set(res[0][1]) == {1, 2, 3} and set(res[3][1]) == {1, 2}


def test_mixed_receives_across_hosts():
    res = harness.run(_on_hosts, 3, ["A", "B", "A"], _mixed_body, init=False, timeout=180)
    _check_mixed(res[0])


# ---------------------------------------------------------------------------------------------
# Through torch.distributed with the "fastcomm" backend


def _backend_body(rank, world):
    dist.init_process_group("fastcomm", store=harness.child_store(), rank=rank, world_size=world,
                            timeout=timedelta(seconds=30))
    errors = []
    sub = dist.new_group([1, 2, 3], backend="fastcomm", use_local_synchronization=True) if rank >= 1 else None
    for case, (dt, n) in enumerate([("float32", 0), ("float32", 7), ("int64", BIG)], start=1):
        # dist.recv without src on the default group: it returns the sender's global rank. (A
        # tag per case: a sender may already be sending the next case's messages.)
        if rank != 0:
            for i in range(PER_SENDER):
                dist.send(payload(rank, i, case, dt, n), dst=0, tag=case)
        else:
            nxt = {1: 0, 2: 0, 3: 0}
            for _ in range(3 * PER_SENDER):
                t = fresh(dt, n)
                src = dist.recv(t, tag=case)
                err = check(t, src, nxt.get(src, 99), case, dt, n, f"dist.recv {dt} n={n}")
                if err:
                    errors.append(err)
                nxt[src] = nxt.get(src, 0) + 1
            if nxt != {1: PER_SENDER, 2: PER_SENDER, 3: PER_SENDER}:
                errors.append(f"dist.recv: counts {nxt}")
        # dist.irecv without src on the triple [1, 2, 3] (receiver 3): the Work's source rank
        # is a group rank; dist.recv maps it to the global one.
        if rank in (1, 2):
            for i in range(PER_SENDER):
                dist.send(payload(rank, i, case, dt, n), dst=3, group=sub, tag=case)
        elif rank == 3:
            nxt = {1: 0, 2: 0}
            ts = [fresh(dt, n) for _ in range(2 * PER_SENDER - 1)]
            works = [dist.irecv(t, group=sub, tag=case) for t in ts]
            for w, t in zip(works, ts):
                w.wait()
                src = dist.get_global_rank(sub, w._source_rank())
                err = check(t, src, nxt[src], case, dt, n, f"dist.irecv {dt} n={n}")
                if err:
                    errors.append(err)
                nxt[src] += 1
            t = fresh(dt, n)
            src = dist.recv(t, group=sub, tag=case)
            if check(t, src, nxt[src], case, dt, n, "last"):
                errors.append(f"dist.recv on the triple: message {nxt[src]} of rank {src} differs")
            nxt[src] += 1
            if nxt != {1: PER_SENDER, 2: PER_SENDER}:
                errors.append(f"dist.irecv: counts {nxt}")
    # A specific receive posted before an any-source one keeps its message.
    if rank == 1:
        dist.send(torch.tensor([1.0]), dst=0, tag=7)
    if rank == 2:
        dist.send(torch.tensor([2.0]), dst=0, tag=7)
    if rank == 0:
        a, b = torch.zeros(1), torch.zeros(1)
        wa = dist.irecv(a, src=1, tag=7)
        wb = dist.irecv(b, tag=7)
        wa.wait()
        wb.wait()
        if (a.item(), b.item(), wa._source_rank(), wb._source_rank()) != (1.0, 2.0, 1, 2):
            errors.append(f"mixed: {a.item(), b.item(), wa._source_rank(), wb._source_rank()}")
    dist.barrier()
    dist.destroy_process_group()
    return errors


def test_torch_distributed_recv_without_src():
    res = harness.run(_backend_body, 4, init=False, timeout=180, env=RING_ENV)
    errors = [e for errs in res for e in errs]
    assert not errors, errors


def test_torch_distributed_recv_without_src_across_hosts():
    def body(rank, world):
        os.environ["FASTCOMM_HOST_ID"] = f"host-{ALTERNATE[rank]}"
        return _backend_body(rank, world)

    res = harness.run(body, 4, init=False, timeout=240, env=RING_ENV)
    errors = [e for errs in res for e in errs]
    assert not errors, errors


# ---------------------------------------------------------------------------------------------
# Faults and bad arguments


def _timeout_body(rank, world):
    g = fc.new_group([0, 1], timeout=0.5)
    out = {}
    if rank == 0:
        out["blocking"] = expect(dist.DistBackendError, lambda: fc.recv(torch.zeros(3), group=g),
                                 "rank 0", "group [0, 1]", "any source", "timed out")
        w = fc.irecv(torch.zeros(3), group=g, tag=4)
        out["async"] = expect(dist.DistBackendError, w.wait, "rank 0", "group [0, 1]", "tag 4", "timed out")
        assert w.is_completed() and w.exception() is not None
    fc.barrier()  # rank 1 sends only once rank 0's receives have failed
    if rank == 1:
        fc.send(torch.full((3,), 7.0), dst=0, group=g)
    fc.barrier()  # and rank 0 receives once it was sent: a stalled rank 1 cannot outlast the 0.5 s
    if rank == 0:
        t = torch.zeros(3)
        out["after"] = (fc.recv(t, group=g), t.tolist())
    return out


def test_any_source_receive_times_out_and_the_group_goes_on():
    res = harness.run(_timeout_body, 2, timeout=60, **SHORT)
    assert res[0]["after"] == (1, [7.0, 7.0, 7.0])


def _dead_sender_body(rank, world):
    g = fc.new_group([0, 1, 2])
    out = {}
    if rank == 2:
        fc.send(torch.full((4,), 2.0), dst=0, group=g)
        os._exit(0)  # after its message is written: rank 0 still gets it
    if rank == 0:
        t = torch.zeros(4)
        out["first"] = (fc.recv(t, group=g), t.tolist())
        # Rank 2 may have been the sender of the next one: it fails, naming rank 2.
        out["second"] = expect(dist.DistBackendError, lambda: fc.recv(torch.zeros(4), group=g),
                               "rank 0", "group [0, 1, 2]", "rank 2", "exited")
        # A receive naming a live member still works on that group, and so do other groups.
        t = torch.zeros(4)
        out["named"] = (fc.recv(t, src=1, group=g, tag=9), t.tolist())
        pair = fc.new_group([0, 1])
        t = torch.zeros(4)
        out["pair"] = (fc.recv(t, group=pair), t.tolist())
        fc.barrier(group=pair)
    if rank == 1:
        # (On a tag of its own, so rank 0's any-source receives on tag 0 never see it.)
        fc.send(torch.full((4,), 1.0), dst=0, group=g, tag=9)
        pair = fc.new_group([0, 1])
        fc.send(torch.full((4,), 3.0), dst=0, group=pair)
        fc.barrier(group=pair)  # stays alive until rank 0 is done (an exit would fail its receives)
    return out


def test_dead_sender_fails_any_source_receives_with_its_name():
    res = harness.run(_dead_sender_body, 3, timeout=90, allow_fail=(2,), **SHORT)
    out = res[0]
    assert out["first"] == (2, [2.0] * 4)
    assert out["named"] == (1, [1.0] * 4)
    assert out["pair"] == (1, [3.0] * 4)


def _args_body(rank, world):
    from fastcomm.collectives import _MONITORED_BARRIER_TAG

    alone = fc.new_group([rank])
    expect(ValueError, lambda: fc.recv(torch.zeros(2), group=alone), f"rank {rank}", f"group [{rank}]",
           "'src' is None (any source)", "no other member")
    expect(ValueError, lambda: fc.irecv(torch.zeros(2), group=alone), "'src'")
    expect(ValueError, lambda: fc.recv(torch.zeros(2), tag=_MONITORED_BARRIER_TAG), "'tag'", "reserved")
    expect(ValueError, lambda: fc.isend(torch.zeros(2), dst=1 - rank, tag=_MONITORED_BARRIER_TAG), "reserved")
    expect(ValueError, lambda: fc.recv(torch.zeros(2, 2).t()), "contiguous")
    w = fc.all_reduce(torch.ones(2), async_op=True)
    w.wait()
    expect(RuntimeError, w.source_rank, "not a single recv")
    # A specific-source irecv knows its sender from the start; a send has none.
    peer = 1 - rank
    r = fc.irecv(torch.zeros(2), src=peer)
    s = fc.isend(torch.ones(2), dst=peer)
    s.wait()
    r.wait()
    expect(RuntimeError, s.source_rank, "not a single recv")
    fc.barrier()
    return r.source_rank()


def test_bad_arguments():
    assert harness.run(_args_body, 2, timeout=60, **SHORT) == [1, 0]
