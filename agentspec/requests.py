"""The one home of per-request state, and the request lifecycle every stateful part follows.

While a request runs, several parts keep a share of it: the session cache drafter its
request's index, the HVD drafter its running choice, the EAGLE drafter the head's stream,
the causal drafter the request's generator, the draft gate its unlabelled drafts, the
budgeted verifier the regret account. Each share lives in a :class:`Slot` (the part's view)
of one :class:`RequestStates` (the home, :data:`REQUESTS` for the process), keyed by the
request (:func:`agentspec.types.state_key`). The home has one bound and one eviction rule: at most
``max_requests`` live requests, the least recently used forgotten whole, every part's share
at once; ``evicted`` counts those (requests that were never ended: a leak shows as a number).

The lifecycle, as the engine runs it (the vLLM proposer follows batch membership the same
way)::

    part.begin_request(session, rng, request_id=rid)   # parts that set up state up front
    ... propose / verify / observe, each reading its slot by ctx.state_key ...
    drafter.finish(ctx)                                 # only when the request completed
    REQUESTS.end(key)                                   # always: finished, failed, abandoned

``end`` drops every share of the request, so no part needs an end-of-request hook to
release memory, and a stream its consumer abandoned holds nothing once its generator closes.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable, Iterator
from typing import Any, Generic, TypeVar, overload

from agentspec.errors import ConfigError
from agentspec.lru import LRU

V = TypeVar("V")

#: Live requests the process keeps state for before forgetting the least recent one.
MAX_LIVE_REQUESTS = 1024


class RequestStates:
    """Every live request's state, one share per part, under one bound.

    Args:
        max_requests: Most live requests kept; beyond it the least recently used request is
            forgotten whole (counted in :attr:`evicted`).

    Raises:
        ConfigError: ``max_requests < 1``.
    """

    def __init__(self, max_requests: int = MAX_LIVE_REQUESTS) -> None:
        if max_requests < 1:
            raise ConfigError(f"max_requests must be >= 1, got {max_requests!r}")
        # request key -> {slot: that part's share}; touched whenever a part stores a share.
        self._live: LRU[Hashable, dict[Slot[Any], object]] = LRU(
            max_requests, on_evict=_release)
        # Requests on different targets (or vLLM's proposer) may run in different threads.
        self.guard = threading.Lock()

    def slot(self, name: str, on_drop: Callable[[V], None] | None = None) -> Slot[V]:
        """A new part's view of the home (one per part instance).

        Args:
            name: The part's name (in :meth:`stats`).
            on_drop: Called with a share the home forgets (the request ended or was
                evicted; not when the part pops it itself), for shares that hold something
                outside the home (an external library's request).
        """
        return Slot(self, name, on_drop)

    def end(self, key: Hashable) -> None:
        """Forget every share of the request ``key`` (nothing happens when none is kept)."""
        with self.guard:
            shares = self._live.pop(key)
        if shares is not None:
            _release(key, shares)

    @property
    def live(self) -> int:
        """Requests holding state now."""
        return len(self._live)

    @property
    def evicted(self) -> int:
        """Requests forgotten because more than ``max_requests`` were live (never ended)."""
        return self._live.evicted

    def stats(self) -> dict[str, int]:
        """``live`` and ``evicted`` requests, and the shares each part name holds now."""
        with self.guard:
            out = {"live": self.live, "evicted": self.evicted}
            slots = [slot for shares in self._live.values() for slot in shares]
        for slot in slots:
            out[f"shares_{slot.name}"] = out.get(f"shares_{slot.name}", 0) + 1
        return out


class Slot(Generic[V]):
    """One part's share of every live request: a typed view of a :class:`RequestStates`.

    Reading does not change recency; storing (``put``, ``touch``) makes the request the most
    recent. A slot is compared by identity: two parts never see each other's shares.
    """

    def __init__(self, home: RequestStates, name: str,
                 on_drop: Callable[[V], None] | None = None) -> None:
        self.home = home
        self.name = name
        self.on_drop = on_drop

    @overload
    def get(self, key: Hashable) -> V | None: ...

    @overload
    def get(self, key: Hashable, default: V) -> V: ...

    def get(self, key: Hashable, default: V | None = None) -> V | None:
        """This part's share of request ``key`` (``default`` when it has none)."""
        with self.home.guard:
            shares = self.home._live.get(key)
            value = shares.get(self, default) if shares is not None else default
        return value  # type: ignore[return-value]

    def touch(self, key: Hashable) -> V | None:
        """Like :meth:`get`, and the request becomes the most recent."""
        with self.home.guard:
            shares = self.home._live.touch(key)
            value = shares.get(self) if shares is not None else None
        return value  # type: ignore[return-value]

    def get_or_put(self, key: Hashable, make: Callable[[], V]) -> V:
        """This part's share of request ``key``, or ``make()`` stored as it first (the
        request becomes the most recent either way)."""
        with self.home.guard:
            shares = self.home._live.get_or_put(key, dict)
            if self not in shares:
                shares[self] = make()
            return shares[self]  # type: ignore[return-value]

    def put(self, key: Hashable, value: V) -> None:
        """Store this part's share of request ``key`` (the most recent request now)."""
        with self.home.guard:
            # A new request may forget the least recent one (the home's bound).
            self.home._live.get_or_put(key, dict)[self] = value

    def pop(self, key: Hashable) -> V | None:
        """Remove and return this part's share of ``key`` (``None`` when it had none); a
        request left with no share is forgotten."""
        with self.home.guard:
            shares = self.home._live.get(key)
            if shares is None:
                return None
            value = shares.pop(self, None)
            if not shares:
                self.home._live.pop(key)
        return value  # type: ignore[return-value]

    def __getitem__(self, key: Hashable) -> V:
        value = self.get(key)
        if value is None:
            raise KeyError(key)
        return value

    def clear(self) -> None:
        """Forget this part's share of every request (``on_drop`` is not called: the part
        dropped them itself)."""
        for key, _ in list(self.items()):
            self.pop(key)

    def __contains__(self, key: Hashable) -> bool:
        with self.home.guard:
            shares = self.home._live.get(key)
            return shares is not None and self in shares

    def items(self) -> Iterator[tuple[Hashable, V]]:
        """``(request key, share)`` for every live request this part holds a share of."""
        with self.home.guard:
            mine = [(key, shares[self]) for key, shares in self.home._live.items()
                    if self in shares]
        yield from mine  # type: ignore[misc]

    def values(self) -> Iterator[V]:
        """This part's shares, least recently used request first."""
        return (value for _, value in self.items())

    def __len__(self) -> int:
        return sum(1 for _ in self.items())


def _release(key: Hashable, shares: dict[Slot[Any], object]) -> None:
    """Hand each forgotten share to its part's ``on_drop``."""
    for slot, value in shares.items():
        if slot.on_drop is not None:
            slot.on_drop(value)


#: The process's home of per-request state (request ids are unique within a process).
REQUESTS = RequestStates()
