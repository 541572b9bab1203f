"""A plan's graph inside a larger user graph (docs/design.md, "CUDA graphs"): ``g.replay()`` while
the caller's stream is captured records the plan's work into that capture, so every replay of
the user's graph runs the collectives. On the fake device runtime (FASTCOMM_FAKE_DEVICE=1) the
user's capture is the fake's capture of the caller's stream (``debug("begin_capture")``, kept by
``debug("end_capture", 1)`` and launched by ``debug("graph_launch", id)``, as torch.cuda.graph's
CUDAGraph would be); the fake refuses a graph launched into a capture, so only the plan's work
recorded anew reaches the user's graph. On a GPU the same bodies use torch.cuda.graph.

- Results: a plan over groups of 2 to 5, overlapping, sizes 0, 1 and odd, recorded into a user
  graph between work of the user's own; nothing runs at the capture; each replay of the user's
  graph (mixed with plain replays of the plan's graph) against a local reference.
- A user graph holding two replays of one plan and one of another over the same pair, launched
  back to back without a wait: every run counted and applied, in order.
- Faults: a peer dead during a user graph's run, and a member that never replays its user graph,
  fail the graph (the user's graph drains: the caller's stream synchronizes, no hang) and raise
  DistBackendError naming the peer from the next wait() or replay(). A failed plan dropped while
  its run in a user graph still waits keeps that run's memory until its communicators are gone.
- Refused under capture: g.wait(), p.capture(), and a dead graph's replay.
- Through the backend (init_process_group("cpu:fastcomm,cuda:fastcomm")): dist.all_reduce under
  capture raises the plan route's message, exactly."""
from __future__ import annotations

import gc
import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import harness
from _device import DEV, ENV, ON_GPU, dsync, fake_only, setup
from _helpers import expect
from _plan_cases import LISTS5, PlanCases, others_go_on, pair_plan, same

import fastcomm as fc

def dbg(what, arg=0):
    return fc._state._engine.device_debug("cpu", what, arg)


class UserGraph:
    """The caller's own graph: torch.cuda.graph on a GPU, the fake's capture of the caller's
    stream otherwise (mode 0: CUDA's global capture mode, torch's default; 1: thread-local)."""

    def __init__(self, mode=0):
        self.mode = mode
        self.id = None
        if ON_GPU:
            self.graph = torch.cuda.CUDAGraph()
            self.stream = torch.cuda.Stream()

    def capture(self, body):
        if ON_GPU:
            torch.cuda.synchronize()
            with torch.cuda.graph(self.graph, stream=self.stream,
                                  capture_error_mode="global" if self.mode == 0 else "thread_local"):
                body()
            return
        dbg("begin_capture", self.mode)
        try:
            body()
        finally:
            self.id = dbg("end_capture", 1)
        assert self.id > 0, "the user's capture was refused (see stderr)"

    def own_work(self):
        """Work of the user's own on the captured stream."""
        if ON_GPU:
            torch.cuda._sleep(1000)
        else:
            dbg("spin", 1)

    def replay(self):
        if ON_GPU:
            self.graph.replay()
        else:
            dbg("graph_launch", self.id)

    def drop(self):
        if not ON_GPU and self.id:
            dbg("graph_destroy", self.id)
            self.id = None


# ---------------------------------------------------------------------------------------------
# Results: every group shape, the user's graph and plain replays in turn


