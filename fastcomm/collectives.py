"""Collectives with torch.distributed's names, argument order and async_op semantics.

Each call is a straight pass-through to the engine, which validates the arguments (naming
rank, group and argument on error) before anything is sent. Inside ``with fastcomm.batch()``
the same calls are validated and queued instead, and the batch issues them together."""
from __future__ import annotations

import time
from datetime import timedelta
from typing import List, Optional, Sequence

import torch
from torch.distributed import DistBackendError, ReduceOp

from . import _C, _state
from .work import Work

_K = _C.op_kinds  # every op enters the engine through Engine.issue(kind, ...)
_ALL_REDUCE, _BROADCAST, _BARRIER = _K["all_reduce"], _K["broadcast"], _K["barrier"]
_ALL_GATHER, _ALL_GATHER_INTO_TENSOR = _K["all_gather"], _K["all_gather_into_tensor"]
_REDUCE_SCATTER, _REDUCE_SCATTER_TENSOR = _K["reduce_scatter"], _K["reduce_scatter_tensor"]
_SEND, _RECV = _K["send"], _K["recv"]
_REDUCE, _GATHER, _SCATTER = _K["reduce"], _K["gather"], _K["scatter"]
_ALL_TO_ALL, _ALL_TO_ALL_SINGLE = _K["all_to_all"], _K["all_to_all_single"]
_ANY_SOURCE = -1  # recv's peer when src and group_src are both None
# monitored_barrier's messages travel on the send/recv channels of this tag, which send and
# recv refuse, so user messages never meet them.
_MONITORED_BARRIER_TAG = -(2 ** 31)


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


def _global_rank(group, rank, group_rank, api: str, arg: str) -> int:
    if (rank is None) == (group_rank is None):
        raise ValueError(f"fastcomm.{api}: give exactly one of '{arg}' and 'group_{arg}'")
    if rank is not None:
        return int(rank)
    ranks = group.ranks if group is not None else list(range(_state.get_world_size()))
    if not isinstance(group_rank, int) or not 0 <= group_rank < len(ranks):
        raise ValueError(f"fastcomm.{api}: rank {_state.get_rank()}, group {list(ranks)}: argument 'group_{arg}' is "
                         f"{group_rank!r}, not a rank of the group (0 to {len(ranks) - 1})")
    return ranks[group_rank]


def _all_reduce_py(tensor: torch.Tensor, op=ReduceOp.SUM, group=None, async_op: bool = False) -> Optional[Work]:
    """Reduces ``tensor`` in place across ``group`` (default: all ranks). (fastcomm.all_reduce
    is _C.all_reduce, which runs the plain case without a Python frame and comes here for the
    rest: before init, a group that is not a fastcomm Group, a wrong argument.)"""
    e, h = _handle(group, "all_reduce")
    return e.issue(_ALL_REDUCE, h, tensor, None, None, op, -1, 0, async_op, None, None)


def _broadcast_py(tensor: torch.Tensor, src: Optional[int] = None, group=None, async_op: bool = False,
                  group_src: Optional[int] = None) -> Optional[Work]:
    """fastcomm.broadcast's cases that _C.broadcast does not run itself (as _all_reduce_py)."""
    e, h = _handle(group, "broadcast")
    src = _global_rank(group, src, group_src, "broadcast", "src")
    return e.issue(_BROADCAST, h, tensor, None, None, None, src, 0, async_op, None, None)


def all_gather(tensor_list, tensor: torch.Tensor, group=None, async_op: bool = False) -> Optional[Work]:
    """Gathers every member's ``tensor`` into ``tensor_list`` (one tensor per member, in group
    rank order), or into one tensor of ``size() * numel`` elements when given a tensor."""
    if isinstance(tensor_list, torch.Tensor):
        return all_gather_into_tensor(tensor_list, tensor, group, async_op)
    e, h = _handle(group, "all_gather")
    return e.issue(_ALL_GATHER, h, tensor, None, list(tensor_list), None, -1, 0, async_op, None, None)


def all_gather_into_tensor(output_tensor: torch.Tensor, input_tensor: torch.Tensor, group=None,
                           async_op: bool = False) -> Optional[Work]:
    e, h = _handle(group, "all_gather_into_tensor")
    return e.issue(_ALL_GATHER_INTO_TENSOR, h, input_tensor, output_tensor, None, None, -1, 0,
                   async_op, None, None)


