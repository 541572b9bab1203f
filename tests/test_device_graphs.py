"""CUDA graphs through plans (docs/design.md, "CUDA graphs"), on the fake device runtime
(FASTCOMM_FAKE_DEVICE=1), whose graph model keeps captured stream work for replay and refuses
what CUDA refuses under capture (tests/cpp/test_fake_graphs.cpp tests the model itself).

- A plan of device ops over groups of 2 to 5, overlapping, sizes 0, 1 and odd, captured once with
  ``p.capture()`` and replayed many times with inputs refilled in place: every replay's results
  against a local reference; and a plan of large ops of groups of 3+ (a group communicator's
  eagerly), captured over pair channels.
- The members agree on the plan at capture: a plan that differs between two members raises on
  both, naming the peer.
- Faults during replay: a dead peer, and a member that never replays (a timeout), raise
  DistBackendError naming the peer from the next replay or wait(), never hang; other groups go on;
  a run with two silent peers drains (their communicators are aborted at once).
- More peers than FASTCOMM_DEVICE_MAX_KERNELS: the launches go in a window, so a triangle of
  pairs, and an op of three, whose branches reach a one-kernel device in a cycle complete.
- A careless capture that allocates with the capture begun fails on the fake, as on CUDA.
- fastcomm.shutdown() ends a live graph: its next replay raises.
- An op issued under capture outside a plan, natively or through the backend, is refused
  naming the plan route (tests/test_device_collectives.py)."""
from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

import harness
from _device import DEV, ENV, ON_GPU, dsync, fake_only, setup
from _helpers import expect, fold, gen
from _plan_cases import LISTS5, PlanCases, others_go_on, pair_plan, same

import fastcomm as fc


def dbg(what, arg=0):
    return fc._state._engine.device_debug("cpu", what, arg)

# ---------------------------------------------------------------------------------------------
# Results: one plan over every group shape, replayed with changing inputs


def _replay_body(rank, world, replays):
    setup(rank)
    return replay_cases(rank, replays, LISTS5)


def replay_cases(rank, replays, lists):
    """The plan of PlanCases over `lists`, captured and replayed with new inputs each time,
    every replay checked; returns the ops checked."""
    cases = PlanCases(rank)
    with fc.plan() as p:
        cases.record(fc.new_groups(lists), lists)
    g = p.capture()
    for r in range(replays):
        cases.refill(r)
        g.replay()
        g.wait()
        dsync()
        cases.check(r, "replay")
    assert g.replays == replays
    return len(cases) * replays


def test_a_captured_plan_replays_with_correct_results_on_every_group_shape():
    res = harness.run(_replay_body, 5, 6, timeout=240, env=ENV, init_timeout=30)
    assert all(r > 0 for r in res), res


def _pairs_body(rank, world, n_ops, replays):
    """A plan of many small pair all_reduces (the case graphs are for), replayed back to back
    without a wait between replays: the last replay's result is checked, every replay adds."""
    setup(rank)
    pair = fc.new_group([0, 1])
    ts = [torch.zeros(1 + (i % 3), dtype=torch.float32, device=DEV) for i in range(n_ops)]
    with fc.plan() as p:
        for t in ts:
            fc.all_reduce(t, group=pair)
    g = p.capture()
    for i, t in enumerate(ts):
        t.fill_(float(rank + 1 + i))
    for _ in range(replays):  # each replay doubles the sum of the two: x -> 2x after the first
        g.replay()
    g.wait()
    dsync()
    for i, t in enumerate(ts):
        expect_v = float((1 + i) + (2 + i)) * 2 ** (replays - 1)
        assert t.tolist() == [expect_v] * t.numel(), (i, t.tolist(), expect_v)
    return g.replays


def test_many_pair_all_reduces_replay_back_to_back():
    assert harness.run(_pairs_body, 2, 64, 20, timeout=120, env=ENV, init_timeout=30) == [20, 20]


