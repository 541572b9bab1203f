"""Collectives with torch.distributed's names, argument order and async_op semantics.

Each call is a straight pass-through to the engine, which validates the arguments (naming
rank, group and argument on error) before anything is sent. Inside ``with fastcomm.batch()``
the same calls are validated and queued instead, and the batch issues them together."""
from __future__ import annotations

import threading
from typing import List, Optional, Sequence

import torch
from torch.distributed import ReduceOp

from . import _C, _state
from .work import Work

_K = _C.op_kinds  # every op enters the engine through Engine.issue(kind, ...)
_ALL_REDUCE, _BROADCAST, _BARRIER = _K["all_reduce"], _K["broadcast"], _K["barrier"]
_ALL_GATHER, _ALL_GATHER_INTO_TENSOR = _K["all_gather"], _K["all_gather_into_tensor"]
_REDUCE_SCATTER, _REDUCE_SCATTER_TENSOR = _K["reduce_scatter"], _K["reduce_scatter_tensor"]
_SEND, _RECV = _K["send"], _K["recv"]
_REDUCE, _GATHER, _SCATTER = _K["reduce"], _K["gather"], _K["scatter"]
_ALL_TO_ALL, _ALL_TO_ALL_SINGLE = _K["all_to_all"], _K["all_to_all_single"]


class _Local(threading.local):
    # A class-level default: looking it up never raises, so the per-op check costs no
    # exception (and no garbage for the cyclic GC) on the hot path.
    batch = None


_tls = _Local()  # the batch being collected by this thread, if any


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


def _wrap(w) -> Optional[Work]:
    return None if w is None else Work(w)


def _global_rank(group, rank, group_rank, api: str, arg: str) -> int:
    if (rank is None) == (group_rank is None):
        raise ValueError(f"fastcomm.{api}: give exactly one of '{arg}' and 'group_{arg}'")
    if rank is not None:
        return int(rank)
    ranks = group.ranks if group is not None else list(range(_state.get_world_size()))
    return ranks[group_rank]


def all_reduce(tensor: torch.Tensor, op=ReduceOp.SUM, group=None, async_op: bool = False) -> Optional[Work]:
    """Reduces ``tensor`` in place across ``group`` (default: all ranks)."""
    e, h = _handle(group, "all_reduce")
    return _wrap(e.issue(_ALL_REDUCE, h, tensor, None, None, op, -1, 0, async_op, _tls.batch, None, None))


def broadcast(tensor: torch.Tensor, src: Optional[int] = None, group=None, async_op: bool = False,
              group_src: Optional[int] = None) -> Optional[Work]:
    """Copies ``tensor`` from global rank ``src`` (or group rank ``group_src``) to all members."""
    e, h = _handle(group, "broadcast")
    src = _global_rank(group, src, group_src, "broadcast", "src")
    return _wrap(e.issue(_BROADCAST, h, tensor, None, None, None, src, 0, async_op, _tls.batch, None, None))


def all_gather(tensor_list, tensor: torch.Tensor, group=None, async_op: bool = False) -> Optional[Work]:
    """Gathers every member's ``tensor`` into ``tensor_list`` (one tensor per member, in group
    rank order), or into one tensor of ``size() * numel`` elements when given a tensor."""
    if isinstance(tensor_list, torch.Tensor):
        return all_gather_into_tensor(tensor_list, tensor, group, async_op)
    e, h = _handle(group, "all_gather")
    return _wrap(e.issue(_ALL_GATHER, h, tensor, None, list(tensor_list), None, -1, 0, async_op,
                          _tls.batch, None, None))


def all_gather_into_tensor(output_tensor: torch.Tensor, input_tensor: torch.Tensor, group=None,
                           async_op: bool = False) -> Optional[Work]:
    e, h = _handle(group, "all_gather_into_tensor")
    return _wrap(e.issue(_ALL_GATHER_INTO_TENSOR, h, input_tensor, output_tensor, None, None, -1, 0,
                         async_op, _tls.batch, None, None))


def reduce_scatter(output: torch.Tensor, input_list: Sequence[torch.Tensor], op=ReduceOp.SUM, group=None,
                   async_op: bool = False) -> Optional[Work]:
    """Member i receives the reduction over members of their ``input_list[i]``."""
    e, h = _handle(group, "reduce_scatter")
    return _wrap(e.issue(_REDUCE_SCATTER, h, None, output, list(input_list), op, -1, 0, async_op,
                          _tls.batch, None, None))


def reduce_scatter_tensor(output: torch.Tensor, input: torch.Tensor, op=ReduceOp.SUM, group=None,
                          async_op: bool = False) -> Optional[Work]:
    """Like reduce_scatter, with the inputs concatenated in one tensor of ``size() * numel``."""
    e, h = _handle(group, "reduce_scatter_tensor")
    return _wrap(e.issue(_REDUCE_SCATTER_TENSOR, h, input, output, None, op, -1, 0, async_op,
                          _tls.batch, None, None))