def reduce_scatter(output: torch.Tensor, input_list: Sequence[torch.Tensor], op=ReduceOp.SUM, group=None,
                   async_op: bool = False) -> Optional[Work]:
    """Member i receives the reduction over members of their ``input_list[i]``."""
    e, h = _handle(group, "reduce_scatter")
    return e.issue(_REDUCE_SCATTER, h, None, output, list(input_list), op, -1, 0, async_op, None, None)


def reduce_scatter_tensor(output: torch.Tensor, input: torch.Tensor, op=ReduceOp.SUM, group=None,
                          async_op: bool = False) -> Optional[Work]:
    """Like reduce_scatter, with the inputs concatenated in one tensor of ``size() * numel``."""
    e, h = _handle(group, "reduce_scatter_tensor")
    return e.issue(_REDUCE_SCATTER_TENSOR, h, input, output, None, op, -1, 0, async_op, None, None)


def _reduce_py(tensor: torch.Tensor, dst: Optional[int] = None, op=ReduceOp.SUM, group=None,
               async_op: bool = False, group_dst: Optional[int] = None) -> Optional[Work]:
    """fastcomm.reduce's cases that _C.reduce does not run itself (as _all_reduce_py)."""
    e, h = _handle(group, "reduce")
    dst = _global_rank(group, dst, group_dst, "reduce", "dst")
    return e.issue(_REDUCE, h, tensor, None, None, op, dst, 0, async_op, None, None)


def _gather_py(tensor: torch.Tensor, gather_list: Optional[List[torch.Tensor]] = None, dst: Optional[int] = None,
               group=None, async_op: bool = False, group_dst: Optional[int] = None) -> Optional[Work]:
    """fastcomm.gather's cases that _C.gather does not run itself (as _all_reduce_py)."""
    e, h = _handle(group, "gather")
    dst = 0 if dst is None and group_dst is None else _global_rank(group, dst, group_dst, "gather", "dst")
    return e.issue(_GATHER, h, tensor, None, gather_list, None, dst, 0, async_op, None, None)


def _scatter_py(tensor: torch.Tensor, scatter_list: Optional[List[torch.Tensor]] = None,
                src: Optional[int] = None, group=None, async_op: bool = False,
                group_src: Optional[int] = None) -> Optional[Work]:
    """fastcomm.scatter's cases that _C.scatter does not run itself (as _all_reduce_py)."""
    e, h = _handle(group, "scatter")
    src = 0 if src is None and group_src is None else _global_rank(group, src, group_src, "scatter", "src")
    return e.issue(_SCATTER, h, tensor, None, scatter_list, None, src, 0, async_op, None, None)


def all_to_all(output_tensor_list: Sequence[torch.Tensor], input_tensor_list: Sequence[torch.Tensor], group=None,
               async_op: bool = False) -> Optional[Work]:
    """Sends ``input_tensor_list[i]`` to group rank i, which receives it into its
    ``output_tensor_list[me]``; tensors may differ in size, but each pair must agree."""
    e, h = _handle(group, "all_to_all")
    return e.issue(_ALL_TO_ALL, h, None, None, list(output_tensor_list), None, -1, 0, async_op,
                   list(input_tensor_list), None)


def all_to_all_single(output: torch.Tensor, input: torch.Tensor, output_split_sizes: Optional[List[int]] = None,
                      input_split_sizes: Optional[List[int]] = None, group=None,
                      async_op: bool = False) -> Optional[Work]:
    """all_to_all over blocks of dim 0: ``input``'s i-th block (``input_split_sizes[i]`` rows,
    or an equal share when None or empty) goes to group rank i; ``output``'s blocks are
    filled likewise, in group rank order."""
    e, h = _handle(group, "all_to_all_single")
    splits = None if not output_split_sizes and not input_split_sizes else (
        output_split_sizes or None, input_split_sizes or None)
    return e.issue(_ALL_TO_ALL_SINGLE, h, input, output, None, None, -1, 0, async_op, None,
                   splits)


