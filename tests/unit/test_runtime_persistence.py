"""The runtime owns persistence: every finished turn of a session is stored once, whichever
drafter decoded it (no drafter, prompt lookup, the session cache); drafters only read."""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from agentspec.errors import StoreBusyError
from agentspec.runtime import Runtime
from agentspec.spec import AgentSpec, DraftingPolicy
from agentspec.storage.sessions import SessionStore, StoreConfig
from agentspec.types import SessionRef
from tests.conftest import TINY_VOCAB

pytestmark = pytest.mark.usefixtures("one_thread")


def _runtime(target: Any, decode: Any, store: SessionStore, method: str) -> Runtime:
    rt = Runtime(target, store, AgentSpec(drafting=DraftingPolicy(method=method)))
    rt.decode = decode  # type: ignore[method-assign]  # the tiny model has no tokenizer
    return rt


def _serve(rt: Runtime, prompt: Sequence[int]) -> None:
    """Make the next chat's rendered prompt ``prompt`` (no chat template on the tiny model)."""
    rt.prompt_ids = lambda *a, **k: (list(prompt), "")  # type: ignore[method-assign]


def _prompts(seed: int, n: int) -> list[list[int]]:
    rng = random.Random(seed)
    base = [rng.randrange(2, TINY_VOCAB) for _ in range(10)]
    return [[0, *base, *base[: rng.randrange(3, 9)], i + 2] for i in range(n)]


@pytest.mark.parametrize("method", ["none", "prompt_lookup", "suffix"])
def test_every_finished_turn_is_stored_whichever_drafter_ran(
    tiny_target: Any, char_decode: Any, tmp_path: Path, method: str
) -> None:
    with SessionStore(tmp_path / "s.sqlite3") as store:
        rt = _runtime(tiny_target, char_decode, store, method)
        ref = SessionRef("s1", tenant="acme")
        expected = []
        for prompt in _prompts(7, 3):
            _serve(rt, prompt)
            result = rt.chat([{"role": "user", "content": "x"}], session=ref, max_tokens=12)
            expected.append([*prompt, *result.tokens])
        assert store.load(ref) == expected  # each turn once: prompt + output
        # A request without a session is never stored.
        _serve(rt, _prompts(8, 1)[0])
        rt.chat([{"role": "user", "content": "x"}], max_tokens=4)
        assert [s.session_id for s in store.list_sessions("acme")] == ["s1"]
        assert store.stats()["turns"] == 3 and rt.store_errors == 0


def test_a_turn_the_store_refuses_is_counted_not_raised(
    tiny_target: Any, char_decode: Any, tmp_path: Path
) -> None:
    """The answer is produced before the turn is written: an oversized session is logged
    and counted, and the caller still gets its result."""
    with SessionStore(tmp_path / "s.sqlite3", StoreConfig(max_tokens_per_session=8)) as store:
        rt = _runtime(tiny_target, char_decode, store, "none")
        _serve(rt, _prompts(9, 1)[0])
        result = rt.chat([{"role": "user", "content": "x"}], session=SessionRef("big"),
                         max_tokens=6)
        assert len(result.tokens) == 6
        assert rt.store_errors == 1 and store.stats()["turns"] == 0
        assert result.stored is False  # the client is told (the server's `agentspec` field)
        assert rt.turns is not None and rt.turns.failures == {("append", "too_large"): 1}


def test_a_stored_turn_says_so_and_a_one_off_turn_is_not_stored(
    tiny_target: Any, char_decode: Any, tmp_path: Path
) -> None:
    with SessionStore(tmp_path / "s.sqlite3") as store:
        rt = _runtime(tiny_target, char_decode, store, "suffix")
        prompt = _prompts(10, 1)[0]
        _serve(rt, prompt)
        msgs = [{"role": "user", "content": "x"}]
        assert rt.chat(msgs, session=SessionRef("kept"), max_tokens=4).stored is True
        # The server's anonymous request under agent scope: no later request can name it,
        # so a row in the store would only push real sessions out.
        anon = SessionRef("anon-1", tenant="default", ephemeral=True)
        assert rt.chat(msgs, session=anon, max_tokens=4).stored is None
        assert rt.chat(msgs, max_tokens=4).stored is None
        assert [s.session_id for s in store.list_sessions()] == ["kept"]


class _FlakyStore:
    """A session store whose reads fail until ``broken`` is cleared (a busy or damaged
    file); writes go to the real store."""

    def __init__(self, store: SessionStore) -> None:
        self.store, self.broken, self.loads = store, True, 0

    def load(self, ref: SessionRef) -> list[list[int]]:
        self.loads += 1
        if self.broken:
            raise StoreBusyError("session store s.sqlite3 stayed locked")
        return self.store.load(ref)

    def append_turn(self, ref: SessionRef, tokens: list[int]) -> None:
        self.store.append_turn(ref, tokens)


