"""What init costs a rank at the store: a constant number of calls and keys, whatever the world
size, except for the one rank that publishes the layout (it reads every rank's entry once).

Each rank's store is wrapped in benchmarks/init_store_ops.py's counting store; hosts are
simulated with FASTCOMM_HOST_ID, in layouts whose hosts hold interleaved ranks (several runs
per host), and the world's all_reduce (hierarchical over those hosts) must fold as
_helpers.all_reduce_ref says, so the layout the leader hands out is the one every rank uses."""
from __future__ import annotations

import os
import sys
from datetime import timedelta

import pytest
import torch

import harness
import _helpers
from _helpers import all_reduce_ref

import fastcomm as fc

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
from init_store_ops import CountingStore  # noqa: E402

LAYOUTS = {
    4: ["A", "B", "A", "C"],
    8: ["A", "B", "A", "C", "B", "A", "C", "D"],
}
# Per rank at init, whatever the world: entry, count, layout wait and read, two host-local
# counters and the cross-host one (each a count, perhaps the last caller's set, and a wait).
MAX_CALLS, MAX_KEYS = 14, 16


def _counted_init_body(rank, world, hosts):
    os.environ["FASTCOMM_HOST_ID"] = f"host-{hosts[rank]}"
    _helpers.HOSTS = hosts
    store = CountingStore(harness.child_store())
    fc.init(store=store, rank=rank, world_size=world, timeout=timedelta(seconds=30))
    try:
        counts = {k: list(v) for k, v in store.counts.items()}
        gen = torch.Generator().manual_seed(7)
        inputs = [torch.randn(33, generator=gen) for _ in range(world)]
        t = inputs[rank].clone()
        fc.all_reduce(t)
        torch.testing.assert_close(t, all_reduce_ref(inputs, list(range(world)), "SUM"),
                                   rtol=0, atol=0)
        pair = fc.new_group([0, 1]) if rank < 2 else None
        if pair is not None:
            x = torch.full((5,), float(rank + 1))
            fc.all_reduce(x, group=pair)
            assert torch.equal(x, torch.full((5,), 3.0))
        return counts["fastcomm"]
    finally:
        fc.shutdown()


@pytest.mark.parametrize("world", sorted(LAYOUTS))
def test_store_cost_per_rank_is_constant(world):
    counts = harness.run(_counted_init_body, world, LAYOUTS[world], init=False, timeout=120)
    keys = sorted(c[1] for c in counts)
    # One rank (the last to arrive) read every entry; no other read more than a constant.
    assert keys[-1] >= world, counts
    for calls, nkeys, _ in sorted(counts, key=lambda c: c[1])[:-1]:
        assert calls <= MAX_CALLS and nkeys <= MAX_KEYS, counts


def _missing_rank_body(rank, world):
    if rank == world - 1:
        return None  # never calls init
    with pytest.raises(RuntimeError, match=f"rank {rank}: {world - 1} of {world} ranks arrived"):
        harness.init_child(rank, world, timeout=2.0)
    assert not fc.is_initialized()
    return True


def test_a_rank_that_never_comes_is_counted_in_the_error():
    assert harness.run(_missing_rank_body, 3, init=False, timeout=60)[:2] == [True, True]