def barrier(group=None, async_op: bool = False, device_ids=None, timeout=None) -> Optional[Work]:
    """Returns once every member of ``group`` reached it (or, with ``async_op``, a Work that
    completes then). ``timeout`` (a timedelta or seconds): this barrier's own, instead of the
    group's, as in torch's Gloo backend; ``device_ids`` is taken and ignored, as there."""
    e, h = _handle(group, "barrier")
    if timeout is None:
        return e.issue(_BARRIER, h, None, None, None, None, -1, 0, async_op, None, None)
    secs = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
    if not secs > 0:
        raise ValueError(f"fastcomm.barrier: rank {e.rank}, group {list(h.ranks)}: argument 'timeout' must be "
                         f"positive, got {timeout}")
    ms = min(max(1, int(round(secs * 1000))), 2**31 - 1)
    return e.issue(_BARRIER, h, None, None, None, None, -1, 0, async_op, None, None, ms)


def _reserved_tag(api: str):
    raise ValueError(f"fastcomm.{api}: rank {_state.get_rank()}: argument 'tag' {_MONITORED_BARRIER_TAG} is "
                     f"reserved (fastcomm.monitored_barrier uses it)")


def isend(tensor: torch.Tensor, dst: Optional[int] = None, group=None, tag: int = 0,
          group_dst: Optional[int] = None) -> Optional[Work]:
    """Sends ``tensor`` to global rank ``dst``; matched, in order, by the recv with the same
    source, group and tag on ``dst`` (or by one from any source there)."""
    e, h = _handle(group, "isend")
    if tag == _MONITORED_BARRIER_TAG:
        _reserved_tag("isend")
    dst = _global_rank(group, dst, group_dst, "isend", "dst")
    return e.issue(_SEND, h, tensor, None, None, None, dst, tag, True, None, None)


def irecv(tensor: torch.Tensor, src: Optional[int] = None, group=None, tag: int = 0,
          group_src: Optional[int] = None) -> Optional[Work]:
    """Receives into ``tensor`` from global rank ``src`` (or group rank ``group_src``); with
    neither, from whichever member's message with this tag comes first. The Work's
    ``source_rank()`` is the sender's global rank once it completed."""
    e, h = _handle(group, "irecv")
    if tag == _MONITORED_BARRIER_TAG:
        _reserved_tag("irecv")
    src = _ANY_SOURCE if src is None and group_src is None else _global_rank(group, src, group_src, "irecv", "src")
    w = e.issue(_RECV, h, tensor, None, None, None, src, tag, True, None, None)
    return None if w is None else Work(w, h)


def send(tensor: torch.Tensor, dst: Optional[int] = None, group=None, tag: int = 0,
         group_dst: Optional[int] = None) -> None:
    e, h = _handle(group, "send")
    if tag == _MONITORED_BARRIER_TAG:
        _reserved_tag("send")
    dst = _global_rank(group, dst, group_dst, "send", "dst")
    e.issue(_SEND, h, tensor, None, None, None, dst, tag, False, None, None)


def recv(tensor: torch.Tensor, src: Optional[int] = None, group=None, tag: int = 0,
         group_src: Optional[int] = None) -> Optional[int]:
    """Receives into ``tensor`` from global rank ``src`` (or group rank ``group_src``); with
    neither, from whichever member's message with this tag comes first (messages of one sender
    still arrive in the order sent, and receives are matched in the order they were posted).
    Returns the sender's global rank, as torch does (inside a batch, for a named source only)."""
    e, h = _handle(group, "recv")
    if tag == _MONITORED_BARRIER_TAG:
        _reserved_tag("recv")
    src = _ANY_SOURCE if src is None and group_src is None else _global_rank(group, src, group_src, "recv", "src")
    got = e.issue(_RECV, h, tensor, None, None, None, src, tag, False, None, None)
    if got is not None:
        return got
    return None if src == _ANY_SOURCE else src


