"""Tensors that the other ranks on this host can read in place."""
from __future__ import annotations

import torch

from . import _C


def empty(*size, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Like ``torch.empty`` (a contiguous CPU tensor, contents undefined), in memory that the
    other ranks on this host can map.

    An ``all_reduce`` of at least ``FASTCOMM_SHM_DIRECT_BYTES`` (256 KiB by default) over a
    group whose members are all on one host, where every member passes such a tensor, reads
    the members' tensors in place instead of copying them through the shared-memory rings:
    about half the memory traffic. Any other all_reduce of such a tensor runs as usual. Usable
    before ``init``; the memory is freed when the tensor is, and by the other ranks that read it
    when they exit or have read 8 newer buffers of this rank."""
    if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)):
        size = tuple(size[0])
    return _C.shared_empty([int(s) for s in size], dtype if dtype is not None else torch.get_default_dtype())