def _results_body(rank, world, rounds, mode):
    setup(rank)
    cases = PlanCases(rank)
    with fc.plan() as p:
        cases.record(fc.new_groups(LISTS5))

    g = p.capture()
    cases.refill(0)
    before = [[t.clone().cpu() for t in ts] for ts in cases.tensors()]
    user = UserGraph(mode)
    user.capture(lambda: (user.own_work(), g.replay(), user.own_work()))
    dsync()
    # recorded, not run: every tensor as it was before the capture
    for i, (ts, old) in enumerate(zip(cases.tensors(), before)):
        for t, o in zip(ts, old):
            same(t, o, f"after the capture, before any replay: case {i}")
    assert (g.recorded, g.user_runs, g.replays) == (1, 0, 0)
    for r in range(rounds):
        cases.refill(r)
        if r % 3 == 2:
            g.replay()  # the plan's own graph, between runs of the user's
            how = "plain replay"
        else:
            user.replay()
            how = "user graph"
        g.wait()
        dsync()
        cases.check(r, how)
    user.drop()
    n_user = sum(1 for r in range(rounds) if r % 3 != 2)
    assert (g.user_runs, g.replays) == (n_user, rounds - n_user), (g.user_runs, g.replays)
    return len(cases)


@pytest.mark.parametrize("mode", [0, 1], ids=["global", "thread_local"])
def test_a_plan_graph_inside_a_user_graph_runs_at_each_user_replay(mode):
    res = harness.run(_results_body, 5, 6, mode, timeout=240, env=ENV, init_timeout=30)
    assert all(r > 0 for r in res), res


def _twice_body(rank, world, n_ops, launches):
    """Two replays of one plan and one of another over the same pair in one user graph; the
    user's graph launched back to back: each run of the first plan doubles the pair's sum."""
    setup(rank)
    pair = fc.new_group([0, 1])
    ts = [torch.zeros(1 + (i % 3), dtype=torch.float32, device=DEV) for i in range(n_ops)]
    with fc.plan() as p:
        for t in ts:
            fc.all_reduce(t, group=pair)
    b = torch.zeros(4, dtype=torch.int64, device=DEV)
    with fc.plan() as q:
        fc.broadcast(b, src=1, group=pair)
    g, h = p.capture(), q.capture()
    user = UserGraph()

    def body():
        g.replay()
        user.own_work()
        h.replay()
        g.replay()

    user.capture(body)
    for i, t in enumerate(ts):
        t.fill_(float(rank + 1 + i))
    b.fill_(10 * (rank + 1))
    dsync()
    for _ in range(launches):
        user.replay()
    g.wait()
    h.wait()
    dsync()
    for i, t in enumerate(ts):
        expect_v = float((1 + i) + (2 + i)) * 2 ** (2 * launches - 1)
        assert t.tolist() == [expect_v] * t.numel(), (i, t.tolist(), expect_v)
    assert b.tolist() == [20] * 4, b.tolist()
    user.drop()
    return g.recorded, g.user_runs, h.user_runs


def test_a_user_graph_holding_several_plan_replays_runs_each_in_order():
    res = harness.run(_twice_body, 2, 16, 5, timeout=120, env=ENV, init_timeout=30)
    assert res == [(2, 10, 5)] * 2, res


# ---------------------------------------------------------------------------------------------
# Faults: the user's graph drains, the plan's graph raises


def _dead_peer_body(rank, world):
    setup(rank)
    pair, other = fc.new_groups([[0, 1], [0, 2]])
    msgs = []
    if rank in (0, 1):
        t = torch.zeros(4, device=DEV)
        g = pair_plan(t, pair)
        user = UserGraph()
        user.capture(g.replay)
        for r in range(3):
            t.fill_(float(rank + r))
            user.replay()
            g.wait()
            dsync()
            assert t.tolist() == [float(1 + 2 * r)] * 4
        if rank == 1:
            os._exit(0)  # dies between runs: rank 0's next run of the user graph has no peer
        user.replay()
        dsync()  # the run drains (the watcher fails the graph): no hang
        msgs.append(expect(dist.DistBackendError, g.wait, "rank 1"))
        msgs.append(expect(dist.DistBackendError, g.replay, "rank 1", "dead"))  # stays dead
        user.replay()  # later runs of the user's graph drain too
        dsync()
        user.drop()
    others_go_on(rank, other, msgs)  # groups without the dead rank go on
    return msgs


