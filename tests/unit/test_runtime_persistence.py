"""The runtime owns persistence: every finished turn of a session is stored once, whichever
drafter decoded it (no drafter, prompt lookup, the session cache); drafters only read."""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

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
