"""The one bounded map (agentspec.lru.LRU): recency, count and weight bounds, eviction count."""

from __future__ import annotations

import pytest

from agentspec.errors import ConfigError
from agentspec.lru import LRU


def test_count_bound_forgets_the_least_recently_used() -> None:
    lru: LRU[str, int] = LRU(max_items=2)
    lru.put("a", 1)
    lru.put("b", 2)
    assert lru.touch("a") == 1  # a is the most recent now
    lru.put("c", 3)
    assert list(lru) == ["a", "c"] and "b" not in lru and lru.evicted == 1
    assert lru.get("a") == 1 and list(lru) == ["a", "c"]  # get does not touch
    lru.put("a", 9)  # a replaced value is the most recent
    assert list(lru.items()) == [("c", 3), ("a", 9)] and lru["a"] == 9
    assert lru.pop("c") == 3 and lru.pop("c") is None and len(lru) == 1
    assert lru.get("zz", 0) == 0 and lru.touch("zz") is None


def test_weight_bound_keeps_the_newest_whatever_its_weight() -> None:
    lru: LRU[str, list[int]] = LRU(max_weight=10, weight=len, min_items=1)
    lru.put("a", [1] * 4)
    lru.put("b", [1] * 5)
    assert lru.total_weight == 9
    lru.put("a", [1] * 3)  # replacing re-weighs
    assert lru.total_weight == 8 and list(lru) == ["b", "a"]
    lru.put("c", [1] * 4)  # 12 > 10: b goes
    assert list(lru) == ["a", "c"] and lru.total_weight == 7
    lru.put("d", [1] * 50)  # alone over the bound: kept, the rest goes
    assert list(lru) == ["d"] and lru.total_weight == 50 and lru.evicted == 3
    lru.pop("d")
    assert lru.total_weight == 0
    empty: LRU[str, list[int]] = LRU(max_weight=3, weight=len)  # min_items 0: may empty
    empty.put("x", [1] * 5)
    assert len(empty) == 0 and empty.total_weight == 0


def test_bad_bounds_are_refused() -> None:
    with pytest.raises(ConfigError, match="max_items"):
        LRU(max_items=0)
    with pytest.raises(ConfigError, match="weight function"):
        LRU(max_weight=5)


def test_get_or_put_makes_a_missing_value_once_and_touches_a_present_one() -> None:
    lru: LRU[str, list[int]] = LRU(max_items=2)
    made: list[str] = []

    def make() -> list[int]:
        made.append("x")
        return []

    first = lru.get_or_put("a", make)
    lru.put("b", [2])
    assert lru.get_or_put("a", make) is first and made == ["x"]
    lru.put("c", [3])  # "a" was touched last: "b" goes
    assert list(lru) == ["a", "c"] and lru.evicted == 1
