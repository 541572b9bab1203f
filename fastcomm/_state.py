"""Process-wide engine state: rendezvous, groups, shutdown.

The rendezvous is the only world-wide step: every rank publishes its host identity and pid
once through a c10d Store and counts itself in; the last to arrive publishes the job's layout
(token, every host's ranks) and each host's pids. Then every rank creates its shared-memory
segment, attaches its same-host peers' segments and, once all of them have attached, unlinks
its own name (so no crash can leave a segment behind). After that, groups are made by their
members alone.
"""
from __future__ import annotations

import atexit
import hashlib
import json
import os
import secrets
import socket
import threading
from datetime import timedelta
from typing import Iterable, List, Optional, Sequence

import torch.distributed as dist

from . import _C, _connect

_lock = threading.Lock()
_engine: Optional[_C.Engine] = None
_world: Optional["Group"] = None
_gloo = None  # the session's Gloo connector (fastcomm/_connect.py), when the job spans hosts
_generation = 0  # how many times this process called init(); keys each rendezvous apart
_token: Optional[str] = None  # the job's random token of the current session (names its segments)

DEFAULT_TIMEOUT = timedelta(seconds=300)


class Group:
    """A small process group. Mirrors the parts of torch's ProcessGroup users touch:
    ``rank()`` (this process's rank in the group, -1 for a non-member), ``size()``, ``ranks``."""

    __slots__ = ("_h",)

    def __init__(self, handle: _C.GroupHandle):
        self._h = handle

    @property
    def ranks(self) -> List[int]:
        return list(self._h.ranks)

    @property
    def is_member(self) -> bool:
        return self._h.is_member

    def rank(self) -> int:
        return self._h.rank

    def size(self) -> int:
        return len(self._h.ranks)

    def __repr__(self) -> str:
        return f"fastcomm.Group(ranks={self.ranks}, rank={self.rank()})"


def _host_identity(settings: _C.Settings) -> str:
    """Ranks with equal identities share /dev/shm and can see each other's pids."""
    if settings.host_id:
        return settings.host_id
    parts = [socket.gethostname()]
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            parts.append(f.read().strip())
    except OSError:
        pass
    for ns in ("pid", "ipc"):
        try:
            parts.append(os.readlink(f"/proc/self/ns/{ns}"))
        except OSError:
            pass
    try:
        st = os.stat("/dev/shm")
        parts.append(f"{st.st_dev}:{st.st_ino}")
    except OSError:
        pass
    return "|".join(parts)


def _to_timedelta(timeout) -> timedelta:
    if timeout is None:
        return DEFAULT_TIMEOUT
    if isinstance(timeout, timedelta):
        return timeout
    return timedelta(seconds=float(timeout))


def init(timeout=None, store: Optional[dist.Store] = None, rank: Optional[int] = None,
         world_size: Optional[int] = None) -> None:
    """Starts this process's engine. Uses ``store`` if given, else torch.distributed's default
    store when it is initialized, else env:// (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)."""
    global _engine, _world, _generation
    timeout = _to_timedelta(timeout)
    _live()
    with _lock:
        if _engine is not None:
            raise RuntimeError(f"fastcomm: rank {_engine.rank}: init() called twice without shutdown()")
        if store is None:
            if dist.is_available() and dist.is_initialized():
                store = dist.distributed_c10d._get_default_store()
                for name, given, theirs in (("rank", rank, dist.get_rank()),
                                            ("world_size", world_size, dist.get_world_size())):
                    if given is not None and given != theirs:
                        raise ValueError(f"fastcomm.init: argument '{name}' is {given}, but torch.distributed "
                                         f"was initialized with {name} {theirs} (fastcomm uses its store)")
                rank, world_size = dist.get_rank(), dist.get_world_size()
            else:
                # As init_process_group: the arguments stand in for RANK and WORLD_SIZE.
                query = "&".join(f"{k}={v}" for k, v in (("rank", rank), ("world_size", world_size)) if v is not None)
                url = "env://" + ("?" + query if query else "")
                store, rank, world_size = next(dist.rendezvous(url, timeout=timeout))
        elif rank is None or world_size is None:
            raise ValueError("fastcomm.init: 'rank' and 'world_size' are required with 'store'")
        _generation += 1
        prefix = _store_prefix(_generation)
        engine = _rendezvous(dist.PrefixStore(prefix, store), rank, world_size, timeout, store, prefix)
        try:
            world = engine.new_group(list(range(world_size)))
        except Exception:
            engine.shutdown()
            raise
        _engine, _world = engine, Group(world)
        _C.set_current(engine, world)


