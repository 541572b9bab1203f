"""Async work handles, as torch.distributed returns them for ``async_op=True``."""
from __future__ import annotations

from datetime import timedelta

import torch


class Work:
    """Handle of an async op: ``wait(timeout=None)``, ``is_completed()``, ``is_success()``,
    ``exception()``, ``get_future()``, ``result()``. Wraps the engine's c10d Work; waiting
    drives the engine on the calling thread with the GIL released."""

    __slots__ = ("_w", "_g")

    def __init__(self, w, group=None):
        self._w = w
        self._g = group  # irecv's group handle: maps the sender's group rank to a global one

    def wait(self, timeout=None) -> bool:
        if timeout is None:
            return self._w.wait()
        if not isinstance(timeout, timedelta):
            timeout = timedelta(seconds=float(timeout))
        # torch reads a zero timeout as "no timeout"; a zero wait here means "do not block".
        return self._w.wait(max(timeout, timedelta(milliseconds=1)))

    def synchronize(self) -> None:
        """CUDA ops: blocks the host until the op has finished on the device (wait() only makes
        the current stream wait). CPU ops: nothing to do."""
        self._w.synchronize()

    def is_completed(self) -> bool:
        return self._w.is_completed()

    def is_success(self) -> bool:
        return self._w.is_completed() and self._w.exception() is None

    def exception(self):
        """The op's error as an exception object, or None (also while still running)."""
        return self._w.exception()

    def get_future(self) -> torch.futures.Future:
        return self._w.get_future()

    def source_rank(self) -> int:
        """An irecv's sender, as a global rank, once the receive completed (for one from any
        source, the member whose message it took). Raises for other Works, and before then."""
        r = self._w._source_rank()
        return r if self._g is None else self._g.ranks[r]

    def result(self):
        return self._w.result()

    def __repr__(self) -> str:
        state = "completed" if self._w.is_completed() else "pending"
        return f"fastcomm.Work({state})"