def test_a_failed_store_read_serves_the_request_and_is_retried(
    tiny_target: Any, char_decode: Any, tmp_path: Path
) -> None:
    """A store that cannot be read costs the drafts of the stored history, not the request;
    the session is not marked loaded, so a later request reads its history after all."""
    ref = SessionRef("s1", tenant="acme")
    prompts = _prompts(11, 3)
    with SessionStore(tmp_path / "s.sqlite3") as store:
        writer = _runtime(tiny_target, char_decode, store, "none")
        _serve(writer, prompts[0])
        writer.chat([{"role": "user", "content": "x"}], session=ref, max_tokens=8)
        flaky = _FlakyStore(store)
        rt = _runtime(tiny_target, char_decode, flaky, "suffix")  # type: ignore[arg-type]
        _serve(rt, prompts[1])
        first = rt.chat([{"role": "user", "content": "x"}], session=ref, max_tokens=8)
        assert len(first.tokens) == 8 and first.stored is True
        assert rt.turns is not None and set(rt.turns.failures) == {("load", "busy")}
        failed, flaky.broken = flaky.loads, False
        drafter = rt.drafter_for(rt.default_spec)
        _serve(rt, prompts[2])
        rt.chat([{"role": "user", "content": "x"}], session=ref, max_tokens=8)
        assert flaky.loads == failed + 1  # read again, this time with success
        pools = [p for k, p in drafter._pools.items() if k[1] == "acme"]  # type: ignore[union-attr]
        assert pools and all("s1" in p.sessions for p in pools)


def test_the_request_kv_is_stored_when_it_ends_not_in_the_next_prefill(
    tiny_target: Any, char_decode: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The previous request's prompt KV goes to the prefix store as that request ends, so
    the next request's timed prefill (perhaps another tenant's) never pays for it."""
    from agentspec.targets.cache.prefix_cache import PrefixCache

    tiny_target.prefill(list(range(2, 5)))  # no scope: nothing of earlier tests to retire
    cache = PrefixCache(1 << 24, block_size=4)
    monkeypatch.setattr(tiny_target, "prefix_cache", cache)
    rt = Runtime(tiny_target, None, AgentSpec(drafting=DraftingPolicy(method="none")))
    rt.decode = char_decode  # type: ignore[method-assign]
    inserts: list[str] = []
    real_insert = cache.insert
    real_prefill = tiny_target.prefill
    phase = ["idle"]

    def insert(scope: str, tokens: Any, kv: Any, **rows: Any) -> int:
        inserts.append(phase[0])
        return real_insert(scope, tokens, kv, **rows)

    def prefill(tokens: Any, *, scope: str | None = None, **kw: Any) -> Any:
        phase[0] = "prefill"
        try:
            return real_prefill(tokens, scope=scope, **kw)
        finally:
            phase[0] = "decode"

    monkeypatch.setattr(cache, "insert", insert)
    monkeypatch.setattr(tiny_target, "prefill", prefill)
    try:
        for tenant, prompt in (("a", _prompts(12, 1)[0] * 3), ("b", _prompts(13, 1)[0])):
            _serve(rt, prompt)
            rt.chat([{"role": "user", "content": "x"}], session=SessionRef("s", tenant=tenant),
                    max_tokens=4)
            assert inserts and inserts[-1] == "decode"  # stored as the request ended
        assert "prefill" not in inserts
        assert cache.stats.inserted_blocks > 0
    finally:
        tiny_target.prefill(list(range(2, 5)))  # leave the shared target without a scope


def test_tenant_b_numbers_do_not_depend_on_tenant_a_last_request(
    tiny_target: Any, char_decode: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whatever tenant A sent just before (a short prompt or one that overflows the prefix
    store), tenant B's next turn reuses the same KV and reports the same numbers: A's KV is
    stored when A's request ends and cannot push B's blocks below B's share of the budget."""
    from agentspec.targets.cache.prefix_cache import PrefixCache

    rng = random.Random(14)
    b_turns = [[0, *(rng.randrange(2, TINY_VOCAB) for _ in range(60))]]
    b_turns.append([*b_turns[0], *(rng.randrange(2, TINY_VOCAB) for _ in range(20))])
    a_short = [0, *(rng.randrange(2, TINY_VOCAB) for _ in range(10))]
    a_long = [0, *(rng.randrange(2, TINY_VOCAB) for _ in range(300))]
    per_token = 2 * 2 * 2 * 16 * 4  # tiny model: layers x (K, V) x kv heads x dims x fp32
    numbers = []
    for a_prompt in (a_short, a_long):
        tiny_target.prefill([2, 3])  # no scope: nothing of earlier runs to retire
        # Room for 200 tokens of KV: A's long prompt alone would fill it.
        monkeypatch.setattr(tiny_target, "prefix_cache", PrefixCache(200 * per_token, 8))
        rt = Runtime(tiny_target, None, AgentSpec(drafting=DraftingPolicy(method="none")))
        rt.decode = char_decode  # type: ignore[method-assign]
        msgs = [{"role": "user", "content": "x"}]
        b = SessionRef("s", tenant="b")
        _serve(rt, b_turns[0])
        rt.chat(msgs, session=b, max_tokens=4)
        _serve(rt, a_prompt)
        rt.chat(msgs, session=SessionRef("s", tenant="a"), max_tokens=4)
        _serve(rt, b_turns[1])
        stats = rt.chat(msgs, session=b, max_tokens=4).stats.to_dict()
        numbers.append({k: v for k, v in stats.items() if k not in ("seconds", "tokens_per_s")})
    tiny_target.prefill([2, 3])
    assert numbers[0] == numbers[1]
    assert numbers[0]["cached_prompt_tokens"] == 56  # B's 61-token first prompt, in 8s
