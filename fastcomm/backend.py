"""fastcomm as a torch.distributed backend.

``import fastcomm`` registers a backend named ``"fastcomm"`` for CPU tensors, so that

    dist.init_process_group("fastcomm", ...)              # or "cpu:fastcomm,cuda:nccl"
    g = dist.new_group([0, 1], backend="fastcomm", use_local_synchronization=True)
    dist.all_reduce(t, group=g)

run on fastcomm's engine. Each torch process group gets a ``_C.FastcommBackend`` (a c10d
Backend written in C++) over one engine group of the same global ranks; its ops call the
engine and return the engine's own Work. Nothing on the op path runs Python.

Lifecycle: the world group's creation starts the engine through the store torch hands it
(``fastcomm.init``), unless this process has already initialized fastcomm, in which case it
reuses that engine. A backend that started the engine also shuts it down when torch shuts the
process group down (``dist.destroy_process_group()``); an engine the user started with
``fastcomm.init()`` stays the user's to shut down. A subgroup needs the engine to exist: its
members create it alone (``use_local_synchronization=True``), so there is no world-wide step
in which the engine could be started."""
from __future__ import annotations

from datetime import timedelta
from typing import Optional

import torch.distributed as dist

from . import _C, _state

BACKEND_NAME = "fastcomm"

# The engine the world backend started (so it is the one that shuts it down), if any.
_owned_engine: Optional[_C.Engine] = None


def _live_engine() -> Optional[_C.Engine]:
    """The engine, after dropping one left shut down by a destroyed process group."""
    e = _state._engine
    if e is not None and e.is_shut_down:
        _state.shutdown()  # clears the stale state; the engine itself is already down
        e = None
    return e


def _world_engine(store, rank: int, size: int, timeout: timedelta) -> tuple:
    """The engine for a world group of ``size`` ranks, started here if needed; and whether
    this backend owns it."""
    global _owned_engine
    e = _live_engine()
    if e is None:
        _state.init(store=store, rank=rank, world_size=size, timeout=timeout)
        e = _owned_engine = _state._engine
    if (e.rank, e.world_size) != (rank, size):
        raise RuntimeError(
            f"fastcomm backend: rank {rank}: torch.distributed's world is rank {rank} of {size}, "
            f"but fastcomm was initialized as rank {e.rank} of {e.world_size}; call "
            f"fastcomm.shutdown() first or initialize both over the same world")
    return e, e is _owned_engine


def _create_backend(opts: dist.distributed_c10d._DistributedBackendOptions, backend_options=None):
    """torch's creator hook (extended API): one backend per process group, on its members."""
    rank, size = opts.group_rank, opts.group_size
    ranks = [int(r) for r in opts.global_ranks_in_group]
    timeout = opts.timeout if isinstance(opts.timeout, timedelta) else timedelta(seconds=opts.timeout)
    if not ranks:
        # torch's default group (init_process_group): its ranks are the world's.
        engine, owns = _world_engine(opts.store, rank, size, timeout)
        ranks = list(range(size))
    else:
        engine, owns = _live_engine(), False
        if engine is None:
            raise RuntimeError(
                f"fastcomm backend: rank {dist.get_rank() if dist.is_initialized() else '?'}: a "
                f"fastcomm process group over ranks {ranks} needs fastcomm's engine, which is "
                f"not running: call dist.init_process_group('fastcomm' or 'cpu:fastcomm,...') "
                f"or fastcomm.init() on every rank first")
        if ranks != sorted(ranks):
            raise ValueError(f"fastcomm backend: rank {engine.rank}: group ranks {ranks} are not "
                             f"sorted (torch's new_group sorts them; fastcomm orders group ranks "
                             f"by global rank)")
    if len(ranks) != size or ranks[rank] != engine.rank:
        raise RuntimeError(f"fastcomm backend: rank {engine.rank}: torch's group rank {rank} of "
                           f"{size} does not match global ranks {ranks}")
    # The group's own timeout (new_group(timeout=...), else init_process_group's).
    timeout_ms = max(1, int(timeout.total_seconds() * 1000))
    return _C.FastcommBackend(engine, engine.new_group(ranks, timeout_ms), owns)


def _register() -> None:
    dist.Backend.register_backend(BACKEND_NAME, _create_backend, extended_api=True,
                                  devices=["cpu", "cuda"] if getattr(_C, "has_nccl", False) else ["cpu"])


if dist.is_available():
    _register()