def reduce(tensor: torch.Tensor, dst: Optional[int] = None, op=ReduceOp.SUM, group=None, async_op: bool = False,
           group_dst: Optional[int] = None) -> Optional[Work]:
    """Reduces ``tensor`` across ``group`` into ``tensor`` on global rank ``dst`` (or group rank
    ``group_dst``); the other members' tensors are left unchanged."""
    e, h = _handle(group, "reduce")
    dst = _global_rank(group, dst, group_dst, "reduce", "dst")
    return _wrap(e.issue(_REDUCE, h, tensor, None, None, op, dst, 0, async_op, _tls.batch, None, None))


def gather(tensor: torch.Tensor, gather_list: Optional[List[torch.Tensor]] = None, dst: Optional[int] = None,
           group=None, async_op: bool = False, group_dst: Optional[int] = None) -> Optional[Work]:
    """Copies every member's ``tensor`` into ``gather_list`` (one tensor per member, in group
    rank order) on ``dst`` (default: global rank 0); the others pass no list."""
    e, h = _handle(group, "gather")
    dst = 0 if dst is None and group_dst is None else _global_rank(group, dst, group_dst, "gather", "dst")
    return _wrap(e.issue(_GATHER, h, tensor, None, gather_list, None, dst, 0, async_op, _tls.batch, None, None))


def scatter(tensor: torch.Tensor, scatter_list: Optional[List[torch.Tensor]] = None, src: Optional[int] = None,
            group=None, async_op: bool = False, group_src: Optional[int] = None) -> Optional[Work]:
    """Copies ``scatter_list[i]`` on ``src`` (default: global rank 0) into group rank i's
    ``tensor``; the others pass no list."""
    e, h = _handle(group, "scatter")
    src = 0 if src is None and group_src is None else _global_rank(group, src, group_src, "scatter", "src")
    return _wrap(e.issue(_SCATTER, h, tensor, None, scatter_list, None, src, 0, async_op, _tls.batch, None, None))


def all_to_all(output_tensor_list: Sequence[torch.Tensor], input_tensor_list: Sequence[torch.Tensor], group=None,
               async_op: bool = False) -> Optional[Work]:
    """Sends ``input_tensor_list[i]`` to group rank i, which receives it into its
    ``output_tensor_list[me]``; tensors may differ in size, but each pair must agree."""
    e, h = _handle(group, "all_to_all")
    return _wrap(e.issue(_ALL_TO_ALL, h, None, None, list(output_tensor_list), None, -1, 0, async_op, _tls.batch,
                         list(input_tensor_list), None))


def all_to_all_single(output: torch.Tensor, input: torch.Tensor, output_split_sizes: Optional[List[int]] = None,
                      input_split_sizes: Optional[List[int]] = None, group=None,
                      async_op: bool = False) -> Optional[Work]:
    """all_to_all over blocks of dim 0: ``input``'s i-th block (``input_split_sizes[i]`` rows,
    or an equal share when None or empty) goes to group rank i; ``output``'s blocks are
    filled likewise, in group rank order."""
    e, h = _handle(group, "all_to_all_single")
    splits = None if not output_split_sizes and not input_split_sizes else (
        output_split_sizes or None, input_split_sizes or None)
    return _wrap(e.issue(_ALL_TO_ALL_SINGLE, h, input, output, None, None, -1, 0, async_op, _tls.batch, None,
                         splits))


def barrier(group=None, async_op: bool = False) -> Optional[Work]:
    e, h = _handle(group, "barrier")
    return _wrap(e.issue(_BARRIER, h, None, None, None, None, -1, 0, async_op, _tls.batch, None, None))


def isend(tensor: torch.Tensor, dst: Optional[int] = None, group=None, tag: int = 0,
          group_dst: Optional[int] = None) -> Optional[Work]:
    """Sends ``tensor`` to global rank ``dst``; matched, in order, by the recv with the same
    source, group and tag on ``dst``."""
    e, h = _handle(group, "isend")
    dst = _global_rank(group, dst, group_dst, "isend", "dst")
    return _wrap(e.issue(_SEND, h, tensor, None, None, None, dst, tag, True, _tls.batch, None, None))


def irecv(tensor: torch.Tensor, src: Optional[int] = None, group=None, tag: int = 0,
          group_src: Optional[int] = None) -> Optional[Work]:
    e, h = _handle(group, "irecv")
    src = _global_rank(group, src, group_src, "irecv", "src")
    return _wrap(e.issue(_RECV, h, tensor, None, None, None, src, tag, True, _tls.batch, None, None))


def send(tensor: torch.Tensor, dst: Optional[int] = None, group=None, tag: int = 0,
         group_dst: Optional[int] = None) -> None:
    e, h = _handle(group, "send")
    dst = _global_rank(group, dst, group_dst, "send", "dst")
    e.issue(_SEND, h, tensor, None, None, None, dst, tag, False, _tls.batch, None, None)


