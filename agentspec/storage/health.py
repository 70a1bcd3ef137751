"""What the session store failed to do, counted where the runtime meets it.

A chat turn is answered before it is stored, so a store that cannot take the turn (disk
full, busy past its timeout, a session past its size limit) must not fail the request, and a
store that cannot be read must not either: the session cache then drafts without the
session's stored history, which costs speed, never a wrong token. Neither may be silent:
:class:`CountingStore` stands between the runtime (and the drafters it builds) and the
store, counts every failure by operation and reason, and re-raises, so each caller decides
what the failure means for its request while operators read one set of numbers
(``/metrics``: ``agentspec:store_failures_total``).
"""

from __future__ import annotations

import threading
from collections import Counter

from agentspec.errors import (
    AgentSpecError,
    SessionTooLargeError,
    StoreBusyError,
    StoreCorruptError,
)
from agentspec.interfaces import TurnStore
from agentspec.types import SessionRef

__all__ = ["STORE_FAILURE_REASONS", "CountingStore", "failure_reason"]

#: Every reason :func:`failure_reason` gives (metrics expose each at 0 from the start).
STORE_FAILURE_REASONS = ("busy", "too_large", "disk_full", "corrupt", "error")


def failure_reason(exc: BaseException) -> str:
    """A short label of a store failure for metrics: ``busy``, ``too_large``, ``disk_full``,
    ``corrupt`` or ``error``."""
    if isinstance(exc, StoreBusyError):
        return "busy"
    if isinstance(exc, SessionTooLargeError):
        return "too_large"
    if isinstance(exc, StoreCorruptError):
        return "corrupt"
    if "disk is full" in str(exc) or "No space left" in str(exc):
        return "disk_full"
    return "error"


class CountingStore:
    """A :class:`~agentspec.interfaces.TurnStore` that counts its store's failures.

    Args:
        store: The session store every call goes to.

    Attributes:
        failures: ``(operation, reason) -> count``; operations are ``load`` and ``append``.
    """

    def __init__(self, store: TurnStore) -> None:
        self.store = store
        self.failures: Counter[tuple[str, str]] = Counter()
        self._lock = threading.Lock()  # the server's handlers and the worker both count

    def _count(self, op: str, exc: BaseException) -> None:
        with self._lock:
            self.failures[(op, failure_reason(exc))] += 1

    def load(self, ref: SessionRef) -> list[list[int]]:
        """The stored turns of ``ref``'s session (failures counted, then re-raised)."""
        try:
            return self.store.load(ref)
        except AgentSpecError as exc:
            self._count("load", exc)
            raise

    def append_turn(self, ref: SessionRef, tokens: list[int]) -> None:
        """Persist one finished turn (failures counted, then re-raised)."""
        try:
            self.store.append_turn(ref, tokens)
        except AgentSpecError as exc:
            self._count("append", exc)
            raise

    def count(self, op: str) -> int:
        """Failures of one operation (``load`` or ``append``), every reason together."""
        with self._lock:
            return sum(n for (o, _), n in self.failures.items() if o == op)