def _fused_body(rank, world):
    """Pair ops captured together go as one NCCL group (one kernel per replay) where their memory
    is disjoint; an op that reads what an earlier one writes (the same tensor again) starts a new
    group, so it sees the earlier op's result."""
    setup(rank)
    pair, other = fc.new_groups([[0, 1], [0, 1]])
    launches = lambda: fc._state._engine.device_debug("cpu", "captured_launches", 0)  # noqa: E731
    out = []
    for kind in ("disjoint", "chained"):
        ts = [torch.zeros(5 + i, device=DEV) for i in range(8)]
        with fc.plan() as p:
            for i, t in enumerate(ts):
                fc.all_reduce(t, group=pair if i % 2 else other)
                if kind == "chained" and i == 3:
                    fc.all_reduce(t, group=pair)  # t again: after the first op's fold
        before = launches()
        g = p.capture()
        captured = launches() - before
        for i, t in enumerate(ts):
            t.fill_(float(rank + 1 + i))
        g.replay()
        g.wait()
        dsync()
        for i, t in enumerate(ts):
            want = float(3 + 2 * i) * (2 if kind == "chained" and i == 3 else 1)
            assert t.tolist() == [want] * t.numel(), (kind, i, t.tolist(), want)
        out.append((kind, captured))
    return out


@fake_only
def test_pair_ops_captured_together_go_as_one_nccl_group():
    for r in harness.run(_fused_body, 2, timeout=120, env=ENV, init_timeout=30):
        assert r == [("disjoint", 1), ("chained", 2)], r


LARGE = [[0, 1, 2], [1, 2, 3], [0, 1, 2, 3]]


def _large_body(rank, world, replays):
    """Ops of groups of 3+ at or above FASTCOMM_RSAG_THRESHOLD, which eager run on the group's
    own communicator: captured, they run over the plan's pair channels (no group communicator in
    a graph); eager ops of the same groups before and after the graph stay on theirs."""
    setup(rank)
    groups = fc.new_groups(LARGE)
    mine = [(gi, ranks, g) for gi, (ranks, g) in enumerate(zip(LARGE, groups)) if rank in ranks]

    def eager(seed):
        for gi, ranks, g in mine:
            t = gen(rank, seed + gi, "float32", 40).to(DEV)
            fc.all_reduce(t, group=g)
            dsync()
            same(t, fold([gen(q, seed + gi, "float32", 40) for q in ranks], "SUM"), f"eager {ranks}")

    eager(1)
    on_group_comms = fc._state._engine.device_debug("cpu", "group_comms", 0) if not ON_GPU else None
    cases = []  # (kind, ranks, tensors, seed)
    with fc.plan() as p:
        for gi, ranks, g in mine:
            n, seed = len(ranks), 100 * gi
            ar = torch.zeros(33, device=DEV)
            fc.all_reduce(ar, group=g)
            cases.append(("all_reduce", ranks, (ar,), seed))
            ari = torch.zeros(21, dtype=torch.int64, device=DEV)
            fc.all_reduce(ari, op=dist.ReduceOp.MAX, group=g)  # MAX: the fold, not the group's NCCL
            cases.append(("all_reduce max", ranks, (ari,), seed + 1))
            b = torch.zeros(20, device=DEV)
            fc.broadcast(b, src=ranks[-1], group=g)
            cases.append(("broadcast", ranks, (b,), seed + 2))
            ag, src = torch.zeros(17 * n, device=DEV), torch.zeros(17, device=DEV)
            fc.all_gather_into_tensor(ag, src, group=g)
            cases.append(("all_gather", ranks, (ag, src), seed + 3))
            rs, rin = torch.zeros(19, device=DEV), torch.zeros(19 * n, device=DEV)
            fc.reduce_scatter_tensor(rs, rin, group=g)
            cases.append(("reduce_scatter", ranks, (rs, rin), seed + 4))
    graph = p.capture()
    for r in range(replays):
        for kind, ranks, ts, seed in cases:  # the inputs, refilled in place
            if kind == "all_reduce max":
                ts[0].copy_(gen(rank, seed + r, "int64", 21, "MAX"))
            elif kind in ("all_gather", "reduce_scatter"):
                ts[1].copy_(gen(rank, seed + r, "float32", ts[1].numel()))
            else:
                ts[0].copy_(gen(rank, seed + r, "float32", ts[0].numel()))
        graph.replay()
        graph.wait()
        dsync()
        for kind, ranks, ts, seed in cases:
            what, me = f"replay {r} {kind} {ranks}", ranks.index(rank)
            if kind == "all_reduce":
                same(ts[0], fold([gen(q, seed + r, "float32", 33) for q in ranks], "SUM"), what)
            elif kind == "all_reduce max":
                same(ts[0], fold([gen(q, seed + r, "int64", 21, "MAX") for q in ranks], "MAX"), what)
            elif kind == "broadcast":
                same(ts[0], gen(ranks[-1], seed + r, "float32", 20), what)
            elif kind == "all_gather":
                same(ts[0], torch.cat([gen(q, seed + r, "float32", 17) for q in ranks]), what)
            else:
                full = fold([gen(q, seed + r, "float32", 19 * len(ranks)) for q in ranks], "SUM")
                same(ts[0], full[19 * me:19 * (me + 1)], what)
    eager(7)
    return on_group_comms, graph.replays


