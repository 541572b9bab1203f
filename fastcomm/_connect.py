"""Connections to ranks on other hosts, made when first needed (docs/design.md, "Connections
across hosts").

The engine asks for a connection to a peer on another host the first time it has something to
send it, an op reads from it, or a group with it is made; it never waits for one. A thread here
takes those requests and, per peer, meets the peer through the store (each side sets a key, then
waits for the other's) and makes a two-rank Gloo process group with it, which it hands to the
engine. All of it runs off the engine's lock: that peer's messages wait, other peers' go on.
A rank therefore holds connections only to the peers it talks to, whatever the world size.

The peer hears of it through its list of requests in the store (asks/{peer}/k): a second
thread per rank waits on its own list and asks its engine for the connection too. So a message
reaches a peer even when no op of the peer reads from this rank (the first message of a
mismatched op, which the peer must see to fail its own). A peer that never answers (gone, or
stalled) is waited for until the engine stops; the ops that need it fail at their group's
timeout, naming it.
"""
from __future__ import annotations

import os
import threading
from datetime import timedelta
from typing import Optional

import torch.distributed as dist

# How long one wait on the store for the peer's key lasts before the thread looks whether the
# session stopped: grows from the first to the last, so that a peer that is slow to ask costs
# few store round trips and a shutdown waits at most the last.
_WAIT_SLICES = (1.0, 2.0, 4.0)
# The listener's wait for its next request: a session's whole life (stop() posts a last
# request to end it), so an idle rank makes no store round trips.
_LISTEN_WAIT = timedelta(days=7)


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


class Connector:
    """The session's connection maker: one thread taking the engine's requests, one short-lived
    thread per connection being made."""

    def __init__(self, engine, base_store: dist.Store, prefix: str, rank: int, timeout: timedelta):
        self._engine = engine
        self._base = base_store
        self._prefix = prefix + "gloo/"
        self._rank = rank
        self._timeout = timeout
        self._device = None if _rank_as_seq() else _device()
        self._stopped = threading.Event()
        self._lock = threading.Lock()
        self._made = 0  # connections handed to the engine
        self._asked_by = set()  # peers that asked this rank first (no need to ask them back)
        self._thread = threading.Thread(target=self._main, name="fc_gloo_connect", daemon=True)
        self._thread.start()
        self._listener = threading.Thread(target=self._listen, args=(self._client(),),
                                          name="fc_gloo_listen", daemon=True)
        self._listener.start()

    @property
    def made(self) -> int:
        return self._made

    def stop(self) -> None:
        """Stops asking; the engine's shutdown (which must follow) ends the request thread,
        a last request of this rank to itself the listener. Threads still waiting for a peer
        end at their next look (at most the last slice)."""
        self._stopped.set()
        try:
            # A peer still waiting to meet this rank (it holds something for it) stops waiting.
            self._base.set(f"{self._prefix}left/{self._rank}", "1")
            self._ask(self._rank, -1)
        except Exception:  # the store is gone (its server's process left): so is the wait
            pass
        self._listener.join(timeout=1.0)

    def _client(self) -> dist.Store:
        """A store client of its own: a wait holds its client for the wait's length, and the
        session and the other connections being made must not queue behind it."""
        try:
            return self._base.clone()
        except Exception:  # a store without clone(): shared, the waits then take turns
            return self._base

    def _ask(self, peer: int, who: int) -> None:
        """Appends `who` to `peer`'s list of requests (two round trips)."""
        store = dist.PrefixStore(f"{self._prefix}asks/{peer}/", self._base)
        k = store.add("n", 1)
        store.set(str(k), str(who))

    def _listen(self, client: dist.Store) -> None:
        """Takes this rank's requests in order; asks the engine for a connection to each
        asker (a no-op if it has asked already). Ends at the request of -1 (stop())."""
        store = dist.PrefixStore(f"{self._prefix}asks/{self._rank}/", client)
        shared = client is self._base
        k = 1
        try:
            while True:
                try:
                    store.wait([str(k)], timedelta(seconds=1) if shared else _LISTEN_WAIT)
                except dist.DistStoreError as e:
                    if "timeout" not in str(e).lower() or self._stopped.is_set():
                        return
                    continue
                peer = int(store.get(str(k)))
                k += 1
                if peer < 0 or self._stopped.is_set():
                    return
                with self._lock:
                    self._asked_by.add(peer)
                self._engine.gloo_connect(peer)
        except Exception:  # the store is gone: the job is ending
            return

    def _main(self) -> None:
        while True:
            peers = self._engine.gloo_wanted()  # blocks without the GIL; empty once stopping
            if not peers or self._stopped.is_set():
                return
            for peer in peers:
                threading.Thread(target=self._connect, args=(peer,), name="fc_gloo_connect",
                                 daemon=True).start()

    def _meet(self, peer: int, lo: int, hi: int) -> bool:
        """Asks the peer (unless it asked first), sets this rank's key and waits for the
        peer's; False if the session stopped first. The waits are on a client of its own
        (closed after)."""
        with self._lock:
            asked = peer in self._asked_by
        if not asked:
            self._ask(peer, self._rank)
        # (Held here: a store written in Python lives only while its Python object does.)
        client = self._client()
        store = dist.PrefixStore(f"{self._prefix}{lo}-{hi}/", client)
        store.set(f"here/{self._rank}", "1")
        left = dist.PrefixStore(f"{self._prefix}left/", client)
        slices = iter(_WAIT_SLICES)
        wait = next(slices)
        while not self._stopped.is_set():
            try:
                store.wait([f"here/{peer}"], timedelta(seconds=wait))
                return True
            except dist.DistStoreError as e:
                if "timeout" not in str(e).lower():
                    raise
                if left.check([str(peer)]):
                    raise RuntimeError(f"rank {peer} shut down before it connected to rank {self._rank}")
                wait = next(slices, wait)
        return False

    def _connect(self, peer: int) -> None:
        lo, hi = min(self._rank, peer), max(self._rank, peer)
        pg: Optional[dist.ProcessGroup] = None
        try:
            if not self._meet(peer, lo, hi) or self._stopped.is_set():
                return
            # Both sides are here: the process group connects at once. Its timeout bounds only
            # the connecting (the transport waits on its transfers with its own bound).
            opts = dist.ProcessGroupGloo._Options()
            opts._timeout = self._timeout
            opts._threads = 1
            opts._devices = [self._device if self._device is not None else _device()]
            # (On the session's client: the group keeps its store, and needs it only now.)
            store = dist.PrefixStore(f"{self._prefix}{lo}-{hi}/pg/", self._base)
            pg = dist.ProcessGroupGloo(store, 0 if self._rank == lo else 1, 2, opts)
            if self._engine.gloo_attach(peer, pg, 1 if self._rank == lo else 0):
                with self._lock:
                    self._made += 1
        except Exception as e:
            if not self._stopped.is_set():
                self._engine.gloo_attach_failed(peer, f"{type(e).__name__}: {e}")
