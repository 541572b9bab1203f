"""Connections to ranks on other hosts, made when first needed (docs/design.md, "Connections
across hosts").

The engine asks for a connection to a peer on another host the first time it sends to it, reads
from it or starts a bulk transfer; it never waits for one. Each rank has a list of requests in
the store (asks/{rank}/k). To meet a peer, a rank puts its own rank in the peer's list; the
connector reads its own list in order and asks its engine for a connection to each rank it
finds there, which puts this rank in that rank's list in turn. Once a rank has both put itself
in the peer's list and read the peer in its own, the two are met: both make a two-rank Gloo
process group and hand it to the engine. All of it runs off the engine's lock: that peer's
messages wait, other peers' go on. A rank therefore holds connections only to the peers it
talks to, whatever the world size.

The list is read while a meeting is under way, and when the engine says an op has waited long
(a peer may then be asking for a connection this rank does not want itself: a mismatched op's
message, which this rank must see to fail its own, or an any-source receive's sender). An idle
rank makes no store round trips, and fastcomm opens no store connection of its own: the store's
server takes each new client on its one thread, behind a reverse lookup of its address
(docs/benchmarks.md). Nothing blocks on the session's client either (the user's torch shares
it): reads of the list and the process groups' address exchange poll.
"""
from __future__ import annotations

import os
import threading
import time
from datetime import timedelta
from typing import Optional

import torch.distributed as dist

# Reads of the list while a meeting is under way: the first soon, then further apart.
_FIRST_READ = 0.002
_LAST_READ = 0.5
# Reads the engine asks for (an op waits long): further apart while they find nothing, so
# that ranks waiting long (on a slow peer, say) load the store little.
_FIRST_LOOK = 0.05
_LAST_LOOK = 5.0
# A request that says its sender left before meeting the reader: -(rank + 2).


def _device():
    """One Gloo device (one listening socket, one event-loop thread) for every connection of
    the session. GLOO_SOCKET_IFNAME may list several interfaces; one connection per peer
    means the first (bulk transfers and the closing handshake must share the frames' link)."""
    ifnames = [n for n in os.environ.get("GLOO_SOCKET_IFNAME", "").split(",") if n]
    if ifnames:
        return dist.ProcessGroupGloo.create_device(interface=ifnames[0], lazy_init=False)
    return dist.ProcessGroupGloo.create_default_device(lazy_init=False)


def _rank_as_seq() -> bool:
    # Gloo then numbers a context's connections by rank, the same in every two-rank context:
    # contexts sharing one device could not tell theirs apart.
    return os.environ.get("GLOO_ENABLE_RANK_AS_SEQUENCE_NUMBER", "") in ("1", "True")


class _PollingStore(dist.Store):
    """The session's client for a two-rank group's address exchange, with waits that poll
    rather than hold the client: a held client would make a rank's other connections (and
    through them its peers') wait on this one, a cycle once they form a ring."""

    def __init__(self, inner: dist.Store, stopped: threading.Event, timeout: timedelta):
        super().__init__()
        self._inner = inner
        self._stopped = stopped
        self._timeout = timeout

    def _await(self, keys, timeout=None) -> None:
        limit = time.monotonic() + (timeout or self._timeout).total_seconds()
        pause = 0.002
        while not self._inner.check(keys):
            if self._stopped.is_set():
                raise RuntimeError("fastcomm is shutting down")
            if time.monotonic() > limit:
                raise dist.DistStoreError(f"wait timeout for keys {keys}")
            time.sleep(pause)
            pause = min(pause * 2, 0.05)

    def set(self, key, value):
        self._inner.set(key, value)

    def get(self, key):
        self._await([key])
        return self._inner.get(key)

    def wait(self, keys, timeout=None):
        self._await(keys, timeout)

    def check(self, keys):
        return self._inner.check(keys)

    def add(self, key, value):
        return self._inner.add(key, value)

    def multi_set(self, keys, values):
        self._inner.multi_set(keys, values)

    def multi_get(self, keys):
        self._await(keys)
        return self._inner.multi_get(keys)

    def append(self, key, value):
        self._inner.append(key, value)

    def compare_set(self, key, expected, desired):
        return self._inner.compare_set(key, expected, desired)

    def delete_key(self, key):
        return self._inner.delete_key(key)

    def num_keys(self):
        return self._inner.num_keys()

    def set_timeout(self, timeout):
        self._timeout = timeout

    def has_extended_api(self):
        return True