def test_a_captured_plan_of_large_ops_of_groups_of_three_or_more_replays_over_pair_channels():
    # 64 bytes per member and up run on a group communicator when issued eagerly.
    res = harness.run(_large_body, 4, 3, timeout=180, env={**ENV, "FASTCOMM_RSAG_THRESHOLD": "64"},
                      init_timeout=30)
    for on_group_comms, replays in res:
        assert replays == 3
        assert on_group_comms is None or on_group_comms >= 1, on_group_comms  # the eager ops used them


# ---------------------------------------------------------------------------------------------
# Agreement at capture


def _mismatch_body(rank, world):
    setup(rank)
    pair = fc.new_group([0, 1])
    t = torch.zeros(3 + rank, device=DEV)  # 3 elements on rank 0, 4 on rank 1
    with fc.plan() as p:
        fc.all_reduce(t, group=pair)
    msg = expect(dist.DistBackendError, p.capture, "does not match", f"rank {1 - rank}")
    # the pair goes on: an eager op after the failed capture
    x = torch.full((2,), float(rank + 1), device=DEV)
    fc.all_reduce(x, group=pair)
    dsync()
    return msg, x.tolist()


def test_a_plan_that_differs_between_members_fails_capture_on_both():
    for msg, x in harness.run(_mismatch_body, 2, timeout=60, env=ENV, init_timeout=30):
        assert x == [3.0, 3.0], msg


# ---------------------------------------------------------------------------------------------
# Faults during replay


def _dead_peer_body(rank, world):
    setup(rank)
    pair, other = fc.new_groups([[0, 1], [0, 2]])
    msgs = []
    if rank in (0, 1):
        t = torch.zeros(4, device=DEV)
        g = pair_plan(t, pair)
        for r in range(3):
            t.fill_(float(rank + r))
            g.replay()
            g.wait()
            dsync()
            assert t.tolist() == [float(1 + 2 * r)] * 4
        if rank == 1:
            os._exit(0)  # dies between replays: rank 0's next replay has no peer

        def replay_and_wait():
            g.replay()
            g.wait()
        msgs.append(expect(dist.DistBackendError, replay_and_wait, "rank 1"))
        msgs.append(expect(dist.DistBackendError, g.replay, "rank 1", "dead"))  # stays dead
    others_go_on(rank, other, msgs)  # groups without the dead rank go on
    return msgs