@fake_only
def test_a_dead_peer_during_a_user_graph_run_drains_it_and_raises_naming_the_peer():
    res = harness.run(_dead_peer_body, 3, timeout=90, env=ENV, init_timeout=5, allow_fail=(1,))
    assert len(res[0]) == 3 and res[0][-1] == [4.0, 4.0] and res[2] == [[4.0, 4.0]], res


def _timeout_body(rank, world):
    setup(rank)
    pair = fc.new_group([0, 1], timeout=timedelta(seconds=2))
    host = fc.new_group([0, 1])
    t = torch.ones(3, device=DEV)
    g = pair_plan(t, pair)
    user = UserGraph()
    user.capture(g.replay)
    msgs = []
    if rank == 0:  # rank 1 never runs its user graph
        user.replay()
        dsync()  # returns once the watcher timed the run out
        msgs.append(expect(dist.DistBackendError, g.wait, "timeout", "ranks [1]"))
        # a dead graph records nothing into a new capture
        dead = UserGraph()
        msgs.append(expect(dist.DistBackendError, lambda: dead.capture(g.replay), "dead"))
        dead.drop()
    fc.barrier(group=host)  # a host op: rank 1 leaves only once rank 0 saw the timeout
    user.drop()
    return msgs


def test_a_member_that_never_runs_its_user_graph_times_the_run_out():
    res = harness.run(_timeout_body, 2, timeout=60, env=ENV, init_timeout=30)
    assert len(res[0]) == 2, res


def _dropped_body(rank, world):
    """The plan goes (g dropped) while a run of a user graph that recorded it still waits for
    rank 1, the plan failed and its communicators' abort slow: the run's memory outlives it."""
    setup(rank)
    pair = fc.new_group([0, 1], timeout=timedelta(seconds=2))
    host = fc.new_group([0, 1])
    t = torch.full((300,), float(rank + 1), device=DEV)
    g = pair_plan(t, pair)
    user = UserGraph()
    user.capture(g.replay)
    before = dbg("late_writes")
    msg = None
    if rank == 0:
        dbg("abort_hold")  # the plan's communicators stay up: the run still waits for rank 1
        user.replay()
        msg = expect(dist.DistBackendError, g.wait, "timeout", "ranks [1]")
        del g
        gc.collect()
    fc.barrier(group=host)  # a host op: rank 1 runs once rank 0's plan is gone
    if rank == 1:
        user.replay()  # rank 0's receive gets its data now
    dsync()  # rank 0: its run ends with rank 1's data
    fc.barrier(group=host)
    if rank == 0:
        dbg("abort_release")
    user.drop()
    return msg, t[:2].tolist(), dbg("late_writes") - before


@fake_only
def test_a_plan_dropped_during_a_user_graph_run_keeps_its_memory_until_the_run_is_over():
    res = harness.run(_dropped_body, 2, timeout=60, env=ENV, init_timeout=30)
    assert res[0][0] and res[0][1:] == ([3.0, 3.0], 0) and res[1] == (None, [3.0, 3.0], 0), res


def _solo_body(rank, world, runs):
    """A plan whose ops have no peer (groups of one: an all_reduce, and an all_gather that is a
    copy), recorded into a user's graph and dropped before it: the user's graph holds the plan's
    watch (its host calls count every run) and memory, so its later runs go on. (They ran on
    freed memory before, and the rank crashed.)"""
    setup(rank)
    solo = fc.new_group([rank])
    t = torch.ones(4, device=DEV)
    src, out = torch.zeros(3, device=DEV), torch.zeros(3, device=DEV)
    with fc.plan() as p:
        fc.all_reduce(t, group=solo)
        fc.all_gather_into_tensor(out, src, group=solo)
    g = p.capture()
    user = UserGraph()
    user.capture(g.replay)
    user.replay()
    g.wait()
    dsync()
    del g, p
    gc.collect()
    junk = [bytearray(200) for _ in range(2000)]  # what would take the plan's memory, were it freed
    wrong = []
    for r in range(runs):
        src.fill_(float(r))
        user.replay()
        dsync()
        if out.tolist() != [float(r)] * 3 or t.tolist() != [1.0] * 4:
            wrong.append((r, out.tolist(), t.tolist()))
    user.drop()
    return wrong, len(junk)


