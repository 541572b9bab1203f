"""Store operations per rank at fastcomm.init, counted by a store that wraps each rank's
TCPStore client.

    .venv/bin/python benchmarks/init_store_ops.py --world 4 8 --hosts-of every pairs one

For each world size and host layout (``every``: a simulated host per rank, FASTCOMM_HOST_ID;
``pairs``: two ranks a host; ``one``: one host) it starts the ranks as processes, runs
``fastcomm.init`` on each and prints, per rank (the median rank / the most any rank paid): round trips to the store and
keys they name and bytes they read, for fastcomm's own keys and, apart, for the Gloo process group's (cross-host
layouts only; Gloo's eager full mesh is its own cost, not fastcomm's rendezvous)."""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
from datetime import timedelta

import torch.distributed as dist


class CountingStore(dist.Store):
    """Forwards every call to ``inner`` and counts it: calls (round trips) and keys named,
    split by whether the key is Gloo's (``.../gloo/...``)."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.counts = {"fastcomm": [0, 0, 0], "gloo": [0, 0, 0]}  # calls, keys, bytes read

    def _count(self, keys, read=b""):
        kind = "gloo" if any("/gloo/" in f"/{k}" for k in keys) else "fastcomm"
        self.counts[kind][0] += 1
        self.counts[kind][1] += len(keys)
        self.counts[kind][2] += len(read)
        return read

    def set(self, key, value):
        self._count([key])
        return self.inner.set(key, value)

    def get(self, key):
        return self._count([key], self.inner.get(key))

    def add(self, key, value):
        self._count([key])
        return self.inner.add(key, value)

    def compare_set(self, key, expected, desired):
        self._count([key])
        return self.inner.compare_set(key, expected, desired)

    def check(self, keys):
        self._count(keys)
        return self.inner.check(keys)

    def wait(self, keys, timeout=None):
        self._count(keys)
        return self.inner.wait(keys) if timeout is None else self.inner.wait(keys, timeout)

    def multi_get(self, keys):
        values = self.inner.multi_get(keys)
        self._count(keys, b"".join(values))
        return values

    def multi_set(self, keys, values):
        self._count(keys)
        return self.inner.multi_set(keys, values)

    def append(self, key, value):
        self._count([key])
        return self.inner.append(key, value)

    def delete_key(self, key):
        self._count([key])
        return self.inner.delete_key(key)

    def num_keys(self):
        return self.inner.num_keys()

    def set_timeout(self, timeout):
        return self.inner.set_timeout(timeout)

    def has_extended_api(self):
        return True

    def clone(self):
        """Another client of the same server, counted with this one."""
        c = CountingStore(self.inner.clone())
        c.counts = self.counts
        self._count(["clone"])  # the new client's connection: a round trip
        return c


def _rank(rank, world, host, port, out):
    os.environ["FASTCOMM_HOST_ID"] = host
    import fastcomm as fc

    tcp = dist.TCPStore("127.0.0.1", port, world, False, timeout=timedelta(seconds=60))
    store = CountingStore(tcp)
    fc.init(store=store, rank=rank, world_size=world, timeout=timedelta(seconds=60))
    fc.shutdown()
    out.put((rank, store.counts))


def measure(world, layout):
    hosts = {"every": lambda r: f"h{r}", "pairs": lambda r: f"h{r // 2}", "one": lambda r: "h"}[layout]
    server = dist.TCPStore("127.0.0.1", 0, world, True, timeout=timedelta(seconds=60),
                           wait_for_workers=False)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, world, hosts(r), server.port, out)) for r in range(world)]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=300) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    # The median rank, and the most any rank paid (the rank that publishes the layout).
    return {k: [[sorted(results[r][k][i] for r in results)[world // 2] for i in range(3)],
                [max(results[r][k][i] for r in results) for i in range(3)]]
            for k in ("fastcomm", "gloo")}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--hosts-of", nargs="+", default=["every", "pairs", "one"])
    a = ap.parse_args()
    print(f"{'world':>5} {'hosts':>6} | {'fastcomm calls':>14} {'keys':>5} {'bytes read':>10} | "
          f"{'gloo calls':>10} {'keys':>5} {'bytes read':>10}   (per rank: median rank / max over ranks)")
    for w in a.world:
        for layout in a.hosts_of:
            c = measure(w, layout)
            f, g = ([f"{m}/{x}" for m, x in zip(*c[k])] for k in ("fastcomm", "gloo"))
            print(f"{w:>5} {layout:>6} | {f[0]:>14} {f[1]:>5} {f[2]:>10} | {g[0]:>10} {g[1]:>5} {g[2]:>10}",
                  flush=True)

if __name__ == "__main__":
    main()