def monitored_barrier(group=None, timeout=None, wait_all_ranks: bool = False) -> None:
    """A barrier that names who is missing. Every member reports to the group's rank 0, which
    waits at most ``timeout`` (a timedelta or seconds; default: the group's timeout) for them,
    in group-rank order, then answers each. If a member did not arrive in time (or has exited),
    rank 0 raises DistBackendError naming the first such rank, or with ``wait_all_ranks`` every
    one of them, and tells the others, which raise naming the same ranks. A member that hears
    nothing from rank 0 within twice ``timeout`` raises too. Nothing spins meanwhile."""
    e, h = _handle(group, "monitored_barrier")
    me = e.rank
    if _C.recording():
        raise RuntimeError(f"fastcomm.monitored_barrier: rank {me}: not allowed inside fastcomm.batch()")
    ranks = list(h.ranks)
    where = f"fastcomm.monitored_barrier: rank {me}, group {ranks}"
    if not h.is_member:
        raise ValueError(f"{where}: rank {me} is not a member of the group (argument 'group')")
    if timeout is None:
        timeout = timedelta(milliseconds=h.timeout_ms)
    elif not isinstance(timeout, timedelta):
        timeout = timedelta(seconds=float(timeout))
    if timeout <= timedelta(0):
        raise ValueError(f"{where}: argument 'timeout' must be positive, got {timeout}")
    k = len(ranks)
    if k == 1:
        return
    secs = timeout.total_seconds()
    tag = _MONITORED_BARRIER_TAG

    def issue(kind, peer, t):
        return e.issue(kind, h, t, None, None, None, peer, tag, True, None, None)

    # Rank 0's answer: one flag per group rank, 1 for a member that did not arrive. It is sent
    # even when some failed, so every member's k-th answer is rank 0's k-th whatever happened.
    if me != ranks[0]:
        issue(_SEND, ranks[0], torch.empty(0, dtype=torch.uint8))
        answer = torch.zeros(k, dtype=torch.int64)
        w = issue(_RECV, ranks[0], answer)
        why = _wait_for(w, 2 * secs)
        if why is not None:
            raise DistBackendError(f"{where}: no answer from rank {ranks[0]} (the group's rank 0) within "
                                   f"{2 * secs:g} s: {why}")
        missing = [r for r, bad in zip(ranks, answer.tolist()) if bad]
        if missing:
            raise DistBackendError(f"{where}: rank {ranks[0]} (the group's rank 0) reports "
                                   f"{_ranks_failed(missing)}")
        return
    arrivals = [(r, issue(_RECV, r, torch.empty(0, dtype=torch.uint8))) for r in ranks[1:]]
    deadline = time.monotonic() + secs
    failed = []
    for r, w in arrivals:
        why = _wait_for(w, deadline - time.monotonic())
        if why is not None:
            failed.append((r, why))
            if not wait_all_ranks:
                break
    answer = torch.zeros(k, dtype=torch.int64)
    for r, _ in failed:
        answer[ranks.index(r)] = 1
    sends = [issue(_SEND, r, answer) for r in ranks[1:]]
    if failed:
        # (The answers are not waited for: a member that exited never takes its own.)
        details = "; ".join(f"rank {r}: {why}" for r, why in failed)
        raise DistBackendError(f"{where}: {_ranks_failed([r for r, _ in failed], secs)} ({details})")
    for w in sends:
        w.wait()


def _wait_for(w, secs: float) -> Optional[str]:
    """Waits up to ``secs`` (at least a millisecond) for the engine Work ``w``; None once it
    succeeded, else why not."""
    try:
        w.wait(timedelta(seconds=max(secs, 0.001)))
        return None
    except RuntimeError as err:
        if not w.is_completed():
            return "no message within the timeout"
        return str(err).splitlines()[0]


def _ranks_failed(ranks: List[int], secs: Optional[float] = None) -> str:
    who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
    return f"{who} failed to pass monitored_barrier" + ("" if secs is None else f" within {secs:g} s")


# ``with fastcomm.batch() as b:`` -- a native type (csrc/bindings.cpp): a batch's own cost is
# paid on every use, so entering, leaving and waiting run no Python frame.
batch = _C.batch