@fake_only
def test_a_dead_peer_during_replay_fails_the_next_replay_or_wait_naming_it():
    res = harness.run(_dead_peer_body, 3, timeout=90, env=ENV, init_timeout=5, allow_fail=(1,))
    assert res[0][-1] == [4.0, 4.0] and res[2] == [[4.0, 4.0]], res


def _timeout_body(rank, world):
    setup(rank)
    pair = fc.new_group([0, 1], timeout=timedelta(seconds=2))
    host = fc.new_group([0, 1])
    t = torch.ones(3, device=DEV)
    g = pair_plan(t, pair)
    msg = None
    if rank == 0:  # rank 1 never replays
        g.replay()
        msg = expect(dist.DistBackendError, g.wait, "timeout", "ranks [1]")
    fc.barrier(group=host)  # a host op: rank 1 leaves only once rank 0 saw the timeout
    return msg


def test_a_member_that_never_replays_times_the_replay_out():
    res = harness.run(_timeout_body, 2, timeout=60, env=ENV, init_timeout=30)
    assert res[0] is not None


def _two_silent_peers_body(rank, world):
    """Rank 0's plan has a pair op with rank 1 and one with rank 2, which never replay: the run
    times out and drains (both of its kernels, on two communicators, end), no hang."""
    setup(rank)
    pairs = fc.new_groups([[0, 1], [0, 2]], timeout=timedelta(seconds=2))
    everyone = fc.new_group([0, 1, 2])
    ts = [torch.ones(3, device=DEV) for g in pairs if g.is_member]
    with fc.plan() as p:
        for t, g in zip(ts, [g for g in pairs if g.is_member]):
            fc.all_reduce(t, group=g)
    g = p.capture()
    msg = None
    if rank == 0:
        g.replay()
        msg = expect(dist.DistBackendError, g.wait, "timeout", "ranks [1, 2]")
        dsync()  # the run has drained
    fc.barrier(group=everyone)  # a host op: ranks 1 and 2 leave only once rank 0 is through
    return msg


def test_a_timed_out_run_with_two_silent_peers_drains():
    res = harness.run(_two_silent_peers_body, 3, timeout=60, env=ENV, init_timeout=30)
    assert res[0] is not None and res[1:] == [None, None], res


def _opposite_order_body(rank, world):
    """Two graphs over one pair replayed in opposite orders: each side's first run waits for a
    run the other has queued behind its own. The timeout ends it with DistBackendError on both
    sides (the rank that times out first aborts its graph, which fails the other's), no hang."""
    setup(rank)
    pair = fc.new_group([0, 1], timeout=timedelta(seconds=2))
    host = fc.new_group([0, 1])
    a, b = torch.ones(3, device=DEV), torch.ones(5, device=DEV)
    with fc.plan() as p1:
        fc.all_reduce(a, group=pair)
    with fc.plan() as p2:
        fc.all_reduce(b, group=pair)
    g1, g2 = p1.capture(), p2.capture()
    first, second = (g1, g2) if rank == 0 else (g2, g1)
    first.replay()
    second.replay()
    msgs = []
    for g in (first, second):
        try:
            g.wait()
        except dist.DistBackendError as e:
            msgs.append(str(e))
    fc.barrier(group=host)
    return msgs


def test_graphs_replayed_in_opposite_orders_fail_by_timeout_not_hang():
    res = harness.run(_opposite_order_body, 2, timeout=60, env=ENV, init_timeout=30)
    assert all(msgs for msgs in res), res
    assert any("timeout" in m for msgs in res for m in msgs), res


# ---------------------------------------------------------------------------------------------
# A careless design fails on the fake: agreeing and allocating with the capture begun


def _naive_body(rank, world):
    setup(rank)
    pair = fc.new_group([0, 1])
    t = torch.ones(5, device=DEV)
    with fc.plan() as p:
        fc.all_reduce(t, group=pair)
    msg = expect(Exception, lambda: p._plan.capture(naive=True), "capturing")
    g = p.capture()  # the design that agrees and allocates first works
    g.replay()
    g.wait()
    dsync()
    return msg, t.tolist()


