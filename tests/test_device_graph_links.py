"""CUDA graphs of plans over same-host IPC links (docs/design.md, "CUDA graphs"), on the fake
device runtime with FASTCOMM_DEVICE_IPC=1: a pair of one host goes over a link of the plan's own
whose flag waits and writes hold fixed values, so the graph replays them as captured.

- The cases of tests/test_device_graphs.py and tests/test_device_user_graphs.py that matter for a
  transport, run over links: every group shape and size against a local reference, many small
  pair ops back to back, large ops of groups of 3+, a plan inside a user's graph; each checks
  that its pairs went over links (debug "plan_ipc_links").
- Faults: a dead peer, a member that never replays, two silent peers and graphs replayed in
  opposite orders raise DistBackendError naming the peer, never hang; the failed side's runs
  drain (their waits are released until the plan goes).
- Where one side cannot link (its runtime cannot capture flag operations, or IPC is off for it),
  the pair goes over a communicator on both sides, with the same results; a plan with pairs of
  both kinds puts all of them on its one stream (debug "plan_serial").
- The plan's rings go once both sides dropped it (the suite's /dev/shm check covers crashes), or,
  where a user's graph recorded it, once that graph goes too; a run of that graph after the plan
  is dropped ends instead of hanging."""
from __future__ import annotations

import gc
import time

import pytest
import torch

import harness
from _device import DEV, dsync, fake_only, setup
from test_device_graphs import (_dead_peer_body, _large_body, _opposite_order_body, _pairs_body, _replay_body,
                                _timeout_body, _two_silent_peers_body, replay_cases)
from _plan_cases import pair_plan
from test_device_user_graphs import UserGraph, _results_body

import fastcomm as fc

# Links on the fake; on a GPU every same-host pair is one by default.
LINKS = {"FASTCOMM_FAKE_DEVICE": "1", "FASTCOMM_DEVICE_IPC": "1"}
SMALL_RING = dict(LINKS, FASTCOMM_DEVICE_IPC_RING_BYTES="4096")  # 4 slots of 1 KiB: sizes wrap the ring

pytestmark = fake_only


def dbg(what, arg=0):
    return fc._state._engine.device_debug("cpu", what, arg)


def _replay_linked(rank, world, replays):
    return _replay_body(rank, world, replays), dbg("plan_ipc_links")


def _pairs_linked(rank, world, n_ops, replays):
    return _pairs_body(rank, world, n_ops, replays), dbg("plan_ipc_links")


def _large_linked(rank, world, replays):
    return _large_body(rank, world, replays), dbg("plan_ipc_links")


def _user_linked(rank, world, rounds, mode):
    return _results_body(rank, world, rounds, mode), dbg("plan_ipc_links")


@pytest.mark.parametrize("env", [LINKS, SMALL_RING], ids=["ring", "small-ring"])
def test_a_plan_over_links_replays_with_correct_results_on_every_group_shape(env):
    res = harness.run(_replay_linked, 5, 4, timeout=240, env=env, init_timeout=30)
    assert all(r > 0 and links > 0 for r, links in res), res


def test_many_small_pair_ops_over_a_link_replay_back_to_back():
    res = harness.run(_pairs_linked, 2, 64, 30, timeout=120, env=LINKS, init_timeout=30)
    assert res == [(30, 1), (30, 1)], res


def test_large_ops_of_groups_of_three_or_more_replay_over_links():
    res = harness.run(_large_linked, 4, 3, timeout=180, env={**SMALL_RING, "FASTCOMM_RSAG_THRESHOLD": "64"},
                      init_timeout=30)
    for (on_group_comms, replays), links in res:
        assert replays == 3 and links >= 1, res


def test_a_plan_over_links_inside_a_user_graph_runs_at_each_user_replay():
    res = harness.run(_user_linked, 5, 6, 0, timeout=240, env=LINKS, init_timeout=30)
    assert all(links > 0 for _, links in res), res


# ---------------------------------------------------------------------------------------------
# Faults


def test_a_dead_peer_fails_the_next_replay_over_a_link_naming_it():
    res = harness.run(_dead_peer_body, 3, timeout=90, env=LINKS, init_timeout=5, allow_fail=(1,))
    assert res[0][-1] == [4.0, 4.0] and res[2] == [[4.0, 4.0]], res


def test_a_member_that_never_replays_times_a_linked_replay_out():
    res = harness.run(_timeout_body, 2, timeout=60, env=LINKS, init_timeout=30)
    assert res[0] is not None


def test_a_timed_out_linked_run_with_two_silent_peers_drains():
    res = harness.run(_two_silent_peers_body, 3, timeout=60, env=LINKS, init_timeout=30)
    assert res[0] is not None and res[1:] == [None, None], res