def _store_prefix(generation: int) -> str:
    """Where one init() keeps its keys. Under torchrun a restarted attempt shares the agent's
    store with the attempts before it, whose keys are still there: the run id and restart
    count keep the attempts apart, as the generation keeps this process's inits apart."""
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if restart is None:
        return f"fastcomm/{generation}/"
    return f"fastcomm/{os.environ.get('TORCHELASTIC_RUN_ID', '')}/{restart}/{generation}/"


def _host_key(identity: str) -> str:
    return "host/" + hashlib.sha256(identity.encode()).hexdigest()[:32]


def _ranges(ranks: List[int]) -> List[List[int]]:
    """Sorted ranks as [first, last] runs: a host's ranks are one run under torchrun."""
    out: List[List[int]] = []
    for r in ranks:
        if out and out[-1][1] == r - 1:
            out[-1][1] = r
        else:
            out.append([r, r])
    return out


def _publish_layout(store: dist.Store, world: int) -> None:
    """Run by the last rank to arrive, when every rank's entry is in: the token, every host's
    ranks as runs (the layout, read by all) and each host's ranks and pids (read by that host's
    ranks), so no rank reads more than the host count plus its own host's entries."""
    infos = [v.decode().split("\n", 2) for v in store.multi_get([f"peer/{r}" for r in range(world)])]
    hosts: dict = {}
    for r, (pid, _, identity) in enumerate(infos):
        hosts.setdefault(identity, []).append([r, int(pid)])
    rings = [int(ring) for _, ring, _ in infos]
    odd = next((r for r in range(world) if rings[r] != rings[0]), None)
    layout = {
        "token": secrets.token_hex(16),
        "hosts": [_ranges([r for r, _ in members]) for members in hosts.values()],
        # The ring size fixes the piece size every op is cut into, and across hosts the largest
        # frame a peer must be ready for: members that disagree would fail mid-op, obscurely.
        "ring": None if odd is None else [rings[0], odd, rings[odd]],
    }
    keys = ["layout", "token"] + [_host_key(identity) for identity in hosts]
    values = [json.dumps(layout), layout["token"]] + [json.dumps(m) for m in hosts.values()]
    store.multi_set(keys, values)


def _count_in(store: dist.Store, key: str, n: int, timeout: timedelta) -> None:
    """Waits until ``n`` ranks have called this with ``key``: a counter and one key its last
    caller sets, so a rank waits on one key, not on one per rank."""
    if store.add(key, 1) == n:
        store.set(key + "/all", "1")
    store.wait([key + "/all"], timeout)