class Connector:
    """The session's connection maker: a thread taking the engine's requests and reading this
    rank's list, and one short-lived thread per connection being made."""

    def __init__(self, engine, base_store: dist.Store, prefix: str, rank: int, timeout: timedelta):
        self._engine = engine
        self._base = base_store
        self._prefix = prefix + "gloo/"
        self._rank = rank
        self._timeout = timeout
        self._device = None if _rank_as_seq() else _device()
        self._stopped = threading.Event()
        self._lock = threading.Lock()
        # Under _lock: peers this rank has put itself in the list of (with when), peers read
        # in its own list, and peers met (their group is being made or made).
        self._posted = {}
        self._heard = set()
        self._met = set()
        self._next = 1  # the next entry of this rank's list to read (the connector's thread)
        self._made = 0  # connections handed to the engine
        # The process groups' store. Held here for the session: a store written in Python
        # lives only while its Python object does, and the groups keep theirs.
        self._polling = _PollingStore(base_store, self._stopped, timeout)
        self._thread = threading.Thread(target=self._main, name="fc_gloo_connect", daemon=True)
        self._thread.start()

    @property
    def made(self) -> int:
        return self._made

    def stop(self) -> None:
        """Stops meeting peers (after the engine's shutdown, which ends the connector's thread)
        and tells the peers that put themselves in this rank's list and were not met that it
        left."""
        self._stopped.set()
        self._thread.join(timeout=1.0)
        try:
            # A peer that puts itself in this rank's list from now on looks here and gives up;
            # one that did before is in the list, read below.
            self._base.set(f"{self._prefix}left/{self._rank}", "1")
            self._read_list()
            with self._lock:
                waiting = sorted(self._heard - self._met)
            for peer in waiting:
                self._post(peer, -(self._rank + 2))
        except Exception:  # the store is gone (its server's process left): so is the wait
            pass

    def _post(self, peer: int, value: int) -> None:
        """Appends `value` to `peer`'s list of requests (two round trips)."""
        store = dist.PrefixStore(f"{self._prefix}asks/{peer}/", self._base)
        k = store.add("n", 1)
        store.set(str(k), str(value))

    def _read_list(self) -> bool:
        """Reads the entries of this rank's list that are there (one round trip when there is
        none); True if there was one."""
        store = dist.PrefixStore(f"{self._prefix}asks/{self._rank}/", self._base)
        found = False
        while store.check([str(self._next)]):
            value = int(store.get(str(self._next)))
            self._next += 1
            found = True
            if value >= 0:
                self._heard_from(value)
                continue
            peer = -value - 2
            with self._lock:
                gone = peer not in self._met
                self._posted.pop(peer, None)
            if gone:
                self._engine.gloo_attach_failed(
                    peer, f"rank {peer} shut down before it connected to rank {self._rank}")
        return found

    def _heard_from(self, peer: int) -> None:
        with self._lock:
            self._heard.add(peer)
            meet = not self._stopped.is_set() and peer in self._posted and peer not in self._met
            if meet:
                self._met.add(peer)
                del self._posted[peer]
        if meet:
            self._start(peer)
        elif not self._stopped.is_set():
            self._engine.gloo_connect(peer)  # a no-op if it asked already

    def _meetings(self) -> float:
        """The longest pause between reads of the list while meetings are under way (0: none
        is): reads stay frequent for a peer asked within init's timeout, and slow to the pace
        of the engine's looks for one asked before (gone, or much later than this rank: a group
        may have a longer timeout than init)."""
        now = time.monotonic()
        with self._lock:
            if not self._posted:
                return 0.0
            young = any(now - t <= self._timeout.total_seconds() for t in self._posted.values())
        return _LAST_READ if young else _LAST_LOOK

    def _main(self) -> None:
        pause, next_read = _FIRST_READ, 0.0  # reads for meetings under way
        look_pause, last_look, last_asked = _FIRST_LOOK, 0.0, 0.0  # reads the engine asks for
        try:
            while True:
                longest = self._meetings()
                wait_ms = int(max(0.0, next_read - time.monotonic()) * 1000) if longest else -1
                peers, look, stopping = self._engine.gloo_wanted(wait_ms)
                if stopping or self._stopped.is_set():
                    return
                for peer in peers:
                    self._ask(peer)
                now = time.monotonic()
                due = longest > 0 and now >= next_read
                if look:
                    if now - last_asked > 1.0:  # a new wait: look soon again
                        look_pause = _FIRST_LOOK
                    last_asked = now
                    look = now - last_look >= look_pause
                if peers or due or look:
                    found = self._read_list()
                    if look:
                        last_look = now
                        look_pause = _FIRST_LOOK if found else min(look_pause * 2, _LAST_LOOK)
                    pause = _FIRST_READ if found or peers else min(pause * 2, longest or _LAST_READ)
                    next_read = now + pause
        except Exception:  # the store is gone: the job is ending
            return

    def _ask(self, peer: int) -> None:
        try:
            self._post(peer, self._rank)
            # (After the post: a peer that leaves later reads it and answers that it left.)
            if self._base.check([f"{self._prefix}left/{peer}"]):
                raise RuntimeError(f"rank {peer} shut down before it connected to rank {self._rank}")
        except Exception as e:
            if not self._stopped.is_set():
                self._engine.gloo_attach_failed(peer, f"{type(e).__name__}: {e}")
            return
        with self._lock:
            meet = peer in self._heard and peer not in self._met
            if meet:
                self._met.add(peer)
            else:
                self._posted[peer] = time.monotonic()
        if meet:
            self._start(peer)

    def _start(self, peer: int) -> None:
        threading.Thread(target=self._connect, args=(peer,), name="fc_gloo_connect", daemon=True).start()

    def _connect(self, peer: int) -> None:
        """Both sides are met: the process group connects at once. Its timeout bounds only the
        connecting (the transport waits on its transfers with its own bound)."""
        lo, hi = min(self._rank, peer), max(self._rank, peer)
        try:
            opts = dist.ProcessGroupGloo._Options()
            opts._timeout = self._timeout
            opts._threads = 1
            opts._devices = [self._device if self._device is not None else _device()]
            store = dist.PrefixStore(f"{self._prefix}{lo}-{hi}/pg/", self._polling)
            pg: Optional[dist.ProcessGroup] = dist.ProcessGroupGloo(store, 0 if self._rank == lo else 1, 2, opts)
            if self._engine.gloo_attach(peer, pg, 1 if self._rank == lo else 0):
                with self._lock:
                    self._made += 1
        except Exception as e:
            if not self._stopped.is_set():
                self._engine.gloo_attach_failed(peer, f"{type(e).__name__}: {e}")
