"""Collectives with torch.distributed's names, argument order and async_op semantics.

Each call is a straight pass-through to the engine, which validates the arguments (naming
rank, group and argument on error) before anything is sent."""
from __future__ import annotations

from typing import Optional

import torch
from torch.distributed import ReduceOp

from . import _state
from .work import Work


def _handle(group, api: str):
    e = _state._engine
    if e is None:
        _state._require(api)
    if group is None:
        return e, _state._world._h
    try:
        return e, group._h
    except AttributeError:
        raise TypeError(f"fastcomm.{api}: rank {e.rank}: argument 'group' must be a fastcomm.Group "
                        f"(from fastcomm.new_group), got {type(group).__name__}") from None


def all_reduce(tensor: torch.Tensor, op=ReduceOp.SUM, group=None, async_op: bool = False) -> Optional[Work]:
    """Reduces ``tensor`` in place across ``group`` (default: all ranks)."""
    e, h = _handle(group, "all_reduce")
    w = e.all_reduce(h, tensor, op, async_op)
    return Work(w) if async_op else None