@fake_only
def test_a_capture_that_allocates_under_capture_is_refused_by_the_fake():
    for msg, t in harness.run(_naive_body, 2, timeout=60, env=ENV, init_timeout=30):
        assert t == [2.0] * 5, msg


def _shutdown_body(rank, world):
    setup(rank)
    pair = fc.new_group([0, 1])
    t = torch.ones(3, device=DEV)
    g = pair_plan(t, pair)
    g.replay()
    g.wait()
    dsync()
    fc.shutdown()  # the graph's communicators are aborted; a later replay raises, never hangs
    return t.tolist(), expect(dist.DistBackendError, g.replay, "shut down", "capture the plan again")


def test_shutdown_ends_a_live_graph():
    for t, msg in harness.run(_shutdown_body, 2, timeout=60, env=ENV, init_timeout=30):
        assert t == [2.0] * 3, msg


def _drop_body(rank, world):
    """Rank 0 drops its graph with a run in flight that needs rank 1's replay, which rank 1 makes
    only once rank 0's main thread has seen the drop waiting and said so: the drop must wait
    without the GIL, or the main thread never gets to say it (the run would time out)."""
    import threading
    setup(rank)
    pair = fc.new_group([0, 1], timeout=timedelta(seconds=20))
    host = fc.new_group([0, 1])
    t = torch.full((3,), float(rank + 1), device=DEV)
    g = pair_plan(t, pair)
    if rank == 0:
        g.replay()
        box = [g]
        del g
        dropper = threading.Thread(target=box.clear)  # the last reference
        dropper.start()
        while dbg("plan_releasing") == 0 and dropper.is_alive():
            threading.Event().wait(0.001)
        fc.barrier(group=host)  # rank 1 may replay now
        dropper.join()
        dsync()
    else:
        fc.barrier(group=host)
        g.replay()
        g.wait()
        dsync()
    return t.tolist()


def test_a_graph_dropped_with_a_run_in_flight_waits_for_it_without_the_gil():
    assert harness.run(_drop_body, 2, timeout=60, env=ENV, init_timeout=30) == [[3.0] * 3] * 2


# ---------------------------------------------------------------------------------------------
# benchmarks/device_graphs.py (scripts/gpu_check.sh runs it on a GPU): the script on the fake


@fake_only
def test_the_graph_benchmark_runs_on_the_fake(tmp_path):
    import json
    import subprocess
    import sys

    bench = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
    out = tmp_path / "graphs.json"
    subprocess.run([sys.executable, os.path.join(bench, "device_graphs.py"), "--fake", "--ops", "64", "--replays",
                    "20", "--plain-iters", "3", "--launcher", "fork", "--job-timeout", "150", "--json", str(out)],
                   check=True, timeout=200, env=dict(os.environ, PYTHONUNBUFFERED="1"), capture_output=True)
    ranks = json.loads(out.read_text())
    assert [r["rank"] for r in ranks] == [0, 1]
    assert all(r["fc_graph_ok"] and r["fc_plan_ok"] for r in ranks), ranks


def _window_body(rank, world, rounds):
    """A triangle: each rank's plan holds an all_reduce with each of the other two. One kernel
    resident per device and FASTCOMM_DEVICE_MAX_KERNELS=1. The graph's branches (one per pair,
    in the plan's canonical order: by group id) reach the device staggered so that rank r's
    first kernel is its pair with rank r + 1 (mod 3), which waits for a peer whose device holds
    its kernel with the next rank: a cycle, unless the launches go in the plan's order, one at
    a time (the window)."""
    setup(rank)
    groups = fc.new_groups([[0, 1], [1, 2], [0, 2]], timeout=timedelta(seconds=5))
    mine = sorted([(g, torch.zeros(4, device=DEV)) for g in groups if g.is_member], key=lambda x: x[0]._h.id)
    with fc.plan() as p:
        for g, t in mine:
            fc.all_reduce(t, group=g)
    graph = p.capture()
    dbg("resident_limit", 1)
    first = mine[0][0].ranks == sorted([rank, (rank + 1) % 3])  # the branch that starts first unstaggered
    dbg("lane_stagger", 300 if first else -300)
    out = []
    for r in range(rounds):
        for _, t in mine:
            t.fill_(float(rank + 1 + r))
        graph.replay()
        graph.wait()
        dsync()
        out.append({tuple(g.ranks): t[0].item() for g, t in mine})
    dbg("lane_stagger", 0)
    return out