def _rendezvous(store: dist.Store, rank: int, world: int, timeout: timedelta, base: dist.Store,
                prefix: str) -> _C.Engine:
    settings = _C.Settings.from_env()  # every FASTCOMM_* variable, parsed once
    ring_bytes = settings.ring_bytes
    identity = _host_identity(settings)
    store.set(f"peer/{rank}", f"{os.getpid()}\n{ring_bytes}\n{identity}")
    # Each rank's entry is in before its add returns, so the last to arrive sees them all.
    if store.add("arrived", 1) == world:
        _publish_layout(store, world)
    try:
        store.wait(["layout"], timeout)
    except Exception as e:
        try:
            arrived = store.add("arrived", 0)
        except Exception:
            arrived = "not all"
        raise RuntimeError(f"fastcomm.init: rank {rank}: {arrived} of {world} ranks arrived within "
                           f"the timeout ({timeout}): {e}") from e
    host_key = _host_key(identity)
    raw_layout, raw_local = store.multi_get(["layout", host_key])
    layout, local_pids = json.loads(raw_layout), json.loads(raw_local)
    if layout["ring"] is not None:
        first, odd, theirs = layout["ring"]
        other, value = (odd, theirs) if ring_bytes == first else (0, first)
        raise ValueError(
            f"fastcomm.init: rank {rank}: FASTCOMM_SHM_RING_BYTES is {ring_bytes} here but "
            f"{value} on rank {other}; it must be equal on every rank")
    token = layout["token"]
    global _token
    _token = token
    host_of = [0] * world
    for h, runs in enumerate(layout["hosts"]):
        for first, last in runs:
            host_of[first:last + 1] = [h] * (last - first + 1)
    # Only same-host peers' pids are known (and needed: liveness and segment checks).
    pids = [0] * world
    for r, pid in local_pids:
        pids[r] = pid

    engine = _C.Engine(rank, world, token, host_of, pids,
                       timeout_ms=int(timeout.total_seconds() * 1000), settings=settings)
    try:
        _count_in(store, f"created/{host_key}", len(local_pids), timeout)
        engine.attach_peers()
        _count_in(store, f"attached/{host_key}", len(local_pids), timeout)
    except BaseException:
        # Unlinks every local rank's segment name, ours and those of ranks that died before
        # they could unlink theirs: nothing may outlive a failed init.
        engine.abandon_init()
        raise
    engine.unlink_segment()
    if len(local_pids) > 1 and settings.exit_idle:
        _exit_politely()
    global _gloo
    _gloo = None
    if len(layout["hosts"]) > 1:
        # No connection yet: each is made when first needed (fastcomm/_connect.py).
        try:
            engine.start_gloo()
            _gloo = _connect.Connector(engine, base, prefix, rank, timeout)
        except BaseException:
            engine.shutdown()
            raise
    return engine


_exit_idle = False  # whether this process's exit runs under SCHED_IDLE (set by a rendezvous)


def _exit_politely() -> None:
    """Makes this process's teardown at interpreter exit yield the CPU to any rank that wakes. A
    rank that exits while same-host peers still run spends up to a second of CPU there (the
    garbage collector over torch's modules, their teardown); at full priority that comes out of
    its peers' share of the cores. Registered once per process: atexit handlers run last-in
    first-out, so this runs before shutdown() and before the handlers torch registered at import."""
    global _exit_idle
    if not _exit_idle:
        _exit_idle = True
        atexit.register(_idle_from_here)


def _idle_from_here() -> None:
    # SCHED_IDLE rather than nice 19: a thread that wakes preempts an idle-policy thread at
    # once, where a niced one keeps the CPU up to a slice, and a pair waits that long per op.
    # On Linux both apply to the calling thread, the one that finalizes the interpreter.
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (OSError, AttributeError):  # no SCHED_IDLE here, or refused
        try:
            os.setpriority(os.PRIO_PROCESS, 0, 19)
        except (OSError, AttributeError):
            pass


def _live() -> Optional[_C.Engine]:
    """The engine, unless it was shut down underneath us (by the torch.distributed backend
    when torch destroyed the process group that started it)."""
    global _engine, _world
    e = _engine
    if e is not None and e.is_shut_down:
        with _lock:
            if _engine is e:
                _engine, _world = None, None
                _C.set_current(None, None)
        e = None
    return e


def _require(api: str) -> _C.Engine:
    e = _live()
    if e is None:
        raise RuntimeError(f"fastcomm.{api}: fastcomm is not initialized (call fastcomm.init() "
                           f"first; after shutdown() call it again)")
    return e


