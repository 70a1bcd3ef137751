"""The one bounded map: state kept per session or tenant that must not grow forever.

Every part that keeps something per key beyond one request (a session's carried index, a
tenant's calibration; per-request state lives in :mod:`agentspec.requests`, itself one
``LRU`` of requests) keeps it in an :class:`LRU`: inserting or touching a key makes it the
most recent, and once the map holds more than ``max_items`` entries (or, with a ``weight``,
more than ``max_weight`` in all) the least recently used ones are forgotten. ``evicted``
counts them, so a leak shows as a number instead of as memory.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from typing import Generic, TypeVar, overload

from agentspec.errors import ConfigError

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")
D = TypeVar("D")


class LRU(Generic[K, V]):
    """A map bounded by entry count and, optionally, by the total weight of its values.

    Args:
        max_items: Most entries kept (``None``: no count bound).
        max_weight: Most total weight kept (needs ``weight``).
        weight: A value's weight (e.g. its tokens); counted when it is put.
        min_items: Entries kept whatever their weight (e.g. 1: the newest entry stays even
            when it alone is over ``max_weight``).
        on_evict: Called with each entry the bounds forget (not with popped ones), for
            values that hold something outside the map to release.

    Raises:
        ConfigError: a bound below 1, or ``max_weight`` without ``weight``.
    """

    def __init__(self, max_items: int | None = None, max_weight: int | None = None,
                 weight: Callable[[V], int] | None = None, min_items: int = 0,
                 on_evict: Callable[[K, V], None] | None = None) -> None:
        if max_items is not None and max_items < 1:
            raise ConfigError(f"max_items must be >= 1, got {max_items!r}")
        if max_weight is not None and (max_weight < 1 or weight is None):
            raise ConfigError(f"max_weight must be >= 1 and come with a weight function, "
                              f"got {max_weight!r}")
        self.max_items = max_items
        self.max_weight = max_weight
        self.min_items = min_items
        self._weight = weight
        self._on_evict = on_evict
        self._data: OrderedDict[K, V] = OrderedDict()
        self._weights: dict[K, int] = {}
        self.total_weight = 0
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._data)

    def __contains__(self, key: object) -> bool:
        return key in self._data

    def __iter__(self) -> Iterator[K]:
        """Keys, least recently used first."""
        return iter(self._data)

    def __getitem__(self, key: K) -> V:
        return self._data[key]

    def values(self) -> Iterator[V]:
        """Values, least recently used first."""
        return iter(self._data.values())

    def items(self) -> Iterator[tuple[K, V]]:
        """``(key, value)`` pairs, least recently used first."""
        return iter(self._data.items())

    @overload
    def get(self, key: K) -> V | None: ...

    @overload
    def get(self, key: K, default: D) -> V | D: ...

    def get(self, key: K, default: object = None) -> object:
        """The value of ``key`` (``default`` when absent); does not touch its recency."""
        return self._data.get(key, default)

    def touch(self, key: K) -> V | None:
        """The value of ``key``, made the most recent (``None`` when absent)."""
        value = self._data.get(key)
        if value is not None or key in self._data:
            self._data.move_to_end(key)
        return value

    def get_or_put(self, key: K, make: Callable[[], V]) -> V:
        """The value of ``key`` made the most recent, or ``make()`` put under it first."""
        value = self.touch(key)
        if value is None:
            value = make()
            self.put(key, value)
        return value

    def put(self, key: K, value: V) -> None:
        """Set ``key`` (the most recent now) and forget the least recent over the bounds."""
        self._drop(key)
        self._data[key] = value
        if self._weight is not None:
            w = self._weight(value)
            self._weights[key] = w
            self.total_weight += w
        self._evict()

    def pop(self, key: K) -> V | None:
        """Remove ``key``; its value (``None`` when absent)."""
        value = self._data.get(key)
        self._drop(key)
        return value

    def clear(self) -> None:
        """Forget everything (not counted as evictions)."""
        self._data.clear()
        self._weights.clear()
        self.total_weight = 0

    def _drop(self, key: K) -> None:
        if key in self._data:
            del self._data[key]
            self.total_weight -= self._weights.pop(key, 0)

    def _evict(self) -> None:
        while len(self._data) > self.min_items and (
                (self.max_items is not None and len(self._data) > self.max_items)
                or (self.max_weight is not None and self.total_weight > self.max_weight)):
            key = next(iter(self._data))
            value = self._data[key]
            self._drop(key)
            self.evicted += 1
            if self._on_evict is not None:
                self._on_evict(key, value)
