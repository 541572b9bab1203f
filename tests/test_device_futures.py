"""Futures of device ops (on the fake device runtime): their callbacks run one at a time, in the
order the ops complete, as on the host path. Ops that callbacks issue are then issued in the same
order on every rank. Before, a callback that blocked got a new thread for the next one, so
callbacks ran side by side and their ops met the wrong ops of the peer (no error: the same
collective, dtype and size). A callback may still wait for the Future of an op it issued (DDP's
PowerSGD hook does): those complete on threads of their own."""
from __future__ import annotations

import threading

import pytest

import harness
from _device import channels
from test_device_streams import FAKE, dsync

import torch

import fastcomm as fc

N = 40


def _ordered_body(rank, world, nested_future):
    g, h = fc.new_group([0, 1]), fc.new_group([0, 1])
    got, ended, threads = {}, [], set()
    for i in range(N):
        ev = threading.Event()
        ended.append(ev)

        def cb(_fut, i=i, ev=ev):
            threads.add(threading.get_ident())
            t = torch.full((4,), float(rank + i))
            if nested_future:  # the callback waits for its own op's Future
                t = fc.all_reduce(t, group=h, async_op=True).get_future().wait()[0]
            else:
                fc.all_reduce(t, group=h)  # blocks the callback until its peer's op is agreed
            dsync()
            got[i] = t[0].item()
            ev.set()

        fc.all_reduce(torch.ones(4), group=g, async_op=True).get_future().then(cb)
    assert all(e.wait(60) for e in ended), "a callback never ended"
    wrong = {i: v for i, v in got.items() if v != 2 * i + 1}
    return len(wrong), len(threads)


@channels
@pytest.mark.parametrize("nested_future", [False, True], ids=["blocking", "future"])
def test_callbacks_run_one_at_a_time_in_completion_order(channel, nested_future):
    for wrong, threads in harness.run(_ordered_body, 2, nested_future, timeout=90, env={**FAKE, **channel}):
        assert wrong == 0 and threads == 1, (wrong, threads)