class plan:
    """A persistent batch: ``with fastcomm.plan() as p:`` records the ops issued in the block
    (validated as in a batch, nothing sent), and ``p.start()`` runs all of them, as many times
    as needed. Arguments are checked and the algorithms built once, at capture; a start only
    queues the ops again, so it costs far less per op than issuing them anew. (MPI's persistent
    collectives are the model; a plan may span any groups.)

    The ops read and write their tensors' current contents at every start, so a loop refills
    the inputs in place and starts the plan again. The tensors must keep their memory and
    layout for the plan's lifetime (no ``resize_``, ``set_`` or ``t_()``), and every member of
    each group must start its plans and issue its other ops on those groups in the same order.
    A plan of CPU tensors runs one start at a time: a start while the last one runs waits for it
    first (as a blocking call waits for its op). A plan of CUDA tensors (all on one device) is
    checked once and its ops issued anew at each start, or captured into a CUDA graph with
    :meth:`capture`."""

    def __init__(self):
        self._engine = None
        self._ops = None
        self._plan = None
        self._discarded = False

    def __enter__(self) -> "plan":
        if self._plan is not None or self._ops is not None:
            raise RuntimeError("fastcomm.plan: this plan was already recorded")
        self._ops = _C.begin_batch("plan")
        self._engine = _state._engine
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        ops, self._ops = self._ops, None
        _C.end_batch(ops, False)
        if exc_type is None:
            self._plan = self._engine.make_plan(ops)
        else:
            self._discarded = True
        return False

    def __len__(self) -> int:
        return len(self._plan) if self._plan is not None else 0

    def _unrecorded(self, what: str) -> str:
        if self._discarded:
            return (f"fastcomm.plan: {what}() of a plan whose with-block raised: nothing was recorded "
                    "(record it again)")
        return f"fastcomm.plan: {what}() before the plan was recorded (leave the with-block first)"

    def start(self, async_op: bool = True) -> Optional[Work]:
        """Runs every recorded op once. Returns their Work (``async_op=True``), or blocks until
        they are done and returns None."""
        if self._plan is None:
            raise RuntimeError(self._unrecorded("start"))
        return self._plan.start(async_op)

    def capture(self) -> "_C.PlanGraph":
        """Captures the plan's CUDA ops into a CUDA graph of fastcomm's own and returns it;
        ``g.replay()`` then enqueues all of them on the current stream with no host work per
        op, reading and writing the tensors in place (refill the inputs, replay again).

        Call it outside any capture, on every member of the plan's groups: the members agree
        on the ops' order and matching here, once, over the host (a mismatch raises on both
        sides), and the plan gets communicators and memory of its own. Replays require, as
        NCCL's captured collectives do, that every member replays its graph the same number of
        times, and graphs that share a pair in the same order on both sides (else the runs wait
        on each other until the timeout). A fault during a
        replay (a peer gone, a run not done within the groups' timeout) is raised as
        ``DistBackendError`` naming the peer by the next ``g.replay()`` or ``g.wait()``, which
        host-blocks until the replays so far have run; the graph is then dead (capture the plan
        again).

        ``g.replay()`` inside ``torch.cuda.graph(...)`` records the plan's work into that graph
        instead, so each replay of it runs the ops; every member must do the same, runs of the
        plan must follow each other (one stream), and ``g`` must outlive that graph. A fault of
        such a run aborts it (the graph drains) and is raised by the next ``g.wait()`` (which
        then also waits for the current stream) or ``g.replay()``. docs/design.md, "CUDA
        graphs", has the design."""
        if self._plan is None:
            raise RuntimeError(self._unrecorded("capture"))
        return self._plan.capture()


def all_reduce_many(tensors: Sequence[torch.Tensor], groups: Sequence, op=ReduceOp.SUM,
                    async_op: bool = False):
    """all_reduce of ``tensors[i]`` over ``groups[i]`` for every i, as one batch."""
    if len(tensors) != len(groups):
        raise ValueError(f"fastcomm.all_reduce_many: {len(tensors)} tensors but {len(groups)} groups")
    if async_op:
        with batch() as b:
            for t, g in zip(tensors, groups):
                all_reduce(t, op, g)
        return b
    if _C.recording():  # inside an enclosing batch: the ops join it
        for t, g in zip(tensors, groups):
            all_reduce(t, op, g)
        return None
    # A batch recorded here and posted blocking: the caller drives it, no Work is made.
    ops = _C.begin_batch("all_reduce_many")
    try:
        for t, g in zip(tensors, groups):
            all_reduce(t, op, g)
    except BaseException:
        _C.end_batch(ops, False)  # discarded: nothing was sent
        raise
    _C.end_batch(ops, True, False)
    return None


# The hot calls are native entries that run the plain case themselves (see csrc/bindings.cpp).
for _name, _py in (("all_reduce", _all_reduce_py), ("broadcast", _broadcast_py), ("reduce", _reduce_py),
                   ("gather", _gather_py), ("scatter", _scatter_py)):
    _C.set_fast_entry(_name, _py)
all_reduce, broadcast, reduce, gather, scatter = _C.all_reduce, _C.broadcast, _C.reduce, _C.gather, _C.scatter
