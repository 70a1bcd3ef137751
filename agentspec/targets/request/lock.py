"""The lock of a target's KV cache.

A target holds one KV cache, so one request at a time may run on it: every caller (each
runtime and drafting policy over the target) holds the target's lock for the whole request.
The lock belongs to the target, so runtimes sharing a target share it by construction.
"""

from __future__ import annotations

import threading
from types import TracebackType
from typing import Any


class TargetLock:
    """A re-entrant lock a deep copy of its owner replaces with a fresh one (a copied
    target, or a copied model whose hooks reference its target, holds no one's lock).

    Use it as a context manager (``with target.lock: ...``), or ``acquire``/``release``.
    """

    def __init__(self) -> None:
        self._lock = threading.RLock()

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        """Take the lock (see :meth:`threading.RLock.acquire`)."""
        return self._lock.acquire(blocking, timeout)

    def release(self) -> None:
        """Release the lock once (it is re-entrant)."""
        self._lock.release()

    def __enter__(self) -> bool:
        return self._lock.acquire()

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._lock.release()

    def __deepcopy__(self, memo: dict[int, Any]) -> TargetLock:
        return TargetLock()
