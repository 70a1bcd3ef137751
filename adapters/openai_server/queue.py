"""The generation queue: one FIFO per tenant, served round-robin, with two bounds, and the
handle (:class:`Ticket`) a queued request is answered through.

The model serves one request at a time, so the order of the queue is the order of service.
A single FIFO lets a tenant that queued 50 requests delay another tenant's one request by 50
generations; here each tenant waits in its own FIFO and the worker takes the head of the
next tenant in turn, so a request waits behind at most one request of each other tenant
with work queued (plus its own tenant's earlier ones).

Two bounds keep one tenant from filling the queue for everyone: ``max_waiting`` requests in
all, and ``max_per_tenant`` of them for any one tenant. :class:`FairQueue` is not
thread-safe: the service guards it with its lock.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import Any, Generic, Literal, TypeVar

from agentspec.errors import ConfigError

__all__ = ["Event", "FairQueue", "Refusal", "Ticket"]

# ("delta", str) | ("done", ChatResult) | ("error", BaseException) | ("cancelled", None)
Event = tuple[str, Any]

T = TypeVar("T")

#: Why :meth:`FairQueue.offer` refused an item: the whole queue is full, or the tenant's
#: share of it.
Refusal = Literal["global_full", "tenant_share"]


class FairQueue(Generic[T]):
    """Per-tenant FIFO queues served round-robin.

    Args:
        max_waiting: Items queued at most, all tenants together.
        max_per_tenant: Items one tenant may have queued at most.

    Raises:
        ConfigError: a bound below 1.
    """

    def __init__(self, max_waiting: int, max_per_tenant: int) -> None:
        for name, value in (("max_waiting", max_waiting), ("max_per_tenant", max_per_tenant)):
            if value < 1:
                raise ConfigError(f"FairQueue {name} must be >= 1, got {value!r}")
        self.max_waiting = max_waiting
        self.max_per_tenant = max_per_tenant
        # The ring of tenants with work queued, in the order they are served next; a
        # tenant leaves it when its FIFO empties and joins at the back when it returns.
        self._ring: OrderedDict[str, deque[T]] = OrderedDict()
        self._size = 0

    def __len__(self) -> int:
        """Items queued, all tenants together."""
        return self._size

    def waiting(self, tenant: str) -> int:
        """Items ``tenant`` has queued."""
        fifo = self._ring.get(tenant)
        return len(fifo) if fifo is not None else 0

    def offer(self, tenant: str, item: T) -> Refusal | None:
        """Queue ``item`` at the back of ``tenant``'s FIFO; ``None`` when it was queued,
        else why not (nothing changes then)."""
        if self._size >= self.max_waiting:
            return "global_full"
        if self.waiting(tenant) >= self.max_per_tenant:
            return "tenant_share"
        fifo = self._ring.get(tenant)
        if fifo is None:
            fifo = self._ring[tenant] = deque()  # a returning tenant joins at the back
        fifo.append(item)
        self._size += 1
        return None

    def pop(self) -> T | None:
        """The next item: the head of the tenant whose turn it is (``None``: empty). That
        tenant then goes to the back of the ring."""
        if not self._ring:
            return None
        tenant, fifo = next(iter(self._ring.items()))
        item = fifo.popleft()
        self._size -= 1
        if fifo:
            self._ring.move_to_end(tenant)
        else:
            del self._ring[tenant]
        return item

    def remove(self, tenant: str, item: T) -> bool:
        """Take ``item`` out of ``tenant``'s FIFO; False if it is not queued there."""
        fifo = self._ring.get(tenant)
        if fifo is None:
            return False
        try:
            fifo.remove(item)  # O(share): a tenant's FIFO is at most max_per_tenant long
        except ValueError:
            return False
        self._size -= 1
        if not fifo:
            del self._ring[tenant]
        return True

    def drain(self) -> list[T]:
        """Take every item out (in service order) and leave the queue empty."""
        items: list[T] = []
        while (item := self.pop()) is not None:
            items.append(item)
        return items


class Ticket:
    """A request's ticket from submission to its last event, queued or running: the service
    answers the request through it; read its events with :meth:`next`.

    Args:
        loop: The event loop the events are handed to.
        job: What to run.
        on_cancel: Called with the handle by :meth:`cancel` (the service takes a queued
            handle off its queue there).
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, job: Any,
                 on_cancel: Callable[[Ticket], None] | None = None) -> None:
        self._loop = loop
        self._queue: asyncio.Queue[Event] = asyncio.Queue()
        self._cancelled = threading.Event()
        self._on_cancel = on_cancel
        self.job = job  # the service's Job (not imported here: service imports this module)
        self.tenant = job.queue_key
        self.submitted = time.perf_counter()

    def emit(self, kind: str, payload: Any) -> None:
        """Hand an event to the event loop (called from the worker thread)."""
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, (kind, payload))
        except RuntimeError:
            self._cancelled.set()  # the loop is gone (shutdown): stop generating

    async def next(self) -> Event:
        """The next event: ``delta``, then one final ``done``, ``error`` or ``cancelled``."""
        return await self._queue.get()

    def cancel(self) -> None:
        """Stop the generation at the runtime's next check, or drop it from the queue now."""
        self._cancelled.set()
        if self._on_cancel is not None:
            self._on_cancel(self)

    @property
    def cancel_event(self) -> threading.Event:
        """Set once :meth:`cancel` was called (the runtime's ``cancel`` argument)."""
        return self._cancelled

    @property
    def cancelled(self) -> bool:
        """True once :meth:`cancel` was called."""
        return self._cancelled.is_set()
