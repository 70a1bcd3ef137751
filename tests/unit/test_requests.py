"""The one home of per-request state (agentspec.requests) and the engine's request lifecycle."""

from __future__ import annotations

from typing import Any

import pytest

from agentspec.drafters.gate import DraftGate
from agentspec.drafters.suffix.drafter import SuffixConfig, SuffixDrafter
from agentspec.engine import EngineConfig, SpeculativeDecoder
from agentspec.errors import ConfigError
from agentspec.requests import REQUESTS, RequestStates
from agentspec.types import SessionRef, state_key
from agentspec.verifiers.budgeted import BudgetConfig, BudgetedVerifier


def test_parts_see_only_their_own_share_and_end_drops_every_share() -> None:
    home = RequestStates(max_requests=8)
    a, b = home.slot("a"), home.slot("b")
    key = state_key("r1")
    a.put(key, 1)
    b.put(key, "one")
    assert a.get(key) == 1 and b.get(key) == "one" and a[key] == 1
    assert a.get(state_key("r2")) is None and a.get(state_key("r2"), 7) == 7
    assert home.live == 1 and len(a) == 1 and list(b.items()) == [(key, "one")]
    assert home.stats() == {"live": 1, "evicted": 0, "shares_a": 1, "shares_b": 1}
    assert a.pop(key) == 1 and key in b and key not in a
    a.put(key, 2)
    home.end(key)
    assert home.live == 0 and a.get(key) is None and b.get(key) is None
    home.end(key)  # ending an unknown request does nothing
    with pytest.raises(KeyError):
        _ = a[key]


def test_get_or_put_makes_a_share_once() -> None:
    home = RequestStates()
    a, b = home.slot("a"), home.slot("b")
    share = a.get_or_put("r", list)
    assert a.get_or_put("r", list) is share and b.get("r") is None
    assert b.get_or_put("r", dict) == {} and home.live == 1


def test_a_request_popped_by_its_last_part_is_forgotten() -> None:
    home = RequestStates()
    a = home.slot("a")
    a.put("k", 1)
    assert a.pop("k") == 1 and home.live == 0 and a.pop("k") is None


def test_the_least_recent_request_is_evicted_whole_and_counted() -> None:
    dropped: list[Any] = []
    home = RequestStates(max_requests=2)
    a = home.slot("a", on_drop=dropped.append)
    b = home.slot("b")
    a.put("r1", "a1")
    b.put("r1", "b1")
    a.put("r2", "a2")
    assert a.touch("r1") == "a1"  # r1 is the most recent now
    b.put("r3", "b3")  # a third request: r2 goes, with all its shares
    assert home.evicted == 1 and a.get("r2") is None and dropped == ["a2"]
    assert a.get("r1") == "a1" and b.get("r1") == "b1"
    home.end("r1")  # on_drop for a share the home forgets at the end of its request
    assert dropped == ["a2", "a1"]
    a.put("r4", "a4")
    assert a.pop("r4") == "a4" and dropped == ["a2", "a1"]  # popped by its part: no drop
    a.put("r5", "a5")
    a.clear()
    assert len(a) == 0 and dropped == ["a2", "a1"]
    with pytest.raises(ConfigError, match="max_requests"):
        RequestStates(0)


def _prompt(i: int) -> list[int]:
    return [5 + (i % 3), *([7, 8, 9, 10, 11, 12] * 4), 13 + i]


def test_every_part_releases_a_request_however_it_stops(tiny_target: Any) -> None:
    """Finished, failed (a budget request begun twice) or abandoned mid-stream: the engine
    ends the request in the home, so no part holds any of its state afterwards."""
    drafter = SuffixDrafter(SuffixConfig())
    gate = DraftGate(lambda k, context: 1.0)
    verifier = BudgetedVerifier(BudgetConfig(budget=0.0))
    engine = SpeculativeDecoder(tiny_target, drafter, verifier, gate=gate,
                                config=EngineConfig(max_draft=4))
    before = REQUESTS.live
    for i in range(3):
        engine.generate(_prompt(i), 12, session=SessionRef(f"s{i}"))
    assert REQUESTS.live == before
    stream = engine.steps(_prompt(4), 12, session=SessionRef("s4"))
    next(stream)
    next(stream)
    assert len(drafter._requests) == 1 and len(verifier._accounts) == 1
    stream.close()  # a consumer that stopped reading
    assert len(drafter._requests) == 0 and len(verifier._accounts) == 0
    assert len(gate._pending) == 0 and REQUESTS.live == before


def test_capabilities_are_asked_once_per_engine(tiny_target: Any) -> None:
    """The engine asks its drafter and target what they can do once, not every request."""

    class Counting(SuffixDrafter):
        asked = 0

        @property
        def wants_features(self) -> bool:
            Counting.asked += 1
            return False

        def observe_features(self, ctx: Any, start: int, features: Any) -> None:
            raise AssertionError("not wanted")

    engine = SpeculativeDecoder(tiny_target, Counting(SuffixConfig()),
                                config=EngineConfig(max_draft=4))
    engine.generate(_prompt(0), 8, session=SessionRef("c"))
    first = Counting.asked  # (a runtime-checkable isinstance reads the property too)
    for i in range(1, 4):
        engine.generate(_prompt(i), 8, session=SessionRef("c"))
    assert 1 <= first == Counting.asked