@fake_only
def test_a_plan_with_more_peers_than_the_kernel_bound_replays_in_a_window():
    env = dict(ENV, FASTCOMM_DEVICE_MAX_KERNELS="1")
    res = harness.run(_window_body, 3, 2, timeout=90, env=env, init_timeout=30)
    sums = {(0, 1): 3.0, (1, 2): 5.0, (0, 2): 4.0}  # round r adds 2r
    for rank, rounds in enumerate(res):
        for r, got in enumerate(rounds):
            assert got == {k: v + 2 * r for k, v in sums.items() if rank in k}, (rank, r, got)


def _wide_body(rank, world, rounds):
    """An all_reduce over three ranks in a plan: two kernels per rank, one per peer. One kernel
    resident per device and FASTCOMM_DEVICE_MAX_KERNELS=1; the branches reach the device so
    that rank r's first kernel is its pair with rank r + 1 (mod 3): a cycle, unless each part is
    a launch of its own in peer order (the window)."""
    setup(rank)
    g = fc.new_group([0, 1, 2], timeout=timedelta(seconds=5))
    t = torch.zeros(3, device=DEV)
    with fc.plan() as p:
        fc.all_reduce(t, group=g)
    graph = p.capture()
    dbg("resident_limit", 1)
    # The pairs' branches go in peer order: the wanted one starts first if it is the lower peer.
    dbg("lane_stagger", 300 if (rank + 1) % 3 < (rank + 2) % 3 else -300)
    out = []
    for r in range(rounds):
        t.fill_(float(rank + 1 + r))
        graph.replay()
        graph.wait()
        dsync()
        out.append(t[0].item())
    dbg("lane_stagger", 0)
    return out


@fake_only
def test_an_op_of_three_in_a_plan_past_the_kernel_bound_replays_in_a_window():
    env = dict(ENV, FASTCOMM_DEVICE_MAX_KERNELS="1")
    assert harness.run(_wide_body, 3, 2, timeout=90, env=env, init_timeout=30) == [[6.0, 9.0]] * 3


def _relay_body(rank, world, replays):
    """A group of 3 whose ops each touch one pair on rank 1: broadcast from 0 (rank 1 receives
    on pair (0, 1)), then reduce to 2 (rank 1 sends on pair (1, 2)): rank 1's send must carry
    what it received, though the two ops are on different pairs (fused batches keep the group's
    order across pairs)."""
    setup(rank)
    g = fc.new_group([0, 1, 2])
    t = torch.zeros(1 << 12, device=DEV)
    with fc.plan() as p:
        fc.broadcast(t, src=0, group=g)
        fc.reduce(t, dst=2, group=g)
    gr = p.capture()
    bad = []
    for r in range(replays):
        t.fill_(float(100 + r) if rank == 0 else -1.0)
        dsync()
        gr.replay()
        gr.wait()
        dsync()
        want = 3.0 * (100 + r)
        if rank == 2 and (t[0].item() != want or t[-1].item() != want):
            bad.append((r, t[0].item(), t[-1].item(), want))
    return bad


def test_a_groups_ops_on_different_pairs_keep_their_order_in_the_graph():
    res = harness.run(_relay_body, 3, 10, timeout=120, env=ENV, init_timeout=30)
    assert all(not b for b in res), res
