"""Async work handles, as torch.distributed returns them for ``async_op=True``.

``Work`` is a native type (csrc/bindings_work.cpp): making one and waiting on it run no Python
frame, since a program that issues many small async ops pays for both on every op. It wraps
the engine's c10d Work; waiting drives the engine on the calling thread with the GIL released.
Methods: ``wait(timeout=None)``, ``is_completed()``, ``is_success()``, ``exception()``,
``get_future()``, ``result()``, ``synchronize()``, ``block_current_stream()``, ``source_rank()``."""
from __future__ import annotations

from ._C import Work

__all__ = ["Work"]
