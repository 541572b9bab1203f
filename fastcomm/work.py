"""Async work handles, as torch.distributed returns them for ``async_op=True``."""
from __future__ import annotations

from datetime import timedelta

import torch


class Work:
    """Handle of an async op: ``wait(timeout=None)``, ``is_completed()``, ``is_success()``,
    ``exception()``, ``get_future()``, ``result()``. Wraps the engine's c10d Work; waiting
    drives the engine on the calling thread with the GIL released."""

    __slots__ = ("_w",)

    def __init__(self, w):
        self._w = w

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

    def result(self):
        return self._w.result()

    def __repr__(self) -> str:
        state = "completed" if self._w.is_completed() else "pending"
        return f"fastcomm.Work({state})"