def is_initialized() -> bool:
    return _live() is not None


def _group_arg(group, api: str) -> "Group":
    if not isinstance(group, Group):
        raise TypeError(f"fastcomm.{api}: argument 'group' must be a fastcomm.Group (from fastcomm.new_group), "
                        f"got {type(group).__name__}")
    return group


def get_rank(group: Optional["Group"] = None) -> int:
    """This process's rank in the world, or in ``group`` (-1 where it is not a member), as torch's."""
    e = _require("get_rank")
    return e.rank if group is None else _group_arg(group, "get_rank").rank()


def get_world_size(group: Optional["Group"] = None) -> int:
    """The world's size, or ``group``'s (-1 where this process is not a member), as torch's."""
    e = _require("get_world_size")
    if group is None:
        return e.world_size
    g = _group_arg(group, "get_world_size")
    return g.size() if g.is_member else -1


def world() -> Group:
    _require("world")
    return _world


def _group_timeout_ms(e: _C.Engine, api: str, ranks, timeout) -> int:
    """A group's timeout (timedelta or seconds) in ms for the engine; 0 = init's."""
    if timeout is None:
        return 0
    secs = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
    if not secs > 0:
        raise ValueError(f"fastcomm.{api}: rank {e.rank}, group {ranks}: argument 'timeout' must be "
                         f"positive, got {timeout!r}")
    return max(1, int(secs * 1000))


def new_group(ranks: Iterable[int], timeout=None) -> Group:
    """Creates a group. Only its members call this, in the same order relative to their other
    new_group calls; nothing is sent to any other process. ``timeout`` (timedelta or seconds):
    how long each op of the group may take before it fails; None = init's timeout."""
    e = _require("new_group")
    ranks = [int(r) for r in ranks]
    g = e.new_group(ranks, _group_timeout_ms(e, "new_group", ranks, timeout))
    if not g.is_member:
        raise ValueError(f"fastcomm.new_group: rank {e.rank} is not in argument 'ranks' {ranks}; "
                         f"only members create a group (new_groups takes lists for everyone)")
    return Group(g)


def new_groups(lists: Sequence[Iterable[int]], timeout=None) -> List[Group]:
    """Creates many groups at once from the same list on every caller. Entries this rank is not
    in come back as non-member groups (``rank() == -1``) that refuse collectives. ``timeout``:
    as for new_group, for every group made."""
    e = _require("new_groups")
    lists = [[int(r) for r in ranks] for ranks in lists]
    return [Group(h) for h in e.new_groups(lists, _group_timeout_ms(e, "new_groups", lists, timeout))]


def init_cuda(device=None) -> None:
    """Starts the CUDA device engine now instead of at the first CUDA op. Not collective: the
    NCCL channel to each peer is made at the first op with it. ``device``: an index or
    torch.device; default the current CUDA device."""
    import torch

    e = _require("init_cuda")
    if device is None:
        device = torch.cuda.current_device()
    dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if dev.type != "cuda":
        raise ValueError(f"fastcomm.init_cuda: rank {e.rank}: argument 'device' must be a CUDA device, got {dev}")
    # torch.device("cuda") has no index: it means the current device, as torch reads it.
    e.init_cuda(dev.index if dev.index is not None else torch.cuda.current_device())


def has_nccl() -> bool:
    """Whether this build has the NCCL path for CUDA tensors."""
    return bool(_C.has_nccl)


def shutdown() -> None:
    """Fails pending ops, stops the engine's thread and releases its shared memory."""
    global _engine, _world
    with _lock:
        e, _engine, _world = _engine, None, None
        _C.set_current(None, None)
    if e is not None:
        global _gloo, _token
        connector, _gloo, _token = _gloo, None, None
        # The connector runs on through the engine's shutdown: data held for a peer whose
        # connection is being made goes out in its closing handshake.
        e.shutdown()
        if connector is not None:
            connector.stop()


atexit.register(shutdown)
