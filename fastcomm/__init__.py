"""fastcomm: fast collectives over many small process groups, with a torch.distributed-like API.

    import fastcomm as fc
    fc.init()                                   # rendezvous once (torch's default store or env://)
    g = fc.new_group([0, 1])                    # members only; costs nothing global
    fc.all_reduce(t, op=fc.ReduceOp.SUM, group=g)
"""
from torch.distributed import ReduceOp  # same enum as torch.distributed, so either spelling works

from ._state import (
    Group,
    get_rank,
    get_world_size,
    has_nccl,
    init,
    init_cuda,
    is_initialized,
    new_group,
    new_groups,
    shutdown,
)
from .collectives import (
    all_gather,
    all_gather_into_tensor,
    all_reduce,
    all_reduce_many,
    all_to_all,
    all_to_all_single,
    barrier,
    batch,
    broadcast,
    gather,
    irecv,
    isend,
    monitored_barrier,
    plan,
    recv,
    reduce,
    reduce_scatter,
    reduce_scatter_tensor,
    scatter,
    send,
)
from .memory import empty
from .work import Work
from . import backend  # noqa: F401,E402  registers the "fastcomm" torch.distributed backend

__all__ = [
    "Group",
    "ReduceOp",
    "Work",
    "all_gather",
    "all_gather_into_tensor",
    "all_reduce",
    "all_reduce_many",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "batch",
    "broadcast",
    "empty",
    "gather",
    "irecv",
    "isend",
    "monitored_barrier",
    "plan",
    "recv",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "scatter",
    "send",
    "get_rank",
    "get_world_size",
    "has_nccl",
    "init",
    "init_cuda",
    "is_initialized",
    "new_group",
    "new_groups",
    "shutdown",
]


def _read_version() -> str:
    """The version is written once, in pyproject.toml; an install records it in the package
    metadata. A source tree built in place but never installed reads the file itself."""
    from importlib import metadata

    try:
        return metadata.version("fastcomm")
    except metadata.PackageNotFoundError:
        import os
        import re

        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "pyproject.toml")
        try:
            with open(path) as f:
                m = re.search(r'^version\s*=\s*"([^"]+)"', f.read(), re.MULTILINE)
        except OSError:
            m = None
        return m.group(1) if m else "0+unknown"


__version__ = _read_version()