def test_linked_graphs_replayed_in_opposite_orders_fail_on_both_sides_not_hang():
    res = harness.run(_opposite_order_body, 2, timeout=60, env=LINKS, init_timeout=30)
    assert all(msgs for msgs in res), res
    assert any("timeout" in m for msgs in res for m in msgs), res


# ---------------------------------------------------------------------------------------------
# Either side cannot link: a communicator on both


def _fallback_body(rank, world, who):
    setup(rank)
    if rank in who:
        dbg("ipc_graphs", 0)  # as a runtime that cannot capture stream flag operations
    t = torch.zeros(5, device=DEV)
    g = pair_plan(t, fc.new_group([0, 1]))
    out = []
    for r in range(3):
        t.fill_(float(rank + 1 + r))
        g.replay()
        g.wait()
        dsync()
        out.append(t.tolist())
    return out, dbg("plan_ipc_links")


@pytest.mark.parametrize("who", [(0,), (1,)], ids=["leader-cannot", "follower-cannot"])
def test_a_pair_where_one_side_cannot_link_goes_over_a_communicator_on_both(who):
    res = harness.run(_fallback_body, 2, who, timeout=60, env=LINKS, init_timeout=30)
    for out, links in res:
        assert out == [[3.0 + 2 * r] * 5 for r in range(3)] and links == 0, res


# ---------------------------------------------------------------------------------------------
# Links and communicators in one plan: every pair's work on one stream, in the canonical order

LISTS3 = [[0, 1], [0, 2], [1, 2], [0, 1, 2]]


def _mixed_body(rank, world, replays):
    setup(rank)
    if rank == 2:
        dbg("ipc_graphs", 0)  # its pairs go over communicators; (0, 1) links
    replay_cases(rank, replays, LISTS3)
    return dbg("plan_serial"), dbg("plan_ipc_links")


@pytest.mark.parametrize("env", [LINKS, {**SMALL_RING, "FASTCOMM_RSAG_THRESHOLD": "64"}], ids=["ring", "small-ring-large-ops"])
def test_a_plan_of_links_and_communicators_replays_on_one_stream(env):
    res = harness.run(_mixed_body, 3, 4, timeout=180, env=env, init_timeout=30)
    assert res == [(1, 1), (1, 1), (0, 0)], res


# ---------------------------------------------------------------------------------------------
# The rings go


def _rings_body(rank, world):
    setup(rank)
    pair = fc.new_group([0, 1])
    host = fc.new_group([0, 1])
    t = torch.ones(300, device=DEV)
    g = pair_plan(t, pair)
    g.replay()
    g.wait()
    during = dbg("ipc_blocks")  # this process's own ring and its mapping of the peer's
    del g
    fc.barrier(group=host)  # both sides dropped the plan
    deadline = time.monotonic() + 10
    while dbg("ipc_blocks") > 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    return during, dbg("ipc_blocks"), dbg("plan_ipc_links")


def test_a_dropped_plans_rings_are_freed_once_both_sides_dropped_it():
    for during, after, links in harness.run(_rings_body, 2, timeout=60, env=LINKS, init_timeout=30):
        assert (during, after, links) == (2, 0, 1)


def _late_user_run_body(rank, world):
    """A user's graph that recorded a plan over a link runs again after both sides dropped the
    plan (which the rules forbid): the run ends, moving garbage, instead of hanging or touching
    unmapped memory; the rings stay while the user's graph does, and go with it."""
    setup(rank)
    pair = fc.new_group([0, 1])
    host = fc.new_group([0, 1])
    t = torch.full((300,), float(rank + 1), device=DEV)
    g = pair_plan(t, pair)
    user = UserGraph()
    user.capture(g.replay)
    user.replay()
    g.wait()
    dsync()
    first = t[:2].tolist()
    during = dbg("ipc_blocks")
    del g
    gc.collect()
    fc.barrier(group=host)
    kept = dbg("ipc_blocks")
    user.replay()  # after the plan is gone, on both sides
    dsync()
    fc.barrier(group=host)
    user.drop()
    deadline = time.monotonic() + 10
    while dbg("ipc_blocks") > 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    # The user's graph let its hold go as CUDA lets user objects go, on a thread of CUDA's own
    # where no runtime call may be made: the rings went on fastcomm's threads, not there.
    return first, during, kept, dbg("ipc_blocks"), dbg("callback_calls")


def test_a_user_graph_run_after_its_linked_plan_is_dropped_ends_and_the_rings_go_with_it():
    for res in harness.run(_late_user_run_body, 2, timeout=60, env=LINKS, init_timeout=30):
        assert res == ([3.0, 3.0], 2, 2, 0, 0), res
