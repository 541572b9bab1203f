"""Ranks spread over simulated hosts (what test_cross_host*.py and test_lazy_connect.py share).

Hosts are simulated on one machine with FASTCOMM_HOST_ID, set per rank before fc.init: ranks
with different ids never use each other's shared memory, only the world-level Gloo process
group. Layouts: ALTERNATE puts even ranks on host A and odd ranks on host B, so every pair [0, 1],
[2, 3], every ring neighbour pair and the reduce-scatter partners cross hosts, while triples
and the world are mixed. SPLIT puts [0, 1] on A and [2, 3] on B; EVERY gives each rank a host
of its own (everything through Gloo); THREE puts ranks 0 and 2 on A, 1 and 3 on hosts of their
own."""
from __future__ import annotations

import os

import harness
import _helpers

import fastcomm as fc

RING_ENV = {"FASTCOMM_SHM_RING_BYTES": "65536"}  # max_payload ~16 KiB: multi-piece ops are cheap
ALTERNATE = ["A", "B", "A", "B"]
SPLIT = ["A", "A", "B", "B"]
EVERY = ["A", "B", "C", "D"]
THREE = ["A", "B", "A", "C"]  # three hosts, two members on one


def _on_hosts(rank, world, hosts, timeout, body, *args):
    os.environ["FASTCOMM_HOST_ID"] = f"host-{hosts[rank]}"
    _helpers.HOSTS = hosts
    harness.init_child(rank, world, timeout=timeout)
    try:
        return body(rank, world, *args)
    finally:
        fc.shutdown()


def run(body, world, *args, hosts=ALTERNATE, op_timeout=30.0, **kw):
    kw.setdefault("timeout", 120)
    kw.setdefault("env", RING_ENV)
    return harness.run(_on_hosts, world, hosts, op_timeout, body, *args, init=False, **kw)
# Every span of one byte or more as a bulk transfer: the other Gloo path.
BULK_ENV = {**RING_ENV, "FASTCOMM_GLOO_BULK_BYTES": "1"}