def recv(tensor: torch.Tensor, src: Optional[int] = None, group=None, tag: int = 0,
         group_src: Optional[int] = None) -> int:
    """Receives into ``tensor``; returns the sender's global rank, as torch does."""
    e, h = _handle(group, "recv")
    src = _global_rank(group, src, group_src, "recv", "src")
    e.issue(_RECV, h, tensor, None, None, None, src, tag, False, _tls.batch, None, None)
    return src


class batch:
    """``with fastcomm.batch() as b:`` -- every op issued in the block (any groups, overlapping
    or not) is validated at once and issued together when the block ends, as one fused step:
    one write and one wake-up per peer. Inside the block ops return None; ``b`` is the Work of
    the whole batch (wait, is_completed, is_success, exception, get_future). An exception
    inside the block discards the batch: nothing was sent."""

    def __init__(self):
        self._engine = None
        self._ops = None
        self._work: Optional[Work] = None

    def __enter__(self) -> "batch":
        if _tls.batch is not None:
            raise RuntimeError("fastcomm.batch: batches do not nest")
        self._engine = _state._require("batch")
        self._ops = _C.Batch()
        _tls.batch = self._ops
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        _tls.batch = None
        if exc_type is None:
            self._work = Work(self._engine.post_batch(self._ops))
        return False

    def __len__(self) -> int:
        return len(self._ops) if self._ops is not None else 0

    def _posted(self) -> Work:
        if self._work is None:
            raise RuntimeError("fastcomm.batch: the batch has not been issued yet (leave the with-block first)")
        return self._work

    def wait(self, timeout=None) -> bool:
        return self._posted().wait(timeout)

    def is_completed(self) -> bool:
        return self._posted().is_completed()

    def is_success(self) -> bool:
        return self._posted().is_success()

    def exception(self):
        return self._posted().exception()

    def get_future(self) -> torch.futures.Future:
        return self._posted().get_future()


class plan:
    """A persistent batch: ``with fastcomm.plan() as p:`` records the ops issued in the block
    (validated as in a batch, nothing sent), and ``p.start()`` runs all of them, as many times
    as needed. Arguments are checked and the algorithms built once, at capture; a start only
    queues the ops again, so it costs far less per op than issuing them anew. (MPI's persistent
    collectives are the model; a plan may span any groups.)

    The ops read and write their tensors' current contents at every start, so a loop refills
    the inputs in place and starts the plan again. The tensors must keep their storage for the
    plan's lifetime (no ``resize_`` or ``set_``), and every member of each group must start its
    plans and issue its other ops on those groups in the same order. A plan runs one start at
    a time: wait for a start before the next."""

    def __init__(self):
        self._engine = None
        self._ops = None
        self._plan = None

    def __enter__(self) -> "plan":
        if _tls.batch is not None:
            raise RuntimeError("fastcomm.plan: a plan cannot be recorded inside a batch or another plan")
        if self._plan is not None or self._ops is not None:
            raise RuntimeError("fastcomm.plan: this plan was already recorded")
        self._engine = _state._require("plan")
        self._ops = _C.Batch()
        _tls.batch = self._ops
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        _tls.batch = None
        if exc_type is None:
            self._plan = self._engine.make_plan(self._ops)
        self._ops = None
        return False

    def __len__(self) -> int:
        return len(self._plan) if self._plan is not None else 0

    def start(self, async_op: bool = True) -> Optional[Work]:
        """Runs every recorded op once. Returns their Work (``async_op=True``), or blocks until
        they are done and returns None."""
        if self._plan is None:
            raise RuntimeError("fastcomm.plan: start() before the plan was recorded (leave the with-block first)")
        return _wrap(self._plan.start(async_op))


def all_reduce_many(tensors: Sequence[torch.Tensor], groups: Sequence, op=ReduceOp.SUM,
                    async_op: bool = False):
    """all_reduce of ``tensors[i]`` over ``groups[i]`` for every i, as one batch."""
    if len(tensors) != len(groups):
        raise ValueError(f"fastcomm.all_reduce_many: {len(tensors)} tensors but {len(groups)} groups")
    if async_op:
        with batch() as b:
            for t, g in zip(tensors, groups):
                all_reduce(t, op=op, group=g)
        return b
    e = _state._require("all_reduce_many")
    if _tls.batch is not None:  # inside an enclosing batch: the ops join it
        for t, g in zip(tensors, groups):
            all_reduce(t, op=op, group=g)
        return None
    ops = _C.Batch()
    for t, g in zip(tensors, groups):
        e.issue(_ALL_REDUCE, _handle(g, "all_reduce_many")[1], t, None, None, op, -1, 0, False, ops, None, None)
    e.post_batch(ops, False)
    return None