@fake_only
def test_a_plan_without_peers_dropped_before_the_user_graph_that_recorded_it():
    res = harness.run(_solo_body, 1, 50, timeout=60, env=ENV, init_timeout=30)
    assert res == [([], 2000)], res


# ---------------------------------------------------------------------------------------------
# Refused under the caller's capture


def _refusals_body(rank, world):
    setup(rank)
    pair = fc.new_group([0, 1])
    t = torch.ones(2, device=DEV)
    with fc.plan() as p:
        fc.all_reduce(t, group=pair)
    g = p.capture()
    msgs = []
    user = UserGraph()

    def body():
        msgs.append(expect(RuntimeError, g.wait, "wait() while the caller's stream is being captured"))
        msgs.append(expect(RuntimeError, p.capture, "outside any capture", "`g.replay()` inside the capture"))
        msgs.append(expect(RuntimeError, lambda: p.start(async_op=False), "fastcomm.plan()", "`g.replay()` inside the capture"))
        g.replay()

    user.capture(body)
    user.replay()
    g.wait()
    dsync()
    user.drop()
    return msgs, t.tolist()


def test_wait_and_capture_under_the_callers_capture_are_refused():
    for msgs, t in harness.run(_refusals_body, 2, timeout=60, env=ENV, init_timeout=30):
        assert t == [2.0, 2.0] and len(msgs) == 3, (msgs, t)


# ---------------------------------------------------------------------------------------------
# Through the backend: dist.all_reduce under capture names the plan route


def refusal(rank, ranks, op="all_reduce"):
    return (f"fastcomm.{op}: rank {rank}, group {ranks}: issued while the caller's stream is being captured into a "
            "CUDA graph. fastcomm launches an op's transfers from its engine thread once the members have agreed "
            "on it, so an op issued under capture cannot be recorded into the graph; nothing was issued. Capture "
            "through a plan instead: record the ops once with `with fastcomm.plan() as p: ...`, then, outside any "
            "capture, `g = p.capture()` (the members agree on the order and matching once, there), and call "
            "`g.replay()` inside the capture (it records the plan's work into the graph) or outside it "
            "(docs/design.md, \"CUDA graphs\")")


def _backend_body(rank, world):
    setup(rank)
    dist.init_process_group("cpu:fastcomm,cuda:fastcomm", store=harness.child_store(), rank=rank,
                            world_size=world, timeout=timedelta(seconds=20))
    try:
        x = torch.ones(3, device=DEV)
        sub = dist.new_group([0, 1])
        msgs = []
        user = UserGraph()

        def body():
            calls = [lambda: dist.all_reduce(x), lambda: dist.all_reduce(x, async_op=True)]
            if rank in (0, 1):
                calls.append(lambda: dist.all_reduce(x, group=sub))
            for fn in calls:
                try:
                    fn()
                except RuntimeError as e:
                    msgs.append(str(e))
                else:
                    msgs.append(None)

        try:
            user.capture(body)
        except Exception:  # noqa: BLE001 - a GPU capture that a refusal left invalid
            pass
        user.drop()
        dist.all_reduce(x)  # nothing was issued: the groups go on
        dsync()
        return msgs, x.tolist()
    finally:
        dist.destroy_process_group()


def test_dist_all_reduce_under_capture_through_the_backend_raises_the_plan_route():
    res = harness.run(_backend_body, 3, timeout=90, env=ENV, init_timeout=20)
    for rank, (msgs, x) in enumerate(res):
        assert x == [3.0] * 3, x
        assert msgs == [refusal(rank, [0, 1, 2])] * 2 + ([refusal(rank, [0, 1])] if rank < 2 else []), msgs
